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
  solve, and ``lax.scan`` runs over chunks only (T / C sequential steps of
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

    Recursive block inversion, doubling the block size each step::

        [[A, 0], [X, D]]⁻¹ = [[A⁻¹, 0], [−D⁻¹ X A⁻¹, D⁻¹]]

    log₂C levels of batched matmuls. Same result as forward substitution
    (what ``torch.linalg.solve_triangular`` does) up to rounding, but XLA's
    CPU ``triangular_solve`` on many small batched systems is a slow loop,
    and matmuls are what every backend is fastest at. C is padded with
    identity rows up to a power of two.
    """
    c = a.shape[-1]
    size = 1 << max(c - 1, 0).bit_length()
    strict = jnp.tril(a.astype(jnp.float32), -1)
    strict = jnp.pad(strict, [(0, 0)] * (a.ndim - 2) + [(0, size - c), (0, size - c)])
    lead = strict.shape[:-2]
    inv = jnp.ones(lead + (size, 1, 1), jnp.float32)  # inverses of the 1 x 1 diagonal blocks
    block = 1
    while block < size:
        pairs = size // (2 * block)
        grid = strict.reshape(lead + (pairs, 2 * block, pairs, 2 * block))
        diag = jnp.moveaxis(jnp.diagonal(grid, axis1=-4, axis2=-2), -1, -3)  # [..., pairs, 2b, 2b]
        lower_left = diag[..., block:, :block]
        a_inv, d_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        off = -jnp.einsum(
            "...ij,...jk,...kl->...il", d_inv, lower_left, a_inv, precision=_PRECISION
        )
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        bottom = jnp.concatenate([off, d_inv], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)
        block *= 2
    return inv[..., 0, :c, :c]


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
    chunk_size: int = 64,
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

    Same arguments and returns as ``recurrent_gated_delta_rule``; the
    triangular systems of all chunks are solved at once (as batched matmuls,
    see ``unit_lower_triangular_inverse``), and only the last three lines run
    in a ``lax.scan`` over chunks.
    """
    _check_delta_rule_inputs(query, key, value, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size: {chunk_size}, expected a positive int")
    out_dtype = query.dtype
    q, k, v, g, beta = _prepare(query, key, value, g, beta, normalize_qk)
    b, h, t, d_k = k.shape
    d_v = v.shape[-1]
    c = chunk_size
    pad = -t % c
    n = (t + pad) // c
    # Zero padding at the end: g = 0 (no decay) and k = β = 0 (no write) keep the final state exact.
    pad_to_chunks = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3)).reshape(
        b, h, n, c, *x.shape[3:]
    )
    q, k, v, g, beta = map(pad_to_chunks, (q, k, v, g, beta))  # [B, H, N, C, ...]

    cum_bhnc = jnp.cumsum(g, axis=-1)
    causal_cc = jnp.tril(jnp.ones((c, c), bool))
    # Masking before exp (not after) keeps exp from overflowing above the diagonal and keeps gradients finite.
    decay_bhncc = jnp.exp(jnp.where(causal_cc, cum_bhnc[..., :, None] - cum_bhnc[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    system_bhncc = jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k, precision=_PRECISION) * decay_bhncc
    inverse_bhncc = unit_lower_triangular_inverse(system_bhncc)
    u_bhncv = jnp.einsum("bhnij,bhnjv->bhniv", inverse_bhncc, v_beta, precision=_PRECISION)
    w_bhnck = jnp.einsum("bhnij,bhnjk->bhnik", inverse_bhncc, k_beta * jnp.exp(cum_bhnc)[..., None], precision=_PRECISION)
    intra_bhncc = jnp.einsum("bhnik,bhnjk->bhnij", q, k, precision=_PRECISION) * decay_bhncc
    q_decayed = q * jnp.exp(cum_bhnc)[..., None]
    k_decayed = k * jnp.exp(cum_bhnc[..., -1:] - cum_bhnc)[..., None]
    chunk_decay_bhn = jnp.exp(cum_bhnc[..., -1])

    state = jnp.zeros((b, h, d_k, d_v), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(s_bhkv, xs):
        u, w, intra, q_dec, k_dec, decay_bh = xs
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, s_bhkv, precision=_PRECISION)
        out = jnp.einsum("bhck,bhkv->bhcv", q_dec, s_bhkv, precision=_PRECISION) + jnp.einsum(
            "bhij,bhjv->bhiv", intra, v_new, precision=_PRECISION
        )
        s_bhkv = s_bhkv * decay_bh[..., None, None] + jnp.einsum(
            "bhck,bhcv->bhkv", k_dec, v_new, precision=_PRECISION
        )
        return s_bhkv, out

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)
    xs = tuple(map(chunk_major, (u_bhncv, w_bhnck, intra_bhncc, q_decayed, k_decayed, chunk_decay_bhn)))
    state, out_nbhcv = jax.lax.scan(step, state, xs)
    out_bhtv = jnp.moveaxis(out_nbhcv, 0, 2).reshape(b, h, n * c, d_v)[:, :, :t]
    return jnp.swapaxes(out_bhtv, 1, 2).astype(out_dtype), state


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
