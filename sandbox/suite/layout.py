"""Writes one embedded task in the MLE-Dojo competition layout.

    <task>/utils/metric.py                 CompetitionMetrics subclass (metrics.py)
    <task>/info/description.txt            Kaggle-style description
    <task>/info/inventory.json             files, columns, dtypes, row counts, missing
    <task>/data/public/description.txt     the description + the data inventory as text
    <task>/data/public/{train,test,sample_submission}.csv
    <task>/data/private/test_answer.csv    hidden answers (same columns as the submission)

Leaderboards and the README are added by `build.py` once the reference
population has been executed. Everything here is a pure function of
(spec, seed): CSVs use a fixed float format and "\\n" line ends, JSON is
written with sorted keys, so a rebuild gives the same bytes.
"""

from __future__ import annotations

import io
import json
import pathlib
import zlib

import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split

from sandbox.suite.metrics import METRICS, metric_source
from sandbox.suite.specs import TaskSpec

ID = "id"
FLOAT_FORMAT = "%.6g"  # 6 significant digits: small files, far below any metric's resolution


def task_seed(spec: TaskSpec, seed: int) -> int:
    """A per-task seed: stable across runs and machines (crc32, not Python's salted hash)."""
    return (zlib.crc32(spec.name.encode()) + 7919 * seed) % (2**31 - 1)


def submission_columns(spec: TaskSpec, classes) -> list[str]:
    """The non-id columns of a submission (and of test_answer.csv)."""
    if METRICS[spec.metric].kind == "classes":
        return [str(c) for c in classes]
    return list(spec.targets)


def split_frames(spec: TaskSpec, seed: int):
    """(train, test, answer, sample) frames for `spec`; test has no target columns."""
    s = task_seed(spec, seed)
    table = spec.make(s).reset_index(drop=True)
    missing = [t for t in spec.targets if t not in table.columns]
    if missing:
        raise KeyError(f"task {spec.name}: generator output lacks target columns {missing}")
    rng = np.random.default_rng(s)
    # Ids are a random permutation so that row order carries no information.
    table.insert(0, ID, rng.permutation(len(table)) + 1)
    stratify = table[spec.targets[0]] if spec.is_classification else None
    train, test = train_test_split(table, test_size=spec.test_fraction, random_state=s, stratify=stratify)
    train = train.sort_values(ID).reset_index(drop=True)
    test = test.sort_values(ID).reset_index(drop=True)
    classes = sorted(table[spec.targets[0]].unique()) if spec.is_classification else []
    cols = submission_columns(spec, classes)
    kind = METRICS[spec.metric].kind
    if kind == "classes":
        answer = pd.DataFrame({c: (test[spec.targets[0]] == k).astype(int) for c, k in zip(cols, classes)})
        sample = pd.DataFrame({c: np.full(len(test), 1.0 / len(cols)) for c in cols})
    else:
        answer = test[list(spec.targets)].copy()
        if kind == "label":
            fill = {c: train[c].mode().iloc[0] for c in cols}  # the majority class
        elif kind == "proba":
            fill = {c: 0.5 for c in cols}
        else:
            fill = {c: round(float(train[c].mean()), 3) for c in cols}
        sample = pd.DataFrame({c: [fill[c]] * len(test) for c in cols})
    answer.insert(0, ID, test[ID].to_numpy())
    sample.insert(0, ID, test[ID].to_numpy())
    return train, test.drop(columns=list(spec.targets)), answer, sample


def to_csv_bytes(frame: pd.DataFrame) -> bytes:
    buf = io.StringIO()
    frame.to_csv(buf, index=False, float_format=FLOAT_FORMAT, lineterminator="\n")
    return buf.getvalue().encode()


def inventory(files: dict[str, bytes]) -> dict:
    """What an agent (and the world model) can know about each public CSV without running code."""
    out = {}
    for name, blob in files.items():
        frame = pd.read_csv(io.BytesIO(blob))
        cols = []
        for c in frame.columns:
            # pandas 2 reads text as "object", pandas 3 as "str": name it the same on both.
            dtype = str(frame[c].dtype) if pd.api.types.is_numeric_dtype(frame[c]) else "str"
            col = {"name": c, "dtype": dtype, "missing": int(frame[c].isna().sum())}
            if frame[c].dtype.kind in "if":
                col.update(min=float(frame[c].min()), max=float(frame[c].max()))
            else:
                col["values"] = sorted(str(v) for v in frame[c].dropna().unique())[:8]
            cols.append(col)
        out[name] = {"rows": len(frame), "columns": cols}
    return out


def inventory_text(inv: dict) -> str:
    lines = ["Data inventory", ""]
    for name, info in inv.items():
        lines.append(f"{name}: {info['rows']} rows x {len(info['columns'])} columns")
        for c in info["columns"]:
            extra = (f"range [{c['min']:.6g}, {c['max']:.6g}]" if "min" in c
                     else "values " + ", ".join(c["values"]))
            miss = f", {c['missing']} missing" if c["missing"] else ""
            lines.append(f"  - {c['name']} ({c['dtype']}{miss}): {extra}")
        lines.append("")
    return "\n".join(lines)


def description(spec: TaskSpec, sample: pd.DataFrame, n_train: int, n_test: int) -> str:
    metric = METRICS[spec.metric]
    better = "Higher" if metric.higher_is_better else "Lower"
    head = to_csv_bytes(sample.head(3)).decode()
    fields = "\n".join(f"  - {k}: {v}" for k, v in spec.fields.items())
    if metric.kind == "classes":
        what = "a probability for each class of " + spec.targets[0]
    elif metric.kind == "proba":
        what = f"the probability that {spec.targets[0]} is 1"
    else:
        what = " and ".join(spec.targets)
    return (
        f"Description\n\nThis is a {spec.category} task. {spec.overview}\n\n"
        f"This competition belongs to the embedded offline task suite of wmrl-jax. The data comes from "
        f"{spec.source}. Notable properties: {', '.join(spec.quirks) or 'none'}.\n\n"
        f"Evaluation\n\n{metric.text} {better} scores are better.\n\n"
        f"Submission File\n\nFor each {ID} in the test set, you must predict {what}. The file should "
        f"contain a header and have the following format:\n```\n{head}etc.\n```\n\n"
        f"Dataset Description\n\n"
        f"File and Data Field Descriptions\n\n"
        f"train.csv\n- {n_train} rows with the features and the target column(s) "
        f"{', '.join(spec.targets)}.\n  - {ID}: a unique row identifier (random; it carries no signal).\n"
        f"{fields}\n\n"
        f"test.csv\n- {n_test} rows with the same features but without the target; predict these.\n\n"
        f"sample_submission.csv\n- A submission file in the correct format.\n")


def write_task(spec: TaskSpec, root: pathlib.Path, seed: int) -> dict:
    """Writes the data, descriptions and metric of one task under root/<name>; returns its manifest row."""
    task_dir = root / spec.name
    train, test, answer, sample = split_frames(spec, seed)
    public = {"train.csv": to_csv_bytes(train), "test.csv": to_csv_bytes(test),
              "sample_submission.csv": to_csv_bytes(sample)}
    inv = inventory(public)
    text = description(spec, sample, len(train), len(test))
    files = {
        "utils/metric.py": metric_source(spec.name, METRICS[spec.metric], list(answer.columns[1:])).encode(),
        "info/description.txt": text.encode(),
        "info/inventory.json": (json.dumps(inv, indent=1, sort_keys=True) + "\n").encode(),
        "data/public/description.txt": (text + "\n" + inventory_text(inv)).encode(),
        "data/private/test_answer.csv": to_csv_bytes(answer),
        **{f"data/public/{k}": v for k, v in public.items()},
    }
    for rel, blob in files.items():
        path = task_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
    return {
        "name": spec.name, "title": spec.title, "category": spec.category, "metric": spec.metric,
        "higher_is_better": spec.higher_is_better, "split": spec.split, "source": spec.source,
        "quirks": list(spec.quirks), "rows_train": len(train), "rows_test": len(test),
        "n_features": train.shape[1] - 1 - len(spec.targets), "targets": list(spec.targets),
        "submission_columns": list(answer.columns),
    }
