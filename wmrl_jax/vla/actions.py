"""Continuous actions <-> discrete token ids, per dimension, as OpenVLA and MiniVLA do it.

OpenVLA (`prismatic/vla/action_tokenizer.py`, `ActionTokenizer`) and
MiniVLA (the same class, Qwen2.5's tokenizer): every action dimension (the
gripper too) is clipped to [-1, 1] and binned on ``n_bins`` uniform EDGES

    edges   = linspace(-1, 1, n_bins)                    # 256 edges, spacing 2 / 255
    centres = (edges[:-1] + edges[1:]) / 2               # 255 centres
    d       = digitize(a, edges)                         # in [1, n_bins]: edges[d-1] <= a < edges[d]
    id      = vocab_size - d                             # the LAST n_bins ids: [V - n_bins, V - 1]
    decode: a = centres[clip(V - id - 1, 0, n_bins - 2)]

so larger actions get smaller ids, and the first id of the range, V - n_bins,
is reached only by an action exactly at +1 (d = n_bins); it decodes to the
last centre, like V - n_bins + 1. Every action decodes to within half a bin,
1 / (n_bins - 1), of its clipped value. ``vocab_size`` is the tokenizer
length whose last ids the bins overwrite (OpenVLA: the Llama tokenizer's
32000; MiniVLA: Qwen2.5's tokenizer with its extra tokens): the model
config's choice, not this module's.

Pure numpy / jax.numpy (works on either, inside jit too); no model imports.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ActionTokenizer:
    """Per-dimension uniform binning of actions in [low, high] onto the last `n_bins` ids of `vocab_size`.

    vocab_size: ids [vocab_size - n_bins, vocab_size) are the action ids.
    n_bins: number of bin edges (OpenVLA's `bins`, default 256; n_bins - 1 centres).
    action_dim: the last axis of every action array (LIBERO: 7, the last the gripper).
    """

    vocab_size: int
    n_bins: int = 256
    action_dim: int = 7
    low: float = -1.0
    high: float = 1.0

    def __post_init__(self):
        if self.n_bins < 2:
            raise ValueError(f"n_bins={self.n_bins}: expected >= 2 bin edges")
        if not self.n_bins <= self.vocab_size:
            raise ValueError(f"n_bins={self.n_bins} does not fit in vocab_size={self.vocab_size}")
        if self.action_dim < 1:
            raise ValueError(f"action_dim={self.action_dim}: expected >= 1")
        if not self.low < self.high:
            raise ValueError(f"low={self.low}, high={self.high}: expected low < high")

    @property
    def first_id(self) -> int:
        """The smallest action id, vocab_size - n_bins; action ids are [first_id, vocab_size)."""
        return self.vocab_size - self.n_bins

    @property
    def edges(self) -> np.ndarray:
        """float64[n_bins] bin edges (OpenVLA's `bins`)."""
        return np.linspace(self.low, self.high, self.n_bins)

    @property
    def centres(self) -> np.ndarray:
        """float64[n_bins - 1] bin centres, what `decode` returns."""
        edges = self.edges
        return (edges[:-1] + edges[1:]) / 2.0

    @property
    def half_bin(self) -> float:
        """The largest |decode(encode(a)) - clip(a)|: half the spacing of the edges."""
        return (self.high - self.low) / (self.n_bins - 1) / 2.0

    def encode(self, actions) -> np.ndarray | jnp.ndarray:
        """int32[..., action_dim] ids of float actions [..., action_dim] (clipped to [low, high] first).

        A jax array in gives a jax array out (jittable), binned on float32 edges: a value within float32
        rounding of an edge may land in the neighbouring bin. Anything else: numpy, float64 edges (OpenVLA's).
        """
        xp = jnp if isinstance(actions, jnp.ndarray) else np
        actions = xp.asarray(actions)
        self._check_dim(actions, "actions")
        if not xp.issubdtype(actions.dtype, xp.floating):
            raise ValueError(f"actions: dtype {actions.dtype}, expected floating point values in [{self.low}, {self.high}]")
        clipped = xp.clip(actions.astype(xp.float64 if xp is np else jnp.float32), self.low, self.high)
        # digitize(a, edges) = #{edges <= a} (edges increasing): in [1, n_bins] after clipping.
        d = xp.searchsorted(xp.asarray(self.edges, clipped.dtype), clipped, side="right")
        return (self.vocab_size - d).astype(xp.int32)

    def decode(self, ids) -> np.ndarray | jnp.ndarray:
        """float32[..., action_dim] bin centres of ids [..., action_dim]; ids outside the range raise (numpy) or
        clip to the nearest end (jax, inside jit)."""
        xp = jnp if isinstance(ids, jnp.ndarray) else np
        ids = xp.asarray(ids)
        self._check_dim(ids, "ids")
        if xp is np:
            if not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"ids: dtype {ids.dtype}, expected integer token ids")
            bad = (ids < self.first_id) | (ids >= self.vocab_size)
            if bad.any():
                raise ValueError(f"ids: {int(ids[bad].flat[0])} (and {int(bad.sum()) - 1} more) outside the action ids "
                                 f"[{self.first_id}, {self.vocab_size})")
        index = xp.clip(self.vocab_size - ids - 1, 0, self.n_bins - 2)
        return xp.asarray(self.centres, xp.float32)[index]

    def bins_to_ids(self, bins):
        """Action ids of bin indices b in [0, n_bins) (b = id - first_id; the policy's softmax axis)."""
        return bins + self.first_id

    def ids_to_bins(self, ids):
        """Bin indices in [0, n_bins) of action ids (the position of each id in the action-id slice)."""
        return ids - self.first_id

    def _check_dim(self, x, name: str) -> None:
        if x.ndim < 1 or x.shape[-1] != self.action_dim:
            raise ValueError(f"{name}: shape {tuple(x.shape)}, expected [..., {self.action_dim}] "
                             f"(action_dim={self.action_dim})")
