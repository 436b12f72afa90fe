"""The corrections' state: a packed pytree of two arrays, and its named view.

Why packed: a host loop calls the jitted ``correct_step`` once per training
step, and every call flattens, checks, donates and re-creates each leaf of the
state -- a few microseconds per leaf. Twenty-nine scalar-sized leaves cost
more to dispatch than the step costs to compute (measured: a donated identity
jit over them took ~0.09 ms, over four arrays ~0.02 ms, and two arrays save
another ~2 us a call over four). So the state holds two arrays -- the ring
buffer, and one int32 vector of everything else (the counters and flags, then
the map's knots and the float scalars as their bits) -- and every named field
is a read-only property over them.

Inside a jitted function the mechanics work on :class:`Fields`, every field
but the ring buffer, unpacked (one value each, so XLA sees plain scalars);
``unpack`` and ``pack`` convert, and XLA fuses both away (``pack`` by
``_vector``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from wmrl_jax._isotonic import MonotoneMap

Array = jax.Array

CALIBRATIONS = ("binned", "exact")

# Layout of the packed vectors (order is the checkpoint format: append only).
COUNTERS = (
    "buf_len",  # pairs held (<= cap); slots [0, buf_len) are live
    "buf_head",  # next slot to write (the oldest once full)
    "since",  # pairs arrived since the last successful refit
    "n_pairs",  # pairs ever pushed
    "n_fits",  # successful refits
    "n_knots",  # knots used by the current map
    "valid",  # bool: the map is fitted (else identity)
    "n_obs",  # non-degenerate anchor groups observed
    "c_set",  # bool: the scale constant c is fixed
    "n_steps",  # correct_step calls
    "n_groups_seen",  # groups seen, for the realised anchor fraction
    "n_anchor_seen",  # anchor groups seen
    # Settings as data (see CorrectionConfig for why). Paper values by default.
    "debias",  # bool; False: the map stays the identity (pairs still buffered)
    "denoise",  # bool; False: anchor weight 1 (disagreement still tracked)
    "min_pairs",  # (200) identity until this many pairs are buffered
    "refit_every",  # (64) pairs since the last successful refit
    "warmup",  # (32) groups observed before c is fixed
)
BOOLS = frozenset({"valid", "c_set", "debias", "denoise"})
SCALARS = (
    "bias_before",  # diagnostics of the last successful refit, on its buffer
    "bias_after",
    "bias_reduction",
    "ewma",  # disagreement EWMA (meaningful once n_obs > 0)
    "c",  # the frozen scale constant (meaningful once c_set)
    "alpha",  # EWMA rate 1 - 0.5^(1 / max(1, half_life)), half-life 64 groups
    "w_max",  # (4.0) the anchor weight never exceeds this
    "target_weight",  # (2.0) the weight at the moment c is fixed
)


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """What fixes array shapes or code paths: static, part of the jit cache key.

    Every other setting is a scalar in the state, so one compiled step serves
    every ablation arm and hyper-parameter (and a run may change them mid-way).
    """

    cap: int = 5000  # FIFO of the newest pairs: the map tracks the current policy
    bins: int = 10  # equal-width bins over [0, 1] (binned calibration)
    calibration: str = "binned"  # "binned" (paper) or "exact" isotonic
    dtype: str = "float32"  # the scores' (and every float field's) dtype

    @property
    def knots(self) -> int:
        """Knot slots of the map: bins (binned) or cap (exact)."""
        return self.bins if self.calibration == "binned" else self.cap

    @property
    def words(self) -> int:
        """int32 words per float in ``CorrectionState.fields``."""
        return jnp.dtype(self.dtype).itemsize // 4


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["buffer", "fields"],
    meta_fields=["config"],
)
@dataclasses.dataclass(frozen=True)
class CorrectionState:
    """All correction state; a pytree of two arrays (checkpointable), config static.

    Attributes:
        buffer: float[2, cap], the ring buffer's WM scores (row 0) and real
            scores (row 1). The FIFO fills from slot 0, so slots past
            ``buf_len`` were never written and hold zeros (a refit relies on it).
        fields: int32[len(COUNTERS) + w (2 K + len(SCALARS))]: ``COUNTERS``,
            then the bits of the map's knots_x and knots_y (K = bins for the
            binned map, cap for the exact one) and of ``SCALARS``, in
            ``config.dtype`` (w = ``config.words`` int32 words per float).

    Every field of ``COUNTERS`` and ``SCALARS`` reads as an attribute
    (``state.n_fits``, ``state.c``), as do ``counters``, ``knots``,
    ``scalars``, ``buf_x``, ``buf_y`` and ``fitted``.
    """

    buffer: Array
    fields: Array
    config: CorrectionConfig

    @property
    def counters(self) -> Array:
        """int32[len(COUNTERS)]."""
        return self.fields[:len(COUNTERS)]

    @property
    def knots(self) -> Array:
        """float[2, K]: knots_x, knots_y."""
        k = self.config.knots
        return _floats(self.fields, len(COUNTERS), 2 * k, self.config).reshape(2, k)

    @property
    def scalars(self) -> Array:
        """float[len(SCALARS)]."""
        start = len(COUNTERS) + self.config.words * 2 * self.config.knots
        return _floats(self.fields, start, len(SCALARS), self.config)

    @property
    def buf_x(self) -> Array:
        return self.buffer[0]

    @property
    def buf_y(self) -> Array:
        return self.buffer[1]

    @property
    def fitted(self) -> MonotoneMap:
        return MonotoneMap(self.knots[0], self.knots[1], self.n_knots, self.valid)


def _floats(fields: Array, start: int, n: int, config: CorrectionConfig) -> Array:
    """The n floats whose bits start at ``fields[start]``."""
    w = config.words
    bits = fields[start:start + w * n]
    return lax.bitcast_convert_type(bits if w == 1 else bits.reshape(n, w), jnp.dtype(config.dtype))


def _bits(x: Array) -> Array:
    """int32 words of the floats x (flattened)."""
    return lax.bitcast_convert_type(x, jnp.int32).reshape(-1)


def _counter(i: int, name: str):
    if name in BOOLS:
        return property(lambda self: self.counters[i].astype(bool), doc=f"bool, counters[{i}]")
    return property(lambda self: self.counters[i], doc=f"int32, counters[{i}]")


for _i, _name in enumerate(COUNTERS):
    setattr(CorrectionState, _name, _counter(_i, _name))
for _i, _name in enumerate(SCALARS):
    setattr(CorrectionState, _name, property(lambda self, i=_i: self.scalars[i], doc=f"scalars[{_i}]"))
del _i, _name


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["fitted", *(k for k in COUNTERS if k not in ("n_knots", "valid")), *SCALARS],
    meta_fields=["config"],
)
@dataclasses.dataclass(frozen=True)
class Fields:
    """The state but its ring buffer, unpacked: one value per field, for the
    mechanics (the buffer is passed on its own, only where it is touched)."""

    fitted: MonotoneMap
    buf_len: Array
    buf_head: Array
    since: Array
    n_pairs: Array
    n_fits: Array
    n_obs: Array
    c_set: Array
    n_steps: Array
    n_groups_seen: Array
    n_anchor_seen: Array
    debias: Array
    denoise: Array
    min_pairs: Array
    refit_every: Array
    warmup: Array
    bias_before: Array
    bias_after: Array
    bias_reduction: Array
    ewma: Array
    c: Array
    alpha: Array
    w_max: Array
    target_weight: Array
    config: CorrectionConfig


def unpack(state: CorrectionState) -> Fields:
    """Every field but the buffer (which is not read, so a jitted caller that
    unpacks inside a branch does not pass the buffer into it)."""
    names = (k for k in COUNTERS if k not in ("n_knots", "valid"))
    return Fields(fitted=state.fitted, **{k: getattr(state, k) for k in (*names, *SCALARS)},
                  config=state.config)


def unpack_packed(fields: Array, config: CorrectionConfig) -> Fields:
    """``unpack`` of a state's ``fields`` (as ``pack`` returns them), with no
    buffer: ``unpack`` never reads one."""
    return unpack(CorrectionState(None, fields, config))


def _vector(values, dtype) -> Array:
    """``jnp.stack(values).astype(dtype)`` for scalars, as one XLA operation.

    XLA:CPU gives each scalar of a ``stack`` an operation of its own (and a
    concatenate after them); as a chain of selects over the vector's index it
    fuses the scalars' arithmetic into a single loop (measured: the no-refit
    step went from 50 to 37 operations, 0.110 -> 0.100 ms a call).
    """
    idx = jnp.arange(len(values))
    out = jnp.zeros(len(values), dtype)
    for k, v in enumerate(values):
        out = jnp.where(idx == k, jnp.asarray(v).astype(dtype), out)
    return out


def pack(f: Fields) -> Array:
    """The ``fields`` of ``f``: with the buffer, a CorrectionState."""
    fitted = f.fitted
    dtype = jnp.dtype(f.config.dtype)
    ints = dict(n_knots=fitted.n_knots, valid=fitted.valid)
    counters = _vector([ints[k] if k in ints else getattr(f, k) for k in COUNTERS], jnp.int32)
    scalars = _vector([getattr(f, k) for k in SCALARS], dtype)
    knots = jnp.concatenate([fitted.knots_x, fitted.knots_y]).astype(dtype)
    return jnp.concatenate([counters, _bits(knots), _bits(scalars)])


def init_correction_state(
        *,
        cap: int = 5000,
        bins: int = 10,
        min_pairs: int = 200,
        refit_every: int = 64,
        half_life: float = 64.0,
        warmup: int = 32,
        w_max: float = 4.0,
        target_weight: float = 2.0,
        debias: bool = True,
        denoise: bool = True,
        calibration: str = "binned",
        dtype=None,
) -> CorrectionState:
    """Fresh correction state: empty buffer, identity map, weight 1.

    ``dtype`` defaults to JAX's default float (float32; float64 under
    ``jax_enable_x64``).
    """
    if calibration not in CALIBRATIONS:
        raise ValueError(f"calibration: {calibration!r}, expected one of {CALIBRATIONS}")
    for name, v, lo in (("cap", cap, 1), ("bins", bins, 1), ("min_pairs", min_pairs, 0),
                        ("refit_every", refit_every, 0), ("warmup", warmup, 0)):
        if int(v) != v or v < lo:
            raise ValueError(f"{name}: {v!r}, expected an integer >= {lo}")
    if not w_max >= 1.0:
        raise ValueError(f"w_max: {w_max!r}, expected >= 1")
    dtype = jnp.zeros(()).dtype if dtype is None else jnp.dtype(dtype)
    config = CorrectionConfig(int(cap), int(bins), calibration, dtype.name)
    k = config.knots
    settings = dict(debias=int(bool(debias)), denoise=int(bool(denoise)), min_pairs=int(min_pairs),
                    refit_every=int(refit_every), warmup=int(warmup),
                    alpha=1.0 - 0.5 ** (1.0 / max(1.0, float(half_life))), w_max=float(w_max),
                    target_weight=float(target_weight))
    counters = jnp.asarray([settings.get(n, 0) for n in COUNTERS], jnp.int32)
    floats = jnp.asarray([0.0] * (2 * k) + [settings.get(n, 0.0) for n in SCALARS], dtype)
    return CorrectionState(buffer=jnp.zeros((2, config.cap), dtype),
                           fields=jnp.concatenate([counters, _bits(floats)]), config=config)


# ----------------------------------------------------------------- step output
# What correct_step returns besides the state. Packed for the same reason as
# the state, and more so: each output array of a jitted call costs ~1.5 us to
# hand back synchronously and ~4 us with asynchronous dispatch (measured: a
# no-op program with correct_step's inputs took 48 / 95 us returning its
# thirteen outputs one by one, 27 / 39 us returning them as two arrays;
# launch/bench_corrections.py prints its no-op floor with the 13 outputs and
# with these 2, e.g. 0.081 vs 0.038 ms a call). So the outputs travel as two
# arrays and read back by name: the float [N, G] arrays, and an int32 one of
# the masks, the counts and the bits of the float diagnostics. Why the
# diagnostics go with the ints: at paper size (8 x 8) each array then holds
# <= 512 bytes, and XLA:CPU runs a computation whose buffers are all that
# small one operation after another on the calling thread; one bigger buffer
# would send the whole no-refit step through its dependency-tracking executor
# (measured 2.5x slower).
STEP_FLOATS = (
    "anchor_weight",  # the anchor groups' advantage weight this step
    "bias_before",  # the last successful refit's diagnostics, on its buffer
    "bias_after",
    "bias_reduction",
    "disagreement",  # the disagreement EWMA
    "anchor_fraction",  # realised share of groups executed for real, over the run
)
STEP_INTS = (
    "calibrated",  # bool: the map is fitted (else WM scores pass unchanged)
    "n_fits",  # successful refits so far
    "pairs_in_buffer",  # pairs the debiaser holds
)
STEP_ARRAYS = ("rewards", "graded", "advantages", "used")
# The order a reader meets them in (correct_step's docstring).
STEP_KEYS = (*STEP_ARRAYS, "anchor_weight", "calibrated", "n_fits", "bias_before", "bias_after",
             "bias_reduction", "disagreement", "pairs_in_buffer", "anchor_fraction")
assert sorted(STEP_KEYS) == sorted((*STEP_ARRAYS, *STEP_FLOATS, *STEP_INTS))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["floats", "ints"],
                   meta_fields=["n_groups", "group_size"])
@dataclasses.dataclass(frozen=True)
class StepOutput(collections.abc.Mapping):
    """``correct_step``'s outputs: a read-only mapping over two packed arrays.

    Reads like the dict it stands for -- ``out["advantages"]``,
    ``out["n_fits"]``, ``dict(out)``, ``out.items()`` -- with keys
    ``STEP_KEYS``: ``rewards`` / ``advantages`` float[N, G], ``graded`` bool[N,
    G], ``used`` bool[N], ``calibrated`` bool, ``n_fits`` / ``pairs_in_buffer``
    int32, the rest floats. As a pytree its leaves are the two arrays, so a
    scan stacks them (every key then gains the leading axis) and
    ``jax.device_get(out)`` is one transfer of two arrays. Reading a key slices
    them: free inside a jit, a numpy view (a small copy for the float
    diagnostics) after ``device_get``, an eager op each on device arrays (so on
    the host, ``device_get`` first).

    Attributes:
        floats: float[..., 2 N G]: rewards, then advantages.
        ints: int32[..., N G + N + len(STEP_INTS) + w len(STEP_FLOATS)]:
            graded, used, STEP_INTS, then the bits of STEP_FLOATS (w int32
            words each: 1 for float32, 2 for float64).
        n_groups, group_size: N and G (static).
    """

    floats: Array
    ints: Array
    n_groups: int
    group_size: int

    def __getitem__(self, key: str):
        n, g = self.n_groups, self.group_size
        ng = n * g
        lead = self.floats.shape[:-1]
        if key in ("rewards", "advantages"):
            start = 0 if key == "rewards" else ng
            return self.floats[..., start:start + ng].reshape(*lead, n, g)
        if key == "graded":
            return self.ints[..., :ng].reshape(*lead, n, g).astype(bool)
        if key == "used":
            return self.ints[..., ng:ng + n].astype(bool)
        if key in _INT_INDEX:
            v = self.ints[..., ng + n + _INT_INDEX[key]]
            return v.astype(bool) if key == "calibrated" else v
        if key in _FLOAT_INDEX:
            dtype = self.floats.dtype
            w = dtype.itemsize // 4
            start = ng + n + len(STEP_INTS) + w * _FLOAT_INDEX[key]
            bits = self.ints[..., start:start + w]
            if isinstance(bits, np.ndarray):
                return np.ascontiguousarray(bits).view(dtype)[..., 0]
            return lax.bitcast_convert_type(bits[..., 0] if w == 1 else bits, dtype)
        raise KeyError(f"{key!r}: not an output of correct_step; expected one of {STEP_KEYS}")

    def __iter__(self):
        return iter(STEP_KEYS)

    def __len__(self) -> int:
        return len(STEP_KEYS)


_FLOAT_INDEX = {k: i for i, k in enumerate(STEP_FLOATS)}
_INT_INDEX = {k: i for i, k in enumerate(STEP_INTS)}


def step_output(rewards, graded, advantages, used, **diagnostics) -> StepOutput:
    """Pack ``correct_step``'s outputs (diagnostics by name, every one of
    ``STEP_FLOATS`` and ``STEP_INTS``; floats take ``rewards``' dtype)."""
    missing = set(STEP_FLOATS + STEP_INTS) ^ set(diagnostics)
    if missing:
        raise ValueError(f"step_output: diagnostics {sorted(missing)} missing or unexpected")
    n, g = rewards.shape
    dtype = rewards.dtype
    floats = jnp.concatenate([rewards.reshape(-1), advantages.astype(dtype).reshape(-1)])
    diag = jnp.stack([jnp.asarray(diagnostics[k]).astype(dtype) for k in STEP_FLOATS])
    ints = jnp.concatenate([graded.reshape(-1).astype(jnp.int32), used.astype(jnp.int32),
                            jnp.stack([jnp.asarray(diagnostics[k]).astype(jnp.int32) for k in STEP_INTS]),
                            _bits(diag)])
    return StepOutput(floats, ints, n, g)
