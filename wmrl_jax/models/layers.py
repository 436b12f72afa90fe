"""Building blocks shared by the model families (Qwen3, Qwen3.5): pure functions.

Einsum dimension letters used in names and docstrings:
  B batch, T query length, S key length (cache slots), D model width,
  N query heads, K key/value heads, G = N // K query heads per KV head,
  H head dim, F MLP width, V vocabulary.

Numerics: norms, RoPE angles and the softmax run in f32 whatever the param
dtype, because bf16 has 8 mantissa bits and these are the places where
rounding compounds (variance of 4k numbers, angles of 32k positions,
exponentials). Matmuls run in the param dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

# Finite "minus infinity": a fully masked row (a padded query) then gets a
# uniform softmax instead of NaN; its output is never used.
_MASK_VALUE = -1e30


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis: y = x / sqrt(mean(x²) + eps) · (offset + w).

    offset=0 is Qwen3's norm (w initialised to 1); offset=1 is Qwen3.5's
    "(1 + w)" norm (w initialised to 0). Computed in f32, returned in x.dtype.

    Args:
      x: [..., D].
      weight: [D].
    """
    chex.assert_equal(x.shape[-1:], weight.shape)
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def rope_settings(rope_parameters: dict | None, head_dim: int, *, rope_theta: float | None = None) -> tuple[float, int]:
    """(theta, rotary_dim) from a transformers-5 `rope_parameters` dict.

    transformers 5 stores {"rope_type": "default", "rope_theta": ...,
    "partial_rotary_factor": ...} in `config.rope_parameters` (older configs
    had a top-level `rope_theta`, accepted as a fallback). Only the "default"
    (unscaled) RoPE is implemented; scaled variants (yarn, linear, ...) would
    silently change long-context positions, so they raise.
    """
    params = dict(rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(
            f"rope_parameters.rope_type={rope_type!r}: only 'default' RoPE is implemented (got {params})"
        )
    theta = params.get("rope_theta", rope_theta)
    if theta is None:
        raise ValueError(f"rope_parameters: expected a 'rope_theta' entry, got {params}")
    factor = float(params.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"partial_rotary_factor={factor} with head_dim={head_dim} gives rotary_dim={rotary_dim}; "
            "expected an even number in (0, head_dim]"
        )
    return float(theta), rotary_dim


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int) -> jax.Array:
    """Rotary embedding (rotate-half convention of HF) on the first `rotary_dim` dims of each head.

    inv_freq_i = theta^(-2i / rotary_dim), angle = position · inv_freq,
    x_rot = x · cos + rotate_half(x) · sin with cos/sin over [freqs, freqs];
    dims past rotary_dim pass through (Qwen3.5's partial rotary).

    Args:
      x: [B, T, N, H].
      positions: int32[B, T].
    """
    chex.assert_rank(x, 4)
    chex.assert_equal(x.shape[:2], positions.shape)
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rotary_dim / 2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    x_rot, x_pass = xf[..., :rotary_dim], xf[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
    return out.astype(x.dtype)


def attention_mask(
    valid_q: jax.Array, valid_k: jax.Array, *, q_offset: jax.Array | int = 0
) -> jax.Array:
    """bool[B, T, S]: query t (at slot q_offset + t) sees key slot s iff s <= q_offset + t and s is valid.

    Without a cache S == T and q_offset == 0 (causal + key padding). With a
    cache, valid_k is the cache's slot validity after writing this step.
    """
    chex.assert_rank([valid_q, valid_k], 2)
    q_slot = q_offset + jnp.arange(valid_q.shape[1])
    causal = jnp.arange(valid_k.shape[1])[None, :] <= q_slot[:, None]  # [T, S]
    return causal[None] & valid_k[:, None, :]


def gqa_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float, *, kv_layout: str = "bskh"
) -> jax.Array:
    """Grouped-query attention: softmax(q·kᵀ·scale + mask)·v, query head n reads KV head n // G.

    The grouping equals HF's `repeat_kv` (repeat-interleave of KV heads)
    without materialising the repeated keys.

    Args:
      q: [B, T, N, H].
      k, v: by `kv_layout`:
        "bskh": both [B, S, K, H] (fresh keys: training, prefill);
        "bksh": both [B, K, S, H] (a head-major KV cache, read in place);
        "bkhs": k [B, K, H, S] and v [B, K, S, H] (a cache with the keys
          stored transposed: the score product is then a plain [T·G, H] x
          [H, S] matmul per KV head, which XLA:CPU runs 1.5x faster at a
          decode step than against [S, H] keys).
      mask: bool[B, T, S].
    Returns:
      [B, T, N, H] in q.dtype (softmax in f32).
    """
    chex.assert_rank([q, k, v, mask], [4, 4, 4, 3])
    if kv_layout not in _KV_LAYOUTS:
        raise ValueError(f"gqa_attention: kv_layout must be one of {_KV_LAYOUTS}, got {kv_layout!r}")
    batch, length, num_heads, head_dim = q.shape
    num_kv = k.shape[2] if kv_layout == "bskh" else k.shape[1]
    if num_heads % num_kv:
        raise ValueError(f"gqa_attention: {num_heads} query heads is not a multiple of {num_kv} KV heads")
    groups = num_heads // num_kv
    q_btkgh = q.reshape(batch, length, num_kv, groups, head_dim)
    if kv_layout == "bskh":
        scores_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k, preferred_element_type=jnp.float32) * scale
        scores_bkgts = jnp.where(mask[:, None, None], scores_bkgts, _MASK_VALUE)
        probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(v.dtype)
        out_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v)
        return out_btkgh.reshape(batch, length, num_heads, head_dim)
    # Cache layouts: per KV head, one [T·G, H] x [H, S] product, the queries
    # moved next to their KV head first (a small copy). Written as
    # "btkgh,bksh->bkgts", XLA:CPU emits the product as [S, G] blocks and
    # transposes the scores back: 2.2x slower at a decode step.
    q_bkxh = q_btkgh.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv, length * groups, head_dim)
    k_spec = "bksh" if kv_layout == "bksh" else "bkhs"
    scores_bkxs = jnp.einsum(f"bkxh,{k_spec}->bkxs", q_bkxh, k, preferred_element_type=jnp.float32) * scale
    scores_bktgs = scores_bkxs.reshape(batch, num_kv, length, groups, -1)
    scores_bktgs = jnp.where(mask[:, None, :, None, :], scores_bktgs, _MASK_VALUE)
    probs_bkxs = jax.nn.softmax(scores_bktgs, axis=-1).astype(v.dtype).reshape(scores_bkxs.shape)
    out_bkxh = jnp.einsum("bkxs,bksh->bkxh", probs_bkxs, v)
    out_btkgh = out_bkxh.reshape(batch, num_kv, length, groups, head_dim).transpose(0, 2, 1, 3, 4)
    return out_btkgh.reshape(batch, length, num_heads, head_dim)


_KV_LAYOUTS = ("bskh", "bksh", "bkhs")


def write_cache(cache_bs: jax.Array, new_bt: jax.Array, index: jax.Array) -> jax.Array:
    """Writes new_bt[B, T, ...] into cache_bs[B, S, ...] at slots [index, index + T)."""
    start = (0, index) + (0,) * (cache_bs.ndim - 2)
    return jax.lax.dynamic_update_slice(cache_bs, new_bt.astype(cache_bs.dtype), start)


def swiglu(x: jax.Array, gate_df: jax.Array, up_df: jax.Array, down_fd: jax.Array) -> jax.Array:
    """SwiGLU MLP: down(silu(x·gate) ⊙ (x·up)). x: [B, T, D] → [B, T, D]."""
    gate_btf = jnp.einsum("btd,df->btf", x, gate_df)
    up_btf = jnp.einsum("btd,df->btf", x, up_df)
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate_btf) * up_btf, down_fd)


def swiglu_fused(x: jax.Array, gate_up_dx, down_fd) -> jax.Array:
    """`swiglu` with gate|up concatenated into one [D, 2F] weight (one matmul instead of two); ``OutIn`` weights too."""
    gate_btf, up_btf = jnp.split(project("btd,dx->btx", x, gate_up_dx), 2, axis=-1)
    return project("btf,fd->btd", jax.nn.silu(gate_btf) * up_btf, down_fd)


def mlp(x: jax.Array, lp: dict) -> jax.Array:
    """A layer's SwiGLU MLP: ``swiglu_fused`` where gate|up is stacked (``gate_up_proj_dx``), else ``swiglu``."""
    if "gate_up_proj_dx" in lp:
        return swiglu_fused(x, lp["gate_up_proj_dx"], lp["down_proj_fd"])
    return swiglu(x, lp["gate_proj_df"], lp["up_proj_df"], lp["down_proj_fd"])


# Up to this many rows a row reduction beats XLA:CPU's dot (the 32000 x 512
# unembedding in a decode loop: 9.9 vs 13.3 ms at 32 rows, 21.6 vs 20.4 at 64).
FEW_ROWS = 32


def few_rows_path(rows: int) -> bool:
    """Whether an ``OutIn`` product of ``rows`` rows takes ``few_rows_matmul``: few rows, no mesh in scope.

    Only a family's ``decode_layout`` makes ``OutIn`` weights, and the sampler
    chooses that layout (on CPU backends by default), so this needs no backend
    check of its own. A mesh's partitioner may place the multiply and the
    reduce apart (the [M, N, K] product would then be materialised), so
    sharded code keeps dots.
    """
    return rows <= FEW_ROWS and jax.sharding.get_abstract_mesh().empty


def few_rows_matmul(x_mk: jax.Array, w_nk: jax.Array) -> jax.Array:
    """``x · wᵀ`` for few rows M (a decode step) as one multiply-and-reduce: f32[M, N].

    Each output is a row reduction over K of ``w[n] * x[m]`` in f32 (the
    [M, N, K] product is fused away, never materialised). At M <= 32 XLA:CPU
    streams the weight through a row reduction faster than through its dot:
    measured in a decode loop, the 32000 x 512 unembedding takes 5.0 ms
    against 7.9 ms ([D, V] dot) and 6.6 ms ([V, D] dot) at M = 8, and 9.9
    against 13.3 ms at M = 32. Take it where ``few_rows_path(M)``.
    """
    f32 = jnp.float32
    return (w_nk[None, :, :].astype(f32) * x_mk[:, None, :].astype(f32)).sum(-1)


class OutIn(NamedTuple):
    """A projection weight stored output dims first (``[*out, *in]``), as a CPU decode step reads it best."""

    weight: jax.Array


def out_in(w: jax.Array, n_in: int) -> OutIn:
    """``w[*in, *out]`` (its first ``n_in`` dims contracted) as an ``OutIn`` ``[*out, *in]``."""
    return OutIn(jnp.transpose(w, tuple(range(n_in, w.ndim)) + tuple(range(n_in))))


def fuse_projections(layer: dict, fused: dict[str, tuple[str, ...]], n_in: dict[str, int]) -> dict:
    """One layer's weights as a decode step of few rows multiplies them fastest on CPU (``decode_layout``).

    Each ``fused[name] = (a, b, ...)`` (projections that read the same input)
    is flattened to ``[in, out]`` and concatenated along its outputs into one
    weight ``name``: one product instead of several. Then every projection
    (``n_in[name]``: how many leading dims it contracts; 1 for a fused one)
    is stored output dims first (``OutIn``), which ``project`` multiplies as
    a row reduction: at M = B·T = 8 rows XLA:CPU streams a ``[out, in]``
    weight through ``few_rows_matmul`` about twice as fast as through a dot
    against ``[in, out]``. Other leaves (norms, conv, biases) pass through.
    """
    layer, n_in = dict(layer), dict(n_in)
    for name, parts in fused.items():
        if all(part in layer for part in parts):
            flat = [layer[part].reshape(math.prod(layer[part].shape[: n_in[part]]), -1) for part in parts]
            for part in parts:
                del layer[part]
            layer[name], n_in[name] = jnp.concatenate(flat, axis=1), 1
    return {name: out_in(w, n_in[name]) if name in n_in else w for name, w in layer.items()}


def project(spec: str, x: jax.Array, w: jax.Array | OutIn) -> jax.Array:
    """``einsum(spec, x, w)`` for a projection whose contracted dims end x and start w.

    An ``OutIn`` weight is multiplied by ``few_rows_matmul`` where
    ``few_rows_path`` (a decode step of few rows), else by the same einsum
    over its transposed dims; the result is laid out as ``spec`` says either way.
    """
    if not isinstance(w, OutIn):
        return jnp.einsum(spec, x, w)
    x_dims, rest = spec.split(",")
    w_dims, out_dims = rest.split("->")
    n_in = sum(d in x_dims for d in w_dims)
    w_in, w_out, lead = w_dims[:n_in], w_dims[n_in:], x_dims[: len(x_dims) - n_in]
    out_shape, lead_shape = w.weight.shape[: len(w_out)], x.shape[: len(lead)]
    rows = math.prod(lead_shape)
    if not few_rows_path(rows):
        return jnp.einsum(f"{x_dims},{w_out}{w_in}->{out_dims}", x, w.weight)
    y = few_rows_matmul(x.reshape(rows, -1), w.weight.reshape(math.prod(out_shape), -1)).astype(x.dtype)
    return jnp.einsum(f"{lead}{w_out}->{out_dims}", y.reshape(*lead_shape, *out_shape))


def seal_decode_params(params: dict, *, tied: bool, head: bool) -> dict:
    """A family's ``decode_layout`` params behind an ``optimization_barrier``, with the LM head as ``OutIn`` if ``head``.

    The head is [V, D] (``lm_head_dv`` transposed, or the tied embedding
    itself), as ``unembed`` multiplies it at a step of few rows. The barrier
    (an identity) keeps XLA from sinking the slices, concatenations and
    transposes that built the layout into the decode loop: they are cheap to
    recompute, so it does, but then per token. A tied head is set after the
    barrier, so that it stays the embedding's own buffer.
    """
    params = dict(params)
    if head and not tied:
        params["lm_head_dv"] = out_in(params["lm_head_dv"], 1)
    params = jax.lax.optimization_barrier(params)
    if head and tied:
        params["lm_head_dv"] = OutIn(params["embed_vd"])
    return params


# Logit of a padded vocabulary id: finite (so p * log p stays 0, not nan) and far below any real logit.
PADDED_LOGIT = -1e9


def mask_padded_vocab(logits: jax.Array, token_count: int | None) -> jax.Array:
    """``logits[..., v]`` for v < token_count, `PADDED_LOGIT` above (None or >= V: unchanged)."""
    if token_count is None or token_count >= logits.shape[-1]:
        return logits
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.where(ids < token_count, logits, jnp.asarray(PADDED_LOGIT, logits.dtype))


def unembed(hidden_btd: jax.Array, params: dict, tied: bool) -> jax.Array:
    """float32[B, T, V] logits of final-normed hidden [B, T, D]: ``lm_head_dv``, or ``embed_vd`` transposed if tied.

    In a decode layout ``lm_head_dv`` is an ``OutIn`` [V, D] (also when tied:
    ``seal_decode_params``), which a step of few rows (``few_rows_path``)
    multiplies by ``few_rows_matmul``.
    """
    head = params.get("lm_head_dv")
    if isinstance(head, OutIn):
        b, t, d = hidden_btd.shape
        if few_rows_path(b * t):
            return few_rows_matmul(hidden_btd.reshape(b * t, d), head.weight).reshape(b, t, -1)
        w_vd = head.weight
    elif tied:
        w_vd = params["embed_vd"]
    else:
        return jnp.einsum("btd,dv->btv", hidden_btd, head, preferred_element_type=jnp.float32)
    return jnp.einsum("btd,vd->btv", hidden_btd, w_vd, preferred_element_type=jnp.float32)


def embed_inputs(embed_vd: jax.Array, tokens: jax.Array, embeds: jax.Array | None) -> jax.Array:
    """A family's input to its first layer: ``embed_vd[tokens]``, or the given ``embeds`` [B, T, D] in its place.

    ``embeds`` lets a caller put other vectors into the sequence (a VLA's
    image patches before its text: ``wmrl_jax.vla.model``); ``tokens`` then
    only give the [B, T] shape. Cast to the embedding's dtype.
    """
    if embeds is None:
        return jnp.take(embed_vd, tokens, axis=0)
    want = tuple(tokens.shape) + (embed_vd.shape[1],)
    if tuple(embeds.shape) != want:
        raise ValueError(f"embeds: shape {tuple(embeds.shape)}, expected {want} (the tokens' [B, T] and the model width)")
    return embeds.astype(embed_vd.dtype)


def positions_from_valid(valid: jax.Array) -> jax.Array:
    """RoPE positions of a left-padded batch: cumsum(valid) - 1, clipped at 0 (int32[B, T])."""
    return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)


def attention_context(tokens: jax.Array, positions: jax.Array, valid: jax.Array, cache: dict | None) -> dict:
    """Checks forward's inputs and builds what every attention layer of a step shares.

    Returns {"positions", "valid", "index" (first cache slot written, 0 without
    a cache), "mask" (bool[B, T, S]), "cache_valid" (bool[B, S], only with a
    cache)}; see family.py for the cache contract.
    """
    if tokens.ndim != 2 or positions.shape != tokens.shape or valid.shape != tokens.shape:
        raise ValueError(
            f"tokens/positions/valid: expected equal [B, T] shapes, got {tokens.shape}, {positions.shape}, {valid.shape}"
        )
    valid = valid.astype(bool)
    ctx = {"positions": positions, "valid": valid}
    if cache is None:
        ctx.update(index=0, mask=attention_mask(valid, valid))
    else:
        cache_valid = write_cache(cache["valid"], valid, cache["index"])
        ctx.update(
            index=cache["index"], cache_valid=cache_valid, mask=attention_mask(valid, cache_valid, q_offset=cache["index"])
        )
    return ctx


def _to_cache_layout(new_btkh: jax.Array, layout: str) -> jax.Array:
    """This step's [B, T, K, H] keys or values in a cache layout: "bksh" or "bkhs" (keys transposed)."""
    if layout == "bksh":
        return new_btkh.transpose(0, 2, 1, 3)
    if layout == "bkhs":
        return new_btkh.transpose(0, 2, 3, 1)
    raise ValueError(f"cache layout must be 'bksh' or 'bkhs', got {layout!r}")


def _slot_start(layout: str, index: jax.Array) -> tuple:
    """Start of slot `index` in one layer's cache: the S axis is third in "bksh", last in "bkhs"."""
    return (0, 0, index, 0) if layout == "bksh" else (0, 0, 0, index)


def write_kv(cache: jax.Array, new_btkh: jax.Array, index: jax.Array, *, layout: str = "bksh") -> jax.Array:
    """Writes this step's keys (or values) [B, T, K, H] into one layer's cache at slots [index, index + T).

    layout "bksh": cache [B, K, S, H]; "bkhs": cache [B, K, H, S] (transposed keys).
    """
    new = _to_cache_layout(new_btkh, layout).astype(cache.dtype)
    return jax.lax.dynamic_update_slice(cache, new, _slot_start(layout, index))


def write_layer_kv(
    stack: jax.Array, new_btkh: jax.Array, layer: jax.Array, index: jax.Array, *, layout: str = "bksh"
) -> jax.Array:
    """Writes this step's keys (or values) [B, T, K, H] into layer `layer` of a stacked cache [L, ...].

    Only the T new slots of layer `layer` are written: the stacked cache rides
    in the layer scan's carry, so XLA updates it in place (a scanned-over cache
    would be sliced out and stacked back, a full copy per layer per token).
    """
    new = _to_cache_layout(new_btkh, layout)[None].astype(stack.dtype)
    return jax.lax.dynamic_update_slice(stack, new, (layer,) + _slot_start(layout, index))
