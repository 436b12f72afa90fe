"""The interface of MLE-Dojo's `mledojo/metrics/base.py` (MIT, Copyright 2025 MLE-Dojo-Group).

Same names and contract as the real module:
* `CompetitionMetrics(higher_is_better=True)`: subclasses implement
  `evaluate(y_true, y_pred) -> float` (note the order: ground truth first) and
  `validate_submission(submission, ground_truth)`, which raises
  `InvalidSubmissionError` with a readable reason (and returns a message
  string such as "Submission is valid." when it passes).
* Every subclass is recorded in `CompetitionMetrics.subclasses`.
* `METRIC_CLASSES`: a module-level list, as in the real file.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

METRIC_CLASSES: list = []


class CompetitionMetrics:
    """Abstract base class for competition evaluation metrics."""

    subclasses: list = []

    def __init__(self, higher_is_better: bool = True):
        self.higher_is_better = higher_is_better

    @abstractmethod
    def evaluate(self, y_true: Any, y_pred: Any) -> float:
        """Score predictions `y_pred` against ground truth `y_true`."""

    @abstractmethod
    def validate_submission(self, submission: Any, ground_truth: Any) -> str:
        """Check format and contents; raise InvalidSubmissionError with the reason."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        CompetitionMetrics.subclasses.append(cls)


class InvalidSubmissionError(Exception):
    """The agent's submission cannot be graded (wrong rows, ids, columns, values)."""
