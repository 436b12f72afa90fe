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
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    finished: jax.Array


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """Result of `generate`, one entry per prompt, in prompt order.

    tokens: new token ids per prompt, stopped at (and including) the EOS id.
    logprobs: float32 log-prob per new token (same length as `tokens[i]`).
    lengths: int64[num_prompts] = len(tokens[i]).
    finished: bool[num_prompts], True where the row ended on an EOS id.
    """

    tokens: list[list[int]]
    logprobs: list[np.ndarray]
    lengths: np.ndarray
    finished: np.ndarray


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
) -> SampleOutput:
    """Samples up to `max_new_tokens` continuations of a left-padded batch of prompts.

    Jittable with everything after `rng` static (`active` and arrays aside).
    Prefill runs the whole prompt through `family.forward` with a fresh cache
    of ``P + max_new_tokens`` slots and unembeds only the last column (left
    padding puts every row's last prompt token there). The decode loop then
    feeds one token per row per step. Step n uses ``fold_in(rng, n)``, so the
    result depends only on the inputs and `rng`.

    Args:
      params, config, family: the model (see `wmrl_jax.models.family`).
      tokens: int32[B, P] left-padded prompts.
      valid: bool[B, P] real prompt tokens; every active row needs >= 1.
      rng: PRNG key.
      max_new_tokens: N, static.
      temperature, top_p, top_k: see `choose_tokens` (static).
      eos_ids: ids that end a row (the EOS token is kept): a tuple or an
        int32[E] array (traced, so changing the ids does not recompile).
      pad_id: id written after a row's end.
      active: bool[B] rows to decode (False = batch padding, done at once);
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

    Returns:
      SampleOutput with [B, N] tokens / logprobs and [B] lengths / finished.
    """
    batch, prompt_len = tokens.shape
    if valid.shape != tokens.shape:
        raise ValueError(f"valid: shape {valid.shape}, expected the shape of tokens {tokens.shape}")
    check_sampling_args(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    eos = jnp.asarray(eos_ids if isinstance(eos_ids, (jax.Array, np.ndarray)) else tuple(eos_ids), jnp.int32).reshape(-1)
    active = jnp.ones((batch,), bool) if active is None else active.astype(bool)
    choose = functools.partial(choose_tokens, temperature=temperature, top_k=top_k, top_p=top_p)

    def is_eos(ids):
        return jnp.any(ids[:, None] == eos[None, :], axis=-1) if eos.size else jnp.zeros(ids.shape, bool)

    dtype = _default_cache_dtype(params) if cache_dtype is None else cache_dtype
    chunked = prefill_chunk is not None and prompt_len > prefill_chunk
    if chunked and prompt_len % prefill_chunk:
        raise ValueError(f"prefill_chunk: {prefill_chunk} does not divide the prompt width {prompt_len}; expected "
                         f"a divisor (e.g. a power of two: generate buckets widths to powers of two) or None")
    # Prefill into a cache of the prompt's length (its attention reads P slots, not P + N), then grow the cache
    # for the decode loop. (Prefilling in chunks straight into P + N slots, to skip the grown copy, measured
    # worse: 4B agent sampler at the paper's caps, fsdp 8, 46.6 GiB a device against 44.0.)
    cache = family.init_cache(config, batch, prompt_len, dtype)
    if mesh is not None:
        cache = jax.lax.with_sharding_constraint(cache, _cache_sharding(family, config, mesh, cache))
    valid = valid.astype(bool)
    positions = positions_from_valid(valid)
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
    cache = grow_cache(family.cache_axes(config), cache, prompt_len + max_new_tokens)
    logits = family.unembed(params, config, hidden[:, -1:])[:, 0]
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
    # Left padding: the last column holds every row's last real token.
    next_pos = positions[:, -1] + 1
    carry = (jnp.int32(1), cache, first, next_pos, done, finished, out_tokens, out_logp, lengths)

    def keep_going(carry):
        step, done = carry[0], carry[4]
        return (step < max_new_tokens) & ~jnp.all(done)

    def decode_one(carry):
        step, cache, prev, pos, done, finished, out_tokens, out_logp, lengths = carry
        # Finished rows keep feeding (their outputs are discarded): a fixed
        # batch shape, and their cache slots stay valid so no row is ever
        # left without a key to attend to.
        hidden, cache = family.forward(
            params, config, prev[:, None], pos[:, None], jnp.ones((batch, 1), bool), cache
        )
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
    _, _, _, _, _, finished, out_tokens, out_logp, lengths = carry
    return SampleOutput(tokens=out_tokens, logprobs=out_logp, lengths=lengths, finished=finished)


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

    Returns:
      GenerateResult (python lists, trimmed at EOS).
    """
    check_sampling_args(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    family = getattr(model, "family", None)
    if family is None:
        raise ValueError(f"model: {type(model).__name__} has no `.family`; expected a wmrl_jax.models.Model")
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
    width = bucket_size(max(len(p) for p in prompts), 16)
    tokens = np.full((batch, width), pad_id, np.int32)
    valid = np.zeros((batch, width), bool)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = prompt
        valid[row, width - len(prompt) :] = True
    valid[num:, -1] = True  # padding rows: one dummy token so attention is never empty
    active = np.arange(batch) < num

    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        rows = NamedSharding(mesh, PartitionSpec(_batch_axes(mesh)))
        tokens, valid, active = (jax.device_put(x, rows) for x in (tokens, valid, active))
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
        )
    out = jax.tree.map(_to_host, out)
    lengths = np.asarray(out.lengths[:num], np.int64)
    return GenerateResult(
        tokens=[out.tokens[row, : lengths[row]].tolist() for row in range(num)],
        logprobs=[np.asarray(out.logprobs[row, : lengths[row]], np.float32) for row in range(num)],
        lengths=lengths,
        finished=np.asarray(out.finished[:num], bool),
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


def _cache_sharding(family: ModelFamily, config: Any, mesh: Any, cache: Any) -> Any:
    """NamedShardings of the family's cache under `mesh` (its logical axes through the rules table)."""
    return sharding.logical_to_sharding(family.cache_axes(config), mesh, shapes_tree=cache)
