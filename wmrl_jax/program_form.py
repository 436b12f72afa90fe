"""The agent's program form: one way to write a suite solution, shared by what trains and what is judged.

The micro-world writes its programs in this form (`normalise_solution`):
the same imports everywhere, the estimator named once, module-qualified, on
a model line right under them, the target list computed rather than
spelled, no comments. The world model is asked about programs in this form,
so its training corpora show them so too: the logged reference runs
(`wmrl_jax.micro_world`) and the mutants of the execution corpus
(`wmrl_jax.execution_corpus`), which start from it. Pure text, no JAX.
"""

from __future__ import annotations

import re
from typing import Sequence

_DOCSTRING = re.compile(r'\A\s*"""(?:.|\n)*?"""\s*\n')


def strip_docstring(code: str) -> str:
    """A reference solution without its leading docstring (which names the model it fits)."""
    return _DOCSTRING.sub("", code, count=1)


GENERIC_TARGETS = "TARGETS = [c for c in train.columns if c not in test.columns]"
# Every agent-form program starts with the same imports: the scikit-learn modules the suite's solutions
# draw estimators from (the estimator is then named once, module-qualified, on the model line) and the two
# pipeline helpers (whether to scale is a choice on the model line alone).
SKLEARN_MODULES = ("discriminant_analysis", "dummy", "ensemble", "linear_model", "multioutput", "naive_bayes",
                   "neighbors", "neural_network", "tree")
PIPELINE_IMPORTS = ("from sklearn.pipeline import make_pipeline", "from sklearn.preprocessing import StandardScaler")
_FROM_IMPORT = re.compile(r"^from sklearn\.(\w+) import (\w+(?:, \w+)*)$")
_TARGETS_LINE = re.compile(r"^TARGETS = (\[.*\])$")
# The suite's prediction blocks (sandbox/suite/solutions.py, one per submission kind) as (lines in the
# program's tail, the `predict = ...` line that moves up under the model line, what the tail keeps).
# `predict` returns the whole submission frame, so every program ends with the same lines whatever the metric:
# what the metric asks for is written once, on the `predict` line near the plan line that states it. (With a
# tail per kind, a micro-world agent wrote a binary log-loss task's `predict` line right and then the only
# log-loss tail it had seen, the multi-class one: a column per class for a one-column prediction, issue #26.)
SUBMISSION_TAIL = "submission = predict(X_test)"
_PREDICT_FORMS = (
    (("proba = model.predict_proba(X_test)[:, list(model.classes_).index(1)]",
      "submission = pd.DataFrame({TARGETS[0]: proba})"),
     "predict = lambda X: pd.DataFrame({TARGETS[0]: model.predict_proba(X)[:, list(model.classes_).index(1)]})",
     (SUBMISSION_TAIL,)),
    (("proba = model.predict_proba(X_test)",
      "submission = pd.DataFrame(proba, columns=[str(c) for c in model.classes_])"),
     "predict = lambda X: pd.DataFrame(model.predict_proba(X), columns=[str(c) for c in model.classes_])",
     (SUBMISSION_TAIL,)),
    (("submission = pd.DataFrame({TARGETS[0]: model.predict(X_test)})",),
     "predict = lambda X: pd.DataFrame({TARGETS[0]: model.predict(X)})",
     (SUBMISSION_TAIL,)),
    (("submission = pd.DataFrame(np.asarray(model.predict(X_test)).reshape(len(X_test), -1), columns=TARGETS)",),
     "predict = lambda X: pd.DataFrame(np.asarray(model.predict(X)).reshape(len(X), -1), columns=TARGETS)",
     (SUBMISSION_TAIL,)),
)
# The `predict` line per metric kind (sandbox.suite.metrics: label, proba, classes, value, values).
PREDICT_LINES = {"proba": _PREDICT_FORMS[0][1], "classes": _PREDICT_FORMS[1][1], "label": _PREDICT_FORMS[2][1],
                 "value": _PREDICT_FORMS[2][1], "values": _PREDICT_FORMS[3][1]}
_PANDAS = "import pandas as pd"

def normalise_solution(code: str, targets: Sequence[str] | None = None) -> str:
    """A suite solution in the agent corpus's form; its behaviour is unchanged.

    The program's one real choice, the estimator, is made in one place, at
    the top, next to the plan line that states it. A model this small, trained
    for minutes, conditions on what is near rather than copying from far away:
    trained on free-form programs it imported one class and fitted another, and wrote a train
    task's target name on a held-out task. So:

    * no leading docstring (it names the model) and no comment lines;
    * the same import block in every program: ``from sklearn import
      <SKLEARN_MODULES>``, ``make_pipeline`` and ``StandardScaler``; the
      estimator is called module-qualified (``linear_model.Ridge(alpha=1.0)``)
      on the ``model = ...`` line, which moves up right after the imports
      (building an estimator reads no data);
    * ``TARGETS = [<the task's targets>]`` becomes the generic
      ``TARGETS = [c for c in train.columns if c not in test.columns]`` (the
      same list on every suite task: test.csv is train.csv without the
      targets). A different literal (a broken solution naming a wrong column)
      is kept, as is every other line.
    """
    lines = [line for line in strip_docstring(code).strip().splitlines() if not line.lstrip().startswith("#")]
    models = [line for line in lines if line.startswith("model = ")]
    if len(models) == 1 and _PANDAS in lines:
        model, modules = models[0], set(SKLEARN_MODULES)
        drop = {model, *PIPELINE_IMPORTS}
        for line in lines:
            m = _FROM_IMPORT.match(line)
            if m and m.group(1) not in ("pipeline", "preprocessing"):
                for name in m.group(2).split(", "):
                    model = re.sub(rf"(?<![\w.]){name}\(", f"{m.group(1)}.{name}(", model)
                modules.add(m.group(1))
                drop.add(line)
        body = [line for line in lines if line not in drop]
        top = [model]
        for old, predict, new in _PREDICT_FORMS:
            at = next((i for i in range(len(body)) if tuple(body[i:i + len(old)]) == old), None)
            if at is not None:
                body[at:at + len(old)] = new
                top.append(predict)
                break
        at = body.index(_PANDAS) + 1
        header = [f"from sklearn import {', '.join(sorted(modules))}", *PIPELINE_IMPORTS]
        lines = body[:at] + header + top + body[at:]
    for i, line in enumerate(lines):
        m = _TARGETS_LINE.match(line)
        if m and (targets is None or m.group(1) == repr(list(targets))):
            lines[i] = GENERIC_TARGETS
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


__all__ = ["GENERIC_TARGETS", "PIPELINE_IMPORTS", "PREDICT_LINES", "SKLEARN_MODULES", "SUBMISSION_TAIL",
           "normalise_solution", "strip_docstring"]
