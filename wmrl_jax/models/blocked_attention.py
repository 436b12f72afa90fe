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
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

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
      q_offset: slot of query row 0 (int, or a traced int32 scalar).
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
    g = n // kv
    bq, bk = min(block_q, t), min(block_k, s)
    t_pad, s_pad = -t % bq, -s % bk
    num_kb = (s + s_pad) // bk
    # [B, K, G, T, H]: the G query heads of one KV head share its key block in one dot.
    q_bkgth = jnp.pad(q_btnh, ((0, 0), (0, t_pad), (0, 0), (0, 0))).reshape(b, t + t_pad, kv, g, h)
    q_bkgth = q_bkgth.transpose(0, 2, 3, 1, 4)
    k_bksh = jnp.pad(k_bksh, ((0, 0), (0, 0), (0, s_pad), (0, 0)))
    v_bksh = jnp.pad(v_bksh, ((0, 0), (0, 0), (0, s_pad), (0, 0)))
    valid_bs = jnp.pad(valid_bs.astype(bool), ((0, 0), (0, s_pad)))  # padded key slots: never visible

    outputs = []
    for i in range((t + t_pad) // bq):
        q_blk = q_bkgth[:, :, :, i * bq : (i + 1) * bq]
        q_slots = q_offset + i * bq + jnp.arange(bq)
        last_slot = q_offset + (i + 1) * bq - 1
        # Key blocks [0, last_slot // bk] can hold a visible key; later ones are all in the future.
        stop = jnp.minimum(last_slot // bk + 1, num_kb) if isinstance(last_slot, jax.Array) else min(last_slot // bk + 1, num_kb)

        def visit(j, carry, q_blk=q_blk, q_slots=q_slots):
            m_bkgq, l_bkgq, o_bkgqh = carry
            k_blk = jax.lax.dynamic_slice_in_dim(k_bksh, j * bk, bk, axis=2)
            v_blk = jax.lax.dynamic_slice_in_dim(v_bksh, j * bk, bk, axis=2)
            valid_blk = jax.lax.dynamic_slice_in_dim(valid_bs, j * bk, bk, axis=1)
            scores = jnp.einsum("bkgqh,bksh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
            visible_qs = j * bk + jnp.arange(bk)[None, :] <= q_slots[:, None]
            visible = visible_qs[None, None, None] & valid_blk[:, None, None, None, :]
            scores = jnp.where(visible, scores, _MASK_VALUE)
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
        _, l_bkgq, o_bkgqh = jax.lax.fori_loop(0, stop, visit, init)
        outputs.append(o_bkgqh / l_bkgq[..., None])
    out_bkgth = jnp.concatenate(outputs, axis=3)[:, :, :, :t]
    return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_btnh.dtype)
