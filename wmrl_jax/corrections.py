"""WMRL's two corrections of world-model rewards, as pure jit-able JAX.

A frozen world model (WM) predicts each rollout's score; a few groups per step
are also executed for real ("anchors"). Two kinds of WM error, two corrections
(docs/design.md, "Semantics of the corrections", is the exact behaviour;
``wmrl_jax._reference_numpy`` transcribes it in plain numpy):

* **Bias -> online debiasing.** Anchor groups yield (WM score, real score)
  pairs; a monotone map fitted on the newest ``cap`` pairs, refitted every
  ``refit_every`` arrivals, is pushed through every WM score. The map must be
  *monotone* -- it never reorders rollouts inside a group, so it keeps the
  ranking the WM got right -- and *non-affine*: GRPO standardises rewards
  within each group, which cancels any affine map exactly, so an affine
  recalibration would change nothing. An isotonic (piecewise-linear) fit
  survives the standardisation, which is the whole point.
* **Noise -> inverse-variance denoising.** What is left after calibration is
  zero-mean noise, which can only be averaged down. The measured within-group
  disagreement s^2 between calibrated WM scores and real scores sets an
  up-weight ``w = clip(1 + c s^2, 1, w_max)`` on the anchor groups'
  advantages; ``c`` is fixed once after a warm-up, so w tracks how the
  disagreement *moves*, not its units.

Contracts: an unscored rollout is masked (``graded`` False), never scored 0.0
-- a 0 would be a confident claim that the attempt was bad. NaN/inf rewards are
ungraded. All state (FIFO, map, EWMA, constant, counters, settings) is one
pytree of named arrays, :class:`CorrectionState`, so Orbax checkpoints it with
the model and a resumed run continues exactly.

Static shapes: the FIFO is a ring buffer with a length. The reference pushes
pairs one at a time and refits after any push where due; where the next refit
falls follows from the counters alone, so a step writes the pairs up to it at
once, refits, and goes on (``_push_and_calibrate``: one loop iteration per
refit, usually none). No model, sandbox or I/O imports here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from wmrl_jax._isotonic import (
    MonotoneMap,
    apply_calibration,
    binned_isotonic_fit,
    binned_isotonic_predict,
    isotonic_fit,
    isotonic_predict,
)
from wmrl_jax.checks import check_array, check_choice
from wmrl_jax.losses import group_advantages

Array = jax.Array

__all__ = [
    "MonotoneMap",
    "isotonic_fit",
    "isotonic_predict",
    "binned_isotonic_fit",
    "binned_isotonic_predict",
    "apply_calibration",
    "bias_stats",
    "group_disagreement",
    "CorrectionConfig",
    "CorrectionState",
    "StepOutput",
    "init_correction_state",
    "correct_step",
    "anchor_weight",
    "correction_stats",
    "select_anchor_groups",
]

CALIBRATIONS = ("binned", "exact")
_VAR_FLOOR = 1e-9  # var(s) below this: a degenerate group, no ranking to compare
_EWMA_FLOOR = 1e-12  # disagreement this small cannot set a finite constant c


# ----------------------------------------------------------------- diagnostics


def _masked_mean(a: Array, mask: Array, axis=-1) -> Array:
    return jnp.where(mask, a, 0.0).sum(axis) / jnp.maximum(mask.sum(axis), 1).astype(a.dtype)


def _centred_residual_sq(x: Array, y: Array, mask: Array) -> Array:
    """mean(((x - mean x) - (y - mean y))^2) over the masked entries."""
    u = x - y  # (x - mean x) - (y - mean y) = u - mean u
    return _masked_mean((u - _masked_mean(u, mask)) ** 2, mask)


def bias_stats(x: Array, y: Array, fitted: MonotoneMap | None = None, mask: Array | None = None):
    """Within-group-centred squared residual before and after calibration.

        before    = mean(((x - mean x) - (y - mean y))^2)
        after     = same with x -> f(x), f the calibration (identity if invalid)
        reduction = 1 - after / max(1e-9, before)

    Centred because GRPO only sees differences: a constant offset is no bias.

    Args:
        x: float[n] WM scores; y: float[n] real scores; fitted: the map (None =
            identity); mask: bool[n] pairs to use (None = all).

    Returns:
        (before, after, reduction), float scalars.
    """
    x = check_array("x", x, "float", (None,), "WM scores")
    y = check_array("y", y, "float", x.shape, "like x")
    m = jnp.ones(x.shape, bool) if mask is None else check_array("mask", mask, "bool", x.shape, "like x")
    before = _centred_residual_sq(x, y, m)
    after = before if fitted is None else _centred_residual_sq(apply_calibration(fitted, x), y, m)
    return before, after, 1.0 - after / jnp.maximum(1e-9, before)


def group_disagreement(calibrated: Array, real: Array, mask: Array | None = None):
    """Normalised within-group disagreement of calibrated WM scores with truth.

        s^2 = mean(((d - mean d) - (s - mean s))^2) / var(s)     (population var)

    over the masked entries (pairs where both scores exist). Dimensionless, so
    groups of different difficulty compare. A group whose real scores are all
    equal (var(s) < 1e-9) carries no ranking information and is skipped rather
    than counted as 0, which would drag the estimate down.

    Args:
        calibrated, real: float[G]; mask: bool[G] (None = all).

    Returns:
        (s2, ok): s2 float scalar (0 when not ok), ok bool scalar.
    """
    d = check_array("calibrated", calibrated, "float", (None,), "one group's scores")
    s = check_array("real", real, "float", d.shape, "like calibrated")
    m = jnp.ones(d.shape, bool) if mask is None else check_array("mask", mask, "bool", d.shape, "like calibrated")
    var_s = _masked_mean((s - _masked_mean(s, m)) ** 2, m)
    ok = m.any() & (var_s >= _VAR_FLOOR)
    return jnp.where(ok, _centred_residual_sq(d, s, m) / jnp.where(ok, var_s, 1.0), 0.0), ok


# ----------------------------------------------------------------------- state


def _short(v, indent: str) -> str:
    """A scalar as its value, an array of <= 64 entries in full, a bigger one
    as dtype[shape]; a tracer as itself (printed inside a jit)."""
    if isinstance(v, MonotoneMap):
        inner = indent + "  "
        return "MonotoneMap(" + ", ".join(f"{k}={_short(getattr(v, k), inner)}" for k in v._fields) + ")"
    try:
        a = np.asarray(v)
    except Exception:
        return repr(v)
    if a.ndim == 0:
        return repr(float(f"{a.item():.6g}")) if a.dtype.kind == "f" else repr(a.item())
    if a.size > 64:
        return f"{a.dtype}{list(a.shape)}"
    return np.array2string(a, max_line_width=100, precision=4, suppress_small=True, separator=", ",
                           prefix=indent)


def _repr(obj) -> str:
    """Field per line, values short (see ``_short``): the readable repr of the
    state and the step output."""
    lines = []
    for f in dataclasses.fields(obj):
        prefix = f"  {f.name}="
        lines.append(prefix + _short(getattr(obj, f.name), " " * len(prefix)))
    return f"{type(obj).__name__}(\n" + ",\n".join(lines) + ",\n)"


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """What fixes array shapes or code paths: static, part of the jit cache key.

    Every other setting is an array in the state, so one compiled step serves
    every ablation arm and hyper-parameter.
    """

    cap: int = 5000  # FIFO of the newest pairs: the map tracks the current policy
    bins: int = 10  # equal-width bins over [0, 1] (binned calibration)
    calibration: str = "binned"  # "binned" (paper) or "exact" isotonic


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CorrectionState:
    """All correction state: a pytree of named arrays, ``config`` static.

    Attributes (scalars unless shaped; paper values in parentheses):
        buf_x, buf_y: float[cap], the FIFO's WM and real scores. Slot
            ``buf_head`` is written next; slots [0, buf_len) are live.
        buf_len, buf_head, since, n_pairs: int32 pairs held (<= cap), next slot,
            pairs arrived since the last successful refit, pairs ever pushed.
        fitted: the current :class:`MonotoneMap` (``valid`` False: identity).
        n_fits: int32 successful refits.
        bias_before, bias_after, bias_reduction: ``bias_stats`` of the last
            successful refit, on its buffer.
        ewma: the disagreement EWMA (meaningful once n_obs > 0); n_obs: int32
            non-degenerate anchor groups observed.
        c, c_set: the frozen scale constant and whether it is fixed.
        n_steps, n_groups_seen, n_anchor_seen: int32 step and group counts.
        debias, denoise: bool switches (False: identity map / weight 1; pairs
            and disagreement are still recorded).
        min_pairs (200), refit_every (64), warmup (32): int32 settings.
        alpha: EWMA rate 1 - 0.5^(1 / half_life) (half-life 64 groups).
        w_max (4.0), target_weight (2.0): the weight's cap, and its value
            at the moment c is fixed.
        config: :class:`CorrectionConfig` (static).
    """

    buf_x: Array
    buf_y: Array
    buf_len: Array
    buf_head: Array
    since: Array
    n_pairs: Array
    fitted: MonotoneMap
    n_fits: Array
    bias_before: Array
    bias_after: Array
    bias_reduction: Array
    ewma: Array
    n_obs: Array
    c: Array
    c_set: Array
    n_steps: Array
    n_groups_seen: Array
    n_anchor_seen: Array
    debias: Array
    denoise: Array
    min_pairs: Array
    refit_every: Array
    warmup: Array
    alpha: Array
    w_max: Array
    target_weight: Array
    config: CorrectionConfig = dataclasses.field(metadata=dict(static=True))

    __repr__ = _repr


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
    """Fresh correction state: empty FIFO, identity map, weight 1.

    ``dtype`` (of scores and float fields) defaults to JAX's default float
    (float32; float64 under ``jax_enable_x64``).
    """
    check_choice("calibration", calibration, CALIBRATIONS)
    for name, v, lo in (("cap", cap, 1), ("bins", bins, 1), ("min_pairs", min_pairs, 0),
                        ("refit_every", refit_every, 0), ("warmup", warmup, 0)):
        if int(v) != v or v < lo:
            raise ValueError(f"{name}: {v!r}, expected an integer >= {lo}")
    if not w_max >= 1.0:
        raise ValueError(f"w_max: {w_max!r}, expected >= 1")
    if not half_life > 0:
        raise ValueError(f"half_life: {half_life!r}, expected > 0")
    dtype = jnp.zeros(()).dtype if dtype is None else jnp.dtype(dtype)
    config = CorrectionConfig(int(cap), int(bins), calibration)
    knots = config.bins if calibration == "binned" else config.cap
    # Every leaf its own buffer: correct_step donates the state.
    i32 = lambda v=0: jnp.array(v, jnp.int32)  # noqa: E731
    flt = lambda v=0.0: jnp.array(v, dtype)  # noqa: E731
    flag = lambda v=False: jnp.array(bool(v))  # noqa: E731
    return CorrectionState(
        buf_x=jnp.zeros((config.cap,), dtype), buf_y=jnp.zeros((config.cap,), dtype),
        buf_len=i32(), buf_head=i32(), since=i32(), n_pairs=i32(),
        fitted=MonotoneMap(jnp.zeros((knots,), dtype), jnp.zeros((knots,), dtype), i32(), flag()),
        n_fits=i32(), bias_before=flt(), bias_after=flt(), bias_reduction=flt(),
        ewma=flt(), n_obs=i32(), c=flt(), c_set=flag(),
        n_steps=i32(), n_groups_seen=i32(), n_anchor_seen=i32(),
        debias=flag(debias), denoise=flag(denoise), min_pairs=i32(min_pairs),
        refit_every=i32(refit_every), warmup=i32(warmup),
        alpha=flt(1.0 - 0.5 ** (1.0 / max(1.0, float(half_life)))),
        w_max=flt(w_max), target_weight=flt(target_weight), config=config,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What ``correct_step`` returns besides the state. ``out.advantages``, or
    ``out["advantages"]`` as from a dict.

    Attributes:
        rewards: float[N, G] real for anchor groups, calibrated WM otherwise;
            0 where ungraded.
        graded: bool[N, G] rollouts with a score (NaN/inf count as ungraded).
        advantages: float[N, G] ``losses.group_advantages`` of ``rewards``,
            anchor groups times ``anchor_weight``.
        used: bool[N] groups with >= min_graded graded rollouts.
        anchor_weight: the anchor groups' advantage weight this step.
        calibrated: bool, the map is fitted (else WM scores pass unchanged).
        n_fits: int32 successful refits so far.
        bias_before, bias_after, bias_reduction: the last successful refit's
            ``bias_stats``, on its buffer.
        disagreement: the disagreement EWMA.
        pairs_in_buffer: int32 pairs the debiaser holds.
        anchor_fraction: realised share of groups executed for real, over the run.
    """

    rewards: Array
    graded: Array
    advantages: Array
    used: Array
    anchor_weight: Array
    calibrated: Array
    n_fits: Array
    bias_before: Array
    bias_after: Array
    bias_reduction: Array
    disagreement: Array
    pairs_in_buffer: Array
    anchor_fraction: Array

    __repr__ = _repr

    def __getitem__(self, name: str) -> Array:
        if name not in self.__dataclass_fields__:
            raise KeyError(f"{name!r}: not an output of correct_step; expected one of "
                           f"{tuple(self.__dataclass_fields__)}")
        return getattr(self, name)


# ------------------------------------------------------------------ mechanics


def _refit(state: CorrectionState) -> CorrectionState:
    """Fit the map on the whole FIFO; keep the old map if the fit is degenerate
    (a failed fit leaves ``since`` due, so the next pushed pair retries)."""
    live = jnp.arange(state.config.cap) < state.buf_len
    if state.config.calibration == "binned":
        new = binned_isotonic_fit(state.buf_x, state.buf_y, live, state.config.bins)
    else:
        new = isotonic_fit(state.buf_x, state.buf_y, mask=live)
    before, after, reduction = bias_stats(state.buf_x, state.buf_y, new, live)
    ok = new.valid
    keep = lambda a, b: jnp.where(ok, a, b)  # noqa: E731
    return dataclasses.replace(
        state, fitted=jax.tree.map(keep, new, state.fitted), since=keep(0, state.since),
        n_fits=state.n_fits + ok, bias_before=keep(before, state.bias_before),
        bias_after=keep(after, state.bias_after), bias_reduction=keep(reduction, state.bias_reduction))


def _pushes_to_refit(state: CorrectionState) -> Array:
    """How many more pushes until a refit is due (int32 max if never).

    Due after a push once the FIFO holds >= min_pairs and >= refit_every
    pairs arrived since the last successful refit; both only grow with pushes.
    """
    k = jnp.maximum(1, jnp.maximum(state.refit_every - state.since, state.min_pairs - state.buf_len))
    return jnp.where(state.debias & (state.min_pairs <= state.config.cap), k, jnp.iinfo(jnp.int32).max)


def _push(state: CorrectionState, x: Array, y: Array, chosen: Array, rank: Array, m: Array) -> CorrectionState:
    """Append the ``chosen`` pairs (x, y float[P]) to the FIFO, in order.

    ``rank`` int32[P]: each chosen pair's 1-based position among the ``m``
    chosen. Of more than ``cap`` pairs only the newest ``cap`` are written, so
    no slot is written twice (a scatter's order among duplicates is undefined).
    """
    cap = state.config.cap
    slot = jnp.where(chosen & (rank > m - cap), (state.buf_head + rank - 1) % cap, cap)  # cap: dropped
    return dataclasses.replace(
        state, buf_x=state.buf_x.at[slot].set(x, mode="drop"), buf_y=state.buf_y.at[slot].set(y, mode="drop"),
        buf_head=(state.buf_head + m) % cap, buf_len=jnp.minimum(state.buf_len + m, cap),
        since=state.since + m, n_pairs=state.n_pairs + m)


def _push_and_calibrate(state: CorrectionState, wm: Array, real: Array, pair: Array):
    """Push the step's pairs in order, refitting after each push where due;
    calibrate each group with the map current after its own pairs.

    Group i (anchor or not) sees the map after the first ``group_end[i]``
    pairs of the step were pushed. Each loop iteration pushes the pairs up to
    the next due refit in one scatter and refits there, so a refit sees the
    FIFO exactly as of its push (the reference's order) and a step costs one
    iteration per refit, not one per pair.

    Args:
        wm, real: float[N, G] scores (0 where missing); pair: bool[N, G].

    Returns:
        (state, calibrated float[N, G]).
    """
    n, g = pair.shape
    sel, x, y = pair.reshape(-1), wm.reshape(-1), real.reshape(-1)
    ordinal = jnp.cumsum(sel.astype(jnp.int32))  # 1-based, in push order
    total = ordinal[-1]
    group_end = ordinal.reshape(n, g)[:, -1]

    def push(state, p0, k):  # the pairs p0 + 1 .. k
        chosen = sel & (ordinal > p0) & (ordinal <= k)
        return _push(state, x, y, chosen, ordinal - p0, jnp.minimum(k, total) - p0)

    def calibrate(state, p0, calibrated):  # groups ending at or after p0 (later maps overwrite)
        return jnp.where((group_end >= p0)[:, None], apply_calibration(state.fitted, wm), calibrated)

    def refit_due(carry):
        state, p0, _ = carry
        return _pushes_to_refit(state) <= total - p0

    def push_and_refit(carry):
        state, p0, calibrated = carry
        k = p0 + _pushes_to_refit(state)
        return _refit(push(state, p0, k)), k, calibrate(state, p0, calibrated)

    # The loop sits behind a cond: most steps refit nothing, and skipping the
    # loop altogether halves their cost inside a scan (measured 15 -> 8 us;
    # XLA:CPU pays for setting up a while loop even when it runs 0 times).
    carry = (state, jnp.int32(0), wm)
    state, p0, calibrated = lax.cond(refit_due(carry), lambda c: lax.while_loop(refit_due, push_and_refit, c),
                                     lambda c: c, carry)
    return push(state, p0, total), calibrate(state, p0, calibrated)


def _observe_groups(state: CorrectionState, s2: Array, observed: Array) -> CorrectionState:
    """Fold each group's disagreement (where ``observed``) into the EWMA, in
    group order, and fix c = (target_weight - 1) / EWMA once, after warm-up.

        EWMA <- s2 (first observation),  (1 - alpha) EWMA + alpha s2 (after)
    """

    def observe(carry, inputs):
        ewma, n_obs, c, c_set = carry
        s2, do = inputs
        new = jnp.where(n_obs == 0, s2, (1.0 - state.alpha) * ewma + state.alpha * s2)
        ewma, n_obs = jnp.where(do, new, ewma), n_obs + do
        fix = do & ~c_set & (n_obs >= state.warmup) & (ewma > _EWMA_FLOOR)
        c = jnp.where(fix, (state.target_weight - 1.0) / jnp.where(fix, ewma, 1.0), c)
        return (ewma, n_obs, c, c_set | fix), None

    init = (state.ewma, state.n_obs, state.c, state.c_set)
    (ewma, n_obs, c, c_set), _ = lax.scan(observe, init, (s2, observed), unroll=True)
    return dataclasses.replace(state, ewma=ewma, n_obs=n_obs, c=c, c_set=c_set)


def anchor_weight(state: CorrectionState) -> Array:
    """w = 1 until c is fixed, then clip(1 + c * EWMA, 1, w_max); 1 without denoising."""
    w = jnp.clip(1.0 + state.c * state.ewma, 1.0, state.w_max)
    return jnp.where(state.c_set & state.denoise, w, 1.0).astype(state.ewma.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "min_graded", "standardize"), donate_argnums=0)
def correct_step(
        state: CorrectionState,
        wm_rewards: Array,
        wm_graded: Array,
        real_rewards: Array,
        real_graded: Array,
        is_anchor: Array,
        *,
        eps: float = 1e-4,
        min_graded: int = 2,
        standardize: bool = True,
) -> tuple[CorrectionState, StepOutput]:
    """One step of WMRL's corrections, in the reference order (docs/design.md).

    Groups are processed in index order. An anchor group pushes its pairs
    (rollouts scored by both) into the debiaser one at a time -- a refit may
    happen after any of them -- then its disagreement is measured on the
    freshly calibrated WM scores. Any other group gets calibrated WM scores
    (with the map current at its turn). The anchor weight is read after all
    groups; advantages are ``losses.group_advantages`` with anchor groups
    scoring real rewards times the weight.

    Jitted, with ``state`` donated: keep the returned state, the one passed in
    is consumed. Called inside your own ``jax.jit`` / ``lax.scan`` it simply
    inlines (donation then is the outer function's business); pass ``eps``,
    ``min_graded`` and ``standardize`` as Python values (they are static).

    Args:
        state: from ``init_correction_state``.
        wm_rewards, real_rewards: float[N, G] (entries not graded are ignored;
            NaN/inf count as ungraded).
        wm_graded, real_graded: bool[N, G].
        is_anchor: bool[N], groups also executed for real.
        eps, min_graded, standardize: as ``losses.group_advantages``.

    Returns:
        (state, out): the next state and a :class:`StepOutput`.
    """
    if not isinstance(state, CorrectionState):
        raise ValueError(f"state: {type(state).__name__}, expected a CorrectionState (init_correction_state)")
    wm_rewards = check_array("wm_rewards", wm_rewards, "float", (None, None), "[N groups, G rollouts]")
    n, g = wm_rewards.shape
    wm_graded = check_array("wm_graded", wm_graded, "bool", (n, g), "like wm_rewards")
    real_rewards = check_array("real_rewards", real_rewards, "float", (n, g), "like wm_rewards")
    real_graded = check_array("real_graded", real_graded, "bool", (n, g), "like wm_rewards")
    is_anchor = check_array("is_anchor", is_anchor, "bool", (n,), "one per group")
    dtype = state.buf_x.dtype

    wm_ok = wm_graded & jnp.isfinite(wm_rewards)
    real_ok = real_graded & jnp.isfinite(real_rewards)
    wm = jnp.where(wm_ok, wm_rewards, 0.0).astype(dtype)
    real = jnp.where(real_ok, real_rewards, 0.0).astype(dtype)
    pair = is_anchor[:, None] & wm_ok & real_ok

    state, calibrated = _push_and_calibrate(state, wm, real, pair)
    s2, ok = jax.vmap(group_disagreement)(calibrated, real, pair)
    state = _observe_groups(state, s2, is_anchor & ok)
    state = dataclasses.replace(state, n_steps=state.n_steps + 1, n_groups_seen=state.n_groups_seen + n,
                                n_anchor_seen=state.n_anchor_seen + is_anchor.sum(dtype=jnp.int32))

    weight = anchor_weight(state)
    graded = jnp.where(is_anchor[:, None], real_ok, wm_ok)
    rewards = jnp.where(graded, jnp.where(is_anchor[:, None], real, calibrated), 0.0)
    advantages, used = group_advantages(rewards, graded, is_anchor, weight, eps=eps, min_graded=min_graded,
                                        standardize=standardize)
    return state, StepOutput(
        rewards=rewards, graded=graded, advantages=advantages, used=used, anchor_weight=weight,
        calibrated=state.fitted.valid, n_fits=state.n_fits, bias_before=state.bias_before,
        bias_after=state.bias_after, bias_reduction=state.bias_reduction, disagreement=state.ewma,
        pairs_in_buffer=state.buf_len, anchor_fraction=_anchor_fraction(state))


def _anchor_fraction(state: CorrectionState) -> Array:
    return state.n_anchor_seen / jnp.maximum(state.n_groups_seen, 1)


def correction_stats(state: CorrectionState) -> dict:
    """The four numbers worth logging every step, and what each one tells you.

    * ``anchor_fraction`` -- realised share of groups executed for real; it
      drifts below target when the sandbox pool's concurrency cap binds.
    * ``calibrated`` -- False means the run is still training on raw WM scores.
    * ``bias_reduction`` -- share of within-group bias the current map removes
      (on its own buffer); near 0 means the WM is already calibrated, or stale.
    * ``anchor_weight`` -- 1 until c is fixed, then rises and falls with the
      measured disagreement: a climbing weight is a WM getting worse.
    """
    return dict(anchor_fraction=_anchor_fraction(state), calibrated=state.fitted.valid,
                bias_reduction=state.bias_reduction, anchor_weight=anchor_weight(state))


# ------------------------------------------------------------ anchor schedule


def select_anchor_groups(
        rng,
        n_groups: int,
        *,
        fraction: float,
        min_per_step: int,
        max_concurrent: int | None = None,
        in_flight: int = 0,
) -> np.ndarray:
    """Choose which groups pay for real execution this step (host side).

        want = min(max(min_per_step, round(fraction * n_groups)), n_groups,
                   max_concurrent - in_flight  [if a cap is given, floored at 0])

    chosen uniformly without replacement. Deterministic given the seed: the
    floor keeps the calibration fed every step, the cap keeps a burst of anchor
    groups from starving the sandbox pool.

    Args:
        rng: an int seed, a ``numpy.random.Generator`` (advanced in place), or
            a JAX PRNG key.
        n_groups: groups this step.

    Returns:
        Sorted int64 indices, shape [want].
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction: {fraction!r}, expected a value in [0, 1]")
    if int(n_groups) != n_groups or n_groups < 0:
        raise ValueError(f"n_groups: {n_groups!r}, expected an integer >= 0")
    if min_per_step < 0:
        raise ValueError(f"min_per_step: {min_per_step!r}, expected >= 0")
    if in_flight < 0:
        raise ValueError(f"in_flight: {in_flight!r}, expected >= 0")
    n_groups = int(n_groups)
    want = min(max(int(min_per_step), int(round(fraction * n_groups))), n_groups)
    if max_concurrent is not None:
        want = min(want, max(0, int(max_concurrent) - int(in_flight)))
    if want == 0:
        return np.zeros((0,), np.int64)
    if isinstance(rng, jax.Array):
        idx = np.asarray(jax.random.choice(rng, n_groups, (want,), replace=False))
    else:
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(int(rng))
        idx = gen.choice(n_groups, size=want, replace=False)
    return np.sort(idx.astype(np.int64))
