"""The embedded task suite: shipped data, rebuild determinism, metrics vs scikit-learn, the log.

Numbers are checked against independent sources: each task's `utils/metric.py`
against scikit-learn / numpy formulas on perturbed answers, position scores
against MLE-Dojo's formula written out here, rewards against docs/design.md, "Reward ladder",
and a rebuild (a fresh sandbox run of the same scripts on regenerated data)
against the shipped files and log.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np
import pandas as pd
import pytest
from sklearn import metrics as skm

import sandbox
from sandbox.suite import TASKS, build, execution_log, get_spec, list_tasks, manifest, suite_dir
from sandbox.suite.metrics import METRICS

SHIPPED = suite_dir()
DATA_FILES = ("utils/metric.py", "info/description.txt", "info/inventory.json", "info/task.json",
              "data/public/description.txt", "data/public/train.csv", "data/public/test.csv",
              "data/public/sample_submission.csv", "data/private/test_answer.csv")


@pytest.fixture(scope="module")
def shipped():
    return manifest(), execution_log()


def _sha(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _position(score, board, higher_is_better):
    """MLE-Dojo: 1-based index of the first board score ours ties or beats (else N+1); (N - pos + 1) / N."""
    n = len(board)
    for i, s in enumerate(board, 1):
        if (score >= s) if higher_is_better else (score <= s):
            return (n - i + 1) / n
    return 0.0


# ----------------------------------------------------------------------------- the shipped suite


def test_manifest_covers_every_spec_with_train_and_held_out_splits(shipped):
    man, _ = shipped
    assert [t["name"] for t in man["tasks"]] == [s.name for s in TASKS]
    assert len(TASKS) >= 16
    train, test = list_tasks("train"), list_tasks("test")
    assert len(train) >= 12 and len(test) >= 4
    assert {p.name for p in train}.isdisjoint(p.name for p in test)
    assert sorted(train + test) == sorted(list_tasks())
    with pytest.raises(ValueError, match="split 'dev'"):
        list_tasks("dev")


def test_suite_is_varied(shipped):
    man, _ = shipped
    tasks = man["tasks"]
    for split in ("train", "test"):  # both metric directions in each split
        assert {t["higher_is_better"] for t in tasks if t["split"] == split} == {True, False}
    assert {"classification", "regression", "multi-target regression"} <= {t["category"] for t in tasks}
    assert len({t["metric"] for t in tasks}) >= 8
    rows = [t["rows_train"] + t["rows_test"] for t in tasks]
    assert min(rows) >= 100 and max(rows) <= 20000 and max(rows) >= 10000
    # The best reference solution differs across tasks (no single family wins everywhere).
    assert len({t["best_family"] for t in tasks}) >= 3
    assert len({t["best_solution"].split("(")[0] for t in tasks}) >= 5
    # Quirks are really in the data: missing values, string columns, imbalance.
    inv = {t["name"]: json.loads((SHIPPED / t["name"] / "info" / "inventory.json").read_text()) for t in tasks}
    missing = [n for n, i in inv.items() if any(c["missing"] for c in i["train.csv"]["columns"])]
    strings = [n for n, i in inv.items()
               if any(c["dtype"] not in ("int64", "float64") for c in i["test.csv"]["columns"])]
    assert len(missing) >= 3 and len(strings) >= 3, (missing, strings)
    fraud = pd.read_csv(SHIPPED / "transaction_fraud" / "data" / "public" / "train.csv")
    assert fraud.is_fraud.mean() < 0.06


@pytest.mark.parametrize("spec", TASKS, ids=lambda s: s.name)
def test_shipped_task_loads_and_boards_match_the_log(spec, shipped):
    man, log = shipped
    row = next(t for t in man["tasks"] if t["name"] == spec.name)
    task = sandbox.load_task(SHIPPED / spec.name)
    assert (task.category, task.split, task.higher_is_better) == (spec.category, spec.split, spec.higher_is_better)
    assert "Data inventory" in task.description and "Evaluation" in task.description
    scores = sorted((e["raw_score"] for e in log
                     if e["task"] == spec.name and e["origin"] == "reference" and e["status"] == "valid"),
                    reverse=spec.higher_is_better)
    assert len(scores) >= 50 and row["board_size"] == len(scores)
    for name in ("public", "private"):
        board = task.leaderboards[name]
        np.testing.assert_array_equal(board, scores)  # repr floats round-trip exactly
        ranks = pd.read_csv(SHIPPED / spec.name / "info" / f"{name}_leaderboard.csv")["rank"]
        assert list(ranks) == list(range(1, len(board) + 1))
    readme = (SHIPPED / spec.name / "README.md").read_text()
    assert "How the leaderboards were built" in readme and f"{len(scores)} entries" in readme
    # Public files hide the target; the answers hold exactly the submission's columns.
    test = pd.read_csv(SHIPPED / spec.name / "data" / "public" / "test.csv")
    answer = pd.read_csv(SHIPPED / spec.name / "data" / "private" / "test_answer.csv")
    sample = pd.read_csv(SHIPPED / spec.name / "data" / "public" / "sample_submission.csv")
    assert not set(spec.targets) & set(test.columns)
    assert list(answer.columns) == list(sample.columns) == row["submission_columns"]
    assert sorted(answer.id) == sorted(test.id) == sorted(sample.id)


def test_log_statuses_positions_and_rewards(shipped):
    _, log = shipped
    assert {e["status"] for e in log} >= {"malformed", "syntax_err", "runtime_err", "ran_no_sub", "valid"}
    ladder = {"malformed": 0.0, "syntax_err": 0.0, "runtime_err": 0.1, "ran_no_sub": 0.2}
    boards = {}
    for e in log:
        spec = get_spec(e["task"])
        assert e["split"] == spec.split
        if e["status"] == "valid":
            if e["task"] not in boards:
                boards[e["task"]] = sandbox.load_task(SHIPPED / e["task"]).leaderboards["private"]
            pos = _position(e["raw_score"], boards[e["task"]], spec.higher_is_better)
            assert e["position_score"] == pytest.approx(pos, abs=1e-12)
            assert e["reward"] == pytest.approx(0.5 + 0.5 * pos, abs=1e-12)
        else:
            assert e["raw_score"] is None and e["reward"] == ladder[e["status"]], e["label"]
        if e["origin"] == "reference":  # what an agent writes: env in, CSV out
            assert 'os.environ["DATA_DIR"]' in e["code"] and 'os.environ["SUBMISSION_PATH"]' in e["code"]
    # Every task's population spans weak to strong.
    for name in boards:
        pos = [e["position_score"] for e in log if e["task"] == name and e["status"] == "valid"]
        assert max(pos) == 1.0 and min(pos) <= 0.2, name


# ----------------------------------------------------------------------------- metrics vs scikit-learn


def _perturbed(answer: pd.DataFrame, kind: str, rng) -> pd.DataFrame:
    sub, cols = answer.copy(), list(answer.columns[1:])
    if kind == "label":
        lab = answer[cols[0]].to_numpy()
        sub[cols[0]] = np.where(rng.random(len(lab)) < 0.3, rng.permutation(lab), lab)
    elif kind == "proba":
        sub[cols[0]] = np.clip(0.6 * answer[cols[0]] + 0.4 * rng.random(len(answer)), 0.0, 1.0)
    elif kind == "classes":  # unnormalised rows, some above 1: the metric must rescale first
        sub[cols] = rng.random((len(answer), len(cols))) + 2.0 * answer[cols].to_numpy()
    else:
        for c in cols:
            sub[c] = answer[c] + rng.normal(0.0, answer[c].std() * 0.5, len(answer))
    return sub.sample(frac=1.0, random_state=1).reset_index(drop=True)  # row order must not matter


def _reference_score(metric: str, a: pd.DataFrame, b: pd.DataFrame) -> float:
    cols = list(a.columns[1:])
    y, p = a[cols[0]], b[cols[0]]
    if metric == "multi_log_loss":
        probs = b[cols].to_numpy()
        probs = probs / probs.sum(axis=1, keepdims=True)
        true = a[cols].to_numpy().argmax(axis=1)
        return float(-np.mean(np.log(np.clip(probs[np.arange(len(true)), true], 1e-15, 1 - 1e-15))))
    return float({
        "accuracy": lambda: np.mean(y.to_numpy() == p.to_numpy()),
        "f1": lambda: skm.f1_score(y, p),
        "f1_macro": lambda: skm.f1_score(y, p, average="macro"),
        "roc_auc": lambda: skm.roc_auc_score(y, p),
        "log_loss": lambda: -np.mean(y * np.log(np.clip(p, 1e-15, 1)) + (1 - y) * np.log(np.clip(1 - p, 1e-15, 1))),
        "rmse": lambda: np.sqrt(np.mean((y - p) ** 2)),
        "mae": lambda: np.mean(np.abs(y - p)),
        "r2": lambda: 1 - np.sum((y - p) ** 2) / np.sum((y - y.mean()) ** 2),
        "mcrmse": lambda: np.mean([np.sqrt(np.mean((a[c] - b[c]) ** 2)) for c in cols]),
    }[metric]())


@pytest.mark.parametrize("spec", TASKS, ids=lambda s: s.name)
def test_metric_file_matches_sklearn_and_rejects_bad_submissions(spec):
    root = SHIPPED / spec.name
    metric = sandbox.tasks.load_metric_class(root / "utils" / "metric.py")()
    assert metric.higher_is_better == spec.higher_is_better
    answer = pd.read_csv(root / "data" / "private" / "test_answer.csv")
    sub = _perturbed(answer, METRICS[spec.metric].kind, np.random.default_rng(0))
    assert metric.validate_submission(sub.copy(), answer.copy()) == "Submission is valid."
    got = metric.evaluate(answer.copy(), sub.copy())
    want = _reference_score(spec.metric, answer.sort_values("id").reset_index(drop=True),
                            sub.sort_values("id").reset_index(drop=True))
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    from mledojo.metrics.base import InvalidSubmissionError

    for bad, why in [(sub.iloc[:-1], "Number of rows"), (sub.rename(columns={"id": "row_id"}), "Missing required"),
                     (sub.assign(extra=1), "Extra unexpected"), (sub.assign(id=sub.id + 10**6), "do not match")]:
        with pytest.raises(InvalidSubmissionError, match=why):
            metric.validate_submission(bad.copy(), answer.copy())


# ----------------------------------------------------------------------------- rebuild


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    """Three tasks rebuilt from scratch (two data-only); iris with 2 baselines + the broken scripts run in the sandbox."""
    out = tmp_path_factory.mktemp("suite")
    build(out / "data_only", seed=0, tasks=["wine_cultivar", "rand_health_visits"], population=0, progress=False)
    build(out / "iris", seed=0, tasks=["iris_species"], population=2, workers=2, timeout_s=120, progress=False)
    return out


@pytest.mark.parametrize("name,sub", [("wine_cultivar", "data_only"), ("rand_health_visits", "data_only"),
                                      ("iris_species", "iris")])
def test_rebuild_gives_the_shipped_bytes(rebuilt, name, sub):
    for rel in DATA_FILES:
        assert _sha(rebuilt / sub / name / rel) == _sha(SHIPPED / name / rel), f"{name}/{rel} differs from the shipped file"


def test_rebuilt_sandbox_runs_reproduce_the_shipped_log(rebuilt, shipped):
    _, log = shipped
    fresh = execution_log(root=rebuilt / "iris")
    assert [e["status"] for e in fresh if e["origin"] == "failing"] == \
        [e["status"] for e in log if e["task"] == "iris_species" and e["origin"] == "failing"]
    by_code = {e["code"]: e for e in log if e["task"] == "iris_species"}
    for e in fresh:  # same script on the same data in a fresh sandbox: the same verdict and score
        if e["code"] in by_code:
            assert (e["status"], e["raw_score"]) == (by_code[e["code"]]["status"], by_code[e["code"]]["raw_score"])
    assert sum(e["code"] in by_code for e in fresh) >= 8
    board = pd.read_csv(rebuilt / "iris" / "iris_species" / "info" / "private_leaderboard.csv")
    assert len(board) == 2 and list(board.score) == sorted(board.score, reverse=True)


def test_build_errors_name_the_problem(tmp_path):
    with pytest.raises(KeyError, match="unknown embedded task 'no_such_task'"):
        build(tmp_path / "x", tasks=["no_such_task"], population=0, progress=False)
    with pytest.raises(ValueError, match="population -1"):
        build(tmp_path / "y", population=-1, progress=False)
    build(tmp_path / "z", tasks=["iris_species"], population=0, progress=False)
    with pytest.raises(ValueError, match="seed=0 population=0"):
        build(tmp_path / "z", seed=1, tasks=["wine_cultivar"], population=0, progress=False)
