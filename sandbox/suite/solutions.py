"""Reference solutions: full python scripts generated from parameterised templates.

A solution is exactly what an agent would write: it reads
`os.environ["DATA_DIR"]` (train.csv, test.csv) and writes a CSV to
`os.environ["SUBMISSION_PATH"]`. The population of one task spans weak to
strong:

  baselines   constant / majority / prior / stratified / mean / median
  linear      logistic or ridge / lasso / elastic-net, C or alpha over 5
              decades, with and without standardisation
  trees       depth 1 .. unlimited
  neighbours  k = 1 .. 45, scaled or not
  others      naive Bayes, LDA, a small MLP
  ensembles   random forests, extra trees, histogram and classic gradient boosting

Feature handling is part of the solution: where a task has string columns,
the population mixes "numeric" (drop the strings) and "onehot" pipelines;
missing values are always median-imputed in the valid population. A few
deliberately broken scripts per task (`failing_solutions`) make every status
of the sandbox's ladder appear in the execution log.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sandbox.suite.metrics import METRICS
from sandbox.suite.specs import TaskSpec


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One reference solution: a model constructor call plus its feature handling."""

    family: str  # "baseline" | "linear" | "tree" | "knn" | "bayes" | "ensemble" | "mlp"
    module: str  # sklearn module to import from
    estimator: str  # class name
    args: str  # constructor arguments, python source
    scale: bool = False  # StandardScaler before the model
    features: str = "numeric"  # "numeric" (drop string columns) | "onehot" | "raw" (no handling at all)

    @property
    def label(self) -> str:
        extras = (["scaled"] if self.scale else []) + ([self.features] if self.features != "numeric" else [])
        return f"{self.estimator}({self.args})" + "".join(f" +{e}" for e in extras)


def _grid(family, module, estimator, argss, scales=(False,)):
    return [Recipe(family, module, estimator, a, s) for a in argss for s in scales]


def _classifier_recipes() -> list[Recipe]:
    return (
        _grid("baseline", "sklearn.dummy", "DummyClassifier",
              ['strategy="most_frequent"', 'strategy="prior"', 'strategy="stratified", random_state=0',
               'strategy="uniform", random_state=0'])
        + _grid("linear", "sklearn.linear_model", "LogisticRegression",
                [f"C={c}, max_iter=2000" for c in ("0.001", "0.01", "0.1", "1.0", "10.0")], (True, False))
        + _grid("tree", "sklearn.tree", "DecisionTreeClassifier",
                [f"max_depth={d}, random_state=0" for d in (1, 2, 3, 4, 6, 8, 12, None)]
                + ["min_samples_leaf=20, random_state=0"])
        + _grid("knn", "sklearn.neighbors", "KNeighborsClassifier",
                [f"n_neighbors={k}" for k in (1, 5, 15, 45)], (True, False))
        + _grid("knn", "sklearn.neighbors", "KNeighborsClassifier", ['n_neighbors=15, weights="distance"'], (True,))
        + _grid("bayes", "sklearn.naive_bayes", "GaussianNB", ["", "var_smoothing=0.01"])
        + _grid("linear", "sklearn.discriminant_analysis", "LinearDiscriminantAnalysis", [""])
        + _grid("linear", "sklearn.linear_model", "LogisticRegression",
                ['C=1.0, class_weight="balanced", max_iter=2000'], (True,))
        + _grid("mlp", "sklearn.neural_network", "MLPClassifier",
                ["hidden_layer_sizes=(64,), early_stopping=True, random_state=0"], (True,))
        + _grid("ensemble", "sklearn.ensemble", "RandomForestClassifier",
                [f"n_estimators={n}, max_depth={d}, random_state=0" for n, d in ((50, 4), (50, None), (100, 8), (100, None))]
                + ['n_estimators=100, min_samples_leaf=5, class_weight="balanced", random_state=0'])
        + _grid("ensemble", "sklearn.ensemble", "ExtraTreesClassifier",
                [f"n_estimators=100, max_depth={d}, random_state=0" for d in (8, None)])
        + _grid("ensemble", "sklearn.ensemble", "HistGradientBoostingClassifier",
                [f"learning_rate={lr}, max_iter={it}, random_state=0"
                 for lr in ("0.03", "0.1", "0.3") for it in (50, 200)]
                + ['max_iter=200, class_weight="balanced", random_state=0'])
        + _grid("ensemble", "sklearn.ensemble", "GradientBoostingClassifier",
                [f"n_estimators={n}, max_depth=3, random_state=0" for n in (50, 150)])
    )


def _regressor_recipes() -> list[Recipe]:
    return (
        _grid("baseline", "sklearn.dummy", "DummyRegressor",
              ['strategy="mean"', 'strategy="median"', 'strategy="quantile", quantile=0.25'])
        + _grid("linear", "sklearn.linear_model", "LinearRegression", [""])
        + _grid("linear", "sklearn.linear_model", "Ridge",
                [f"alpha={a}" for a in ("0.1", "1.0", "10.0", "100.0", "1000.0")], (True, False))
        + _grid("linear", "sklearn.linear_model", "Lasso",
                [f"alpha={a}, max_iter=5000" for a in ("0.01", "0.1", "1.0", "10.0")], (True,))
        + _grid("linear", "sklearn.linear_model", "ElasticNet",
                ["alpha=0.1, l1_ratio=0.5, max_iter=5000", "alpha=1.0, l1_ratio=0.5, max_iter=5000"], (True,))
        + _grid("tree", "sklearn.tree", "DecisionTreeRegressor",
                [f"max_depth={d}, random_state=0" for d in (1, 2, 3, 4, 6, 8, 12, None)])
        + _grid("knn", "sklearn.neighbors", "KNeighborsRegressor",
                [f"n_neighbors={k}" for k in (1, 5, 15, 45)], (True, False))
        + _grid("mlp", "sklearn.neural_network", "MLPRegressor",
                ["hidden_layer_sizes=(64,), early_stopping=True, max_iter=500, random_state=0"], (True,))
        + _grid("ensemble", "sklearn.ensemble", "RandomForestRegressor",
                [f"n_estimators={n}, max_depth={d}, random_state=0" for n, d in ((50, 4), (50, None), (100, 8), (100, None))])
        + _grid("ensemble", "sklearn.ensemble", "ExtraTreesRegressor",
                [f"n_estimators=100, max_depth={d}, random_state=0" for d in (8, None)])
        + _grid("ensemble", "sklearn.ensemble", "HistGradientBoostingRegressor",
                [f"learning_rate={lr}, max_iter={it}, random_state=0"
                 for lr in ("0.03", "0.1", "0.3") for it in (50, 200)]
                + ['loss="absolute_error", max_iter=200, random_state=0'])
        + _grid("ensemble", "sklearn.ensemble", "GradientBoostingRegressor",
                [f"n_estimators={n}, max_depth=3, random_state=0" for n in (50, 150)])
    )


# Estimators without native multi-output support get wrapped in MultiOutputRegressor.
_SINGLE_OUTPUT = {"HistGradientBoostingRegressor", "GradientBoostingRegressor"}


def recipes(classification: bool) -> list[Recipe]:
    """Every recipe of the grid for a classification (True) or regression (False) task."""
    return _classifier_recipes() if classification else _regressor_recipes()


def population(spec: TaskSpec, size: int, seed: int, has_strings: bool) -> list[Recipe]:
    """`size` reference recipes for `spec`, deterministic in `seed`, weak to strong mixed.

    All baselines come first (they anchor the bottom of the leaderboard); the
    rest is a seeded sample of the grid without replacement.
    """
    grid = _classifier_recipes() if spec.is_classification else _regressor_recipes()
    if size > len(grid):
        raise ValueError(f"task {spec.name}: population {size} exceeds the {len(grid)} recipes available")
    rng = np.random.default_rng(seed)
    base = [r for r in grid if r.family == "baseline"]
    rest = [r for r in grid if r.family != "baseline"]
    chosen = base[: min(size, len(base))]
    order = rng.permutation(len(rest))
    chosen += [rest[i] for i in sorted(order[: size - len(chosen)])]
    if has_strings:  # half of the non-baseline solutions encode the string columns
        flags = rng.random(len(chosen)) < 0.5
        chosen = [dataclasses.replace(r, features="onehot") if f and r.family != "baseline" else r
                  for r, f in zip(chosen, flags)]
    return chosen


_HEADER = '''\
"""{doc}"""
import os

import numpy as np
import pandas as pd
{imports}

DATA_DIR = os.environ["DATA_DIR"]
train = pd.read_csv(os.path.join(DATA_DIR, "train.csv"))
test = pd.read_csv(os.path.join(DATA_DIR, "test.csv"))
TARGETS = {targets}

X = train.drop(columns=["id"] + TARGETS)
X_test = test.drop(columns=["id"])
'''

_NUMERIC = '''\
# Keep numeric columns only; impute missing values with the training median.
X = X.select_dtypes(include="number")
X_test = X_test[X.columns]
'''

_ONEHOT = '''\
# One-hot encode string columns (missing is its own category), then impute numeric gaps.
both = pd.get_dummies(pd.concat([X, X_test], axis=0), dummy_na=True, dtype=float)
X, X_test = both.iloc[: len(X)], both.iloc[len(X):]
'''

_IMPUTE = '''\
fill = X.median()
X = X.fillna(fill).fillna(0.0)
X_test = X_test.fillna(fill).fillna(0.0)
'''


def _predict_block(spec: TaskSpec) -> str:
    kind = METRICS[spec.metric].kind
    if kind == "label":
        y, out = "y = train[TARGETS[0]]", "submission = pd.DataFrame({TARGETS[0]: model.predict(X_test)})"
    elif kind == "proba":
        y = "y = train[TARGETS[0]]"
        out = ("proba = model.predict_proba(X_test)[:, list(model.classes_).index(1)]\n"
               "submission = pd.DataFrame({TARGETS[0]: proba})")
    elif kind == "classes":
        y = "y = train[TARGETS[0]]"
        out = ("proba = model.predict_proba(X_test)\n"
               "submission = pd.DataFrame(proba, columns=[str(c) for c in model.classes_])")
    elif kind == "value":
        y, out = "y = train[TARGETS[0]]", "submission = pd.DataFrame({TARGETS[0]: model.predict(X_test)})"
    else:
        y = "y = train[TARGETS]"
        out = "submission = pd.DataFrame(np.asarray(model.predict(X_test)).reshape(len(X_test), -1), columns=TARGETS)"
    return (f"{y}\nmodel.fit(X, y)\n{out}\n"
            'submission.insert(0, "id", test["id"].to_numpy())\n'
            'submission.to_csv(os.environ["SUBMISSION_PATH"], index=False)\n')


def render(spec: TaskSpec, recipe: Recipe) -> str:
    """The full script of `recipe` for `spec`."""
    imports = [f"from {recipe.module} import {recipe.estimator}"]
    model = f"{recipe.estimator}({recipe.args})"
    if len(spec.targets) > 1 and recipe.estimator in _SINGLE_OUTPUT:
        imports.append("from sklearn.multioutput import MultiOutputRegressor")
        model = f"MultiOutputRegressor({model})"
    if recipe.scale:
        imports += ["from sklearn.pipeline import make_pipeline", "from sklearn.preprocessing import StandardScaler"]
        model = f"make_pipeline(StandardScaler(), {model})"
    doc = f"Reference solution for {spec.name}: {recipe.label}."
    return (_HEADER.format(doc=doc, imports="\n".join(imports), targets=repr(list(spec.targets)))
            + {"onehot": _ONEHOT + _IMPUTE, "numeric": _NUMERIC + _IMPUTE, "raw": ""}[recipe.features]
            + f"\nmodel = {model}\n" + _predict_block(spec))


def failing_solutions(spec: TaskSpec, has_missing: bool, has_strings: bool) -> list[tuple[str, str]]:
    """(label, script) pairs that fail the way agents fail; together they cover every status but "valid"."""
    model = "DecisionTreeClassifier" if spec.is_classification else "DecisionTreeRegressor"
    good = render(spec, Recipe("tree", "sklearn.tree", model, "max_depth=4, random_state=0"))
    edits = [
        ("syntax_err: missing colon", "import os\n", "import os\nfor name in ['train', 'test']\n    pass\n"),
        ("runtime_err: wrong target column name", f"TARGETS = {list(spec.targets)!r}", 'TARGETS = ["target"]'),
        ("runtime_err: library not installed", "import os\n", "import os\nimport lightgbm as lgb\n"),
        ("ran_no_sub: wrong id column name", 'submission.insert(0, "id"', 'submission.insert(0, "row_id"'),
        ("ran_no_sub: only half the test rows", "submission.to_csv(", "submission.head(len(submission) // 2).to_csv("),
    ]
    # An answer cut off at the token limit: the ```python fence never closes, so there is no program.
    out = [("malformed: answer truncated inside its code fence",
            "I will train a gradient boosting model and write the predictions.\n\n```python\n"
            + good[: len(good) // 3])]
    for label, old, new in edits:
        if old not in good:
            raise AssertionError(f"task {spec.name}: failing solution {label!r}: {old!r} not in the template")
        out.append((label, good.replace(old, new, 1)))
    if has_missing or has_strings:  # the classic: fit on raw columns without encoding / imputation
        linear = "LogisticRegression" if spec.is_classification else "LinearRegression"
        out.append(("runtime_err: raw columns into a model that cannot take them",
                    render(spec, Recipe("linear", "sklearn.linear_model", linear, "", features="raw"))))
    return out
