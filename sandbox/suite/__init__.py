"""The embedded offline task suite: 16 Kaggle-style tasks that ship with the repo.

Built from data inside installed packages (scikit-learn, statsmodels) and seeded
synthetic generators, in the MLE-Dojo competition layout, with leaderboards
from a population of reference solutions run through the real sandbox and
their execution log (what the embedded world model learns from).

    from sandbox import load_task
    from sandbox.suite import list_tasks
    tasks = [load_task(p) for p in list_tasks(split="train")]

Rebuild (bit-for-bit for the same seed): `python -m sandbox.suite build --out DIR --seed 0`.
"""

from __future__ import annotations

import json
import pathlib

from sandbox.suite.build import LOG_NAME, MANIFEST_NAME, build
from sandbox.suite.specs import TASKS, TaskSpec, get_spec

SPLITS = ("train", "test")


def suite_dir() -> pathlib.Path:
    """The shipped, built suite (one MLE-Dojo folder per task, `suite.json`, `execution_log.jsonl`)."""
    return pathlib.Path(__file__).resolve().parent / "embedded"


def manifest(root=None) -> dict:
    path = pathlib.Path(root or suite_dir()) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"suite manifest {path} missing; build it with `python -m sandbox.suite build --out "
                                f"{path.parent}`")
    return json.loads(path.read_text())


def list_tasks(split: str | None = None, root=None) -> list[pathlib.Path]:
    """Task folders of the built suite (all, or those of `split` = "train" | "test"), in manifest order."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split {split!r}, expected one of {SPLITS} or None")
    base = pathlib.Path(root or suite_dir())
    return [base / t["name"] for t in manifest(base)["tasks"] if split is None or t["split"] == split]


def execution_log(split: str | None = None, root=None) -> list[dict]:
    """The reference solutions' sandbox runs (task, code, status, raw_score, position_score, reward, ...)."""
    base = pathlib.Path(root or suite_dir())
    keep = {p.name for p in list_tasks(split, base)}
    with open(base / LOG_NAME) as f:
        return [e for e in map(json.loads, f) if e["task"] in keep]


__all__ = ["TASKS", "TaskSpec", "build", "execution_log", "get_spec", "list_tasks", "manifest", "suite_dir"]
