"""The gated delta rule (Gated DeltaNet) and its causal depthwise conv, as pure functions.

Qwen3.5's linear-attention layers keep, per value head, a matrix state
``S ∈ R^{d_k × d_v}`` updated once per token t (Yang, Kautz & Hatamizadeh,
"Gated Delta Networks", arXiv:2412.06464)::

    S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ,   α_t = exp(g_t) ≤ 1
    o_t = S_tᵀ q_t

i.e. decay the memory, then overwrite what it currently predicts for key k_t
by v_t at learning rate β_t. Two numerically equivalent evaluations:

* ``recurrent_gated_delta_rule`` — the recurrence above, one ``lax.scan``
  step per token. Used for single-token decoding.
* ``chunk_gated_delta_rule`` — the WY / UT-transform form: within a chunk of
  C tokens the C rank-1 updates are condensed into one unit lower-triangular
  solve, and a loop runs over chunks only (T / C sequential steps of
  matmuls instead of T steps of outer products). Used for prefill/training.

Both follow transformers' ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` (models/qwen3_5) step for step: grouped
value heads (value head h reads key head ``h // (H_v / H_k)``), optional L2
normalisation of q and k (eps 1e-6 inside the rsqrt, like FLA), q scaled by
``d_k^{-1/2}``, everything in f32, sequences of any length (zero-padded to a
chunk multiple; padding has g = 0, k = 0 so it leaves the state untouched).

``causal_conv1d`` is the short depthwise convolution that precedes the delta
rule, with its rolling state of the last K−1 inputs. Tokens marked invalid
(padding) are skipped: each valid token convolves the K−1 previous *valid*
inputs and the returned state holds the last K−1 valid inputs, so padding
never leaks into the state wherever it sits in the sequence.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

# The state is a running sum over the whole sequence; TPU/GPU's default
# reduced-precision f32 matmuls would let error accumulate across chunks.
_PRECISION = jax.lax.Precision.HIGHEST


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(Σ x² + eps)`` over the last axis (FLA's / transformers' ``l2norm``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def unit_lower_triangular_inverse(a: jax.Array) -> jax.Array:
    """``(I + tril₋₁(a))⁻¹`` for ``a [..., C, C]`` (diagonal and upper triangle of ``a`` ignored).

    With P = −tril₋₁(a) strictly lower triangular, P^C = 0, so the inverse is
    the finite Neumann series Σ_{k<C} P^k, evaluated as the product::

        (I + P)(I + P²)(I + P⁴) ··· (I + P^{2^{m−1}}),   2^m ≥ C

    i.e. 2(m − 1) batched C×C matmuls. Same result as forward substitution
    (``torch.linalg.solve_triangular``) up to rounding, but XLA's CPU
    ``triangular_solve`` on many small batched systems is a slow loop, and a
    recursive block inversion costs a gather and concatenations per level;
    whole-matrix matmuls are what every backend is fastest at.
    """
    c = a.shape[-1]
    power = -jnp.tril(a.astype(jnp.float32), -1)  # P^{2^i}
    inverse = jnp.eye(c, dtype=jnp.float32) + power
    for _ in range(max(c - 1, 1).bit_length() - 1):
        power = jnp.einsum("...ij,...jk->...ik", power, power, precision=_PRECISION)
        inverse = inverse + jnp.einsum("...ij,...jk->...ik", inverse, power, precision=_PRECISION)
    return inverse


def _check_delta_rule_inputs(query, key, value, g, beta, initial_state):
    chex.assert_rank([query, key, value, g, beta], [4, 4, 4, 3, 3])
    chex.assert_equal_shape([query, key])
    b, t, h_k, d_k = key.shape
    _, _, h_v, d_v = value.shape
    if value.shape[:2] != (b, t):
        raise ValueError(f"value: shape {value.shape}, expected leading dims (B, T) = {(b, t)} like key {key.shape}")
    if h_v % h_k:
        raise ValueError(f"value heads ({h_v}) must be a multiple of key heads ({h_k})")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, h_v):
            raise ValueError(f"{name}: shape {x.shape}, expected (B, T, H_v) = {(b, t, h_v)}")
    if initial_state is not None and initial_state.shape != (b, h_v, d_k, d_v):
        raise ValueError(f"initial_state: shape {initial_state.shape}, expected (B, H_v, d_k, d_v) = {(b, h_v, d_k, d_v)}")


def _prepare(query, key, value, g, beta, normalize_qk):
    """Broadcast q/k to value heads, cast to f32, normalise and scale q; all to [B, H, T, ...]."""
    groups = value.shape[2] // key.shape[2]
    query = jnp.repeat(query, groups, axis=2).astype(jnp.float32)
    key = jnp.repeat(key, groups, axis=2).astype(jnp.float32)
    if normalize_qk:
        query, key = l2_normalize(query), l2_normalize(key)
    query = query * query.shape[-1] ** -0.5
    to_bh = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)
    return to_bh(query), to_bh(key), to_bh(value), to_bh(g), to_bh(beta)


@functools.partial(jax.jit, static_argnames=("normalize_qk",))
def recurrent_gated_delta_rule(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    normalize_qk: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token.

    Args:
      query, key: ``[B, T, H_k, d_k]``.
      value: ``[B, T, H_v, d_v]`` with ``H_v`` a multiple of ``H_k``.
      g: ``[B, T, H_v]`` log decay (≤ 0). beta: ``[B, T, H_v]`` in [0, 1].
      initial_state: ``f32[B, H_v, d_k, d_v]`` or None (zeros).
      normalize_qk: L2-normalise q and k first (Qwen3.5 does).

    Returns:
      ``(out [B, T, H_v, d_v] in query's dtype, final_state f32[B, H_v, d_k, d_v])``.
    """
    _check_delta_rule_inputs(query, key, value, g, beta, initial_state)
    out_dtype = query.dtype
    q, k, v, g, beta = _prepare(query, key, value, g, beta, normalize_qk)
    b, h, _, d_k = k.shape
    d_v = v.shape[-1]
    state = jnp.zeros((b, h, d_k, d_v), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(s_bhkv, xs):
        q_bhk, k_bhk, v_bhv, g_bh, beta_bh = xs
        s_bhkv = s_bhkv * jnp.exp(g_bh)[..., None, None]
        predicted_bhv = jnp.einsum("bhkv,bhk->bhv", s_bhkv, k_bhk, precision=_PRECISION)
        delta_bhv = (v_bhv - predicted_bhv) * beta_bh[..., None]
        s_bhkv = s_bhkv + k_bhk[..., :, None] * delta_bhv[..., None, :]
        return s_bhkv, jnp.einsum("bhkv,bhk->bhv", s_bhkv, q_bhk, precision=_PRECISION)

    time_major = lambda x: jnp.moveaxis(x, 2, 0)
    state, out_tbhv = jax.lax.scan(step, state, tuple(map(time_major, (q, k, v, g, beta))))
    return jnp.moveaxis(out_tbhv, 0, 1).astype(out_dtype), state


@functools.partial(jax.jit, static_argnames=("chunk_size", "normalize_qk"))
def chunk_gated_delta_rule(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    chunk_size: int = 16,
    normalize_qk: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks of ``chunk_size`` tokens (WY form).

    Within a chunk, with Γ_i = Σ_{j≤i} g_j (cumulative log decay) and the
    lower-triangular decay matrix D_ij = exp(Γ_i − Γ_j) (j ≤ i, else 0), the
    C sequential updates collapse to the unit lower-triangular system
    ``(I + tril₋₁(diag(β) K Kᵀ ⊙ D)) [U | W] = [diag(β) V | diag(β e^Γ) K]``
    (the UT transform). Then, with S the state entering the chunk::

        V' = U − W S                                 (what S has not predicted)
        O  = (Q ⊙ e^Γ) S + (Q Kᵀ ⊙ D) V'
        S ← e^{Γ_C} S + (K ⊙ e^{Γ_C − Γ})ᵀ V'

    Same arguments and returns as ``recurrent_gated_delta_rule``.

    Layout, measured on CPU (8 × 2048 tokens, 8 value heads of 64: 0.54 s
    with the per-chunk systems solved for all chunks at once up front and a
    scan over chunks, 0.14 s this way): one loop over chunks does all of a
    chunk's work while its ``[B, J, G, C, ·]`` tensors sit in cache (batched
    matmuls over every chunk at once ran at a third of the speed), slicing
    the chunk straight out of ``[B, N, C, ...]`` (no chunk-major transposes
    of the whole sequence), with matmuls that share an operand merged
    (``[KβKᵀ; QKᵀ]``, ``[W; Q e^Γ] S``, ``[QKᵀ ⊙ D; (K e^{Γ_C−Γ})ᵀ] V'``).
    Value heads are grouped as (key head J, G = H_v / H_k) so that q and k
    are never repeated per value head and Kᵀ K, Q Kᵀ are formed once per key
    head. The default C = 16 was the fastest of 8 / 16 / 32 / 64 there: the
    C² intra-chunk terms shrink with C while the state terms per token do not
    depend on it.
    """
    _check_delta_rule_inputs(query, key, value, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size: {chunk_size}, expected a positive int")
    out_dtype = query.dtype
    b, t, j, d_k = key.shape
    h_v, d_v = value.shape[2:]
    groups, c = h_v // j, chunk_size
    q = query.astype(jnp.float32)
    k = key.astype(jnp.float32)
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * d_k**-0.5
    pad = -t % c
    n = (t + pad) // c
    # Zero padding at the end: g = 0 (no decay) and k = β = 0 (no write) keep the final state exact.
    to_chunks = lambda x, *tail: jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(
        b, n, c, *tail
    )
    q_bncjk, k_bncjk = to_chunks(q, j, d_k), to_chunks(k, j, d_k)
    v_bncjgv = to_chunks(value, j, groups, d_v)
    g_bncjg, beta_bncjg = to_chunks(g, j, groups), to_chunks(beta, j, groups)
    causal_il = jnp.tril(jnp.ones((c, c), bool))
    strict_il = jnp.tril(jnp.ones((c, c), bool), -1)
    if initial_state is None:
        state = jnp.zeros((b, j, groups, d_k, d_v), jnp.float32)
    else:
        state = initial_state.astype(jnp.float32).reshape(b, j, groups, d_k, d_v)

    def chunk(i, carry):
        s_bjgkv, out_bncjgv = carry
        take = lambda x: jax.lax.dynamic_index_in_dim(x, i, 1, keepdims=False)
        q_bcjk, k_bcjk, v_bcjgv = take(q_bncjk), take(k_bncjk), take(v_bncjgv)
        beta_bcjg = take(beta_bncjg)
        cum_bcjg = jnp.cumsum(take(g_bncjg), axis=1)
        cum_bjgc = cum_bcjg.transpose(0, 2, 3, 1)
        # Masking before exp (not after) keeps exp from overflowing above the diagonal and keeps gradients finite.
        decay_bjgil = jnp.exp(jnp.where(causal_il, cum_bjgc[..., :, None] - cum_bjgc[..., None, :], -jnp.inf))
        # [K; Q] Kᵀ per key head: rows :c give the system, rows c: the intra-chunk scores.
        qk_bjxl = jnp.einsum("bxjk,bljk->bjxl", jnp.concatenate([k_bcjk, q_bcjk], 1), k_bcjk, precision=_PRECISION)
        system_bjgil = qk_bjxl[:, :, None, :c] * beta_bcjg.transpose(0, 2, 3, 1)[..., None] * decay_bjgil
        inverse_bjgil = unit_lower_triangular_inverse(jnp.where(strict_il, system_bjgil, 0.0))
        exp_cum_bcjg = jnp.exp(cum_bcjg)
        rhs_bcjgx = jnp.concatenate(
            [v_bcjgv * beta_bcjg[..., None], (beta_bcjg * exp_cum_bcjg)[..., None] * k_bcjk[:, :, :, None]], -1
        )
        uw_bjgix = jnp.einsum("bjgil,bljgx->bjgix", inverse_bjgil, rhs_bcjgx, precision=_PRECISION)
        q_decayed_bjgik = (exp_cum_bcjg[..., None] * q_bcjk[:, :, :, None]).transpose(0, 2, 3, 1, 4)
        # [W; Q e^Γ] S: what the state predicts for the chunk's keys, and its part of the output.
        ws_bjgxv = jnp.einsum(
            "bjgxk,bjgkv->bjgxv", jnp.concatenate([uw_bjgix[..., d_v:], q_decayed_bjgik], 3), s_bjgkv, precision=_PRECISION
        )
        v_new_bjgiv = uw_bjgix[..., :d_v] - ws_bjgxv[..., :c, :]
        k_decayed_bjgkl = jnp.exp(cum_bjgc[..., -1:] - cum_bjgc)[..., None, :] * k_bcjk.transpose(0, 2, 3, 1)[:, :, None]
        intra_bjgil = qk_bjxl[:, :, None, c:] * decay_bjgil
        # [QKᵀ ⊙ D; (K e^{Γ_C−Γ})ᵀ] V': rows :c the intra-chunk output, rows c: the state update.
        r_bjgxv = jnp.einsum(
            "bjgxl,bjglv->bjgxv", jnp.concatenate([intra_bjgil, k_decayed_bjgkl], 3), v_new_bjgiv, precision=_PRECISION
        )
        o_bcjgv = (ws_bjgxv[..., c:, :] + r_bjgxv[..., :c, :]).transpose(0, 3, 1, 2, 4)
        s_bjgkv = s_bjgkv * jnp.exp(cum_bjgc[..., -1])[..., None, None] + r_bjgxv[..., c:, :]
        return s_bjgkv, jax.lax.dynamic_update_index_in_dim(out_bncjgv, o_bcjgv, i, 1)

    out = jnp.zeros((b, n, c, j, groups, d_v), jnp.float32)
    state, out = jax.lax.fori_loop(0, n, chunk, (state, out))
    out_bthv = out.reshape(b, n * c, h_v, d_v)[:, :t]
    return out_bthv.astype(out_dtype), state.reshape(b, h_v, d_k, d_v)


@functools.partial(jax.jit, static_argnames=("activation",))
def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    conv_state: jax.Array | None = None,
    valid: jax.Array | None = None,
    *,
    activation: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv over time (no bias), then SiLU, skipping invalid tokens.

    ``y_t[c] = silu(Σ_{i<K} w[i, c] · x̃_{t−K+1+i}[c])`` where x̃ is the
    sequence of *valid* inputs preceded by the ``K − 1`` state entries
    (zeros for a fresh sequence) — a depthwise ``F.conv1d`` with ``K − 1``
    left zero padding when nothing is padded.

    Args:
      x: ``[B, T, C]``.
      weight: ``[K, C]`` (transformers' ``conv1d.weight[c, 0, i]`` is ``weight[i, c]``).
      conv_state: ``[B, K − 1, C]``, the last K−1 valid inputs, oldest first; None = zeros.
      valid: ``bool[B, T]`` or None (all valid). Invalid tokens are skipped:
        neither convolved by later tokens nor stored; their output is 0.
      activation: apply SiLU (Qwen3.5 does).

    Returns:
      ``(y [B, T, C] in x's dtype, new_state [B, K − 1, C] in x's dtype)``.
    """
    chex.assert_rank([x, weight], [3, 2])
    b, t, ch = x.shape
    kernel = weight.shape[0]
    if weight.shape[1] != ch:
        raise ValueError(f"conv weight: shape {weight.shape}, expected (K, C) with C = {ch} channels of x {x.shape}")
    if conv_state is None:
        conv_state = jnp.zeros((b, kernel - 1, ch), x.dtype)
    if conv_state.shape != (b, kernel - 1, ch):
        raise ValueError(f"conv_state: shape {conv_state.shape}, expected (B, K-1, C) = {(b, kernel - 1, ch)}")
    if valid is not None and valid.shape != (b, t):
        raise ValueError(f"valid: shape {valid.shape}, expected (B, T) = {(b, t)}")
    history = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    if valid is not None:
        # Move valid entries to the front (in order) so each token's window is contiguous: then one gather
        # maps outputs back. Padding anywhere (not only on the left) is then exactly skipped.
        valid_hist = jnp.concatenate([jnp.ones((b, kernel - 1), bool), valid.astype(bool)], axis=1)
        order = jnp.argsort(~valid_hist, axis=1, stable=True)
        history = jnp.take_along_axis(history, order[..., None], axis=1)
        n_valid = jnp.sum(valid_hist, axis=1)  # >= K-1
        # Compacted history slot of token t (or of the last valid token before it, for padding).
        slot_bt = jnp.cumsum(valid_hist, axis=1)[:, kernel - 1 :] - 1
    # K shifted multiply-adds: elementwise work XLA fuses into one pass (an einsum over a stacked
    # [K, B, T, C] window tensor lowers to a transposing dot and was 30x slower on CPU).
    history_f32, weight_f32 = history.astype(jnp.float32), weight.astype(jnp.float32)
    y = sum(history_f32[:, i : i + t] * weight_f32[i] for i in range(kernel))
    if valid is None:
        new_state = history[:, t:]
    else:
        # Output for compacted position p sits at index p - (K - 1) of `y`.
        y = jnp.take_along_axis(y, jnp.maximum(slot_bt - (kernel - 1), 0)[..., None], axis=1)
        y = jnp.where(valid[..., None], y, 0.0)
        state_slots = n_valid[:, None] - (kernel - 1) + jnp.arange(kernel - 1)[None, :]
        new_state = jnp.take_along_axis(history, state_slots[..., None], axis=1)
    if activation:
        y = jax.nn.silu(y)
    return y.astype(x.dtype), new_state.astype(x.dtype)
