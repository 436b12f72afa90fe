"""The execution corpus: mutants labelled by real sandbox runs, a file that refuses to be half-read.

References: the real sandbox (`sandbox.run_solution`) for every label; the
suite's own files for what a task has (columns, strings, missing values).
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

import sandbox
from sandbox import suite
from sandbox.suite import mutations
from sandbox.suite.metrics import METRICS
from wmrl_jax import execution_corpus, micro_world


def _facts(name):
    row = next(r for r in suite.manifest()["tasks"] if r["name"] == name)
    path = next(p for p in suite.list_tasks() if p.name == name)
    return mutations.task_facts(path, row["targets"], METRICS[row["metric"]].kind), row


def _program(name, index=10):
    """A valid numeric-features reference program of `name` in the agent's form (no one-hot encoding)."""
    entry = [e for e in suite.execution_log("train") if e["task"] == name and e["status"] == "valid"
             and "+onehot" not in e["label"]][index]
    _, row = _facts(name)
    return micro_world.normalise_solution(entry["code"], row["targets"])


def test_task_facts_read_the_data():
    facts, row = _facts("customer_churn")
    assert facts.targets == ("churned",) and "churned" not in facts.features and "id" not in facts.features
    assert set(facts.string_columns) == {"plan", "region"} and facts.has_missing
    iris, _ = _facts("iris_species")
    assert iris.string_columns == () and not iris.has_missing


def test_every_mutation_kind_changes_the_program_where_it_applies():
    tasks = ("customer_churn", "breast_cancer_diagnosis", "wine_cultivar")   # label, proba, classes metrics
    for kind in mutations.MUTATIONS:
        applied = 0
        for name in tasks:
            facts, _ = _facts(name)
            program = _program(name)
            for seed in range(4):
                out = mutations.mutate(program, facts, kind, seed)
                assert out is None or (out != program and compile(out, "solution.py", "exec"))
                applied += out is not None
        assert applied, kind
    facts, _ = _facts("customer_churn")
    program = _program("customer_churn")
    assert mutations.mutate(program, facts, "drop_misspelt_column", 3) == \
        mutations.mutate(program, facts, "drop_misspelt_column", 3)   # deterministic in the seed
    with pytest.raises(ValueError, match="mutation kind 'bogus'"):
        mutations.mutate(program, facts, "bogus", 0)


def test_misspell_never_returns_the_name():
    rng = np.random.default_rng(0)
    for name in ("a", "ab", "churned", "tenure_z", "AA"):
        for _ in range(50):
            assert mutations.misspell(name, rng) != name


def test_labels_come_from_real_runs_not_from_the_mutation():
    """The same kind of edit runs or fails depending on the task's data, and the corpus records what ran."""
    churn, _ = _facts("customer_churn")     # string columns and missing values
    iris, _ = _facts("iris_species")        # neither
    strings_churn = mutations.mutate(_program("customer_churn"), churn, "keep_string_columns", 0)
    assert strings_churn is not None
    strings_iris = mutations.mutate(_program("iris_species"), iris, "keep_string_columns", 0)
    typo = mutations.mutate(_program("iris_species"), iris, "drop_misspelt_column", 0)
    tasks = {p.name: sandbox.load_task(p) for p in suite.list_tasks("train")}
    results = [sandbox.run_solution(tasks[t], c, timeout_s=60)
               for t, c in (("customer_churn", strings_churn), ("iris_species", strings_iris), ("iris_species", typo))]
    assert [r.status for r in results] == ["runtime_err", "valid", "runtime_err"]
    assert results[0].error_type in ("ValueError", "TypeError") and results[2].error_type == "KeyError"


def test_plan_is_deterministic_train_only_and_unique():
    config = execution_corpus.CorpusConfig(references_per_task=1, mutants_per_reference=3, slow_tasks=1)
    a, b = execution_corpus.plan(config), execution_corpus.plan(config)
    assert a == b and len({e["key"] for e in a}) == len(a)
    assert {e["task"] for e in a} <= {p.name for p in suite.list_tasks("train")}
    assert sum(e["kind"] == "too_slow" for e in a) == 1


def test_execute_resumes_and_writes_atomically(tmp_path):
    config = execution_corpus.CorpusConfig(references_per_task=1, mutants_per_reference=1, slow_tasks=0,
                                           timeout_s=60)
    entries = [e for e in execution_corpus.plan(config) if e["task"] == "iris_species"][:1]
    entries.append({**entries[0], "key": "second", "code": _program("iris_species", 3)})
    out = tmp_path / "corpus.jsonl.gz"
    partial = tmp_path / "corpus.jsonl.gz.partial"
    # An interrupted build: the header, one finished run, and half a line.
    header = execution_corpus._header(entries, config, None)
    done = {**entries[1], "status": "valid", "reward": 0.9, "raw_score": 1.0, "position_score": 0.8,
            "error_type": None, "error_line": None, "feedback": "", "cpu_s": 0.0}
    partial.write_text(json.dumps(header) + "\n" + json.dumps(done) + "\n" + '{"key": "tru')
    rows = execution_corpus.execute(entries, out, config=config, workers=1, progress=False)
    assert [r["key"] for r in rows] == [entries[0]["key"], "second"]
    assert rows[1]["reward"] == 0.9          # taken from the partial file, not run again
    assert not partial.exists() and out.is_file()
    assert execution_corpus.load(out) == rows


def test_targeted_kinds_are_added_without_changing_the_drawn_plan():
    config = execution_corpus.CorpusConfig(references_per_task=2, mutants_per_reference=3, slow_tasks=0)
    entries = execution_corpus.plan(config)
    targeted = [e for e in entries if e["kind"] in execution_corpus.TARGETED]
    drawn = [e for e in entries if e["kind"] not in execution_corpus.TARGETED]
    assert entries[:len(drawn)] == drawn           # the targeted pass comes last, after every drawn program
    # probability_shape applies to the classification tasks' picked references (2 each), on every metric kind
    kinds = {METRICS[r["metric"]].kind for r in suite.manifest()["tasks"]
             if r["name"] in {e["task"] for e in targeted}}
    assert kinds == {"label", "proba", "classes"} and len(targeted) >= 2 * 6
    program = _program("breast_cancer_diagnosis")
    facts, _ = _facts("breast_cancer_diagnosis")
    mutant = mutations.mutate(program, facts, "probability_shape", 0)
    assert "predict = lambda X: pd.DataFrame({TARGETS[0]: model.predict_proba(X)})\n" in mutant
    assert "submission = predict(X_test)\n" in mutant


def test_shipped_labels_are_reused_not_rerun(tmp_path):
    """A regeneration that adds programs runs only those: earlier labels come from the file at --out."""
    config = execution_corpus.CorpusConfig()
    shipped = execution_corpus.reusable(execution_corpus.corpus_path(), config)
    assert len(shipped) == len(execution_corpus.load())
    entries = [{k: r[k] for k in ("key", "task", "origin", "kind", "code")} for r in list(shipped.values())[:3]]
    rows = execution_corpus.execute(entries, tmp_path / "c.jsonl.gz", config=config, workers=1, progress=False,
                                    previous=shipped)
    assert rows == [shipped[e["key"]] for e in entries]
    # Another time limit, or a file that is not a corpus: nothing is reused.
    assert execution_corpus.reusable(execution_corpus.corpus_path(), execution_corpus.CorpusConfig(timeout_s=61.0)) == {}
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    assert execution_corpus.reusable(tmp_path / "bad.jsonl.gz", config) == {}


def test_load_refuses_truncated_foreign_and_missing_files(tmp_path):
    header = {"format": execution_corpus.FORMAT, "version": execution_corpus.VERSION,
              "suite": execution_corpus.suite_fingerprint()}
    good = tmp_path / "good.jsonl.gz"
    execution_corpus.write(good, header, [{"key": "a"}, {"key": "b"}])
    assert execution_corpus.load(good) == [{"key": "a"}, {"key": "b"}]
    lines = gzip.open(good, "rt").read().splitlines()
    cut = tmp_path / "cut.jsonl.gz"
    with gzip.open(cut, "wt") as f:
        f.write("\n".join(lines[:-1]) + "\n")
    with pytest.raises(execution_corpus.CorpusError, match=r"cut.jsonl.gz: truncated.*build_wm_corpus.py"):
        execution_corpus.load(cut)
    half = tmp_path / "half.jsonl.gz"
    half.write_bytes(good.read_bytes()[:-12])
    with pytest.raises(execution_corpus.CorpusError, match=r"half.jsonl.gz: unreadable.*build_wm_corpus.py"):
        execution_corpus.load(half)
    other = tmp_path / "other.jsonl.gz"
    execution_corpus.write(other, {**header, "suite": "0123456789abcdef"}, [])
    with pytest.raises(execution_corpus.CorpusError, match=r"other.jsonl.gz: built for suite '0123456789abcdef'"):
        execution_corpus.load(other)
    old = tmp_path / "old.jsonl.gz"
    execution_corpus.write(old, {**header, "version": 0}, [])
    with pytest.raises(execution_corpus.CorpusError, match="format version 0, expected 1"):
        execution_corpus.load(old)
    with pytest.raises(execution_corpus.CorpusError, match=r"nothing.jsonl.gz: missing.*build_wm_corpus.py"):
        execution_corpus.load(tmp_path / "nothing.jsonl.gz")


def test_shipped_corpus_is_train_only_and_labelled_by_runs():
    rows = execution_corpus.load()
    train = {p.name for p in suite.list_tasks("train")}
    assert {r["task"] for r in rows} == train
    statuses = {r["status"] for r in rows}
    assert {"valid", "runtime_err", "ran_no_sub"} <= statuses and "unknown" not in statuses
    assert {r["origin"] for r in rows} == {"mutant", "agent"}
    valid = [r for r in rows if r["status"] == "valid"]
    assert all(r["position_score"] is not None and 0.0 <= r["position_score"] <= 1.0 for r in valid)
    failed = [r for r in rows if r["status"] in ("runtime_err", "ran_no_sub")]
    assert len(failed) >= 0.3 * len(rows) and all(r["error_type"] for r in failed)
