"""Task layouts (MLE-Dojo, DSBench), the mledojo shim, and grading against sklearn."""

import csv
import os
import pathlib
import shutil
import sys

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, mean_absolute_error, roc_auc_score

import sandbox
import sandbox.suite
from sandbox.grading import grade_submission
from sandbox.tasks import TaskFormatError

FIX = pathlib.Path(__file__).parent / "fixtures"
ST = FIX / "mle-dojo" / "spaceship-titanic"
KID = FIX / "mle-dojo" / "playground-series-s3e12"
CRAB = FIX / "mle-dojo" / "playground-series-s3e16"
DSB = FIX / "dsbench"


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _write(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def _boards(path):
    return [np.loadtxt(path / f"info/{b}_leaderboard.csv", delimiter=",", skiprows=1)[:, 1]
            for b in ("private", "public")]


def _hand_position(score, boards, higher):
    out = []
    for b in boards:
        better = np.sum(b > score) if higher else np.sum(b < score)
        out.append((len(b) - (better + 1) + 1) / len(b))
    return sum(out) / len(out)


def test_load_mle_dojo_layout():
    t = sandbox.load_task(ST)
    assert (t.layout, t.name, t.higher_is_better) == ("mle-dojo", "spaceship-titanic", True)
    assert t.public_dir == ST.resolve() / "data" / "public"
    assert t.answer_path == ST.resolve() / "data" / "private" / "test_answer.csv"
    assert sorted(t.leaderboards) == ["private", "public"]
    assert "Spaceship Titanic" in t.description
    assert sandbox.load_task(CRAB).higher_is_better is False
    # The task id is stable and names the layout and competition.
    assert t.task_id == sandbox.load_task(str(ST)).task_id and t.task_id.startswith("mle-dojo/spaceship-titanic@")


def test_metric_file_loads_unchanged_through_the_shim():
    src = (ST / "utils" / "metric.py").read_text()
    assert "from mledojo.metrics.base import CompetitionMetrics, InvalidSubmissionError" in src
    sandbox.load_task(ST)
    base = sys.modules["mledojo.metrics.base"]
    assert base.CompetitionMetrics.__name__ == "CompetitionMetrics"
    assert any(c.__name__ == "SpaceshipTitanicMetrics" for c in base.CompetitionMetrics.subclasses)
    assert issubclass(base.InvalidSubmissionError, Exception)


def test_load_dsbench_layout_and_direction_from_board():
    t = sandbox.load_task(DSB)
    assert (t.layout, t.name) == ("dsbench", "playground-series-s3e16")
    assert t.higher_is_better is False          # rank 1 holds the smallest MAE
    assert t.public_dir == DSB.resolve() / "data_resplit" / "playground-series-s3e16"
    same = sandbox.load_task(DSB / "data_resplit" / "playground-series-s3e16")
    assert same.task_id == t.task_id
    assert sandbox.load_task(DSB, higher_is_better=True).higher_is_better is True


def test_layout_errors_name_what_is_missing(tmp_path):
    with pytest.raises(TaskFormatError, match="expected an MLE-Dojo competition"):
        sandbox.load_task(tmp_path)
    comp = tmp_path / "comp"
    shutil.copytree(ST, comp)
    (comp / "data" / "private" / "test_answer.csv").unlink()
    with pytest.raises(TaskFormatError, match="test_answer.csv"):
        sandbox.load_task(comp)
    ds = tmp_path / "ds"
    shutil.copytree(DSB, ds)
    shutil.rmtree(ds / "leaderboards")
    with pytest.raises(TaskFormatError, match="leaderboard"):
        sandbox.load_task(ds)


def test_grade_accuracy_matches_sklearn(tmp_path):
    t = sandbox.load_task(ST)
    test = _rows(ST / "data/public/test.csv")
    preds = [[r["PassengerId"], r["CryoSleep"] == "True"] for r in test]
    sub = _write(tmp_path / "submission.csv", ["PassengerId", "Transported"], preds)
    g = grade_submission(t, sub)
    truth = {r["PassengerId"]: r["Transported"] == "True" for r in _rows(t.answer_path)}
    expected = accuracy_score([truth[p] for p, _ in preds], [v for _, v in preds])
    assert g.valid and g.raw_score == pytest.approx(expected, abs=1e-12)
    assert g.position_score == pytest.approx(_hand_position(expected, _boards(ST), True), abs=1e-12)


def test_grade_auc_and_mae_match_sklearn(tmp_path):
    kid = sandbox.load_task(KID)
    test = _rows(KID / "data/public/test.csv")
    probs = [[r["id"], float(r["calc"]) / 15.0] for r in reversed(test)]   # any row order is fine
    g = grade_submission(kid, _write(tmp_path / "k.csv", ["id", "target"], probs))
    truth = {r["id"]: int(r["target"]) for r in _rows(kid.answer_path)}
    auc = roc_auc_score([truth[i] for i, _ in probs], [p for _, p in probs])
    assert g.valid and g.raw_score == pytest.approx(auc, abs=1e-12)

    crab = sandbox.load_task(CRAB)
    test = _rows(CRAB / "data/public/test.csv")
    ages = [[r["id"], 3 + 6 * float(r["Length"])] for r in test]
    g = grade_submission(crab, _write(tmp_path / "c.csv", ["id", "Age"], ages))
    truth = {r["id"]: float(r["Age"]) for r in _rows(crab.answer_path)}
    mae = mean_absolute_error([truth[i] for i, _ in ages], [a for _, a in ages])
    assert g.valid and g.raw_score == pytest.approx(mae, abs=1e-12)
    assert g.position_score == pytest.approx(_hand_position(mae, _boards(CRAB), False), abs=1e-12)


def test_grade_dsbench_runs_its_eval_script(tmp_path):
    t = sandbox.load_task(DSB)
    test = _rows(t.public_dir / "test.csv")
    ages = [[r["id"], 2 + 7 * float(r["Length"])] for r in test]
    g = grade_submission(t, _write(tmp_path / "s.csv", ["id", "Age"], ages))
    truth = {r["id"]: float(r["Age"]) for r in _rows(t.answer_path)}
    assert g.valid
    assert g.raw_score == pytest.approx(mean_absolute_error([truth[i] for i, _ in ages], [a for _, a in ages]))


@pytest.mark.parametrize("case,reason", [
    ("wrong_column", "Missing required columns"),
    ("extra_column", "Extra unexpected columns"),
    ("short", "Number of rows"),
    ("wrong_ids", "First column values do not match"),
    ("nan", "NaN"),
    ("not_csv", "Failed to read submission"),
    ("missing", "Submission file not found"),
    ("symlink", "regular file"),
])
def test_invalid_submissions_give_the_reason(tmp_path, case, reason):
    t = sandbox.load_task(CRAB)
    ids = [r["id"] for r in _rows(CRAB / "data/public/test.csv")]
    path = tmp_path / "submission.csv"
    if case == "wrong_column":
        _write(path, ["id", "age"], [[i, 9] for i in ids])
    elif case == "extra_column":
        _write(path, ["id", "Age", "x"], [[i, 9, 1] for i in ids])
    elif case == "short":
        _write(path, ["id", "Age"], [[i, 9] for i in ids[:-1]])
    elif case == "wrong_ids":
        _write(path, ["id", "Age"], [[int(i) + 1000, 9] for i in ids])
    elif case == "nan":
        _write(path, ["id", "Age"], [[i, "" if k == 3 else 9] for k, i in enumerate(ids)])
    elif case == "not_csv":
        path.write_bytes(b"\x00\x01\x02 not,a\n\"csv")
    elif case == "symlink":   # pointing at the hidden answers must not score them
        os.symlink(t.answer_path, path)
    g = grade_submission(t, path)
    assert not g.valid and reason in g.message, g.message
    assert g.infrastructure_error is None


def test_dsbench_generic_checks(tmp_path):
    t = sandbox.load_task(DSB)
    ids = [r["id"] for r in _rows(t.public_dir / "test.csv")]
    g = grade_submission(t, _write(tmp_path / "s.csv", ["id", "Age"], [[i, 9] for i in ids[1:]]))
    assert not g.valid and "Number of rows" in g.message
    g = grade_submission(t, _write(tmp_path / "s.csv", ["id", "Age"], [[i, "nan"] for i in ids]))
    assert not g.valid and "NaN" in g.message


def test_task_repr_is_one_short_line():
    t = sandbox.load_task(ST)
    text = repr(t)
    print(text)
    boards = {b: len(_rows(ST / "data" / "private" / f"{b}_leaderboard.csv")) for b in ("private", "public")}
    assert text == (f"Task(name='spaceship-titanic', layout='mle-dojo', metric='SpaceshipTitanicMetrics' "
                    f"(higher is better), leaderboards={boards}, description={len(t.description)} chars, "
                    f"category='uncategorized', split='')")
    assert str(t) == text and "\n" not in text and len(text) < 250   # not thousands of scores
    # The embedded suite names its metric in info/task.json; DSBench falls back to its scorer's file.
    iris = sandbox.load_task(sandbox.suite.suite_dir() / "iris_species")
    assert "metric='accuracy' (higher is better)" in repr(iris) and "split='train'" in repr(iris)
    assert "metric='playground-series-s3e16_eval.py' (lower is better)" in repr(sandbox.load_task(DSB))
