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
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

Params = dict
Cache = dict


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
    ) -> tuple[jax.Array, Cache | None]: ...

    def unembed(self, params: Params, config: Any, hidden: jax.Array) -> jax.Array: ...
