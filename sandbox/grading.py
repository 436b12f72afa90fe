"""Grading a submission exactly as the benchmark does, the reward ladder, and the agent's feedback text.

MLE-Dojo (`CodeExecutionInterface._process_submission`): read the submission
and `data/private/test_answer.csv` with pandas, call the competition's
`validate_submission(submission, ground_truth)` (it raises with the reason),
then `evaluate(ground_truth, submission)` on the same two frames, then rank the
score on the private and public leaderboards. We add one check MLE-Dojo leaves
to the metric: NaN predictions make the submission invalid (sklearn would
raise inside `evaluate`, which MLE-Dojo also reports as a failed submission).

DSBench: its `evaluation/<comp>_eval.py` writes `result.txt`; we run it
unchanged (in-process, argv patched) after the generic checks every Kaggle
grader makes: the sample submission's columns, the answer's row count and ids,
no NaN.

Reward ladder (docs/design.md, "Reward ladder"; the real grader and the world model share it):

    malformed / syntax error          0.0
    runtime error (incl. timeout)     0.1
    ran, no valid submission          0.2
    valid                             0.5 + 0.5 * position_score
    unknown (infrastructure failure)  None   -- never 0: an unscored rollout is masked
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import pathlib
import runpy
import stat
import sys
import tempfile
import threading
from typing import Mapping

from sandbox import scoring
from sandbox.tasks import LAYOUT_DSBENCH, LAYOUT_MLE_DOJO, Task, load_metric_class

STATUSES = ("malformed", "syntax_err", "runtime_err", "ran_no_sub", "valid", "unknown")

REWARD_MALFORMED = 0.0
REWARD_SYNTAX_ERR = 0.0
REWARD_RUNTIME_ERR = 0.1
REWARD_RAN_NO_SUB = 0.2
REWARD_VALID_BASE = 0.5
REWARD_VALID_SPAN = 0.5
REWARD_LADDER: Mapping[str, float | None] = {
    "malformed": REWARD_MALFORMED,
    "syntax_err": REWARD_SYNTAX_ERR,
    "runtime_err": REWARD_RUNTIME_ERR,
    "ran_no_sub": REWARD_RAN_NO_SUB,
    "valid": REWARD_VALID_BASE,     # + REWARD_VALID_SPAN * position_score
    "unknown": None,
}


def ladder_reward(status: str, position: float | None = None) -> float | None:
    """The reward of an outcome: 0.0 / 0.1 / 0.2 / 0.5 + 0.5*pos, None for "unknown"."""
    if status not in REWARD_LADDER:
        raise ValueError(f"status {status!r}: expected one of {STATUSES}")
    if status == "unknown":
        return None
    if status == "valid":
        if position is None or not (0.0 <= position <= 1.0):
            raise ValueError(f"position {position!r}: a valid outcome needs a position score in [0, 1]")
        return REWARD_VALID_BASE + REWARD_VALID_SPAN * float(position)
    return REWARD_LADDER[status]


@dataclasses.dataclass(frozen=True)
class Grade:
    """The grader's verdict on one submission file."""

    valid: bool
    raw_score: float | None = None
    position_score: float | None = None
    positions: Mapping[str, dict] | None = None   # per board: position, total, position_score
    error_type: str | None = None                 # MLE-Dojo error class name when invalid
    message: str = ""
    infrastructure_error: str | None = None       # the grader (not the submission) failed


class GraderInfrastructureError(RuntimeError):
    """Task files needed for grading are missing or broken (not the agent's fault)."""


def _invalid(error_type: str, message: str) -> Grade:
    return Grade(valid=False, error_type=error_type, message=message)


def _finish(task: Task, score) -> Grade:
    try:
        score = float(score)
    except (TypeError, ValueError):
        return _invalid("EvaluationError", f"Failed to evaluate submission: metric returned {score!r}, not a number")
    if not math.isfinite(score):
        return _invalid("EvaluationError", f"Failed to evaluate submission: metric returned {score}")
    positions = scoring.board_positions(score, task.leaderboards, task.higher_is_better)
    pos = sum(p["position_score"] for p in positions.values()) / len(positions)
    return Grade(valid=True, raw_score=score, position_score=pos, positions=positions,
                 message="Submission processed successfully")


def _read_csv(path: pathlib.Path, what: str):
    import pandas as pd

    try:
        return pd.read_csv(path)
    except Exception as e:   # pandas raises many types for a broken CSV
        raise ValueError(f"Could not parse {what} file as CSV: {e}") from e


def _grade_mle_dojo(task: Task, submission_path: pathlib.Path) -> Grade:
    try:
        ground_truth = _read_csv(task.answer_path, "ground truth")
        metric = load_metric_class(task.metric_path)()
    except Exception as e:
        raise GraderInfrastructureError(f"task {task.name}: {e}") from e
    try:
        submission = _read_csv(submission_path, "submission")
    except ValueError as e:
        return _invalid("InvalidSubmissionError", f"Failed to read submission file. {e}")
    try:
        metric.validate_submission(submission, ground_truth)
    except Exception as e:
        return _invalid("InvalidSubmissionError", f"Submission validation failed: {e}")
    nan_cols = [str(c) for c in submission.columns if submission[c].isna().any()]
    if nan_cols:
        return _invalid("InvalidSubmissionError",
                        f"Submission validation failed: NaN values in column(s) {', '.join(nan_cols)}.")
    try:
        score = metric.evaluate(ground_truth, submission)
    except Exception as e:
        return _invalid("EvaluationError", f"Failed to evaluate submission: Error during metric calculation: {e}")
    return _finish(task, score)


def check_submission_frame(submission, ground_truth, sample) -> str | None:
    """Generic Kaggle checks; the reason a submission is invalid, or None."""
    expected = list(sample.columns) if sample is not None else list(ground_truth.columns)
    missing = [c for c in expected if c not in submission.columns]
    extra = [c for c in submission.columns if c not in expected]
    if missing:
        return f"Missing required columns in submission: {', '.join(map(str, missing))}."
    if extra:
        return f"Extra unexpected columns found in submission: {', '.join(map(str, extra))}."
    if len(submission) != len(ground_truth):
        return (f"Number of rows in submission ({len(submission)}) does not match "
                f"ground truth ({len(ground_truth)}).")
    id_col = ground_truth.columns[0]
    if id_col in submission.columns:
        sub_ids = sorted(submission[id_col].astype(str))
        true_ids = sorted(ground_truth[id_col].astype(str))
        if sub_ids != true_ids:
            return f"{id_col} values do not match between submission and ground truth."
    nan_cols = [str(c) for c in submission.columns if submission[c].isna().any()]
    if nan_cols:
        return f"NaN values in column(s) {', '.join(nan_cols)}."
    return None


# DSBench's scorers read sys.argv; one at a time.
_ARGV_LOCK = threading.Lock()


def _grade_dsbench(task: Task, submission_path: pathlib.Path) -> Grade:
    try:
        ground_truth = _read_csv(task.answer_path, "ground truth")
        sample = _read_csv(task.sample_submission_path, "sample submission") if task.sample_submission_path else None
    except ValueError as e:
        raise GraderInfrastructureError(f"task {task.name}: {e}") from e
    if task.metric_path is None:
        raise GraderInfrastructureError(
            f"DSBench task {task.name}: no evaluation/{task.name}_eval.py to score with")
    try:
        submission = _read_csv(submission_path, "submission")
    except ValueError as e:
        return _invalid("InvalidSubmissionError", f"Failed to read submission file. {e}")
    reason = check_submission_frame(submission, ground_truth, sample)
    if reason:
        return _invalid("InvalidSubmissionError", f"Submission validation failed: {reason}")
    with tempfile.TemporaryDirectory(prefix="wmrl-dsbench-eval-") as out:
        os.makedirs(os.path.join(out, task.name), exist_ok=True)
        argv = [str(task.metric_path), "--path", out, "--name", task.name,
                "--answer_file", str(task.answer_path), "--predict_file", str(submission_path)]
        with _ARGV_LOCK:
            saved = sys.argv
            sys.argv = argv
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    runpy.run_path(str(task.metric_path), run_name="__main__")
            except SystemExit as e:
                if e.code not in (None, 0):
                    return _invalid("EvaluationError", f"Failed to evaluate submission: scorer exited with {e.code}")
            except Exception as e:
                return _invalid("EvaluationError", f"Failed to evaluate submission: {type(e).__name__}: {e}")
            finally:
                sys.argv = saved
        result = pathlib.Path(out, task.name, "result.txt")
        if not result.is_file():
            raise GraderInfrastructureError(f"DSBench scorer {task.metric_path} wrote no result.txt")
        text = result.read_text().strip()
    return _finish(task, text)


def grade_submission(task: Task, submission_path: str | os.PathLike, max_bytes: int = 256 << 20) -> Grade:
    """Grade one submission file of `task`; never raises for a bad submission.

    Returns a Grade; `infrastructure_error` is set (and `valid` False) when the
    task's own files are broken, so the caller can report "unknown".
    """
    submission_path = pathlib.Path(submission_path)
    try:
        st = os.lstat(submission_path)
    except OSError:
        return _invalid("SubmissionNotFoundError",
                        f"Submission file not found: no submission file found at SUBMISSION_PATH "
                        f"(expected {submission_path.name})")
    # The file was written by untrusted code and is read by the host: a symlink
    # could point at the hidden answers, a FIFO would block the grader.
    if not stat.S_ISREG(st.st_mode):
        return _invalid("InvalidSubmissionError",
                        f"Submission validation failed: {submission_path.name} must be a regular file "
                        f"(got a {'symlink' if stat.S_ISLNK(st.st_mode) else 'special file'}).")
    if st.st_size > max_bytes:
        return _invalid("InvalidSubmissionError",
                        f"Submission validation failed: {submission_path.name} is {st.st_size} bytes, "
                        f"more than the {max_bytes} allowed.")
    try:
        if task.layout == LAYOUT_MLE_DOJO:
            return _grade_mle_dojo(task, submission_path)
        if task.layout == LAYOUT_DSBENCH:
            return _grade_dsbench(task, submission_path)
        raise GraderInfrastructureError(f"task {task.name}: unknown layout {task.layout!r}")
    except GraderInfrastructureError as e:
        return Grade(valid=False, error_type="GraderError", message=str(e), infrastructure_error=str(e))


# ---------------------------------------------------------------------------- feedback

def trim_middle(text: str, max_chars: int = 3000, head_frac: float = 0.3) -> str:
    """Head + tail of `text` within `max_chars` (tracebacks end with the useful part)."""
    if len(text) <= max_chars:
        return text
    head = int(max_chars * head_frac)
    tail = max_chars - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n... [{cut} characters trimmed] ...\n{text[-tail:]}"


def execution_feedback(*, status: str, wall_s: float, stdout: str, stderr: str, grade: Grade | None,
                       error_type: str | None, timeout_s: float, max_chars: int = 3000) -> str:
    """MLE-Dojo-style "=== Code Execution Results ===" text the agent reads next turn."""
    lines = ["=== Code Execution Results ==="]
    if status == "malformed":
        lines.append("Execution failed: no Python code could be extracted from the response.")
        return "\n".join(lines)
    if status == "syntax_err":
        lines.append("Execution failed: Code syntax validation failed")
        lines.append(f"Error Details: {trim_middle(stderr, max_chars)}")
        return "\n".join(lines)
    if status == "unknown":
        lines.append("Execution could not be completed because of an infrastructure problem (not your code).")
        if stderr:
            lines.append(f"Details: {trim_middle(stderr, max_chars // 2)}")
        return "\n".join(lines)
    if status == "runtime_err":
        if error_type == "TimeoutError":
            lines.append(f"Execution failed: time limit of {timeout_s:g}s exceeded; the process was killed.")
        else:
            lines.append(f"Execution failed: {error_type or 'the program exited with an error'}")
        lines.append(f"Code execution time: {wall_s:.2f}s")
        if stdout.strip():
            lines.append(f"Code output: {trim_middle(stdout, max_chars // 3)}")
        if stderr.strip():
            lines.append(f"Error Details: {trim_middle(stderr, max_chars)}")
        return "\n".join(lines)
    lines.append("Execution successful")
    lines.append(f"Code execution time: {wall_s:.2f}s")
    if stdout.strip():
        lines.append(f"Code output: {trim_middle(stdout, max_chars // 2)}")
    lines.append("")
    lines.append("=== Submission Evaluation ===")
    if grade is not None and grade.valid:
        lines.append("Submission successful")
        for board, info in (grade.positions or {}).items():
            lines.append(f"{board.capitalize()} Leaderboard: Position {info['position']} / {info['total']}")
        lines.append(f"Raw Score: {grade.raw_score}")
        lines.append(f"Average Position Score: {grade.position_score:.4f}")
    elif grade is not None:
        lines.append(f"Submission error ({grade.error_type}): {grade.message}")
    return "\n".join(lines)


__all__ = ["Grade", "GraderInfrastructureError", "REWARD_LADDER", "REWARD_MALFORMED", "REWARD_SYNTAX_ERR",
           "REWARD_RUNTIME_ERR", "REWARD_RAN_NO_SUB", "REWARD_VALID_BASE", "REWARD_VALID_SPAN", "STATUSES",
           "check_submission_frame", "execution_feedback", "grade_submission", "ladder_reward", "trim_middle"]
