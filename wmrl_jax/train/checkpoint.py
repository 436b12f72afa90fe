"""Run checkpoints: any pytree of arrays + a JSON dict, saved atomically, restored from the newest GOOD one.

    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=3)
    ckpt.save(step, {"train": state, "corrections": corr, "rng": key_data}, {"cursor": 17})
    restored = ckpt.latest({"train": state, "corrections": corr, "rng": key_data})
    if restored is not None:
        step, tree, meta = restored

One Orbax `CheckpointManager` underneath: each step is a folder `<step>/`
holding the tree (item "state", Orbax's standard pytree format) and the meta
(item "meta", JSON). Orbax writes a step into a temporary folder and renames
it into place only once complete, so a crash mid-save leaves a
`<step>.orbax-checkpoint-tmp-*` folder that is never taken for a checkpoint,
and the previous checkpoints are untouched until then (old ones are pruned
only after a newer one is complete).

What Orbax cannot see is a finished checkpoint damaged afterwards (a file
truncated by a full disk, deleted by hand). So `save` also stores a
fingerprint of the tree in the meta -- per leaf, a wrapping uint32 sum of its
bits -- and `latest` checks it after restoring. A checkpoint that fails to
restore or to match is reported (logging.warning), moved aside to
`<step>.corrupt` (kept for inspection, never read again) and the previous one
is tried.

Multi-process runs: every process constructs the Checkpointer and calls
`save` / `latest` / `wait` at the same points (they are collective). The
directory must be one folder every process sees (a shared filesystem): Orbax
writes each array's shards from the processes that hold them, and the JSON
meta from process 0 only. Moving a damaged checkpoint aside is done by
process 0, after which every process waits for the others before reading
the folder again.
"""

from __future__ import annotations

import gc
import json
import logging
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

_FINGERPRINT = "_wmrl_fingerprint"

# Orbax reads an array's shards as coroutines gathered on a private event loop (`asyncio_utils.run_sync`),
# which it closes without cancelling them. When one shard of a damaged checkpoint fails, the shard reads
# still in flight are abandoned; each is closed when garbage-collected, and its `except BaseException:
# raise Exception(...)` turns the GeneratorExit into "Exception ignored in: <coroutine object
# _read_array_index_and_device_put>" plus a 60-line TensorStore spec -- 17 of them after the one warning
# that already said the checkpoint is damaged.
_ORBAX_SHARD_READS = ("_read_array_index_and_device_put",)


def _leaf_bits_sum(x: jax.Array) -> jax.Array:
    """uint32 sum (wrapping) of the leaf's bit patterns: any changed byte changes it (almost surely)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    # 64-bit leaves (x64 mode) become two uint32 words each (a trailing axis of 2).
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    x = jax.lax.bitcast_convert_type(x, unsigned)
    # Weight each element by its position so that moved bytes are noticed too.
    index = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(x.astype(jnp.uint32) * index, dtype=jnp.uint32)


@jax.jit
def _fingerprint_arrays(tree):
    return [_leaf_bits_sum(x) for x in jax.tree.leaves(tree)]


def fingerprint(tree: Any) -> list[int]:
    """One integer per leaf of `tree` (jax or numpy arrays), computed where the arrays live."""
    return [int(v) for v in jax.device_get(_fingerprint_arrays(tree))]


def _abstract(like: Any) -> Any:
    """ShapeDtypeStructs (with the shardings of jax arrays) for every leaf of `like`."""

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    return jax.tree.map(one, like)


def _is_abandoned_read_noise(unraisable) -> bool:
    """An error Orbax's abandoned shard reads raise after a failed restore, which has been reported once:
    the read coroutine's close-time `Exception(...)` (its `except BaseException` catches the GeneratorExit of
    its closing), or TensorStore finishing an abandoned read and calling back into the event loop Orbax
    closed (`RuntimeError: Event loop is closed`, in a callback of no Python object)."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and code.co_name in _ORBAX_SHARD_READS:
        return True
    return (unraisable.object is None and isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed")


def _drop_abandoned_read_noise() -> None:
    """Wraps sys.unraisablehook, once a process, to drop `_is_abandoned_read_noise` and pass on the rest.
    Process-wide and not undone: TensorStore completes the abandoned reads on its own threads, possibly
    after `latest` has returned."""
    previous = sys.unraisablehook
    if getattr(previous, "_wmrl_drops_abandoned_reads", False):
        return

    def hook(unraisable):
        if not _is_abandoned_read_noise(unraisable):
            previous(unraisable)

    hook._wmrl_drops_abandoned_reads = True
    sys.unraisablehook = hook


class Checkpointer:
    """Saves (step, tree, meta) under `directory`; restores the newest good checkpoint. See the module docstring."""

    def __init__(self, directory, *, max_to_keep: int = 3):
        if not (isinstance(max_to_keep, int) and max_to_keep >= 1):
            raise ValueError(f"max_to_keep: {max_to_keep!r}, expected an int >= 1")
        self.directory = pathlib.Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def save(self, step: int, tree: Any, meta: dict) -> None:
        """Starts saving `tree` (any pytree of arrays) and `meta` (JSON-able) as checkpoint `step`.

        Asynchronous: returns once the arrays are copied off the accelerator;
        `wait()` blocks until the files are complete. A step that already
        exists is not overwritten (a warning says so).
        """
        step = int(step)
        if not isinstance(meta, dict):
            raise TypeError(f"meta: {type(meta).__name__}, expected a JSON-able dict")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"meta: not JSON-able ({exc}); expected plain dicts, lists, strings and numbers") from exc
        if _FINGERPRINT in meta:
            raise ValueError(f"meta: the key {_FINGERPRINT!r} is reserved for the checkpoint's own fingerprint")
        self._manager.wait_until_finished()
        if step in self._manager.all_steps():
            logging.warning("checkpoint %s: step %d already saved; keeping it, not overwriting", self.directory, step)
            return
        meta = {**meta, _FINGERPRINT: fingerprint(tree)}
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                         meta=ocp.args.JsonSave(meta)))

    def latest(self, like: Any) -> tuple[int, Any, dict] | None:
        """(step, tree, meta) of the newest checkpoint that restores intact; None when there is none.

        `like` gives the structure, dtypes and shardings to restore into: a
        tree of arrays, or of `jax.ShapeDtypeStruct`s (with `sharding=`).
        Damaged checkpoints are reported, moved aside to `<step>.corrupt`, and
        skipped in favour of the previous one.
        """
        self._manager.wait_until_finished()
        abstract = _abstract(like)
        for step in sorted(self._manager.all_steps(), reverse=True):
            restored = self._restore_checked(step, abstract)
            if restored is not None:
                return restored
            gc.collect()   # close the abandoned reads now (they hang off the exception's frames, a cycle)
        return None

    def _restore_checked(self, step: int, abstract: Any) -> tuple[int, Any, dict] | None:
        """(step, tree, meta) if checkpoint `step` restores and matches its fingerprint; else moves it aside,
        warns once and returns None."""
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
            tree, meta = restored["state"], dict(restored["meta"])
            expected = meta.pop(_FINGERPRINT, None)
            got = fingerprint(tree)
            if expected is not None and expected != got:
                bad = [jax.tree_util.keystr(p) for (p, _), e, g in
                       zip(jax.tree_util.tree_flatten_with_path(tree)[0], expected, got) if e != g]
                raise ValueError(f"restored arrays differ from what was saved: {', '.join(bad[:5])}")
        except Exception as exc:  # any failure to read a checkpoint back makes it unusable
            _drop_abandoned_read_noise()
            aside = self._move_aside(step)
            logging.warning("checkpoint %s/%d is damaged and was skipped (%s: %s); moved to %s, trying the "
                            "previous one", self.directory, step, type(exc).__name__, (str(exc).splitlines() or [''])[0][:300], aside)
            return None
        return step, tree, meta

    def _move_aside(self, step: int) -> pathlib.Path:
        source = self.directory / str(step)
        target = self.directory / f"{step}.corrupt"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}.corrupt{n}"
        if source.exists() and jax.process_index() == 0:
            source.rename(target)
        if jax.process_count() > 1:   # the others must not list the folder before the rename
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"wmrl_checkpoint_move_aside_{step}")
        self._manager.reload()
        return target

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's threads."""
        self._manager.close()

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, steps={self.all_steps()})"
