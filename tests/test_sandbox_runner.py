"""run_solution: every status of the ladder, rewards, feedback, error type/line — end to end in the sandbox."""

import csv
import os
import shutil

import pytest
from sklearn.metrics import mean_absolute_error

import sandbox
from helpers_sandbox import FIX, GOOD, copy_task
from sandbox import isolation


@pytest.fixture(scope="module")
def crab(tmp_path_factory):
    return copy_task(tmp_path_factory.mktemp("tasks") / "playground-series-s3e16")


def _expected_mae(task):
    with open(task.public_dir / "test.csv") as f:
        pred = {r["id"]: 3 + 6 * float(r["Length"]) for r in csv.DictReader(f)}
    with open(task.answer_path) as f:
        truth = {r["id"]: float(r["Age"]) for r in csv.DictReader(f)}
    return mean_absolute_error([truth[i] for i in pred], [pred[i] for i in pred])


def test_valid_run_is_graded_like_mle_dojo(crab):
    r = sandbox.run_solution(crab, GOOD, timeout_s=60)
    assert r.status == "valid", r.feedback
    mae = _expected_mae(crab)
    assert r.raw_score == pytest.approx(mae, abs=1e-12)
    per = [(len(b) - int((b < mae).sum())) / len(b) for b in crab.leaderboards.values()]
    assert r.position_score == pytest.approx(sum(per) / 2, abs=1e-12)
    assert r.reward == pytest.approx(0.5 + 0.5 * r.position_score)
    assert r.error_type is None and r.isolation["backend"] == "bwrap"
    assert "=== Submission Evaluation ===" in r.feedback and "Private Leaderboard: Position" in r.feedback
    assert "wrote 30 rows" in r.feedback
    assert r.wall_s > 0 and r.cpu_s > 0


def test_markdown_answer_runs_its_python_block(crab):
    r = sandbox.run_solution(crab, f"My plan: predict from Length.\n```python\n{GOOD}\n```\nDone.", timeout_s=60)
    assert r.status == "valid"


@pytest.mark.parametrize("code", ["", "   \n", None, b"print(1)", 42, "```python\n\n```", "print(1)\x00"])
def test_malformed_is_zero_without_launching(crab, code):
    r = sandbox.run_solution(crab, code)
    assert (r.status, r.reward, r.wall_s) == ("malformed", 0.0, 0.0)


@pytest.mark.parametrize("code,etype,line", [("x = 1\ndef f(:\n", "SyntaxError", 2),
                                             ("if True:\nprint(1)\n", "IndentationError", 2)])
def test_syntax_error_is_caught_before_launch(crab, code, etype, line):
    r = sandbox.run_solution(crab, code)
    assert (r.status, r.reward, r.error_type, r.error_line, r.wall_s) == ("syntax_err", 0.0, etype, line, 0.0)
    assert etype in r.feedback


def test_runtime_error_type_line_and_traceback(crab):
    r = sandbox.run_solution(crab, "import os\nx = {}\nprint(x['missing'])\n", timeout_s=60)
    assert (r.status, r.reward, r.error_type, r.error_line) == ("runtime_err", 0.1, "KeyError", 3)
    assert "Traceback" in r.feedback and "KeyError: 'missing'" in r.feedback


def test_crash_after_writing_a_submission_is_a_runtime_error(crab):
    r = sandbox.run_solution(crab, GOOD + "\nraise RuntimeError('late')\n", timeout_s=60)
    assert (r.status, r.reward, r.error_type) == ("runtime_err", 0.1, "RuntimeError")


def test_exit_code_without_traceback(crab):
    r = sandbox.run_solution(crab, "import sys\nsys.exit(3)\n", timeout_s=60)
    assert (r.status, r.error_type) == ("runtime_err", "SystemExit")


def test_timeout_is_a_runtime_error(crab):
    r = sandbox.run_solution(crab, "import time\nprint('start')\ntime.sleep(60)\n", timeout_s=1.5)
    assert (r.status, r.reward, r.error_type) == ("runtime_err", 0.1, "TimeoutError")
    assert 1.5 <= r.wall_s < 5.0
    assert "time limit of 1.5s exceeded" in r.feedback


def test_no_submission_and_invalid_submission(crab):
    r = sandbox.run_solution(crab, "print('thinking')", timeout_s=60)
    assert (r.status, r.reward, r.error_type) == ("ran_no_sub", 0.2, "SubmissionNotFoundError")
    bad = GOOD.replace('"id,Age', '"id,age')
    r = sandbox.run_solution(crab, bad, timeout_s=60)
    assert (r.status, r.reward) == ("ran_no_sub", 0.2)
    assert "Missing required columns in submission: Age" in r.feedback


def test_feedback_is_trimmed_head_and_tail(crab):
    code = "print('HEAD')\nprint('x' * 200000)\nraise ValueError('TAIL')\n"
    r = sandbox.run_solution(crab, code, timeout_s=60, feedback_chars=2000)
    assert r.status == "runtime_err" and len(r.feedback) < 3500
    assert "characters trimmed" in r.feedback and "ValueError: TAIL" in r.feedback


def test_infrastructure_failures_are_unknown_never_zero(crab, tmp_path, monkeypatch):
    # The grader's own files are broken: not the agent's fault.
    broken = tmp_path / "broken"
    shutil.copytree(crab.root, broken)
    for d, _, _ in os.walk(broken):
        os.chmod(d, 0o755)
    task = sandbox.load_task(broken)
    (broken / "data" / "private" / "test_answer.csv").write_text("garbage\x00\x01")
    os.remove(broken / "utils" / "metric.py")
    r = sandbox.run_solution(task, GOOD, timeout_s=60)
    assert (r.status, r.reward) == ("unknown", None)
    # The sandbox cannot start.
    monkeypatch.setattr(isolation, "bwrap_path", lambda: "/nonexistent/bwrap")
    r = sandbox.run_solution(crab, GOOD, timeout_s=60)
    assert (r.status, r.reward) == ("unknown", None)
    assert "infrastructure" in r.feedback


def test_dsbench_task_end_to_end(tmp_path):
    dst = tmp_path / "dsbench"
    shutil.copytree(FIX / "dsbench", dst)
    r = sandbox.run_solution(sandbox.load_task(dst), GOOD, timeout_s=60)
    assert r.status == "valid" and 0.0 <= r.position_score <= 1.0


def test_result_repr_is_one_short_line(crab):
    r = sandbox.run_solution(crab, GOOD, timeout_s=60)
    text = repr(r)
    print(text)
    assert text == (f"ExecutionResult(task={r.task_id!r}, status='valid', reward={round(r.reward, 4)!r}, "
                    f"raw_score={round(r.raw_score, 4)!r}, position={round(r.position_score, 4)!r}, "
                    f"wall_s={r.wall_s:.2f}, cpu_s={r.cpu_s:.2f}, feedback={len(r.feedback)} chars)")
    assert str(r) == text and "\n" not in text and len(text) < 250
    r = sandbox.run_solution(crab, "import os\nx = {}\nprint(x['missing'])\n", timeout_s=60)
    assert "status='runtime_err', reward=0.1, raw_score=None, position=None, error=KeyError at line 3," in repr(r)
    r = sandbox.run_solution(crab, "x = (", timeout_s=60)
    assert "status='syntax_err', reward=0.0," in repr(r) and "error=SyntaxError at line 1" in repr(r)
    unknown = sandbox.ExecutionResult(task_id="t", code_sha256="0", status="unknown", reward=None, cached=True)
    assert repr(unknown) == ("ExecutionResult(task='t', status='unknown', reward=None, raw_score=None, "
                             "position=None, wall_s=0.00, cpu_s=0.00, feedback=0 chars, cached)")
