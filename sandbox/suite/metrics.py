"""The suite's metrics, written out as MLE-Dojo `utils/metric.py` files.

Each task folder carries its own `utils/metric.py`, a `CompetitionMetrics`
subclass in exactly the shape MLE-Dojo's competitions use (sort both frames by
the id column, compare, `validate_submission` raising `InvalidSubmissionError`),
so the sandbox grades the embedded tasks through the same loader as a real
MLE-Dojo competition. The metric *source* is generated from the table below;
the test suite checks its numbers against scikit-learn called directly.

Submission kinds (what one row of the submission holds):
  label    the predicted class label in the target column
  proba    P(positive class) in the target column (binary tasks)
  classes  one probability column per class (columns = class labels)
  value    a real number in the target column
  values   one real number per target column (multi-target regression)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    title: str
    higher_is_better: bool
    kind: str  # see the module docstring
    imports: str  # extra import line(s) for metric.py
    score: str  # python expression over `t` / `p` (aligned, id-sorted frames) and `cols`
    text: str  # the Evaluation section of the description


METRICS: dict[str, Metric] = {
    m.name: m
    for m in [
        Metric("accuracy", "Accuracy", True, "label",
               "from sklearn.metrics import accuracy_score",
               "accuracy_score(t[cols[0]], p[cols[0]])",
               "Submissions are evaluated on classification accuracy: the fraction of test rows whose "
               "predicted label equals the true label."),
        Metric("f1", "F1 score", True, "label",
               "from sklearn.metrics import f1_score",
               "f1_score(t[cols[0]], p[cols[0]], pos_label=1)",
               "Submissions are evaluated on the F1 score of the positive class (label 1): "
               "F1 = 2 * precision * recall / (precision + recall)."),
        Metric("f1_macro", "Macro F1 score", True, "label",
               "from sklearn.metrics import f1_score",
               "f1_score(t[cols[0]], p[cols[0]], average='macro')",
               "Submissions are evaluated on the macro-averaged F1 score: the F1 score of every class, "
               "averaged with equal weight per class."),
        Metric("roc_auc", "ROC AUC", True, "proba",
               "from sklearn.metrics import roc_auc_score",
               "roc_auc_score(t[cols[0]], p[cols[0]])",
               "Submissions are evaluated on the area under the ROC curve between the predicted "
               "probability of the positive class and the observed target."),
        Metric("log_loss", "Log loss", False, "proba",
               "from sklearn.metrics import log_loss",
               "log_loss(t[cols[0]], np.clip(p[cols[0]].astype(float), 1e-15, 1 - 1e-15), labels=[0, 1])",
               "Submissions are evaluated on the binary log loss: -mean(y log p + (1 - y) log(1 - p)), "
               "with p the predicted probability that the target is 1, clipped to [1e-15, 1 - 1e-15]."),
        Metric("multi_log_loss", "Multi-class log loss", False, "classes",
               "from sklearn.metrics import log_loss",
               "log_loss(t[cols].to_numpy().argmax(axis=1), _rows_normalised(p[cols]), labels=list(range(len(cols))))",
               "Submissions are evaluated on the multi-class log loss: -mean over rows of log p(true class). "
               "Each row's probabilities are first rescaled to sum to 1 (they need not sum to 1), then "
               "clipped to [1e-15, 1 - 1e-15]."),
        Metric("rmse", "RMSE", False, "value",
               "from sklearn.metrics import root_mean_squared_error",
               "root_mean_squared_error(t[cols[0]], p[cols[0]])",
               "Submissions are evaluated on the root mean squared error: sqrt(mean((y - y_hat)^2))."),
        Metric("mae", "MAE", False, "value",
               "from sklearn.metrics import mean_absolute_error",
               "mean_absolute_error(t[cols[0]], p[cols[0]])",
               "Submissions are evaluated on the mean absolute error: mean(|y - y_hat|)."),
        Metric("r2", "R squared", True, "value",
               "from sklearn.metrics import r2_score",
               "r2_score(t[cols[0]], p[cols[0]])",
               "Submissions are evaluated on the coefficient of determination "
               "R^2 = 1 - sum((y - y_hat)^2) / sum((y - mean(y))^2). A constant prediction of the "
               "test mean scores 0; R^2 can be negative."),
        Metric("mcrmse", "Mean column-wise RMSE", False, "values",
               "from sklearn.metrics import root_mean_squared_error",
               "np.mean([root_mean_squared_error(t[c], p[c]) for c in cols])",
               "Submissions are evaluated on the mean column-wise root mean squared error (MCRMSE): the "
               "RMSE of every target column, averaged over the target columns."),
    ]
}

_TEMPLATE = '''\
"""Metric for the embedded `{task}` competition: {title} ({direction} is better).

Generated by `python -m sandbox.suite build`; MLE-Dojo's metric layout.
"""
from typing import Any

import numpy as np
import pandas as pd
from mledojo.metrics.base import CompetitionMetrics, InvalidSubmissionError
{imports}


def _rows_normalised(frame: pd.DataFrame) -> np.ndarray:
    # Kaggle's multi-class log loss: rescale each row to sum to 1, then clip.
    probs = frame.to_numpy(dtype=float)
    return np.clip(probs / probs.sum(axis=1, keepdims=True), 1e-15, 1 - 1e-15)


class {cls}(CompetitionMetrics):
    """{title} over the columns {cols}; {direction} is better."""

    def __init__(self, value: str = "{value}", higher_is_better: bool = {hib}):
        super().__init__(higher_is_better)
        self.value = value
        self.columns = {cols}

    def evaluate(self, y_true: pd.DataFrame, y_pred: pd.DataFrame) -> float:
        id_col = y_true.columns[0]
        y_true[id_col] = y_true[id_col].astype(str)
        y_pred[id_col] = y_pred[id_col].astype(str)
        t = y_true.sort_values(by=id_col).reset_index(drop=True)
        p = y_pred.sort_values(by=id_col).reset_index(drop=True)
        cols = self.columns
        return float({score})

    def validate_submission(self, submission: Any, ground_truth: Any) -> str:
        if not isinstance(submission, pd.DataFrame):
            raise InvalidSubmissionError("Submission must be a pandas DataFrame.")
        if len(submission) != len(ground_truth):
            raise InvalidSubmissionError(
                f"Number of rows in submission ({{len(submission)}}) does not match the test set "
                f"({{len(ground_truth)}}).")
        missing = [c for c in ground_truth.columns if c not in submission.columns]
        extra = [c for c in submission.columns if c not in ground_truth.columns]
        if missing:
            raise InvalidSubmissionError(f"Missing required columns in submission: {{', '.join(missing)}}.")
        if extra:
            raise InvalidSubmissionError(f"Extra unexpected columns found in submission: {{', '.join(extra)}}.")
        id_col = ground_truth.columns[0]
        sub_ids = np.sort(submission[id_col].astype(str).to_numpy())
        true_ids = np.sort(ground_truth[id_col].astype(str).to_numpy())
        if (sub_ids != true_ids).any():
            raise InvalidSubmissionError(
                f"Submission {{id_col}} values do not match the test set's {{id_col}} values.")
        if submission[self.columns].isna().any().any():
            raise InvalidSubmissionError("Submission contains missing (NaN) predictions.")
        if {numeric}:
            for c in self.columns:
                if not pd.api.types.is_numeric_dtype(submission[c]):
                    raise InvalidSubmissionError(f"Column {{c}} must be numeric, got {{submission[c].dtype}}.")
        return "Submission is valid."
'''


def class_name(task: str) -> str:
    return "".join(part.capitalize() for part in task.split("_")) + "Metrics"


def metric_source(task: str, metric: Metric, columns: list[str]) -> str:
    """The text of `utils/metric.py` for `task` scored by `metric` over `columns`."""
    if metric.kind not in {"label", "proba", "classes", "value", "values"}:
        raise ValueError(f"metric {metric.name!r}: unknown submission kind {metric.kind!r}")
    return _TEMPLATE.format(
        task=task, title=metric.title, direction="higher" if metric.higher_is_better else "lower",
        imports=metric.imports, cls=class_name(task), cols=repr(list(columns)), value=columns[0],
        hib=metric.higher_is_better, score=metric.score, numeric=metric.kind != "label")
