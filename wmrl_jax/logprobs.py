"""Training-side token log-probs and entropies, chunked over the sequence.

The GRPO update needs ``log pi(y_t | y_<t)`` for every completion token, and the
entropy of each next-token distribution, with gradients to the params. The
naive way unembeds the whole sequence: an f32 ``[B, T, V]`` array, which for
Qwen vocabularies (152k-248k) dwarfs every other activation (B=8, T=8192,
V=248k: 63 GiB). Here the backbone runs once (`family.forward`, no cache), then
the head runs chunk by chunk over T under `lax.scan`, each chunk under
`jax.checkpoint`: the forward keeps only ``[B, C, V]`` alive at a time and the
backward recomputes each chunk's logits instead of storing them, so peak memory
is ``O(B * C * V)`` in both directions. The backbone's own activations are
the other large term under `jax.grad`; ``remat=`` checkpoints its layers
(`family.remat_layer`).

Alignment: outputs line up with `tokens`. ``logp[b, t] = log p(tokens[b, t] |
tokens[b, :t])``, predicted from the hidden state at t - 1; it is 0 where
there is no prediction (t = 0, or the first real token of a left-padded row)
and where `valid` or `mask` is False. ``entropy[b, t]`` is the entropy of that
same predictive distribution (same zeros).
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp

from wmrl_jax.models.family import ModelFamily, Params
from wmrl_jax.models.layers import positions_from_valid
from wmrl_jax.sampling import select_rows


def logprob_and_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position log-prob of `targets` and entropy of softmax(`logits`).

    ``logp = z_y - logsumexp(z)``, ``H = logsumexp(z) - sum_v softmax(z)_v z_v``
    (= -sum p log p), in float32.

    Args:
      logits: float[..., V].
      targets: int[...] ids in [0, V).

    Returns:
      (logp float32[...], entropy float32[...]).
    """
    chex.assert_equal_shape_prefix((logits, targets), targets.ndim)
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    z_target = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return z_target - lse, entropy


def token_logprobs(
    params: Params,
    config: Any,
    family: ModelFamily,
    tokens: jax.Array,
    valid: jax.Array,
    mask: jax.Array | None = None,
    *,
    temperature: float = 1.0,
    chunk: int = 128,
    remat: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-probs of the given tokens and next-token entropies, without a [B, T, V] array.

    ``logp[b, t] = log softmax(unembed(h[b, t-1]) / temperature)[tokens[b, t]]``
    where ``h = family.forward(params, config, tokens, positions, valid)`` and
    ``positions = max(cumsum(valid) - 1, 0)`` (left padding). Differentiable
    w.r.t. `params`; `temperature` matches the sampler's logits scaling (no
    top-k/top-p: the GRPO ratio uses the full softmax at that temperature).

    Args:
      params, config, family: the model (`wmrl_jax.models.family` contract).
      tokens: int32[B, T] left-padded prompt + completion.
      valid: bool[B, T] real tokens.
      mask: optional bool[B, T]; positions to score (e.g. completion tokens
        only). Others get 0 and no gradient. None = every scorable position.
      temperature: static, > 0.
      chunk: static number of positions unembedded at once; T is padded up to
        a multiple of it internally.
      remat: static; None, or a `family.REMAT_POLICIES` name passed to
        `family.forward` (layer remat: under `jax.grad`, the backbone's
        backward keeps one [B, T, D] residual per layer instead of every
        layer's activations). Same values and gradients either way.

    Returns:
      (logp float32[B, T], entropy float32[B, T]), zeros where not scored.
    """
    chex.assert_rank([tokens, valid], 2)
    chex.assert_equal_shape([tokens, valid])
    if mask is not None:
        chex.assert_equal_shape([tokens, mask])
    if not temperature > 0.0:
        raise ValueError(f"temperature: got {temperature!r}, expected > 0")
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk: got {chunk!r}, expected an int >= 1")
    tokens = tokens.astype(jnp.int32)
    valid = valid.astype(bool)
    positions = positions_from_valid(valid)
    hidden, _ = family.forward(params, config, tokens, positions, valid, None, remat=remat)

    # Position t is predicted by the hidden state at t - 1.
    hidden_prev = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))
    scored = valid & jnp.pad(valid[:, :-1], ((0, 0), (1, 0)))
    if mask is not None:
        scored = scored & mask.astype(bool)
    logp, entropy = _chunked_head(params, config, family, hidden_prev, tokens, temperature, chunk)
    return jnp.where(scored, logp, 0.0), jnp.where(scored, entropy, 0.0)


def prefix_logprobs(
    params: Params,
    config: Any,
    family: ModelFamily,
    prompt_tokens: jax.Array,
    prompt_valid: jax.Array,
    tokens: jax.Array,
    valid: jax.Array,
    mask: jax.Array | None = None,
    *,
    group_size: int,
    temperature: float = 1.0,
    chunk: int = 128,
    remat: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`token_logprobs` of rows that share their prompt in groups: each prompt runs once, not once a row.

    Row b continues prompt ``g = b // group_size`` (a GRPO group: K rollouts of
    one prompt). The prompts run through `family.forward` into a cache of
    ``P + T`` slots (attention keys and values, the recurrent and conv states
    of linear-attention layers), the cache is copied to the rows of each
    group, and the continuations run from it:

        logp[b, t] = log softmax(unembed(h[b, t-1]) / temperature)[tokens[b, t]]

    where h is the hidden state of prompt g followed by ``tokens[b, :t]``
    (the prompt's last position predicts t = 0). The same values as
    `token_logprobs` of the concatenated rows, up to float rounding, for
    ``G * P + B * T`` tokens through the backbone instead of ``B * (P + T)``.
    Gradients flow into the prompts' forward through the cache (summed over
    the group's rows). Offsets are static (the cache's write index is a
    Python int), so the blocked attention's recomputing backward applies.

    Args:
      params, config, family: the model (`wmrl_jax.models.family` contract).
      prompt_tokens, prompt_valid: int32 / bool[G, P], LEFT-padded prompts
        (every prompt's last column is a real token).
      tokens, valid: int32 / bool[B, T], B = G * group_size, the continuations,
        RIGHT-padded (each row's real tokens first).
      mask: optional bool[B, T]: positions to score; others get 0, no gradient.
      group_size: static K, the rows per prompt.
      temperature, chunk, remat: as `token_logprobs`.

    Returns:
      (logp float32[B, T], entropy float32[B, T]), zeros where not scored.
    """
    chex.assert_rank([prompt_tokens, prompt_valid, tokens, valid], 2)
    chex.assert_equal_shape([prompt_tokens, prompt_valid])
    chex.assert_equal_shape([tokens, valid])
    if mask is not None:
        chex.assert_equal_shape([tokens, mask])
    groups, prompt_len = prompt_tokens.shape
    batch, length = tokens.shape
    if not (isinstance(group_size, int) and group_size >= 1) or batch != groups * group_size:
        raise ValueError(f"group_size: {group_size!r} with {groups} prompts and {batch} rows; expected an int "
                         f"K >= 1 with rows = prompts x K")
    if not temperature > 0.0:
        raise ValueError(f"temperature: got {temperature!r}, expected > 0")
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk: got {chunk!r}, expected an int >= 1")
    prompt_valid, valid = prompt_valid.astype(bool), valid.astype(bool)
    floating = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    dtype = max(floating, key=lambda x: x.size).dtype   # the matmul dtype (norms may stay f32)
    # A Python-int write index: static offsets, so attention under jax.grad takes the recomputing backward.
    cache = {**family.init_cache(config, groups, prompt_len + length, dtype), "index": 0}
    hidden, cache = family.forward(params, config, prompt_tokens.astype(jnp.int32),
                                   positions_from_valid(prompt_valid), prompt_valid, cache, remat=remat)
    rows = jnp.arange(batch) // group_size
    cache = select_rows(family.cache_axes(config), cache, rows)   # each row continues its group's prompt
    held = jnp.sum(prompt_valid, axis=1, dtype=jnp.int32)[rows]
    tokens = tokens.astype(jnp.int32)
    cont, _ = family.forward(params, config, tokens, positions_from_valid(valid) + held[:, None], valid, cache,
                             remat=remat)
    # Left padding puts each prompt's last real token in its last column: it predicts the continuation's first.
    hidden_prev = jnp.concatenate([hidden[rows, -1:], cont[:, :-1]], axis=1)
    scored = valid & jnp.pad(valid[:, :-1], ((0, 0), (1, 0)), constant_values=True)
    if mask is not None:
        scored = scored & mask.astype(bool)
    logp, entropy = _chunked_head(params, config, family, hidden_prev, tokens, temperature, chunk)
    return jnp.where(scored, logp, 0.0), jnp.where(scored, entropy, 0.0)


def _chunked_head(params, config, family, hidden_prev, targets, temperature: float, chunk: int):
    """(logp, entropy) float32[B, T] of `targets` under unembed(`hidden_prev`), C positions at a time.

    The head runs under `lax.scan` over chunks of the sequence, each under
    `jax.checkpoint`: only one [B, C, V] block of logits is alive at a time,
    in the forward and in the backward.
    """
    batch, length = targets.shape
    chunk = min(chunk, length)
    num_chunks = -(-length // chunk)
    pad = num_chunks * chunk - length
    hidden_prev = jnp.pad(hidden_prev, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [n, B, C, ...]: scan over chunks of the sequence axis.
    hidden_chunks = hidden_prev.reshape(batch, num_chunks, chunk, -1).swapaxes(0, 1)
    target_chunks = targets.reshape(batch, num_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(hidden_btd, targets_bt):
        logits = family.unembed(params, config, hidden_btd).astype(jnp.float32)
        if temperature != 1.0:
            logits = logits / temperature
        return logprob_and_entropy(logits, targets_bt)

    def body(carry, xs):
        return carry, one_chunk(*xs)

    _, (logp, entropy) = jax.lax.scan(body, None, (hidden_chunks, target_chunks))
    logp = logp.swapaxes(0, 1).reshape(batch, -1)[:, :length]
    entropy = entropy.swapaxes(0, 1).reshape(batch, -1)[:, :length]
    return logp, entropy
