"""Autoregressive sampling for any model family: one jitted prefill + `lax.while_loop` decode.

Two levels:

* `sample(params, config, family, tokens, valid, rng, ...)` is a pure, jittable
  function of arrays (config, family and the sampling knobs are static);
  `generate` jits it and `train.plan` lowers it to plan a run's memory. It
  returns padded arrays.
* `generate(model, prompts, ...)` is the host-side convenience: it left-pads
  python lists, buckets the shapes (so a new prompt length rarely means a new
  compile), calls a cached jit of `sample`, and trims the result to python
  lists.

Why one program for prefill and decode: the KV cache is created, filled and
updated inside a single XLA computation, so it never crosses a jit boundary and
the while-loop carry updates it in place (XLA aliases loop-carried buffers);
there is nothing to donate and nothing is copied per step. Decoding stops as
soon as every row has emitted an EOS id (or after `max_new_tokens`).

Across calls: `generate(..., return_cache=True)` hands the cache back as a
`SamplerCache`, and `generate(..., cache=...)` continues it: the prompts
extend the held conversations and only their new ids are prefilled (an
agent's next turn: observation and assistant header). `generate(...,
num_samples=K)` prefills each prompt once for its K samples. Both give the
tokens and log-probs of the plain path (docs/design.md, "Multi-turn cache
reuse").

Sampling distribution, in the order transformers applies its warpers:
``logits / temperature`` -> keep the ``top_k`` largest -> keep the smallest set
of most likely tokens whose probability mass reaches ``top_p``. The returned
log-prob of a sampled token is under exactly that filtered, renormalised
distribution: ``logp = z_tok - logsumexp(z_kept)``. Temperature 0 is greedy
(argmax); its distribution is a point mass, so the log-probs returned are the
model's own (``log_softmax(logits)``, i.e. temperature 1, no filter), which is
what a teacher-forced pass gives and what the GRPO ratio needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from wmrl_jax.models.family import ModelFamily, Params
from wmrl_jax.models.layers import positions_from_valid
from wmrl_jax.models import sharding


class SampleOutput(NamedTuple):
    """Padded result of `sample`.

    tokens: int32[B, N] new tokens; `pad_id` after a row's end.
    logprobs: float32[B, N] log-prob of each token under the sampling
      distribution used (see module docstring); 0 after a row's end.
    lengths: int32[B] number of new tokens per row, the EOS token included.
    finished: bool[B] whether the row stopped on an EOS id (else it ran out of
      `max_new_tokens`, or was an inactive padding row).
    cache: with `sample(return_cache=True)`, the cache at the end of the
      decode, in the family's stored layout, holding for each row exactly its
      real tokens except the last sampled one: its prompt (the held tokens of
      a continued cache included) and ``tokens[:lengths - 1]`` (see
      docs/design.md, "Multi-turn cache reuse"); else None.
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    finished: jax.Array
    cache: Any = None


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """Result of `generate`, one entry per prompt (K per prompt with `num_samples`), in prompt order.

    tokens: new token ids per prompt, stopped at (and including) the EOS id.
    logprobs: float32 log-prob per new token (same length as `tokens[i]`).
    lengths: int64[num_prompts] = len(tokens[i]).
    finished: bool[num_prompts], True where the row ended on an EOS id.
    cache: with `generate(return_cache=True)`, the `SamplerCache` a later call
      continues from; else None.
    prefill_tokens: real prompt tokens this call prefilled (with a cache: the
      new ones only); prefill_slots: token positions the prefill computed
      (padded batch x padded width).
    """

    tokens: list[list[int]]
    logprobs: list[np.ndarray]
    lengths: np.ndarray
    finished: np.ndarray
    cache: Any = None
    prefill_tokens: int = 0
    prefill_slots: int = 0


def check_sampling_args(*, max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    """Raises ValueError naming the argument when a sampling knob is out of range."""
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: got {max_new_tokens!r}, expected an int >= 1")
    if not temperature >= 0.0:
        raise ValueError(f"temperature: got {temperature!r}, expected >= 0 (0 = greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: got {top_p!r}, expected 0 < top_p <= 1 (1 = no nucleus filter)")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k: got {top_k!r}, expected an int >= 0 (0 = no top-k filter)")


def choose_tokens(
    logits: jax.Array,
    rng: jax.Array,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row from the filtered distribution; returns (ids int32[B], logp f32[B]).

    ``z = logits / temperature``; top-k keeps the k largest z (``lax.top_k``,
    no full sort); top-p then keeps sorted z_i while the mass strictly before
    i, ``sum_{j<i} softmax(z)_j``, is < top_p (the smallest prefix reaching
    top_p, at least one token). Sampling is Gumbel-max over the kept set:
    ``argmax(z + Gumbel)`` ~ softmax(z) restricted to kept tokens, and
    ``logp = z_tok - logsumexp(z_kept)``.

    Args:
      logits: float[B, V] next-token logits.
      rng: PRNG key for this step.
      temperature: static; 0 means greedy (argmax, logp = log_softmax(logits)).
      top_k: static; 0 (or >= V) keeps the whole vocabulary.
      top_p: static; 1.0 disables the nucleus filter.
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        ids = jnp.argmax(logits, axis=-1)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), ids[:, None], axis=-1)[:, 0]
        return ids.astype(jnp.int32), logp
    z = logits / temperature
    vocab = z.shape[-1]
    ids_kept = None  # None: candidate j is token j (whole vocabulary, unsorted).
    if 0 < top_k < vocab:
        z, ids_kept = jax.lax.top_k(z, top_k)  # sorted, largest first
    elif top_p < 1.0:
        # The nucleus needs the candidates in descending order: one full sort.
        iota = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), z.shape)
        neg_z, ids_kept = jax.lax.sort((-z, iota), dimension=-1, num_keys=1)
        z = -neg_z
    if top_p < 1.0:
        probs = jax.nn.softmax(z, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        z = jnp.where(mass_before < top_p, z, -jnp.inf)
    gumbel = jax.random.gumbel(rng, z.shape, jnp.float32)
    pick = jnp.argmax(z + gumbel, axis=-1)
    z_pick = jnp.take_along_axis(z, pick[:, None], axis=-1)[:, 0]
    logp = z_pick - jax.nn.logsumexp(z, axis=-1)
    ids = pick if ids_kept is None else jnp.take_along_axis(ids_kept, pick[:, None], axis=-1)[:, 0]
    return ids.astype(jnp.int32), logp


# Prompts longer than this are prefilled in chunks of it (`sample(prefill_chunk=)`): a power of two, so that
# it divides `generate`'s bucketed widths above it.
PREFILL_CHUNK = 4096


def _default_cache_dtype(params: Params) -> Any:
    """The dtype of the largest floating leaf: the matmul dtype (norms may stay f32)."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return max(leaves, key=lambda x: x.size).dtype


def sample(
    params: Params,
    config: Any,
    family: ModelFamily,
    tokens: jax.Array,
    valid: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_ids: Sequence[int] | jax.Array = (),
    pad_id: int = 0,
    active: jax.Array | None = None,
    cache_dtype: Any = None,
    mesh: Any = None,
    decode_layout: bool | None = None,
    prefill_chunk: int | None = PREFILL_CHUNK,
    cache: Any = None,
    held_width: int | None = None,
    rows: jax.Array | None = None,
    return_cache: bool = False,
) -> SampleOutput:
    """Samples up to `max_new_tokens` continuations of a left-padded batch of prompts.

    Jittable with everything after `rng` static (`active`, `cache`, `rows` and
    arrays aside). Prefill runs the whole prompt through `family.forward` with
    a fresh cache of ``P + max_new_tokens`` slots and unembeds only the last
    column (left padding puts every row's last prompt token there). The decode
    loop then feeds one token per row per step. Step n uses
    ``fold_in(rng, n)``, so the result depends only on the inputs and `rng`.

    A token fed to the decode loop counts as real (a valid cache slot, a
    step of the recurrent state) only while its row is still running: once a
    row has sampled an EOS id its later feeds are padding, so the cache never
    holds anything after a row's end (docs/design.md, "Multi-turn cache
    reuse").

    Args:
      params, config, family: the model (see `wmrl_jax.models.family`).
      tokens: int32[B, P] left-padded prompts (with `cache`: only the tokens
        that follow each row's held ones).
      valid: bool[B, P] real prompt tokens; every active row needs >= 1.
      rng: PRNG key.
      max_new_tokens: N, static.
      temperature, top_p, top_k: see `choose_tokens` (static).
      eos_ids: ids that end a row (the EOS token is kept): a tuple or an
        int32[E] array (traced, so changing the ids does not recompile).
      pad_id: id written after a row's end.
      active: bool[B_out] rows to decode (False = batch padding, done at once);
        None = all rows.
      cache_dtype: KV-cache dtype; None = the params' matmul dtype.
      mesh: optional `jax.sharding.Mesh` (static): pins the cache to the
        family's `cache_axes` through the sharding rules (batch over
        data x fsdp, KV heads over tensor); inputs keep their own shardings.
      decode_layout: decode in the family's `decode_layout` (static): the
        one place the CPU-specific decode path is chosen. The prefill runs in
        the stored layout; then params and cache are converted once and the
        decode loop reads the converted ones (per-layer weights and buffers,
        projections fused and stored output dims first, which few rows
        multiply as row reductions). None = only on a CPU backend: XLA:CPU
        copies every stacked-weight slice per token under the layer scan
        (the Qwen3 bench model: 96 -> ~70 ms a step with it), while GPU/TPU
        XLA reads the slices in place and the layout would hold a second copy
        of the weights during sampling.
      prefill_chunk: a prompt longer than this many tokens (static) is
        prefilled in chunks of it, one `family.forward` into the cache per
        chunk under a `lax.scan` (the cache's write index moves on), so the
        prefill's activations are those of one chunk, not of the whole
        prompt (at the paper's caps, a 32,768-token last turn). P must then
        be a multiple of it (`generate`'s power-of-two widths are). None:
        the whole prompt at once. Same result up to float rounding.
      cache: the `SampleOutput.cache` of an earlier call with these params
        (stored layout, B rows): each row continues from the tokens it holds
        instead of a fresh cache. Its held slots are first packed to the
        right of `held_width` slots (`compact_cache`: gaps of padding and of
        finished rows dropped), `tokens` are written after them at RoPE
        positions that go on from each row's held count, then the decode
        runs as usual. The same tokens and log-probs as one prefill of the
        held tokens followed by `tokens`, up to float rounding.
      held_width: static; the slots the held tokens are packed into, at least
        the most any row holds (not checked inside jit: `generate` checks
        it). None = the cache's own slot count.
      rows: int32[B_out] (optional): decode row r continues prefill row
        ``rows[r]`` (its cache, state and first-token logits are copied
        after the prefill). Prefix sharing: K samples of one prompt prefill
        it once. None = B_out = B, row r from row r.
      return_cache: static; also return the final cache (`SampleOutput.cache`,
        stored layout) for a later continuation.

    Returns:
      SampleOutput with [B_out, N] tokens / logprobs and [B_out] lengths /
      finished (and the cache with `return_cache`).
    """
    batch, prompt_len = tokens.shape
    if valid.shape != tokens.shape:
        raise ValueError(f"valid: shape {valid.shape}, expected the shape of tokens {tokens.shape}")
    check_sampling_args(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    eos = jnp.asarray(eos_ids if isinstance(eos_ids, (jax.Array, np.ndarray)) else tuple(eos_ids), jnp.int32).reshape(-1)
    out_rows = batch if rows is None else rows.shape[0]
    active = jnp.ones((out_rows,), bool) if active is None else active.astype(bool)
    if active.shape != (out_rows,):
        raise ValueError(f"active: shape {active.shape}, expected ({out_rows},): one flag per decoded row")
    choose = functools.partial(choose_tokens, temperature=temperature, top_k=top_k, top_p=top_p)

    def is_eos(ids):
        return jnp.any(ids[:, None] == eos[None, :], axis=-1) if eos.size else jnp.zeros(ids.shape, bool)

    dtype = _default_cache_dtype(params) if cache_dtype is None else cache_dtype
    chunked = prefill_chunk is not None and prompt_len > prefill_chunk
    if chunked and prompt_len % prefill_chunk:
        raise ValueError(f"prefill_chunk: {prefill_chunk} does not divide the prompt width {prompt_len}; expected "
                         f"a divisor (e.g. a power of two: generate buckets widths to powers of two) or None")
    axes = family.cache_axes(config)
    valid = valid.astype(bool)
    positions = positions_from_valid(valid)
    if cache is None:
        # Prefill into a cache of the prompt's length (its attention reads P slots, not P + N), then grow the
        # cache for the decode loop. (Prefilling in chunks straight into P + N slots, to skip the grown copy,
        # measured worse: 4B agent sampler at the paper's caps, fsdp 8, 46.6 GiB a device against 44.0.)
        cache = family.init_cache(config, batch, prompt_len, dtype)
        held_width = 0
    else:
        check_cache(family, config, cache, batch, dtype)
        held_width = cache["valid"].shape[1] if held_width is None else held_width
        held = jnp.sum(cache["valid"], axis=1, dtype=jnp.int32)
        # The new tokens' positions go on from each row's held count (a left-padded row's padding keeps the
        # position of its first real token: it is never attended to).
        positions = positions + held[:, None]
        cache = compact_cache(axes, cache, held_width, held_width + prompt_len)
    if mesh is not None:
        cache = jax.lax.with_sharding_constraint(cache, _cache_sharding(family, config, mesh, cache))
    tokens = tokens.astype(jnp.int32)
    if not chunked:
        hidden, cache = family.forward(params, config, tokens, positions, valid, cache)
    else:
        chunks = prompt_len // prefill_chunk

        def by_chunk(x):   # [B, P] -> [P / chunk, B, chunk]
            return x.reshape(batch, chunks, prefill_chunk).swapaxes(0, 1)

        def prefill(cache, xs):
            hidden, cache = family.forward(params, config, *xs, cache)
            return cache, hidden[:, -1:]

        cache, last = jax.lax.scan(prefill, cache, (by_chunk(tokens), by_chunk(positions), by_chunk(valid)))
        hidden = last[-1]
    # Left padding: the last column holds every row's last real token.
    next_pos = positions[:, -1] + 1
    hidden = hidden[:, -1:]
    if rows is not None:  # prefix sharing: decode row r continues prefill row rows[r]
        rows = rows.astype(jnp.int32)
        cache = select_rows(axes, cache, rows)
        hidden, next_pos = hidden[rows], next_pos[rows]
        if mesh is not None:
            cache = jax.lax.with_sharding_constraint(cache, _cache_sharding(family, config, mesh, cache))
    batch = out_rows
    cache = grow_cache(axes, cache, held_width + prompt_len + max_new_tokens)
    stored_cache = cache   # the stored layout's structure, to return the cache in it
    logits = family.unembed(params, config, hidden)[:, 0]
    if decode_layout is None:
        decode_layout = jax.default_backend() == "cpu"
    if decode_layout:
        params, cache = family.decode_layout(config, params, cache, fuse_matmuls=mesh is None)
    first, first_logp = choose(logits, jax.random.fold_in(rng, 0))
    first = jnp.where(active, first, pad_id)

    out_tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    out_logp = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(jnp.where(active, first_logp, 0.0))
    lengths = active.astype(jnp.int32)
    finished = active & is_eos(first)
    done = ~active | finished
    carry = (jnp.int32(1), cache, first, next_pos, done, finished, out_tokens, out_logp, lengths)

    def keep_going(carry):
        step, done = carry[0], carry[4]
        return (step < max_new_tokens) & ~jnp.all(done)

    def decode_one(carry):
        step, cache, prev, pos, done, finished, out_tokens, out_logp, lengths = carry
        # Finished rows keep feeding (their outputs are discarded: a fixed batch shape), as padding: their
        # cache slots stay invalid and their recurrent state does not move, so the cache holds each row's
        # real tokens only. Their earlier slots stay valid, so no row is left without a key to attend to.
        hidden, cache = family.forward(params, config, prev[:, None], pos[:, None], ~done[:, None], cache)
        logits = family.unembed(params, config, hidden)[:, 0]
        ids, logp = choose(logits, jax.random.fold_in(rng, step))
        ids = jnp.where(done, pad_id, ids)
        logp = jnp.where(done, 0.0, logp)
        out_tokens = jax.lax.dynamic_update_slice(out_tokens, ids[:, None], (0, step))
        out_logp = jax.lax.dynamic_update_slice(out_logp, logp[:, None], (0, step))
        lengths = lengths + (~done).astype(jnp.int32)
        finished = finished | (~done & is_eos(ids))
        done = done | finished
        return (step + 1, cache, ids, pos + 1, done, finished, out_tokens, out_logp, lengths)

    if max_new_tokens > 1:
        carry = jax.lax.while_loop(keep_going, decode_one, carry)
    _, cache, _, _, _, finished, out_tokens, out_logp, lengths = carry
    if not return_cache:
        cache = None
    elif decode_layout:
        cache = _to_stored_layout(stored_cache, cache)
    return SampleOutput(tokens=out_tokens, logprobs=out_logp, lengths=lengths, finished=finished, cache=cache)


_SAMPLE_STATIC = (
    "config",
    "family",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "pad_id",
    "cache_dtype",
    "mesh",
    "decode_layout",
    "prefill_chunk",
    "held_width",
    "return_cache",
)

# Compiled once per (shapes, static knobs); `generate` buckets shapes to keep that set small.
_sample_jit = jax.jit(sample, static_argnames=_SAMPLE_STATIC)


def bucket_size(n: int, minimum: int, multiple: int = 1) -> int:
    """Smallest power of two >= max(n, minimum), rounded up to `multiple`."""
    size = max(minimum, 1 << max(0, int(n) - 1).bit_length())
    return -(-size // multiple) * multiple


def _to_host(x: Any) -> np.ndarray:
    """numpy of one result array; in a multi-process run, rows held by other processes' devices are gathered."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _batch_axes(mesh) -> tuple[str, ...]:
    """Mesh axes the batch is split over (data parallel + fsdp), those the mesh has."""
    return tuple(name for name in ("data", "fsdp") if name in mesh.axis_names)


@dataclasses.dataclass(eq=False)
class SamplerCache:
    """The state of a batch of conversations at the end of a `generate` call, to continue from.

    Made by `generate(..., return_cache=True)` (`GenerateResult.cache`) and
    passed back as `generate(..., cache=...)`, whose prompts then extend
    `tokens` row for row: only what follows is prefilled.

    arrays: the sampler's cache (stored layout, the call's padded batch of
      rows) holding, for row i, exactly the tokens `tokens[i]`: the row's
      prompt and its new tokens except the last one, which was sampled but
      never fed (docs/design.md, "Multi-turn cache reuse").
    tokens: per row, the token ids the cache holds, in order.
    model: the `Model` whose params made it; the cache is only valid for them.
    """

    arrays: Any
    tokens: tuple[tuple[int, ...], ...]
    model: Any

    def __repr__(self) -> str:
        held = [len(t) for t in self.tokens]
        return (f"SamplerCache({len(held)} rows, {min(held)}..{max(held)} tokens held, "
                f"{self.arrays['valid'].shape[1]} slots)")


def _check_continuation(cache: Any, model: Any, prompts: list[list[int]], batch: int) -> list[list[int]]:
    """Checks that `cache` belongs to `model` and that `prompts` extend its rows; returns each row's new ids."""
    if not isinstance(cache, SamplerCache):
        raise ValueError(f"cache: got {type(cache).__name__}, expected the SamplerCache of an earlier "
                         f"generate(..., return_cache=True) (its result's .cache)")
    made = cache.model
    if made.family is not model.family or made.config != model.config:
        raise ValueError(f"cache: made by a {made.family.__name__} model with {made.config}; this model is a "
                         f"{model.family.__name__} with {model.config}. A cache continues only the model that made it")
    if made.params is not model.params and any(
            a is not b for a, b in zip(jax.tree.leaves(made.params), jax.tree.leaves(model.params))):
        raise ValueError("cache: made with other params than this model's; it holds those params' keys, values and "
                         "recurrent state, so it continues only the same params (re-prefill after an update)")
    if len(prompts) != len(cache.tokens):
        raise ValueError(f"prompts: {len(prompts)} rows, but the cache holds {len(cache.tokens)}; expected one prompt "
                         f"per cached row, in the same order")
    if cache.arrays["valid"].shape[0] != batch:
        raise ValueError(f"cache: {cache.arrays['valid'].shape[0]} rows of padded batch, expected {batch} (this "
                         f"call's batch for {len(prompts)} prompts under this mesh)")
    suffixes = []
    for row, (prompt, held) in enumerate(zip(prompts, cache.tokens)):
        if len(prompt) <= len(held) or tuple(prompt[: len(held)]) != held:
            bad = next((i for i, (a, b) in enumerate(zip(prompt, held)) if a != b), min(len(prompt), len(held)))
            raise ValueError(
                f"prompts[{row}]: expected the {len(held)} token ids the cache holds for this row followed by at "
                f"least one new id (a continuation appends to the conversation); "
                + (f"it has only {len(prompt)} ids" if bad == len(prompt) else f"they differ at position {bad}"))
        suffixes.append(prompt[len(held):])
    return suffixes


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_ids: Sequence[int] = (),
    seed: int = 0,
    pad_id: int = 0,
    mesh: Any = None,
    num_samples: int = 1,
    cache: SamplerCache | None = None,
    return_cache: bool = False,
) -> GenerateResult:
    """Samples a continuation for each prompt (python lists of ids) with `sample`.

    Prompts of unequal length are left-padded into one batch. The padded
    length is bucketed to a power of two (>= 16) and the batch to a power of
    two (a multiple of the mesh's data x fsdp size under a mesh); padding rows
    are inactive. Same shapes and knobs reuse the compiled program.

    Args:
      model: has `.params`, `.config` and `.family` (as `wmrl_jax.models.load_hf`
        returns); under a mesh the params keep the sharding they already have.
      prompts: non-empty list of non-empty lists of token ids in [0, vocab).
      max_new_tokens, temperature, top_p, top_k, eos_ids: see `sample`.
      seed: PRNG seed; same seed and inputs -> same output.
      pad_id: id used for padding (never attended to).
      mesh: optional `jax.sharding.Mesh`; the batch is split over its `data`
        and `fsdp` axes. Defaults to `model.mesh` when the model has one.
      num_samples: K continuations of each prompt, result rows prompt-major
        (row i·K + k), as from `prompts` with each repeated K times and the
        same seed; each prompt is prefilled once and its cache copied to its
        K rows (prefix sharing).
      cache: the `.cache` of an earlier call's result with the same model:
        `prompts[i]` must then start with the ids that cache holds for row i
        (`SamplerCache.tokens`); only the ids after them are prefilled
        (docs/design.md, "Multi-turn cache reuse"). The same tokens and
        log-probs as a call without it, up to float rounding.
      return_cache: also return the cache at the end (`GenerateResult.cache`),
        for a call that continues these conversations.

    Returns:
      GenerateResult (python lists, trimmed at EOS).
    """
    check_sampling_args(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    family = getattr(model, "family", None)
    if family is None:
        raise ValueError(f"model: {type(model).__name__} has no `.family`; expected a wmrl_jax.models.Model")
    if not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise ValueError(f"num_samples: got {num_samples!r}, expected an int >= 1")
    config = model.config
    vocab = getattr(config, "vocab_size", None)
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("prompts: got an empty list, expected at least one prompt")
    for row, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompts[{row}]: empty, expected at least one token id")
        bad = [t for t in prompt if not 0 <= int(t) < (vocab if vocab is not None else np.iinfo(np.int32).max)]
        if bad:
            raise ValueError(f"prompts[{row}]: token ids {bad[:5]} outside [0, {vocab})")
    eos_ids = tuple(int(e) for e in eos_ids)
    mesh = mesh if mesh is not None else getattr(model, "mesh", None)

    shards = 1
    if mesh is not None:
        shards = int(np.prod([mesh.shape[name] for name in _batch_axes(mesh)]))
    num = len(prompts)
    batch = bucket_size(num, 1, shards)
    new = prompts if cache is None else _check_continuation(cache, model, prompts, batch)
    width = bucket_size(max(len(p) for p in new), 16)
    tokens = np.full((batch, width), pad_id, np.int32)
    valid = np.zeros((batch, width), bool)
    for row, ids in enumerate(new):
        tokens[row, width - len(ids) :] = ids
        valid[row, width - len(ids) :] = True
    valid[num:, -1] = True  # padding rows: one dummy token so attention is never empty
    held_width = None
    if cache is not None:
        held_width = bucket_size(max(len(t) for t in cache.tokens), 16)
    out_num = num * num_samples
    out_batch = bucket_size(out_num, 1, shards)
    active = np.arange(out_batch) < out_num
    rows = None
    if num_samples > 1:  # decode row i·K + k continues prefill row i; padding rows read row 0
        rows = np.where(active, np.arange(out_batch) // num_samples, 0).astype(np.int32)

    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        split = NamedSharding(mesh, PartitionSpec(_batch_axes(mesh)))
        tokens, valid, active = (jax.device_put(x, split) for x in (tokens, valid, active))
        rows = None if rows is None else jax.device_put(rows, split)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        out = _sample_jit(
            model.params,
            config,
            family,
            tokens,
            valid,
            jax.random.key(seed),
            active=active,
            max_new_tokens=int(max_new_tokens),
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            eos_ids=np.asarray(eos_ids, np.int32).reshape(-1),
            pad_id=int(pad_id),
            mesh=mesh,
            cache=None if cache is None else cache.arrays,
            held_width=held_width,
            rows=rows,
            return_cache=bool(return_cache),
        )
    arrays, out = out.cache, out._replace(cache=None)
    out = jax.tree.map(_to_host, out)
    lengths = np.asarray(out.lengths[:out_num], np.int64)
    result_tokens = [out.tokens[row, : lengths[row]].tolist() for row in range(out_num)]
    next_cache = None
    if return_cache:
        held = [list(prompts[row // num_samples]) + result_tokens[row][:-1] for row in range(out_num)]
        counts = _to_host(jnp.sum(arrays["valid"], axis=1))[:out_num]
        if [len(h) for h in held] != counts.tolist():   # the invariant a continuation relies on
            raise RuntimeError(f"sampler: the returned cache holds {counts.tolist()} tokens per row, expected "
                               f"{[len(h) for h in held]} (prompt + new tokens but the last); a sampler bug")
        next_cache = SamplerCache(arrays=arrays, tokens=tuple(tuple(h) for h in held), model=model)
    return GenerateResult(
        tokens=result_tokens,
        logprobs=[np.asarray(out.logprobs[row, : lengths[row]], np.float32) for row in range(out_num)],
        lengths=lengths,
        finished=np.asarray(out.finished[:out_num], bool),
        cache=next_cache,
        prefill_tokens=sum(len(ids) for ids in new),
        prefill_slots=batch * width,
    )


def grow_cache(cache_axes: Any, cache: Any, max_len: int) -> Any:
    """The cache with every "cache_length" axis zero-padded to `max_len` slots (new slots: not valid).

    `cache_axes` is the family's `cache_axes(config)` (the stored layout).
    """

    def grow(names, x):
        if "cache_length" not in names:
            return x
        if len(names) != x.ndim:
            raise ValueError(f"cache: a leaf of shape {x.shape} has axes {names}, expected one name per dim")
        axis = names.index("cache_length")
        if x.shape[axis] > max_len:
            raise ValueError(f"cache: {x.shape[axis]} slots already, cannot grow to {max_len}")
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, max_len - x.shape[axis])
        return jnp.pad(x, pad)

    return jax.tree.map(grow, cache_axes, cache, is_leaf=sharding.is_axes)


def check_cache(family: ModelFamily, config: Any, cache: Any, batch: int, dtype: Any) -> None:
    """Raises ValueError naming the difference when `cache` is not a stored-layout cache of this model.

    Expected: the tree `family.init_cache(config, batch, S, dtype)` makes for
    some slot count S, leaf for leaf (shapes and dtypes), in the stored
    layout (not `decode_layout`'s per-layer tuples). Runs on shapes only
    (at trace time under jit).
    """
    slots = cache["valid"].shape[-1] if isinstance(cache, dict) and "valid" in cache else 1
    want = jax.eval_shape(lambda: family.init_cache(config, batch, slots, dtype))
    name = getattr(family, "__name__", type(family).__name__)
    try:
        got_tree, want_tree = jax.tree.structure(cache), jax.tree.structure(want)
    except Exception as exc:  # not a pytree at all
        raise ValueError(f"cache: {type(cache).__name__} is not a cache pytree ({exc})") from exc
    if got_tree != want_tree:
        raise ValueError(f"cache: its tree is not a {name} cache of this config in the stored layout; "
                         f"expected {want_tree}, got {got_tree}")
    for (path, got), exp in zip(jax.tree_util.tree_leaves_with_path(cache), jax.tree.leaves(want)):
        where = jax.tree_util.keystr(path)
        if got.shape != exp.shape or got.dtype != exp.dtype:
            raise ValueError(f"cache{where}: {got.dtype}{list(got.shape)}, expected {exp.dtype}{list(exp.shape)} "
                             f"({name}, {batch} rows, {slots} slots): a cache of another model, batch or dtype")


def compact_cache(cache_axes: Any, cache: Any, held_width: int, width: int) -> Any:
    """The cache with each row's valid slots packed, in order, to the right of slots [0, held_width).

    Slots [held_width, width) are left free (not valid) and the write index is
    set to `held_width`, so the next `forward` appends there. A row's held
    tokens keep their keys, values and order (attention depends on slot
    validity, not slot numbers, and RoPE was applied at each token's own
    position), so attending to the packed cache is attending to the same
    tokens; the recurrent and conv states, which have no slot axis, are kept
    as they are. `held_width` must be at least the most valid slots of any
    row (not checked inside jit). Packing drops the gaps that left padding,
    finished rows and earlier packing leave, so a continued cache grows by
    the new tokens only.
    """
    valid = cache["valid"]
    batch, slots = valid.shape
    held = jnp.sum(valid, axis=1, dtype=jnp.int32)
    order = jnp.argsort(~valid, axis=1, stable=True)             # [B, S]: valid slots first, in order
    slot = jnp.arange(width, dtype=jnp.int32)[None, :]
    rank = slot - (held_width - held[:, None])                   # [B, width]: which held token lands here
    new_valid = (rank >= 0) & (slot < held_width)
    source = jnp.take_along_axis(order, jnp.clip(rank, 0, slots - 1), axis=1)   # [B, width]

    def pack(names, x):
        if "cache_length" not in names:
            return x
        if len(names) != x.ndim:
            raise ValueError(f"cache: a leaf of shape {x.shape} has axes {names}, expected one name per dim")
        b, s = names.index("batch"), names.index("cache_length")
        shape = [1] * x.ndim
        shape[b], shape[s] = batch, width
        index = (source if b < s else source.T).reshape(shape)   # [B, width] on the leaf's (batch, slot) dims
        return jnp.take_along_axis(x, index, axis=s)

    packed = jax.tree.map(pack, cache_axes, cache, is_leaf=sharding.is_axes)
    return {**packed, "index": jnp.asarray(held_width, jnp.int32), "valid": new_valid}


def select_rows(cache_axes: Any, cache: Any, rows: jax.Array) -> Any:
    """The cache of rows `rows` (int32[B_out]): every leaf with a "batch" axis gathered along it."""

    def take(names, x):
        return jnp.take(x, rows, axis=names.index("batch")) if "batch" in names else x

    return jax.tree.map(take, cache_axes, cache, is_leaf=sharding.is_axes)


def _to_stored_layout(stored: Any, decoded: Any) -> Any:
    """A cache in `decode_layout` back in the stored layout whose structure `stored` has.

    The families' `decode_layout` turns a stacked part of the cache into a
    tuple of its slices along the leading (layer or repeat) axis; this stacks
    every such tuple back and checks that the result has `stored`'s shapes.
    """

    def restack(ref, got):
        if isinstance(got, (tuple, list)) and not isinstance(ref, (tuple, list)):
            return jax.tree.map(lambda *xs: jnp.stack(xs), *got)
        if isinstance(ref, dict):
            return {key: restack(ref[key], got[key]) for key in ref}
        return got

    out = restack(stored, decoded)
    same = jax.tree.structure(out) == jax.tree.structure(stored) and all(
        a.shape == b.shape for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(stored)))
    if not same:
        raise ValueError("decode_layout: the family's decoded cache does not stack back into its stored layout "
                         "(expected each stacked part turned into a tuple of its leading-axis slices)")
    return out


def _cache_sharding(family: ModelFamily, config: Any, mesh: Any, cache: Any) -> Any:
    """NamedShardings of the family's cache under `mesh` (its logical axes through the rules table)."""
    return sharding.logical_to_sharding(family.cache_axes(config), mesh, shapes_tree=cache)
