"""Demonstrations for the VLA's SFT: a folder of `simulator.Episode` files -> (observation, action) samples.

    samples, report = demos.load(folder, config, tokenizer)       # config: `vla.model.Config`
    train, held_out = demos.split_by_state(samples, held_out_states=range(40, 50))
    for step, batch in enumerate(demos.batches(train, batch_size=32, seed=0, steps=1000)):
        ...                                                          # batch: what `vla.sft_loss` reads

One sample per recorded frame f of a successful episode whose step
`frame_steps[f]` executed an action: the frame of each camera of
`config.cameras` (the observation the expert acted on), the episode's
instruction in the model's prompt (`vla.model.PROMPT`, through
`tokenize_instructions`), and `actions[frame_steps[f]]` binned by
`config.tokenizer` (`ActionTokenizer.encode`) into `action_ids`. The last
frame of an episode, taken after its last action, has no action and gives no
sample. Only episodes with status "success" are used; the others (failure,
unknown, running) are counted in the report, as are `build_demos`'s
`*.failed.json` records.

The instructions are tokenized once, left-padded to one width over the whole
set, so every batch has the same shapes (one compile). Batches are drawn
epoch by epoch in a seeded order that depends only on (seed, step): a resumed
run draws exactly the batches an uninterrupted one would (`batch_rows`).

The split is by initial-state index (the benchmark's 50 fixed states of each
task): samples from a held-out state never train, so an evaluation on those
states (`launch/vla_eval.py`) starts from scenes the policy has not seen.

Every problem with the files is one line naming the file and what was expected
(`DemoError`, a ValueError). No simulator import beyond `simulator.episode`
(numpy only: no benchmark install needed).
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import zipfile
from typing import Iterable, Iterator, Sequence

import numpy as np

from simulator.episode import Episode

_ARRAYS = ("action_ids", "actions", "instruction_index", "task_id", "init_state", "step", "episode")


class DemoError(ValueError):
    """A demonstration folder or file the SFT cannot use; the message names the file and what was expected."""


@dataclasses.dataclass
class Samples:
    """(observation, action) training samples; row i of every per-sample array is one sample.

    images: camera -> uint8 [N, S, S, 3] (S = the model's image_size).
    action_ids: int32 [N, action_dim], the demonstrated action binned (`ActionTokenizer.encode`).
    actions: float32 [N, action_dim], the action as executed (before binning).
    instruction_index: int32 [N], the sample's row of `text` / `text_valid` / `instructions`.
    text, text_valid: int32 / bool [K, T]: the K distinct instructions in the prompt template, left-padded.
    task_id, init_state, step, episode: int32 [N]: where the sample comes from (episode: index into `sources`).
    suites: str [N]. sources: the episode files, in load order.
    """

    images: dict
    action_ids: np.ndarray
    actions: np.ndarray
    instruction_index: np.ndarray
    task_id: np.ndarray
    init_state: np.ndarray
    step: np.ndarray
    episode: np.ndarray
    suites: np.ndarray
    text: np.ndarray
    text_valid: np.ndarray
    instructions: tuple
    sources: tuple

    def __len__(self) -> int:
        return int(self.action_ids.shape[0])

    def batch(self, rows) -> dict:
        """The arrays `vla.model.sft_loss` reads for `rows`: each camera, "text", "text_valid", "action_ids"."""
        rows = np.asarray(rows)
        k = self.instruction_index[rows]
        return {**{cam: v[rows] for cam, v in self.images.items()}, "text": self.text[k],
                "text_valid": self.text_valid[k], "action_ids": self.action_ids[rows]}

    def select(self, mask) -> "Samples":
        """The samples where `mask` (bool [N]) holds; instructions and sources are kept whole."""
        mask = np.asarray(mask, bool)
        return dataclasses.replace(self, images={c: v[mask] for c, v in self.images.items()}, suites=self.suites[mask],
                                   **{name: getattr(self, name)[mask] for name in _ARRAYS})

    @property
    def tasks(self) -> list[tuple[str, int]]:
        """The (suite, task_id) pairs present, sorted."""
        return sorted({(str(s), int(t)) for s, t in zip(self.suites, self.task_id)})

    @property
    def states(self) -> list[int]:
        """The initial-state indices present, sorted."""
        return sorted({int(s) for s in self.init_state})

    def __repr__(self) -> str:
        cams = ", ".join(f"{c} {v.shape[1]}px" for c, v in self.images.items())
        return (f"Samples({len(self)} from {len(set(self.episode.tolist()))} episodes, tasks "
                f"{[t for _, t in self.tasks]}, states {self.states}, cameras [{cams}])")


def _episode_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """Every Episode `.npz` under `folder`, sorted (`Episode.save`'s temporaries, dot names, are not episodes);
    DemoError for a missing folder or one without any."""
    if not folder.is_dir():
        raise DemoError(f"{folder}: no such folder (expected a folder of Episode .npz files, as launch/build_demos.py "
                        f"--out writes)")
    files = sorted(p for p in folder.rglob("*.npz") if not p.name.startswith("."))
    if not files:
        failed = len(list(folder.rglob("*.failed.json")))
        raise DemoError(f"{folder}: no Episode .npz files (expected <suite>/task<TT>/state<SS>.npz from "
                        f"launch/build_demos.py; {failed} *.failed.json records)")
    return files


def _load_one(path: pathlib.Path) -> Episode:
    if not zipfile.is_zipfile(path):   # np.load would take it for a pickle and say so, which misleads
        raise DemoError(f"{path}: not a readable Episode file (not an .npz archive); expected an .npz written by "
                        f"simulator.Episode.save (launch/build_demos.py)")
    try:
        return Episode.load(path)
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        raise DemoError(f"{path}: not a readable Episode file ({type(e).__name__}: {e}); expected an .npz written "
                        f"by simulator.Episode.save (launch/build_demos.py)") from None


def _check(path: pathlib.Path, ep: Episode, cameras: Sequence[str], size: int, action_dim: int) -> np.ndarray:
    """The rows f of the episode's frames that give a sample (an action at step frame_steps[f]), checked."""
    actions = np.asarray(ep.actions)
    if actions.ndim != 2 or actions.shape[1] != action_dim or actions.shape[0] != ep.steps:
        raise DemoError(f"{path}: actions of shape {actions.shape}, expected [steps={ep.steps}, {action_dim}]")
    if not np.isfinite(actions).all():
        raise DemoError(f"{path}: actions hold NaN or inf, expected finite actions in [-1, 1]")
    steps = np.asarray(ep.frame_steps)
    for cam in cameras:
        if cam not in ep.frames:
            raise DemoError(f"{path}: no frames of camera {cam!r} (it has {sorted(ep.frames)}); the model reads "
                            f"{list(cameras)} (record the demonstrations with those cameras)")
        frames = ep.frames[cam]
        if frames.ndim != 4 or frames.shape[1:] != (size, size, 3) or frames.dtype != np.uint8:
            raise DemoError(f"{path}: frames[{cam!r}] are {frames.dtype} {tuple(frames.shape[1:])}, expected uint8 "
                            f"({size}, {size}, 3) (the model's vision.image_size={size}; build_demos --camera_size)")
        if frames.shape[0] != steps.shape[0]:
            raise DemoError(f"{path}: {frames.shape[0]} frames of {cam!r} for {steps.shape[0]} frame_steps, "
                            f"expected one frame per entry of frame_steps")
    rows = np.flatnonzero((steps >= 0) & (steps < actions.shape[0]))
    if rows.size == 0:
        raise DemoError(f"{path}: no recorded frame before an action (frame_steps {steps[:5].tolist()}..., "
                        f"{actions.shape[0]} actions); expected frames recorded while it ran (record_every >= 1)")
    return rows


def load(folder, config, tokenizer, *, frame_stride: int = 1, template: str | None = None) -> tuple[Samples, dict]:
    """All successful demonstrations under `folder` as samples for `config` (a `vla.model.Config`).

    Args:
      folder: searched recursively for Episode `.npz` files (build_demos' `<suite>/task<TT>/state<SS>.npz`).
      config: the model: its cameras, vision.image_size, action_dim and action tokenizer.
      tokenizer: the backbone's text tokenizer (an HF tokenizer; `vla.model.tokenize_instructions`).
      frame_stride: keep every k-th sample of each episode (on top of the file's own record_every).
      template: the prompt (default: the model's `PROMPT`).

    Returns (samples, report): report counts the files, the episodes used and skipped by status, the
    `*.failed.json` records beside them, the samples, and the actions clipped into [-1, 1] by binning.
    Raises DemoError for a missing or empty folder, no successful episode, or a file that does not fit
    the model (a camera missing, another image size, a malformed action array).
    """
    from wmrl_jax.vla import model as vla

    if isinstance(frame_stride, bool) or not isinstance(frame_stride, int) or frame_stride < 1:
        raise DemoError(f"frame_stride={frame_stride!r}: expected an int >= 1")
    folder = pathlib.Path(folder)
    files = _episode_files(folder)
    failed_records = len(list(folder.rglob("*.failed.json")))
    cameras, size, tok = tuple(config.cameras), config.vision.image_size, config.tokenizer
    statuses = collections.Counter()
    parts = collections.defaultdict(list)
    images = {cam: [] for cam in cameras}
    instructions: dict[str, int] = {}
    sources = []
    for path in files:
        ep = _load_one(path)
        statuses[ep.status] += 1
        if ep.status != "success":
            continue
        rows = _check(path, ep, cameras, size, config.action_dim)[::frame_stride]
        steps = np.asarray(ep.frame_steps)[rows].astype(np.int32)
        actions = np.asarray(ep.actions, np.float32)[steps]
        n = rows.size
        for cam in cameras:
            images[cam].append(ep.frames[cam][rows])
        k = instructions.setdefault(ep.instruction, len(instructions))
        parts["actions"].append(actions)
        parts["instruction_index"].append(np.full(n, k, np.int32))
        parts["task_id"].append(np.full(n, ep.task_id, np.int32))
        parts["init_state"].append(np.full(n, ep.init_state_index, np.int32))
        parts["step"].append(steps)
        parts["episode"].append(np.full(n, len(sources), np.int32))
        parts["suites"].append(np.full(n, ep.suite))
        sources.append(str(path))
    if not sources:
        counts = ", ".join(f"{s} {c}" for s, c in sorted(statuses.items()))
        raise DemoError(f"{folder}: none of the {len(files)} episodes succeeded ({counts}; {failed_records} "
                        f"*.failed.json records); expected demonstrations with status 'success'")
    arrays = {name: np.concatenate(v) for name, v in parts.items()}
    actions = arrays.pop("actions")
    text, valid = vla.tokenize_instructions(tokenizer, list(instructions), **({"template": template} if template else {}))
    samples = Samples(images={cam: np.concatenate(v) for cam, v in images.items()}, action_ids=tok.encode(actions),
                      actions=actions, text=text, text_valid=valid, instructions=tuple(instructions),
                      sources=tuple(sources), **arrays)
    report = {
        "folder": str(folder), "files": len(files), "episodes_used": len(sources),
        "skipped_by_status": {s: c for s, c in sorted(statuses.items()) if s != "success"},
        "failed_records": failed_records, "samples": len(samples), "frame_stride": frame_stride,
        "instructions": len(instructions), "text_tokens": int(text.shape[1]),
        "actions_clipped": int(np.sum((actions < tok.low) | (actions > tok.high))),
        "tasks": [list(t) for t in samples.tasks], "states": samples.states,
        "image_bytes": int(sum(v.nbytes for v in samples.images.values())),
    }
    return samples, report


def frame_size(folder, camera: str) -> int:
    """The frame side (pixels) of `camera` in the first Episode file under `folder` (DemoError as `load`)."""
    files = _episode_files(pathlib.Path(folder))
    ep = _load_one(files[0])
    if camera not in ep.frames:
        raise DemoError(f"{files[0]}: no frames of camera {camera!r} (it has {sorted(ep.frames)})")
    return int(ep.frames[camera].shape[1])


def split_by_state(samples: Samples, held_out_states: Iterable[int]) -> tuple[Samples, Samples]:
    """(train, held_out): the samples whose initial-state index is not / is in `held_out_states`.

    The same state indices are held out for every task. Raises DemoError when nothing is left to train on.
    """
    held = sorted({int(s) for s in held_out_states})
    mask = np.isin(samples.init_state, held)
    if mask.all():
        raise DemoError(f"held_out_states={held}: every demonstration is from a held-out state (the demos have "
                        f"states {samples.states}); expected some states left to train on")
    return samples.select(~mask), samples.select(mask)


def batch_rows(count: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """The sample rows of batch `step`: epoch e visits all `count` rows in the order
    `default_rng([seed, e]).permutation(count)`; batches take consecutive runs of that stream (a batch may
    span two epochs). A function of (seed, step) alone: resuming at step k needs no replay."""
    if count < 1 or batch_size < 1:
        raise ValueError(f"count={count}, batch_size={batch_size}: expected >= 1 each")
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), count)
        order = np.random.default_rng([seed, epoch]).permutation(count)
        out.extend(order[offset : offset + batch_size - len(out)].tolist())
    return np.asarray(out, np.int64)


def batches(samples: Samples, *, batch_size: int, seed: int, steps: int, start: int = 0) -> Iterator[dict]:
    """Batches `start` .. `steps - 1` (`batch_rows` of each step, then `Samples.batch`)."""
    for step in range(start, steps):
        yield samples.batch(batch_rows(len(samples), batch_size, seed, step))


def eval_rows(count: int, limit: int | None) -> np.ndarray:
    """At most `limit` rows of `count`, evenly spaced (all of them for None): a deterministic evaluation subset."""
    if limit is None or limit >= count:
        return np.arange(count)
    return np.unique(np.linspace(0, count - 1, limit).round().astype(np.int64))


def parse_indices(spec) -> list[int]:
    """"0-9,20" (or a list of such strings, or ints) -> [0, ..., 9, 20], sorted and unique; "" -> []."""
    specs = [spec] if isinstance(spec, (str, int)) else list(spec)
    out = set()
    for s in specs:
        for part in str(s).split(","):
            part = part.strip()
            if not part:
                continue
            lo, _, hi = part.partition("-")
            try:
                lo, hi = int(lo), int(hi or lo)
            except ValueError:
                raise ValueError(f"{s!r}: expected indices or ranges such as 40-49 or 3,5") from None
            if lo < 0 or hi < lo:
                raise ValueError(f"{s!r}: expected non-negative indices and ranges lo-hi with lo <= hi")
            out.update(range(lo, hi + 1))
    return sorted(out)
