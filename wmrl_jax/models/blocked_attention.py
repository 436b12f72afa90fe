"""Causal grouped-query attention in key blocks with an online softmax (flash-attention style), pure JAX.

``layers.gqa_attention`` builds the whole ``[B, K, G, T, S]`` score tensor:
at a 2k-token prefill of batch 8 that is 1 GiB of f32 per layer, written,
masked, exponentiated and read back, and half of it is above the causal
diagonal. Here the queries are cut into blocks of ``block_q`` and, for each,
the keys are visited in blocks of ``block_k`` with the running maximum m,
normaliser l and un-normalised output o of the online softmax (Milakov &
Gimelshein 2018; Dao et al., "FlashAttention", arXiv:2205.14135)::

    m' = max(m, rowmax(s)),   p = exp(s − m'),   α = exp(m − m')
    l' = α l + rowsum(p),     o' = α o + p v,    output = o / l

so only one ``[B, K, G, block_q, block_k]`` score block is alive at a time
(it stays in cache), and key blocks entirely after a query block's last slot
are never visited (causal block skipping: about half the work at a prefill).

The query of row t sits at cache slot ``q_offset + t`` and sees key slot s
iff ``s ≤ q_offset + t`` and ``valid_k[s]`` — the mask ``layers.attention_mask``
builds, with the same finite −1e30 fill, so a query with no visible key (a
padded position) gets a finite average instead of NaN, as there. With a
traced ``q_offset`` (a cache's write index) the number of key blocks per
query block is traced too and the loop is a ``while``; with a Python int it
is static.

The backward (FlashAttention-2's, Dao 2023, arXiv:2307.08691) is a
``jax.custom_vjp``: the forward saves, besides its inputs, only the output
and the final m and l of every query row (their log-sum-exp ``m + log l``,
kept as the pair so that a row with no visible key, whose m is the −1e30
fill, gets back exactly the p its forward used). The backward visits the
same (query block, key block) pairs and recomputes each block's

    p = exp(s − m) / l,   dv += pᵀ·do,   dp = do·vᵀ,   ds = p ∘ (dp − D),
    dq += ds·k·scale,     dk += dsᵀ·q·scale,      with D = rowsum(do ∘ o)

so the memory of the backward is O(T) per row instead of one score block
per visited (query block, key block) pair, which is what ``jax.grad`` of the
loop keeps. A traced ``q_offset`` (a cache prefill in the sampler, never
differentiated) runs the forward alone; the backward needs a Python int
offset (training has none: offset 0).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

# Same finite fill as layers.gqa_attention (a fully masked row stays finite).
_MASK_VALUE = -1e30


def blocked_causal_attention(
    q_btnh: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    valid_bs: jax.Array,
    scale: float,
    *,
    q_offset: jax.Array | int = 0,
    block_q: int = 256,
    block_k: int = 256,
) -> jax.Array:
    """softmax(q·kᵀ·scale + causal/padding mask)·v, query head n reading KV head n // (N / K).

    Args:
      q_btnh: ``[B, T, N, H]`` queries; row t is at key slot ``q_offset + t``.
      k_bksh, v_bksh: ``[B, K, S, H]`` keys and values, head-major (the KV
        cache layout; fresh keys ``[B, T, K, H]`` are ``swapaxes(1, 2)``).
      valid_bs: ``bool[B, S]`` key slots that hold real tokens.
      scale: score scale (``head_dim ** -0.5``).
      q_offset: slot of query row 0 (int, or a traced int32 scalar). Only
        with an int is the function differentiable (the recompute backward
        of the module docstring).
      block_q, block_k: block sizes (clipped to T and S).

    Returns:
      ``[B, T, N, H]`` in q's dtype; scores and softmax in f32.
    """
    chex.assert_rank([q_btnh, k_bksh, v_bksh, valid_bs], [4, 4, 4, 2])
    b, t, n, h = q_btnh.shape
    _, kv, s, _ = k_bksh.shape
    if k_bksh.shape != (b, kv, s, h) or v_bksh.shape != k_bksh.shape:
        raise ValueError(
            f"k/v: shapes {k_bksh.shape}, {v_bksh.shape}, expected equal [B, K, S, H] with B = {b}, H = {h} like q {q_btnh.shape}"
        )
    if n % kv:
        raise ValueError(f"blocked_causal_attention: {n} query heads is not a multiple of {kv} KV heads")
    if valid_bs.shape != (b, s):
        raise ValueError(f"valid_bs: shape {valid_bs.shape}, expected (B, S) = {(b, s)}")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q={block_q}, block_k={block_k}: expected positive ints")
    blocks = (min(block_q, t), min(block_k, s))
    valid_bs = valid_bs.astype(bool)
    if isinstance(q_offset, (int, np.integer)):
        return _attention(q_btnh, k_bksh, v_bksh, valid_bs, float(scale), int(q_offset), blocks)
    out, _ = _forward(q_btnh, k_bksh, v_bksh, valid_bs, scale, q_offset, blocks)
    return out


def _layout(q_btnh, k_bksh, blocks):
    """Sizes: (b, t, n, h, kv, g, s, bq, bk, t_pad, s_pad, query blocks, key blocks)."""
    b, t, n, h = q_btnh.shape
    kv, s = k_bksh.shape[1], k_bksh.shape[2]
    bq, bk = blocks
    t_pad, s_pad = -t % bq, -s % bk
    return b, t, n, h, kv, n // kv, s, bq, bk, t_pad, s_pad, (t + t_pad) // bq, (s + s_pad) // bk


def _to_heads(x_btnh, kv, t_pad):
    """[B, T, N, H] -> [B, K, G, T + t_pad, H]: the G query heads of one KV head side by side."""
    b, t, n, h = x_btnh.shape
    x = jnp.pad(x_btnh, ((0, 0), (0, t_pad), (0, 0), (0, 0))).reshape(b, t + t_pad, kv, n // kv, h)
    return x.transpose(0, 2, 3, 1, 4)


def _from_heads(x_bkgth, t, dtype):
    b, kv, g, _, h = x_bkgth.shape
    return x_bkgth[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, h).astype(dtype)


def _key_blocks(q_offset, i, bq, bk, num_kb):
    """Key blocks [0, stop) can hold a key visible to query block i; later ones are all in the future."""
    last_slot = q_offset + (i + 1) * bq - 1
    if isinstance(last_slot, jax.Array):
        return jnp.minimum(last_slot // bk + 1, num_kb)
    return min(last_slot // bk + 1, num_kb)


def _block_scores(q_blk, k_bksh, valid_bs, j, q_slots, bk, scale):
    """Masked f32 scores [B, K, G, bq, bk] of a query block against key block j."""
    k_blk = jax.lax.dynamic_slice_in_dim(k_bksh, j * bk, bk, axis=2)
    valid_blk = jax.lax.dynamic_slice_in_dim(valid_bs, j * bk, bk, axis=1)
    scores = jnp.einsum("bkgqh,bksh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    visible_qs = j * bk + jnp.arange(bk)[None, :] <= q_slots[:, None]
    visible = visible_qs[None, None, None] & valid_blk[:, None, None, None, :]
    return jnp.where(visible, scores, _MASK_VALUE)


def _forward(q_btnh, k_bksh, v_bksh, valid_bs, scale, q_offset, blocks):
    """(output [B, T, N, H] in q's dtype, (m, l) f32 [B, K, G, T + t_pad] of every query row)."""
    b, t, n, h, kv, g, s, bq, bk, t_pad, s_pad, num_qb, num_kb = _layout(q_btnh, k_bksh, blocks)
    q_bkgth = _to_heads(q_btnh, kv, t_pad)
    k_bksh = jnp.pad(k_bksh, ((0, 0), (0, 0), (0, s_pad), (0, 0)))
    v_bksh = jnp.pad(v_bksh, ((0, 0), (0, 0), (0, s_pad), (0, 0)))
    valid_bs = jnp.pad(valid_bs, ((0, 0), (0, s_pad)))  # padded key slots: never visible

    outputs, ms, ls = [], [], []
    for i in range(num_qb):
        q_blk = q_bkgth[:, :, :, i * bq : (i + 1) * bq]
        q_slots = q_offset + i * bq + jnp.arange(bq)

        def visit(j, carry, q_blk=q_blk, q_slots=q_slots):
            m_bkgq, l_bkgq, o_bkgqh = carry
            scores = _block_scores(q_blk, k_bksh, valid_bs, j, q_slots, bk, scale)
            v_blk = jax.lax.dynamic_slice_in_dim(v_bksh, j * bk, bk, axis=2)
            m_new = jnp.maximum(m_bkgq, jnp.max(scores, axis=-1))
            p = jnp.exp(scores - m_new[..., None])
            alpha = jnp.exp(m_bkgq - m_new)
            l_new = alpha * l_bkgq + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, l_new, alpha[..., None] * o_bkgqh + pv

        init = (
            jnp.full((b, kv, g, bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, kv, g, bq), jnp.float32),
            jnp.zeros((b, kv, g, bq, h), jnp.float32),
        )
        m_bkgq, l_bkgq, o_bkgqh = jax.lax.fori_loop(0, _key_blocks(q_offset, i, bq, bk, num_kb), visit, init)
        outputs.append(o_bkgqh / l_bkgq[..., None])
        ms.append(m_bkgq)
        ls.append(l_bkgq)
    out = _from_heads(jnp.concatenate(outputs, axis=3), t, q_btnh.dtype)
    return out, (jnp.concatenate(ms, axis=3), jnp.concatenate(ls, axis=3))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q_btnh, k_bksh, v_bksh, valid_bs, scale, q_offset, blocks):
    return _forward(q_btnh, k_bksh, v_bksh, valid_bs, scale, q_offset, blocks)[0]


def _attention_fwd(q_btnh, k_bksh, v_bksh, valid_bs, scale, q_offset, blocks):
    out, (m, l) = _forward(q_btnh, k_bksh, v_bksh, valid_bs, scale, q_offset, blocks)
    return out, (q_btnh, k_bksh, v_bksh, valid_bs, out, m, l)


def _attention_bwd(scale, q_offset, blocks, residuals, d_out):
    """FlashAttention-2's backward: each visited score block recomputed from q, k and the rows' (m, l)."""
    q_btnh, k_in, v_in, valid_bs, out, m_bkgt, l_bkgt = residuals
    b, t, n, h, kv, g, s, bq, bk, t_pad, s_pad, num_qb, num_kb = _layout(q_btnh, k_in, blocks)
    q_bkgth = _to_heads(q_btnh, kv, t_pad)
    do_bkgth = _to_heads(d_out.astype(q_btnh.dtype), kv, t_pad)   # padded query rows: zero cotangent
    # D = rowsum(do ∘ o): the softmax's Jacobian term, one f32 per query row.
    delta_bkgt = jnp.sum(_to_heads(d_out, kv, t_pad).astype(jnp.float32)
                         * _to_heads(out, kv, t_pad).astype(jnp.float32), axis=-1)
    k_bksh = jnp.pad(k_in, ((0, 0), (0, 0), (0, s_pad), (0, 0)))
    v_bksh = jnp.pad(v_in, ((0, 0), (0, 0), (0, s_pad), (0, 0)))
    valid_pad = jnp.pad(valid_bs, ((0, 0), (0, s_pad)))
    dk_bksh = jnp.zeros(k_bksh.shape, jnp.float32)
    dv_bksh = jnp.zeros(v_bksh.shape, jnp.float32)

    dqs = []
    for i in range(num_qb):
        rows = slice(i * bq, (i + 1) * bq)
        q_blk, do_blk = q_bkgth[:, :, :, rows], do_bkgth[:, :, :, rows]
        m_blk, l_blk, delta_blk = m_bkgt[..., rows, None], l_bkgt[..., rows, None], delta_bkgt[..., rows, None]
        q_slots = q_offset + i * bq + jnp.arange(bq)

        def visit(j, carry, q_blk=q_blk, do_blk=do_blk, m_blk=m_blk, l_blk=l_blk, delta_blk=delta_blk,
                  q_slots=q_slots):
            dq_bkgqh, dk_bksh, dv_bksh = carry
            scores = _block_scores(q_blk, k_bksh, valid_pad, j, q_slots, bk, scale)
            k_blk = jax.lax.dynamic_slice_in_dim(k_bksh, j * bk, bk, axis=2)
            v_blk = jax.lax.dynamic_slice_in_dim(v_bksh, j * bk, bk, axis=2)
            p = jnp.exp(scores - m_blk) / l_blk                      # the forward's softmax, exactly
            dv_blk = jnp.einsum("bkgqs,bkgqh->bksh", p.astype(do_blk.dtype), do_blk,
                                preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqh,bksh->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_blk)
            dq_bkgqh = dq_bkgqh + jnp.einsum("bkgqs,bksh->bkgqh", ds.astype(k_blk.dtype), k_blk,
                                             preferred_element_type=jnp.float32) * scale
            dk_blk = jnp.einsum("bkgqs,bkgqh->bksh", ds.astype(q_blk.dtype), q_blk,
                                preferred_element_type=jnp.float32) * scale

            def add(acc, delta):
                return jax.lax.dynamic_update_slice_in_dim(
                    acc, jax.lax.dynamic_slice_in_dim(acc, j * bk, bk, axis=2) + delta, j * bk, axis=2)

            return dq_bkgqh, add(dk_bksh, dk_blk), add(dv_bksh, dv_blk)

        init = (jnp.zeros((b, kv, g, bq, h), jnp.float32), dk_bksh, dv_bksh)
        dq_bkgqh, dk_bksh, dv_bksh = jax.lax.fori_loop(0, _key_blocks(q_offset, i, bq, bk, num_kb), visit, init)
        dqs.append(dq_bkgqh)
    dq_btnh = _from_heads(jnp.concatenate(dqs, axis=3), t, q_btnh.dtype)
    dk = dk_bksh[:, :, :s].astype(k_in.dtype)
    dv = dv_bksh[:, :, :s].astype(v_in.dtype)
    return dq_btnh, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)
