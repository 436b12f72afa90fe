"""Leaderboard position score (MLE-Dojo) and the avg@k evaluation score.

(docs/design.md, "Position score" and "avg@8".)

Position on one board (MLE-Dojo `_calculate_leaderboard_position`):

    sorted = board scores, best first
    position = first 1-based i with  score >= sorted[i]  (higher is better)
                                 or  score <= sorted[i]  (lower is better),
               else total + 1
    pos = (total - position + 1) / total               in [0, 1]

so a tie with rank k counts as rank k, beating everybody gives 1.0 and losing
to everybody gives 0.0. `position_score` averages `pos` over the boards given
(MLE-Dojo: the private and public boards that exist).

avg@k (the paper's headline number, k = 8 attempts per task):

    per task:  valid_rate * mean_{valid attempts} best_pos
             = mean over attempts of (best position of the attempt, 0 if it never was valid)
    avg@k = mean over tasks   (also per category)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np


def board_position(score: float, board: Sequence[float] | np.ndarray, higher_is_better: bool) -> tuple[int, int]:
    """(position, total) of `score` on one leaderboard; position is 1-based, total+1 = last.

    Equivalent to MLE-Dojo's scan over the sorted board: the first index whose
    score ours ties or beats is 1 + the number of strictly better board scores.
    """
    arr = np.asarray(board, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError("board: expected at least one leaderboard score, got an empty board")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"board: expected finite scores, got {int((~np.isfinite(arr)).sum())} non-finite")
    score = float(score)
    if not math.isfinite(score):
        raise ValueError(f"score: expected a finite number, got {score}")
    strictly_better = int(np.sum(arr > score)) if higher_is_better else int(np.sum(arr < score))
    return strictly_better + 1, int(arr.size)


def position_score(score: float, boards: Mapping[str, Any] | Sequence[Any], higher_is_better: bool) -> float:
    """MLE-Dojo's position score of `score`, averaged over the boards given.

    Args:
      score: the submission's raw metric value.
      boards: {"private": scores, "public": scores} or a list of score arrays.
      higher_is_better: metric direction.
    Returns:
      mean over boards of (total - position + 1) / total, in [0, 1].
    """
    items = list(boards.values()) if isinstance(boards, Mapping) else list(boards)
    if not items:
        raise ValueError("boards: expected at least one leaderboard")
    pos = []
    for board in items:
        position, total = board_position(score, board, higher_is_better)
        pos.append((total - position + 1) / total)
    return float(sum(pos) / len(pos))


def board_positions(score: float, boards: Mapping[str, Any], higher_is_better: bool) -> dict[str, dict]:
    """Per board: {"position", "total", "position_score"} (MLE-Dojo's feedback data)."""
    out = {}
    for name, board in boards.items():
        position, total = board_position(score, board, higher_is_better)
        out[name] = {"position": position, "total": total, "position_score": (total - position + 1) / total}
    return out


def _attempt_best(attempt: Any) -> float:
    """Best position of one attempt; 0.0 when it never produced a valid submission.

    An attempt is a position (float), None (failed), an object with `.status`
    and `.position_score` (an ExecutionResult), or a sequence of those (the
    turns of one multi-turn attempt: the best valid turn counts).
    """
    if attempt is None:
        return 0.0
    if isinstance(attempt, (int, float, np.floating, np.integer)) and not isinstance(attempt, bool):
        value = float(attempt)
        if not (0.0 <= value <= 1.0):
            raise ValueError(f"attempt position {value}: expected a position score in [0, 1] or None")
        return value
    if hasattr(attempt, "status"):
        if attempt.status != "valid" or attempt.position_score is None:
            return 0.0
        return float(attempt.position_score)
    if isinstance(attempt, Iterable) and not isinstance(attempt, (str, bytes)):
        return max((_attempt_best(turn) for turn in attempt), default=0.0)
    raise TypeError(f"attempt {attempt!r}: expected a position, None, an ExecutionResult or a list of them")


def _is_valid(attempt: Any) -> bool:
    if attempt is None:
        return False
    if hasattr(attempt, "status"):
        return attempt.status == "valid" and attempt.position_score is not None
    if isinstance(attempt, (int, float, np.floating, np.integer)):
        return True
    return any(_is_valid(t) for t in attempt)


@dataclasses.dataclass(frozen=True)
class AvgAtK:
    """avg@k and its parts (fractions in [0, 1]; multiply by 100 for the paper's percent)."""

    score: float                              # mean over tasks
    per_task: Mapping[str, float]             # valid_rate * mean best position
    valid_rate: Mapping[str, float]
    per_category: Mapping[str, float]         # mean over the category's tasks
    k: Mapping[str, int]                      # attempts per task


def avg_at_k(results_by_task: Mapping[str, Sequence[Any]], categories: Mapping[str, str] | None = None,
             k: int | None = None) -> AvgAtK:
    """avg@k: per task valid-rate x mean best position over valid attempts; mean over tasks.

    Args:
      results_by_task: task id -> its attempts (see `_attempt_best` for what an attempt may be).
      categories: task id -> category, for the per-category means (missing: "uncategorized").
      k: if given, every task must have exactly k attempts (avg@8: k=8).
    """
    if not results_by_task:
        raise ValueError("results_by_task: expected at least one task")
    per_task, valid_rate, counts = {}, {}, {}
    for task, attempts in results_by_task.items():
        attempts = list(attempts)
        if not attempts:
            raise ValueError(f"results_by_task[{task!r}]: expected at least one attempt")
        if k is not None and len(attempts) != k:
            raise ValueError(f"results_by_task[{task!r}]: expected k={k} attempts, got {len(attempts)}")
        best = [_attempt_best(a) for a in attempts]
        valid = [_is_valid(a) for a in attempts]
        n_valid = sum(valid)
        rate = n_valid / len(attempts)
        mean_best_valid = (sum(b for b, v in zip(best, valid) if v) / n_valid) if n_valid else 0.0
        per_task[task] = rate * mean_best_valid
        valid_rate[task] = rate
        counts[task] = len(attempts)
    cats: dict[str, list[float]] = {}
    for task, value in per_task.items():
        cats.setdefault((categories or {}).get(task, "uncategorized"), []).append(value)
    return AvgAtK(
        score=float(np.mean(list(per_task.values()))),
        per_task=per_task, valid_rate=valid_rate,
        per_category={c: float(np.mean(v)) for c, v in sorted(cats.items())},
        k=counts,
    )


__all__ = ["AvgAtK", "avg_at_k", "board_position", "board_positions", "position_score"]
