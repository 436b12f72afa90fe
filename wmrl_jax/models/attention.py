"""Causal grouped-query attention over several kernels: cuDNN's flash attention where it applies, blocked elsewhere.

`causal_attention` takes the arguments of `blocked_attention.blocked_causal_attention`
(queries ``[B, T, N, H]``, keys and values head-major ``[B, K, S, H]``,
``valid_bs`` the key slots holding real tokens, a query offset) and runs one of:

* ``"cudnn"`` -- ``jax.nn.dot_product_attention(..., implementation="cudnn",
  is_causal=True)``: cuDNN's fused flash attention (forward and backward),
  grouped-query natively. It expresses the causal mask of queries and keys
  that start at the same slot (``q_offset == 0`` as a Python int and
  ``T == S``: the update's and the logits' forward, which have no cache), with
  the left padding as a ``[B, 1, 1, S]`` key mask (turned into an additive
  bias by JAX). A prefill into a cache (a traced ``q_offset``) is not
  expressible without a full ``[T, S]`` mask, so it stays blocked. cuDNN also
  needs a GPU, bf16 or fp16 inputs and a head dim that is a multiple of 8, at
  most 256 on Hopper and later (128 before; JAX raises otherwise).
* ``"blocked"`` -- the hand-written blocked attention with the recomputing
  backward (`blocked_attention`): any backend, any offset.
* ``"xla"`` -- ``jax.nn.dot_product_attention(..., implementation="xla")``:
  the whole ``[B, N, T, S]`` score tensor; for checks (tests) only.
* ``"auto"`` (the default) -- cuDNN on a GPU where it applies, blocked elsewhere.

The choice is made when a program is traced: `set_implementation` (the
training loop calls it with `config.attention`) sets the default for programs
traced afterwards. A query row whose every key is masked (a left-padding
position) gets a finite output from every kernel, but not the same one; no
real token reads such a row, and the update's loss masks it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from wmrl_jax.models.blocked_attention import blocked_causal_attention

IMPLEMENTATIONS = ("auto", "blocked", "cudnn", "xla")

_implementation = "auto"


def set_implementation(name: str) -> None:
    """Sets the kernel of programs traced from now on (one of `IMPLEMENTATIONS`; `config.attention`)."""
    global _implementation
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"config.attention: {name!r}, expected one of {IMPLEMENTATIONS}")
    _implementation = name


def get_implementation() -> str:
    return _implementation


def cudnn_unsupported(q_btnh, k_bksh, q_offset) -> str | None:
    """Why cuDNN's kernel cannot compute this call (None: it can)."""
    if not isinstance(q_offset, (int, np.integer)) or q_offset != 0:
        return "queries start after slot 0 (a prefill into a cache): the causal mask would need [T, S]"
    if q_btnh.shape[1] != k_bksh.shape[2]:
        return f"{q_btnh.shape[1]} queries against {k_bksh.shape[2]} keys: is_causal aligns them at slot 0 only"
    if q_btnh.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q_btnh.dtype}: cuDNN's flash attention takes bf16 / fp16"
    if q_btnh.shape[-1] % 8 or q_btnh.shape[-1] > 256:
        return f"head dim {q_btnh.shape[-1]}: expected a multiple of 8, at most 256"
    if jax.default_backend() != "gpu":
        return f"backend {jax.default_backend()!r}, cuDNN needs a GPU"
    return None


def selected(q_btnh, k_bksh, q_offset=0, implementation: str | None = None) -> str:
    """The kernel `causal_attention` runs for these arguments: "cudnn", "blocked" or "xla"."""
    name = _implementation if implementation is None else implementation
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: {name!r}, expected one of {IMPLEMENTATIONS}")
    if name == "auto":
        return "blocked" if cudnn_unsupported(q_btnh, k_bksh, q_offset) else "cudnn"
    if name == "cudnn":
        why = cudnn_unsupported(q_btnh, k_bksh, q_offset)
        if why:
            raise ValueError(f"attention implementation 'cudnn' does not apply: {why} (use 'auto' to fall back)")
    if name == "xla" and (not isinstance(q_offset, (int, np.integer)) or q_offset != 0
                          or q_btnh.shape[1] != k_bksh.shape[2]):
        raise ValueError("attention implementation 'xla': expected queries and keys starting at slot 0, T == S")
    return name


def causal_attention(q_btnh, k_bksh, v_bksh, valid_bs, scale: float, *, q_offset=0,
                     implementation: str | None = None) -> jax.Array:
    """softmax(q·kᵀ·scale + causal/padding mask)·v by the kernel `selected` picks; ``[B, T, N, H]`` in q's dtype.

    Arguments as `blocked_attention.blocked_causal_attention`'s; `implementation`
    overrides the default of `set_implementation` for this call.
    """
    name = selected(q_btnh, k_bksh, q_offset, implementation)
    if name == "blocked":
        return blocked_causal_attention(q_btnh, k_bksh, v_bksh, valid_bs, scale, q_offset=q_offset)
    mask = valid_bs.astype(bool)[:, None, None, :]            # [B, 1, 1, S]: padded keys never visible
    out = jax.nn.dot_product_attention(q_btnh, k_bksh.swapaxes(1, 2), v_bksh.swapaxes(1, 2), mask=mask,
                                       scale=scale, is_causal=True, implementation=name)
    return out.astype(q_btnh.dtype)


__all__ = ["IMPLEMENTATIONS", "causal_attention", "cudnn_unsupported", "get_implementation", "selected",
           "set_implementation"]
