"""Mutations of working solutions: the ways agents' programs go wrong (and nearly wrong), as text edits.

The world model learns what running a program gives from programs whose
outcome was *measured*: each mutant here is executed in the real sandbox
(`wmrl_jax.execution_corpus`), and its label is whatever that run returned,
never what the mutation was meant to cause. A mutation only proposes a
program; several are built in pairs whose halves differ in one detail that
decides the outcome, so the model must read that detail:

* a column dropped by its real name (runs) vs by a misspelt one (KeyError);
* the string columns kept on a task that has them (a ValueError for most
  estimators) vs on one that has none (runs);
* the imputation removed on a task with missing values (fails for
  estimators that reject NaN, runs for the histogram boosters) vs without;
* an import removed that the program needs (NameError) vs one it does not.

Every mutation works on the agent's program form (the normalised reference
solutions the micro-world writes, `wmrl_jax.micro_world.normalise_solution`):
line-level edits found by exact text, so a program not in that form simply
yields no mutant for that kind. No JAX here (sandbox/ stays host-side).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class TaskFacts:
    """What a mutation may know about a task: its columns as the data inventory lists them."""

    name: str
    features: tuple[str, ...]        # train.csv columns other than id and the targets
    string_columns: tuple[str, ...]  # features with non-numeric values
    has_missing: bool                # any feature has an empty cell
    targets: tuple[str, ...]
    metric_kind: str                 # sandbox.suite.metrics kind: label | proba | classes | value | values


def task_facts(task_dir, targets: Sequence[str], metric_kind: str) -> TaskFacts:
    """`TaskFacts` of a suite task folder, read from its public train.csv."""
    import pathlib

    import pandas as pd

    frame = pd.read_csv(pathlib.Path(task_dir) / "data" / "public" / "train.csv")
    features = [c for c in frame.columns if c != "id" and c not in targets]
    strings = [c for c in features if not pd.api.types.is_numeric_dtype(frame[c])]
    return TaskFacts(name=pathlib.Path(task_dir).name, features=tuple(features), string_columns=tuple(strings),
                     has_missing=bool(frame[features].isna().any().any()), targets=tuple(targets),
                     metric_kind=metric_kind)


# --------------------------------------------------------------------------- helpers

_SELECT = ('X = X.select_dtypes(include="number")', "X_test = X_test[X.columns]")
_FILL = ("fill = X.median()", "X = X.fillna(fill).fillna(0.0)", "X_test = X_test.fillna(fill).fillna(0.0)")
_DROP_ID = 'X_test = test.drop(columns=["id"])'
_WRITE = 'submission.to_csv(os.environ["SUBMISSION_PATH"], index=False)'


def _replace(code: str, old: str, new: str) -> str | None:
    return code.replace(old, new, 1) if old in code else None


def _without_lines(code: str, lines: Sequence[str]) -> str | None:
    rows = code.split("\n")
    if not all(line in rows for line in lines):
        return None
    return "\n".join(r for r in rows if r not in lines)


def _after(code: str, anchor: str, insert: Sequence[str]) -> str | None:
    return _replace(code, anchor + "\n", anchor + "\n" + "\n".join(insert) + "\n")


def misspell(name: str, rng: np.random.Generator) -> str:
    """A plausible typo of `name` that differs from it: a dropped, doubled or swapped character, or a case change."""
    for _ in range(20):
        i = int(rng.integers(len(name)))
        kind = int(rng.integers(4))
        if kind == 0 and len(name) > 2:
            out = name[:i] + name[i + 1:]
        elif kind == 1:
            out = name[:i] + name[i] + name[i:]
        elif kind == 2 and i + 1 < len(name):
            out = name[:i] + name[i + 1] + name[i] + name[i + 2:]
        else:
            out = name[:i] + name[i].swapcase() + name[i + 1:]
        if out != name:
            return out
    return name + "_"


# --------------------------------------------------------------------------- mutations
# Each: (program, facts, rng) -> mutant program, or None where it does not apply.

def drop_real_column(code, facts, rng):
    """Drops one real feature column by its exact name (runs; the score moves a little)."""
    col = facts.features[int(rng.integers(len(facts.features)))]
    return _after(code, _DROP_ID, [f"X = X.drop(columns=[{col!r}])", f"X_test = X_test.drop(columns=[{col!r}])"])


def drop_misspelt_column(code, facts, rng):
    """Drops a feature column by a misspelt name (KeyError: not in the inventory)."""
    col = misspell(facts.features[int(rng.integers(len(facts.features)))], rng)
    return _after(code, _DROP_ID, [f"X = X.drop(columns=[{col!r}])", f"X_test = X_test.drop(columns=[{col!r}])"])


_INVENTED = ("age", "income", "score", "feature_0", "value", "amount", "total", "ratio", "count", "label")


def absent_column_feature(code, facts, rng):
    """Builds a feature from a column the data does not have (KeyError), or from a real one (runs)."""
    absent = [c for c in _INVENTED if c not in facts.features and c not in facts.targets]
    numeric = [c for c in facts.features if c not in facts.string_columns]
    use_real = bool(rng.integers(2)) and numeric
    col = numeric[int(rng.integers(len(numeric)))] if use_real else absent[int(rng.integers(len(absent)))]
    return _after(code, _DROP_ID, [f"X[{col + '_sq'!r}] = X[{col!r}] ** 2",
                                   f"X_test[{col + '_sq'!r}] = X_test[{col!r}] ** 2"])


def target_literal(code, facts, rng):
    """TARGETS spelled out: the right names (runs), a misspelt one, or a generic guess ("target")."""
    generic = "TARGETS = [c for c in train.columns if c not in test.columns]"
    choice = int(rng.integers(3))
    if choice == 0:
        names = list(facts.targets)
    elif choice == 1:
        names = [misspell(facts.targets[0], rng), *facts.targets[1:]]
    else:
        names = ["target" if "target" not in facts.targets else "y"]
    return _replace(code, generic, f"TARGETS = {names!r}")


def target_kept_as_feature(code, facts, rng):
    """Forgets to drop the targets from the features (the test frame has no such column)."""
    return _replace(code, 'X = train.drop(columns=["id"] + TARGETS)', 'X = train.drop(columns=["id"])')


# The program form's `predict` lines, per metric kind (`wmrl_jax.program_form`: `predict` returns the whole
# submission frame, and every program ends `submission = predict(X_test)`).
_CLASS_1 = ("predict = lambda X: pd.DataFrame({TARGETS[0]: model.predict_proba(X)[:, "
            "list(model.classes_).index(1)]})")
_CLASS_COLUMNS = "predict = lambda X: pd.DataFrame(model.predict_proba(X), columns=[str(c) for c in model.classes_])"
_LABELS = "predict = lambda X: pd.DataFrame({TARGETS[0]: model.predict(X)})"


def predict_labels_not_probabilities(code, facts, rng):
    """Submits predicted labels where the metric scores probabilities (no label-metric counterpart)."""
    if facts.metric_kind == "proba":
        return _replace(code, _CLASS_1, _LABELS)
    if facts.metric_kind == "classes":
        return _replace(code, _CLASS_COLUMNS, _CLASS_COLUMNS.replace("predict_proba", "predict"))
    return None


def probability_shape(code, facts, rng):
    """Confuses one probability column with one per class: `predict_proba`'s 2-D array into a 1-D column.

    On a label or probability metric the `predict` line keeps `predict_proba`
    whole (the submission has one column); on a per-class metric the
    probabilities are written as one column. Either way a 2-D array meets a
    1-D column (a ValueError, as the agent's own held-out samples failed).
    """
    one_column_of_all = "predict = lambda X: pd.DataFrame({TARGETS[0]: model.predict_proba(X)})"
    if facts.metric_kind == "proba":
        return _replace(code, _CLASS_1, one_column_of_all)
    if facts.metric_kind == "label":
        return _replace(code, _LABELS, one_column_of_all)
    if facts.metric_kind == "classes":
        return _replace(code, _CLASS_COLUMNS, one_column_of_all)
    return None


def submission_path_wrong(code, facts, rng):
    """Writes the submission somewhere other than SUBMISSION_PATH, or not at all."""
    if rng.integers(2):
        return _replace(code, _WRITE, 'submission.to_csv("predictions.csv", index=False)')
    return _without_lines(code, [_WRITE])


def submission_rows_wrong(code, facts, rng):
    """Writes the wrong number of rows (a head, a dropped row) or loses the id column."""
    choice = int(rng.integers(3))
    if choice == 0:
        return _replace(code, "submission.to_csv(", "submission.head(len(submission) // 2).to_csv(")
    if choice == 1:
        return _replace(code, "submission.to_csv(", "submission.iloc[1:].to_csv(")
    return _without_lines(code, ['submission.insert(0, "id", test["id"].to_numpy())'])


def undefined_name(code, facts, rng):
    """Uses a name that was never defined (NameError)."""
    options = [("model.fit(X, y)", "model.fit(X_train, y)"), ("model.fit(X, y)", "model.fit(X, y_train)"),
               ("predict(X_test)", "predict(X_valid)"), ("y = train[TARGETS", "y = df[TARGETS")]
    old, new = options[int(rng.integers(len(options)))]
    return _replace(code, old, new)


def missing_import(code, facts, rng):
    """Removes one import line: needed ones give a NameError, unneeded ones change nothing."""
    imports = [line for line in code.split("\n") if line.startswith(("import ", "from "))]
    if not imports:
        return None
    return _without_lines(code, [imports[int(rng.integers(len(imports)))]])


def keep_string_columns(code, facts, rng):
    """Skips the numeric selection: string columns reach the estimator (ValueError where the task has them)."""
    return _without_lines(code, list(_SELECT))


def skip_imputation(code, facts, rng):
    """Skips the median imputation: NaN reaches the estimator where the task has missing values."""
    return _without_lines(code, list(_FILL))


# Estimators outside the reference grid (other settings, other classes): real runs label their quality.
_CLASSIFIERS = (
    "neighbors.KNeighborsClassifier(n_neighbors=3)", "neighbors.KNeighborsClassifier(n_neighbors=25)",
    "tree.DecisionTreeClassifier(max_depth=5, random_state=0)", "linear_model.LogisticRegression(C=0.3, max_iter=2000)",
    "ensemble.RandomForestClassifier(n_estimators=200, random_state=0)",
    "ensemble.RandomForestClassifier(n_estimators=20, max_depth=3, random_state=0)",
    "ensemble.ExtraTreesClassifier(n_estimators=200, random_state=0)",
    "ensemble.HistGradientBoostingClassifier(max_iter=100, random_state=0)",
    "ensemble.GradientBoostingClassifier(n_estimators=100, random_state=0)",
    "ensemble.AdaBoostClassifier(random_state=0)", "naive_bayes.BernoulliNB()",
    "linear_model.RidgeClassifier(alpha=1.0)", "dummy.DummyClassifier()",
    "neural_network.MLPClassifier(hidden_layer_sizes=(32,), max_iter=300, random_state=0)",
)
_REGRESSORS = (
    "neighbors.KNeighborsRegressor(n_neighbors=3)", "neighbors.KNeighborsRegressor(n_neighbors=25)",
    "tree.DecisionTreeRegressor(max_depth=5, random_state=0)", "linear_model.Ridge(alpha=3.0)",
    "linear_model.Lasso(alpha=0.3, max_iter=5000)", "linear_model.BayesianRidge()", "linear_model.HuberRegressor()",
    "ensemble.RandomForestRegressor(n_estimators=200, random_state=0)",
    "ensemble.RandomForestRegressor(n_estimators=20, max_depth=3, random_state=0)",
    "ensemble.ExtraTreesRegressor(n_estimators=200, random_state=0)",
    "ensemble.HistGradientBoostingRegressor(max_iter=100, random_state=0)",
    "ensemble.GradientBoostingRegressor(n_estimators=100, random_state=0)",
    "ensemble.AdaBoostRegressor(random_state=0)", "dummy.DummyRegressor()",
    "neural_network.MLPRegressor(hidden_layer_sizes=(32,), max_iter=300, random_state=0)",
)


def other_estimator(code, facts, rng):
    """Swaps the model line for an estimator outside the reference grid, scaled or not."""
    rows = code.split("\n")
    at = next((i for i, r in enumerate(rows) if r.startswith("model = ")), None)
    if at is None:
        return None
    pool = _CLASSIFIERS if facts.metric_kind in ("label", "proba", "classes") else _REGRESSORS
    estimator = pool[int(rng.integers(len(pool)))]
    if facts.metric_kind == "values" and ("GradientBoosting" in estimator or "AdaBoost" in estimator
                                          or "Huber" in estimator):
        estimator = f"multioutput.MultiOutputRegressor({estimator})"
    rows[at] = f"model = make_pipeline(StandardScaler(), {estimator})" if rng.integers(2) else f"model = {estimator}"
    return "\n".join(rows)


def too_slow(code, facts, rng):
    """An estimator far too large for the time limit on this data (a timeout, if the task is big enough)."""
    rows = code.split("\n")
    at = next((i for i, r in enumerate(rows) if r.startswith("model = ")), None)
    if at is None:
        return None
    if facts.metric_kind in ("label", "proba", "classes"):
        estimator = "ensemble.GradientBoostingClassifier(n_estimators=20000, max_depth=8, random_state=0)"
    else:
        estimator = "ensemble.GradientBoostingRegressor(n_estimators=20000, max_depth=8, random_state=0)"
        if facts.metric_kind == "values":
            estimator = f"multioutput.MultiOutputRegressor({estimator})"
    rows[at] = f"model = {estimator}"
    return "\n".join(rows)


MUTATIONS: dict[str, Callable] = {
    "drop_real_column": drop_real_column,
    "drop_misspelt_column": drop_misspelt_column,
    "absent_column_feature": absent_column_feature,
    "target_literal": target_literal,
    "target_kept_as_feature": target_kept_as_feature,
    "predict_labels_not_probabilities": predict_labels_not_probabilities,
    "submission_path_wrong": submission_path_wrong,
    "submission_rows_wrong": submission_rows_wrong,
    "undefined_name": undefined_name,
    "missing_import": missing_import,
    "keep_string_columns": keep_string_columns,
    "skip_imputation": skip_imputation,
    "other_estimator": other_estimator,
    "too_slow": too_slow,
    "probability_shape": probability_shape,
}


def mutate(code: str, facts: TaskFacts, kind: str, seed: int) -> str | None:
    """The `kind` mutant of `code` (deterministic in `seed`), or None when the kind does not apply to it."""
    if kind not in MUTATIONS:
        raise ValueError(f"mutation kind {kind!r}: expected one of {sorted(MUTATIONS)}")
    out = MUTATIONS[kind](code, facts, np.random.default_rng(seed))
    return None if out is None or out == code else out


__all__ = ["MUTATIONS", "TaskFacts", "misspell", "mutate", "task_facts"]
