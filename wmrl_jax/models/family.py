"""The contract every model family (Qwen3, Qwen3.5, ...) implements.

A family is a module (e.g. `wmrl_jax.models.qwen3`) exposing the names of
`ModelFamily` below. The sampler, the log-prob code, the world model and the
training step only ever talk to a family through this contract, so adding an
architecture never touches them.

Conventions shared by all families
----------------------------------
* Params are a plain nested dict of arrays. Per-layer weights are stacked on a
  leading layer axis (logical name ``"layers"``) and consumed by
  ``jax.lax.scan``. ``param_axes(config)`` returns the same tree structure with
  a tuple of logical axis names per array (one name or None per dim).
* ``Config`` is a frozen, hashable dataclass (it is a static jit argument).
* Sequences are LEFT-padded. ``valid: bool[B, T]`` marks real tokens;
  ``positions: int32[B, T]`` are RoPE positions (``cumsum(valid) - 1`` for a
  left-padded prompt, clipped at 0). Padded tokens are never attended to and
  never change recurrent state (Qwen3.5 zeroes their inputs and gates).
* Cache: a pytree from ``init_cache(config, batch, max_len, dtype)`` holding at
  least ``index: int32[]`` (next slot to write, shared by all rows) and
  ``valid: bool[B, max_len]`` (which slots hold real tokens), plus the
  per-layer state (KV for attention layers; conv + recurrent state for linear
  layers). ``forward`` with a cache writes its T tokens at slots
  ``[index, index + T)``; a query at slot i sees valid slots j <= i.
  Without a cache, ``forward`` is plain causal attention over the T tokens
  with ``valid`` as the key mask (training / teacher forcing).
* ``forward`` returns the final-normed hidden states ``[B, T, D]``; logits
  are ``unembed(params, config, hidden)`` (tied or untied head). Log-prob
  code never materialises ``[B, T, V]`` in f32 at once: it calls
  ``unembed`` on chunks of T.
* The HF checkpoint mapping is data: ``hf_table(config)`` lists one
  ``HfTensor`` per HF tensor (key, param path, layout); ``hf_io`` does all
  reading, writing, checking and placement. A family may also define
  ``hf_ignore(config) -> tuple[str, ...]`` (regexes of HF keys skipped on load
  with a one-line notice, e.g. a vision tower) — optional.
* ``decode_layout(config, params, cache, *, fuse_matmuls) -> (params,
  cache)``: the same model in a layout that ``forward`` also accepts and that
  a CPU decode loop reads fastest (both families: the layer stacks unstacked
  into tuples, so that no per-token slice of a stacked weight is copied, and
  the cache likewise, updated in place; with ``fuse_matmuls``, projections
  that read one input concatenated and every projection and the LM head
  stored output dims first, ``layers.OutIn``, which few rows multiply as row
  reductions). ``forward`` never looks at the backend: it runs whichever
  layout it is given. The choice is made in one place, ``sampling.sample``
  (its ``decode_layout`` argument, default: on a CPU backend), which applies
  the hook once per call, after the prefill; on GPU/TPU the decode stays the
  stored layer scan (no second copy of the weights). ``fuse_matmuls`` is
  False under a mesh (a fused axis would mix differently sharded heads).
* ``forward(..., remat=None)``: rematerialisation of the layers for training.
  ``None`` (the default; sampling and scoring never differentiate) stores
  every layer's activations for the backward pass; a policy name from
  ``REMAT_POLICIES`` wraps each scanned layer body (each repeat of a
  pattern, for a hybrid family) in ``jax.checkpoint`` (`remat_layer`), so
  the backward keeps only the residual stream between layers and recomputes
  one layer's internals at a time: ``"full"`` saves nothing inside the layer,
  ``"dots"`` keeps the outputs of the weight matmuls (those without batch
  dims; attention scores and the rest are recomputed), trading memory back
  for less recomputation. The result and its gradient are the same either
  way (up to float rounding).
* ``forward(..., embeds=None)``: optional ``[B, T, D]`` input vectors in
  place of the token embeddings (``layers.embed_inputs``); the tokens then
  only give the shape. A VLA puts image patches before its text this way
  (``wmrl_jax.vla.model``).
* ``param_axes`` leaves are tuples of logical names (see ``sharding.RULES``);
  ``cache_axes`` likewise, with ``()`` for the scalar ``index``.
* Writing past ``max_len`` in a cache is not detected inside jit
  (``dynamic_update_slice`` clamps); callers size the cache.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp

Params = dict
Cache = dict

# HF `model_type` -> module implementing the family, imported on first use.
FAMILIES: dict[str, str] = {
    "qwen2": "wmrl_jax.models.qwen2",
    "qwen3": "wmrl_jax.models.qwen3",
    "qwen3_5": "wmrl_jax.models.qwen35",
    "qwen3_5_text": "wmrl_jax.models.qwen35",
}


# `forward(remat=...)` policy names -> what `jax.checkpoint` may keep from inside a layer.
REMAT_POLICIES: dict[str, Any] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_layer(fn, remat: str | None, *, prevent_cse: bool = True):
    """`fn` (one layer, or one scan body) under `jax.checkpoint` with the named policy; `fn` itself for None.

    prevent_cse=False is safe (and cheaper) for a `lax.scan` body, whose
    recomputation XLA cannot merge with the forward anyway (JAX docs).
    """
    if remat is None:
        return fn
    if not (isinstance(remat, str) and remat in REMAT_POLICIES):
        raise ValueError(f"remat: {remat!r}, expected None or one of {sorted(REMAT_POLICIES)}")
    return jax.checkpoint(fn, policy=REMAT_POLICIES[remat], prevent_cse=prevent_cse)


def get_family(model_type: str):
    """The family module for an HF `model_type` (e.g. "qwen3"); a clear error for anything else."""
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[model_type])


@dataclasses.dataclass(frozen=True)
class HfTensor:
    """One HF tensor <-> one param leaf (or one layer of a stacked leaf).

    Layout: param = hf.reshape(view).transpose(perm). `key` contains
    "{layer}" when `stacked`: slice i of the param is the HF tensor
    `layer_key(i)`, i.e. HF layer `layer_ids[i]` (default: layer i; a family
    whose stack holds every P-th layer lists them).
    """

    key: str
    path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    view: tuple[int, ...]
    perm: tuple[int, ...]
    stacked: bool = False
    layer_ids: tuple[int, ...] | None = None

    @property
    def param_shape(self) -> tuple[int, ...]:
        return tuple(self.view[p] for p in self.perm)

    def layer_key(self, i: int) -> str:
        """The HF key of slice i of a stacked param."""
        return self.key.format(layer=i if self.layer_ids is None else self.layer_ids[i])

    @classmethod
    def same(
        cls, key: str, path: tuple[str, ...], shape: tuple[int, ...], stacked: bool = False, layer_ids=None
    ) -> "HfTensor":
        shape = tuple(shape)
        return cls(key, tuple(path), shape, shape, tuple(range(len(shape))), stacked, layer_ids)

    @classmethod
    def linear(
        cls,
        key: str,
        path: tuple[str, ...],
        in_dims: tuple[int, ...],
        out_dims: tuple[int, ...],
        stacked: bool = False,
        layer_ids=None,
    ) -> "HfTensor":
        """An `nn.Linear` weight [prod(out), prod(in)] stored as param [*in_dims, *out_dims]."""
        n_out, n_in = len(out_dims), len(in_dims)
        return cls(
            key,
            tuple(path),
            (math.prod(out_dims), math.prod(in_dims)),
            tuple(out_dims) + tuple(in_dims),
            tuple(range(n_out, n_out + n_in)) + tuple(range(n_out)),
            stacked,
            layer_ids,
        )


@dataclasses.dataclass
class Model:
    """A loaded model: params (sharded over `mesh` when given) + config + the family implementing it."""

    config: Any
    params: Params
    family: Any
    mesh: Any = None

    def logits(self, tokens, valid=None) -> jax.Array:
        """float32[B, T, V] logits of int32[B, T] tokens (left-padded rows: pass `valid`, bool[B, T])."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"tokens: expected int32[B, T], got shape {tokens.shape}")
        valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.asarray(valid, bool)
        if valid.shape != tokens.shape:
            raise ValueError(f"valid: shape {valid.shape}, expected the tokens' shape {tokens.shape}")
        if self.mesh is None:
            return _jit_logits(self.family, self.config, self.params, tokens, valid)
        with jax.set_mesh(self.mesh):
            return _jit_logits(self.family, self.config, self.params, tokens, valid)


def _logits(family, config, params, tokens, valid):
    from wmrl_jax.models.layers import positions_from_valid

    hidden, _ = family.forward(params, config, tokens, positions_from_valid(valid), valid)
    return family.unembed(params, config, hidden).astype(jnp.float32)


_jit_logits = jax.jit(_logits, static_argnums=(0, 1))


class ModelFamily(Protocol):
    MODEL_TYPES: tuple[str, ...]  # HF `model_type` values this family loads.
    Config: type

    def config_from_hf(self, hf_config: dict) -> Any: ...

    def config_to_hf(self, config: Any) -> dict: ...

    def init_params(self, config: Any, rng: jax.Array, dtype: Any) -> Params: ...

    def param_axes(self, config: Any) -> dict: ...

    def hf_table(self, config: Any) -> list: ...

    def init_cache(self, config: Any, batch: int, max_len: int, dtype: Any) -> Cache: ...

    def cache_axes(self, config: Any) -> dict: ...

    def forward(
        self,
        params: Params,
        config: Any,
        tokens: jax.Array,  # int32[B, T]
        positions: jax.Array,  # int32[B, T]
        valid: jax.Array,  # bool[B, T]
        cache: Cache | None = None,
        *,
        remat: str | None = None,  # None or a key of REMAT_POLICIES
        embeds: jax.Array | None = None,  # [B, T, D] inputs in place of the token embeddings
    ) -> tuple[jax.Array, Cache | None]: ...

    def unembed(self, params: Params, config: Any, hidden: jax.Array) -> jax.Array: ...

    def decode_layout(
        self, config: Any, params: Params, cache: Cache | None, *, fuse_matmuls: bool = True
    ) -> tuple[Params, Cache | None]: ...
