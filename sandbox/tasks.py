"""Benchmark task formats: MLE-Dojo competition folders and DSBench data-modeling tasks.

`load_task(path)` detects the layout and returns a `Task`: where the public
data lives (mounted read-only as DATA_DIR), where the hidden answers are, the
leaderboards a score is ranked against, the metric and its direction.

MLE-Dojo (a competition folder, as its prepare step writes it):

    <comp>/utils/metric.py          CompetitionMetrics subclass (loaded unchanged)
    <comp>/info/description.txt     (+ optional public/private_leaderboard.csv)
    <comp>/data/public/{description.txt, train.csv, test.csv, sample_submission.csv, ...}
    <comp>/data/private/{test_answer.csv, private_leaderboard.csv, public_leaderboard.csv}

  MLE-Dojo ranks against `data/private/*_leaderboard.csv`; `info/` is used
  when those are absent. `path` may also be the `data/` folder's parent's
  parent (the repo's `competitions/<comp>`) — anything holding the above.

DSBench data modeling (the benchmark's `data.zip`; `path` is the root or
`<root>/data_resplit/<comp>`):

    <root>/data_resplit/<comp>/{train.csv, test.csv, sample_submission.csv}
    <root>/answers/<comp>/test_answer.csv
    <root>/task/<comp>.txt
    <root>/evaluation/<comp>_eval.py       DSBench's own scorer (run unchanged)
    <root>/leaderboards/<comp>/{private,public}_leaderboard.csv   (rank,score)

  DSBench itself ships no leaderboards (it reports a relative gap); the paper
  ranks on the real Kaggle leaderboard, so those files are an addition of this
  project, in MLE-Dojo's `rank,score` format. The metric direction is read
  from the leaderboard (rank 1's score vs the last rank's) unless given.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import pathlib
from typing import Mapping

import numpy as np

LAYOUT_MLE_DOJO = "mle-dojo"
LAYOUT_DSBENCH = "dsbench"
BOARD_NAMES = ("private", "public")   # MLE-Dojo's order


class TaskFormatError(ValueError):
    """A task folder does not match either benchmark layout."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One benchmark task (everything the runner and grader need).

    Attributes:
      name: competition id (folder name).
      layout: "mle-dojo" or "dsbench".
      root: the folder the task was loaded from.
      public_dir: host folder mounted read-only as DATA_DIR.
      answer_path: hidden answers (never visible to a solution).
      sample_submission_path: the format a submission must follow.
      description: the task text the agent reads.
      leaderboards: {"private": scores, "public": scores} (whichever exist), [N] float64.
      higher_is_better: metric direction.
      metric_path: MLE-Dojo `utils/metric.py` or DSBench `evaluation/<comp>_eval.py` (or None).
      category: a label for per-category reports (from `info/task.json` when present).
      split: "train" / "test" / "" (from `info/task.json` when present).
      metric: the metric's name for people: `info/task.json`'s "metric" when
        present, else the MLE-Dojo metric class or the DSBench scorer's file name.
    """

    name: str
    layout: str
    root: pathlib.Path
    public_dir: pathlib.Path
    answer_path: pathlib.Path
    sample_submission_path: pathlib.Path | None
    description: str
    leaderboards: Mapping[str, np.ndarray]
    higher_is_better: bool
    metric_path: pathlib.Path | None
    category: str = "uncategorized"
    split: str = ""
    metric: str = ""

    def __repr__(self) -> str:
        # Short on purpose: the leaderboards are thousands of scores, the description pages of text.
        boards = {name: int(np.size(scores)) for name, scores in self.leaderboards.items()}
        better = "higher" if self.higher_is_better else "lower"
        return (f"Task(name={self.name!r}, layout={self.layout!r}, metric={self.metric!r} ({better} is better), "
                f"leaderboards={boards}, description={len(self.description)} chars, "
                f"category={self.category!r}, split={self.split!r})")

    @property
    def task_id(self) -> str:
        """Stable id: layout/name + a hash of the answers (two copies of a task share it)."""
        return f"{self.layout}/{self.name}@{_file_digest(str(self.answer_path))[:12]}"

    def __hash__(self):   # np arrays are unhashable; identity of a task is its files
        return hash((self.layout, str(self.root), str(self.answer_path)))

    def __eq__(self, other):
        return (isinstance(other, Task) and self.layout == other.layout
                and self.root == other.root and self.answer_path == other.answer_path)


@functools.lru_cache(maxsize=1024)
def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        h.update(path.encode())
    return h.hexdigest()


def read_leaderboard(path: str | os.PathLike) -> np.ndarray:
    """Scores of a `rank,score` leaderboard CSV (second column, as MLE-Dojo reads it)."""
    import csv

    path = pathlib.Path(path)
    scores, ranks = [], []
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or len(rows[0]) < 2:
        raise TaskFormatError(f"leaderboard {path}: expected a header and rows of `rank,score`, got {rows[:2]}")
    for i, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        try:
            scores.append(float(row[1]))
            ranks.append(float(row[0]) if row[0].strip() else float(i - 1))
        except (ValueError, IndexError) as e:
            raise TaskFormatError(f"leaderboard {path} line {i}: expected `rank,score`, got {row!r}") from e
    arr = np.asarray(scores, dtype=np.float64)
    if arr.size == 0 or not np.all(np.isfinite(arr)):
        raise TaskFormatError(f"leaderboard {path}: expected >= 1 finite score, got {arr.size} rows")
    return arr


def _direction_from_board(path: pathlib.Path) -> bool:
    """True when rank 1 holds the largest score (ties: higher is better)."""
    import csv

    with open(path, newline="", encoding="utf-8") as f:
        rows = [r for r in list(csv.reader(f))[1:] if r]
    ranked = sorted(rows, key=lambda r: float(r[0]))
    return float(ranked[0][1]) >= float(ranked[-1][1])


def _boards(*folders: pathlib.Path) -> dict[str, np.ndarray]:
    for folder in folders:
        found = {b: folder / f"{b}_leaderboard.csv" for b in BOARD_NAMES}
        found = {b: p for b, p in found.items() if p.is_file()}
        if found:
            return {b: read_leaderboard(p) for b, p in found.items()}
    return {}


def _meta(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TaskFormatError(f"{path}: not valid JSON ({e})") from e


def load_metric_class(metric_path: str | os.PathLike):
    """The CompetitionMetrics subclass defined in an MLE-Dojo `utils/metric.py`.

    The file is imported unchanged; `mledojo.metrics.base` comes from the real
    package or, when absent, from `sandbox.mledojo_shim`.
    """
    from sandbox import mledojo_shim

    mledojo_shim.install()
    path = pathlib.Path(metric_path).resolve()
    try:
        version = path.stat().st_mtime_ns   # a rebuilt task re-imports its metric
    except OSError as e:
        raise TaskFormatError(f"metric file {path}: {e.strerror}") from e
    return _load_metric_class(str(path), version)


@functools.lru_cache(maxsize=256)
def _load_metric_class(path: str, version: int):
    import sys

    from mledojo.metrics.base import CompetitionMetrics

    mod_name = "wmrl_task_metric_" + hashlib.sha1(f"{path}@{version}".encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise TaskFormatError(f"metric file {path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    classes = [v for v in vars(module).values()
               if isinstance(v, type) and issubclass(v, CompetitionMetrics)
               and v is not CompetitionMetrics and v.__module__ == mod_name]
    if len(classes) != 1:
        raise TaskFormatError(
            f"metric file {path}: expected exactly one CompetitionMetrics subclass, "
            f"found {[c.__name__ for c in classes]}")
    return classes[0]


def _find_mle_dojo_root(path: pathlib.Path) -> pathlib.Path | None:
    for cand in (path, path.parent):
        if (cand / "data" / "public").is_dir() and (cand / "data" / "private").is_dir():
            return cand
    return None


def _load_mle_dojo(root: pathlib.Path, category: str | None, split: str | None) -> Task:
    data = root / "data"
    public, private = data / "public", data / "private"
    answer = private / "test_answer.csv"
    metric_path = root / "utils" / "metric.py"
    for required in (answer, public / "sample_submission.csv", metric_path):
        if not required.is_file():
            raise TaskFormatError(f"MLE-Dojo task {root}: missing {required.relative_to(root)}")
    boards = _boards(private, root / "info")
    if not boards:
        raise TaskFormatError(
            f"MLE-Dojo task {root}: no leaderboard; expected data/private/{{private,public}}_leaderboard.csv "
            f"or info/{{private,public}}_leaderboard.csv")
    metric = load_metric_class(metric_path)()
    desc_path = next((p for p in (public / "description.txt", root / "info" / "description.txt") if p.is_file()), None)
    meta = _meta(root / "info" / "task.json")
    return Task(
        name=root.name, layout=LAYOUT_MLE_DOJO, root=root, public_dir=public, answer_path=answer,
        sample_submission_path=public / "sample_submission.csv",
        description=desc_path.read_text(encoding="utf-8") if desc_path else "",
        leaderboards=boards, higher_is_better=bool(metric.higher_is_better), metric_path=metric_path,
        category=category or meta.get("category", "uncategorized"), split=split or meta.get("split", ""),
        metric=meta.get("metric", type(metric).__name__),
    )


def _load_dsbench(root: pathlib.Path, comp: str, category: str | None, split: str | None,
                  higher_is_better: bool | None) -> Task:
    public = root / "data_resplit" / comp
    answer = root / "answers" / comp / "test_answer.csv"
    task_txt = root / "task" / f"{comp}.txt"
    for required in (public, answer, task_txt):
        if not required.exists():
            raise TaskFormatError(f"DSBench task {comp} in {root}: missing {required.relative_to(root)}")
    board_dir = root / "leaderboards" / comp
    boards = _boards(board_dir)
    if not boards:
        raise TaskFormatError(
            f"DSBench task {comp}: no leaderboard; expected {board_dir}/{{private,public}}_leaderboard.csv (rank,score)")
    if higher_is_better is None:
        first = next(board_dir / f"{b}_leaderboard.csv" for b in BOARD_NAMES if b in boards)
        higher_is_better = _direction_from_board(first)
    script = root / "evaluation" / f"{comp}_eval.py"
    sample = public / "sample_submission.csv"
    meta = _meta(board_dir / "task.json")
    return Task(
        name=comp, layout=LAYOUT_DSBENCH, root=root, public_dir=public, answer_path=answer,
        sample_submission_path=sample if sample.is_file() else None,
        description=task_txt.read_text(encoding="utf-8"), leaderboards=boards,
        higher_is_better=bool(higher_is_better), metric_path=script if script.is_file() else None,
        category=category or meta.get("category", "uncategorized"), split=split or meta.get("split", ""),
        metric=meta.get("metric", script.name if script.is_file() else ""),
    )


def load_task(path: str | os.PathLike, *, competition: str | None = None, category: str | None = None,
              split: str | None = None, higher_is_better: bool | None = None) -> Task:
    """Load a task folder in the MLE-Dojo or DSBench layout (detected).

    Args:
      path: an MLE-Dojo competition folder, a DSBench root (then `competition`
        names the task) or a DSBench `<root>/data_resplit/<comp>` folder.
      competition: DSBench competition name when `path` is the DSBench root.
      category, split: override the labels of `info/task.json`.
      higher_is_better: DSBench only; overrides the direction read from the leaderboard.
    Raises:
      TaskFormatError naming the missing file and the layout expected.
    """
    path = pathlib.Path(path).expanduser().resolve()
    if not path.is_dir():
        raise TaskFormatError(f"task path {path}: not a directory")
    mle_root = _find_mle_dojo_root(path)
    if mle_root is not None:
        return _load_mle_dojo(mle_root, category, split)
    if (path / "data_resplit").is_dir():
        if competition is None:
            comps = sorted(p.name for p in (path / "data_resplit").iterdir() if p.is_dir())
            if len(comps) != 1:
                raise TaskFormatError(
                    f"DSBench root {path}: pass competition= (one of {comps[:10]}{'...' if len(comps) > 10 else ''})")
            competition = comps[0]
        return _load_dsbench(path, competition, category, split, higher_is_better)
    if path.parent.name == "data_resplit":
        return _load_dsbench(path.parent.parent, competition or path.name, category, split, higher_is_better)
    raise TaskFormatError(
        f"task path {path}: expected an MLE-Dojo competition (data/public + data/private + utils/metric.py) "
        f"or a DSBench root (data_resplit/<comp>, answers/<comp>, task/<comp>.txt)")


__all__ = ["Task", "TaskFormatError", "load_task", "load_metric_class", "read_leaderboard",
           "LAYOUT_MLE_DOJO", "LAYOUT_DSBENCH", "BOARD_NAMES"]
