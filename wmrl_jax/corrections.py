"""WMRL's two corrections of world-model rewards, as pure jit-able JAX.

A frozen world model (WM) predicts each rollout's score; a few groups per step
are also executed for real ("anchors"). Two kinds of WM error, two corrections
(DESIGN.md, "Semantics of the paper's corrections" is the exact behaviour):

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
ungraded. All state (ring buffer, map, EWMA, constant, counters) is one pytree,
so Orbax checkpoints it with the model and a resumed run continues exactly.

Everything is jit-able with static shapes: the FIFO is a ring buffer with a
length, pairs are pushed one at a time inside ``lax.scan`` so a refit can
happen in the middle of a step exactly as in the reference, and a refit is a
``lax.cond`` (its O(cap) work runs only when due).
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
    "init_correction_state",
    "correct_step",
    "correction_stats",
    "anchor_weight",
    "select_anchor_groups",
]

CALIBRATIONS = ("binned", "exact")
_VAR_FLOOR = 1e-9  # var(s) below this: a degenerate group, no ranking to compare
_EWMA_FLOOR = 1e-12  # disagreement this small cannot set a finite constant c


# ----------------------------------------------------------------- diagnostics


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
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.ndim != 1 or y.shape != x.shape:
        raise ValueError(f"bias_stats: x {tuple(x.shape)} and y {tuple(y.shape)}, expected equal [n]")
    m = jnp.ones(x.shape, bool) if mask is None else jnp.asarray(mask)
    if m.shape != x.shape or m.dtype != jnp.bool_:
        raise ValueError(f"bias_stats: mask {m.dtype}{tuple(m.shape)}, expected bool{tuple(x.shape)}")
    xh = x if fitted is None else apply_calibration(fitted, x)

    def centred_mse(a):
        cnt = jnp.maximum(m.sum(), 1).astype(x.dtype)
        a_bar = jnp.where(m, a, 0.0).sum() / cnt
        y_bar = jnp.where(m, y, 0.0).sum() / cnt
        return jnp.where(m, ((a - a_bar) - (y - y_bar)) ** 2, 0.0).sum() / cnt

    before, after = centred_mse(x), centred_mse(xh)
    return before, after, 1.0 - after / jnp.maximum(1e-9, before)


def group_disagreement(calibrated: Array, real: Array, mask: Array | None = None):
    """Normalised within-group disagreement of calibrated WM scores with truth.

        s^2 = mean(((d - mean d) - (s - mean s))^2) / var(s)     (population var)

    over the masked entries (pairs where both scores exist). Dimensionless, so
    groups of different difficulty compare. A group whose real scores are all
    equal (var(s) < 1e-9) carries no ranking information and is skipped rather
    than counted as 0, which would drag the estimate down.

    Returns:
        (s2, ok): s2 float scalar (0 when not ok), ok bool scalar.
    """
    d, s = jnp.asarray(calibrated), jnp.asarray(real)
    m = jnp.ones(d.shape, bool) if mask is None else jnp.asarray(mask)
    if d.shape != s.shape or m.shape != d.shape:
        raise ValueError(
            f"group_disagreement: calibrated {tuple(d.shape)}, real {tuple(s.shape)}, "
            f"mask {tuple(m.shape)}, expected all equal"
        )
    cnt = m.sum()
    c = jnp.maximum(cnt, 1).astype(d.dtype)
    d = jnp.where(m, d, 0.0)
    s = jnp.where(m, s, 0.0)
    dc = jnp.where(m, d - d.sum() / c, 0.0)
    sc = jnp.where(m, s - s.sum() / c, 0.0)
    var_s = (sc**2).sum() / c
    ok = (cnt > 0) & (var_s >= _VAR_FLOOR)
    s2 = ((dc - sc) ** 2).sum() / c / jnp.where(ok, var_s, 1.0)
    return jnp.where(ok, s2, 0.0), ok


# ----------------------------------------------------------------------- state


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """What fixes array shapes or code paths: static, part of the jit cache key.

    Every other setting is a scalar in the state, so one compiled step serves
    every ablation arm and hyper-parameter (and a run may change them mid-way).
    """

    cap: int = 5000  # FIFO of the newest pairs: the map tracks the current policy
    bins: int = 10  # equal-width bins over [0, 1] (binned calibration)
    calibration: str = "binned"  # "binned" (paper) or "exact" isotonic


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "buf_x", "buf_y", "buf_len", "buf_head", "since", "n_pairs", "n_fits", "fitted",
        "bias_before", "bias_after", "bias_reduction", "ewma", "n_obs", "c", "c_set",
        "n_steps", "n_groups_seen", "n_anchor_seen", "debias", "denoise", "min_pairs",
        "refit_every", "alpha", "warmup", "w_max", "target_weight",
    ],
    meta_fields=["config"],
)
@dataclasses.dataclass(frozen=True)
class CorrectionState:
    """All correction state; a pytree (checkpointable), config static."""

    buf_x: Array  # [cap] WM scores of the buffered pairs (ring)
    buf_y: Array  # [cap] real scores of the buffered pairs
    buf_len: Array  # int32, pairs held (<= cap); slots [0, buf_len) are live
    buf_head: Array  # int32, next slot to write (the oldest once full)
    since: Array  # int32, pairs arrived since the last successful refit
    n_pairs: Array  # int32, pairs ever pushed
    n_fits: Array  # int32, successful refits
    fitted: MonotoneMap  # current map (valid False = identity)
    bias_before: Array  # diagnostics of the last refit, on its buffer
    bias_after: Array
    bias_reduction: Array
    ewma: Array  # disagreement EWMA (meaningful once n_obs > 0)
    n_obs: Array  # int32, non-degenerate anchor groups observed
    c: Array  # the frozen scale constant (meaningful once c_set)
    c_set: Array  # bool
    n_steps: Array  # int32 correct_step calls
    n_groups_seen: Array  # int32 groups seen, for the realised anchor fraction
    n_anchor_seen: Array  # int32 anchor groups seen
    # Settings as data (see CorrectionConfig for why). Paper values by default.
    debias: Array  # bool; False: the map stays the identity (pairs still buffered)
    denoise: Array  # bool; False: anchor weight 1 (disagreement still tracked)
    min_pairs: Array  # int32 (200): identity until this many pairs are buffered
    refit_every: Array  # int32 (64): pairs since the last successful refit
    alpha: Array  # EWMA rate 1 - 0.5^(1 / max(1, half_life)), half-life 64 groups
    warmup: Array  # int32 (32): groups observed before c is fixed
    w_max: Array  # (4.0) the anchor weight never exceeds this
    target_weight: Array  # (2.0) the weight at the moment c is fixed
    config: CorrectionConfig


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
    config = CorrectionConfig(int(cap), int(bins), calibration)
    dtype = jnp.zeros(()).dtype if dtype is None else jnp.dtype(dtype)
    k = config.bins if calibration == "binned" else config.cap
    i32 = functools.partial(jnp.zeros, (), jnp.int32)
    f = functools.partial(jnp.zeros, (), dtype)
    fitted = MonotoneMap(jnp.zeros((k,), dtype), jnp.zeros((k,), dtype), i32(), jnp.zeros((), bool))
    return CorrectionState(
        buf_x=jnp.zeros((config.cap,), dtype), buf_y=jnp.zeros((config.cap,), dtype),
        buf_len=i32(), buf_head=i32(), since=i32(), n_pairs=i32(), n_fits=i32(), fitted=fitted,
        bias_before=f(), bias_after=f(), bias_reduction=f(), ewma=f(), n_obs=i32(), c=f(),
        c_set=jnp.zeros((), bool), n_steps=i32(), n_groups_seen=i32(), n_anchor_seen=i32(),
        debias=jnp.asarray(bool(debias)), denoise=jnp.asarray(bool(denoise)),
        min_pairs=jnp.asarray(int(min_pairs), jnp.int32),
        refit_every=jnp.asarray(int(refit_every), jnp.int32),
        alpha=jnp.asarray(1.0 - 0.5 ** (1.0 / max(1.0, float(half_life))), dtype),
        warmup=jnp.asarray(int(warmup), jnp.int32), w_max=jnp.asarray(float(w_max), dtype),
        target_weight=jnp.asarray(float(target_weight), dtype), config=config,
    )


# ------------------------------------------------------------------ mechanics


def _refit(st: CorrectionState) -> CorrectionState:
    """Fit on the whole buffer; keep the old map if the fit is degenerate."""
    cfg = st.config
    live = jnp.arange(cfg.cap) < st.buf_len
    if cfg.calibration == "binned":
        new = binned_isotonic_fit(st.buf_x, st.buf_y, live, bins=cfg.bins)
    else:
        new = isotonic_fit(st.buf_x, st.buf_y, mask=live)
    ok = new.valid
    before, after, red = bias_stats(st.buf_x, st.buf_y, new, live)
    keep = lambda a, b: jnp.where(ok, a, b)  # noqa: E731
    return dataclasses.replace(
        st,
        fitted=jax.tree.map(keep, new, st.fitted),
        since=keep(0, st.since),
        n_fits=st.n_fits + ok.astype(jnp.int32),
        bias_before=keep(before, st.bias_before),
        bias_after=keep(after, st.bias_after),
        bias_reduction=keep(red, st.bias_reduction),
    )


def _push(st: CorrectionState, x: Array, y: Array, do: Array) -> CorrectionState:
    """Append one pair (when ``do``) to the FIFO; refit if due (DESIGN.md)."""
    cfg = st.config
    head = st.buf_head
    d = do.astype(jnp.int32)
    st = dataclasses.replace(
        st,
        buf_x=st.buf_x.at[head].set(jnp.where(do, x, st.buf_x[head])),
        buf_y=st.buf_y.at[head].set(jnp.where(do, y, st.buf_y[head])),
        buf_head=(head + d) % cfg.cap,
        buf_len=jnp.minimum(st.buf_len + d, cfg.cap),
        since=st.since + d,
        n_pairs=st.n_pairs + d,
    )
    due = do & st.debias & (st.buf_len >= st.min_pairs) & (st.since >= st.refit_every)
    return lax.cond(due, _refit, lambda s: s, st)


def _refit_possible(st: CorrectionState, pair: Array) -> Array:
    """Whether pushing ``pair``'s pairs in order could trigger a refit."""
    k = jnp.cumsum(pair.astype(jnp.int32))
    due = pair & (jnp.minimum(st.buf_len + k, st.config.cap) >= st.min_pairs) & (
        st.since + k >= st.refit_every)
    # More pairs than slots would overwrite a slot twice in one scatter.
    return (st.debias & due.any()) | (k[-1] > st.config.cap)


def _write(st: CorrectionState, x: Array, y: Array, pair: Array) -> CorrectionState:
    """Push all of ``pair``'s pairs at once (valid only when no refit is due)."""
    cfg = st.config
    k = jnp.cumsum(pair.astype(jnp.int32))
    slot = jnp.where(pair, (st.buf_head + k - 1) % cfg.cap, cfg.cap)
    p = k[-1]
    return dataclasses.replace(
        st,
        buf_x=st.buf_x.at[slot].set(x, mode="drop"),
        buf_y=st.buf_y.at[slot].set(y, mode="drop"),
        buf_head=(st.buf_head + p) % cfg.cap,
        buf_len=jnp.minimum(st.buf_len + p, cfg.cap),
        since=st.since + p,
        n_pairs=st.n_pairs + p,
    )


def _push_many(st: CorrectionState, x: Array, y: Array, pair: Array) -> CorrectionState:
    """Push one group's pairs in order: one at a time only if a refit may fall
    among them (the refit must see the buffer exactly as of its push)."""

    def one_by_one(st):
        return lax.scan(lambda s, q: (_push(s, *q), None), st, (x, y, pair))[0]

    return lax.cond(_refit_possible(st, pair), one_by_one, lambda s: _write(s, x, y, pair), st)


def _ewma_update(ewma, n_obs, c, c_set, alpha, warmup, target_weight, s2, do):
    """Fold one group's disagreement into the EWMA; fix c once after warm-up."""
    new = jnp.where(n_obs == 0, s2, (1.0 - alpha) * ewma + alpha * s2)
    ewma = jnp.where(do, new, ewma)
    n_obs = n_obs + do.astype(jnp.int32)
    fix = do & ~c_set & (n_obs >= warmup) & (ewma > _EWMA_FLOOR)
    c = jnp.where(fix, (target_weight - 1.0) / jnp.where(fix, ewma, 1.0), c)
    return ewma, n_obs, c, c_set | fix


_EWMA_KEYS = ("ewma", "n_obs", "c", "c_set")


def _observe(st: CorrectionState, s2: Array, do: Array) -> CorrectionState:
    """Fold one group's disagreement (when ``do``) into the state."""
    out = _ewma_update(*(getattr(st, k) for k in _EWMA_KEYS), st.alpha, st.warmup,
                       st.target_weight, s2, do)
    return dataclasses.replace(st, **dict(zip(_EWMA_KEYS, out)))


def _observe_many(st: CorrectionState, s2: Array, do: Array) -> CorrectionState:
    """``_observe`` over groups in order, carrying only the four scalars."""
    params = (st.alpha, st.warmup, st.target_weight)

    def body(carry, inp):
        return _ewma_update(*carry, *params, *inp), None

    # Unrolled: N is small and static, and a loop costs more than its body.
    carry, _ = lax.scan(body, tuple(getattr(st, k) for k in _EWMA_KEYS), (s2, do), unroll=True)
    return dataclasses.replace(st, **dict(zip(_EWMA_KEYS, carry)))


def anchor_weight(st: CorrectionState) -> Array:
    """w = 1 until c is fixed, then clip(1 + c * EWMA, 1, w_max); 1 without denoising."""
    w = jnp.clip(1.0 + st.c * st.ewma, 1.0, st.w_max)
    return jnp.where(st.c_set & st.denoise, w, 1.0).astype(st.buf_x.dtype)


def _check(name, a, shape, kind):
    a = jnp.asarray(a)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    if kind == "float" and not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"{name}: dtype {a.dtype}, expected a floating dtype")
    if kind == "bool" and a.dtype != jnp.bool_:
        raise TypeError(f"{name}: dtype {a.dtype}, expected bool")
    return a


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
):
    """One step of WMRL's corrections, in the reference order (DESIGN.md).

    Groups are processed in index order. An anchor group pushes its pairs
    (rollouts scored by both) into the debiaser one at a time -- a refit may
    happen after any of them -- then its disagreement is measured on the
    freshly calibrated WM scores. Any other group gets calibrated WM scores
    (with the map current at its turn). The anchor weight is read after all
    groups; advantages are ``losses.group_advantages`` with anchor groups
    scoring real rewards times the weight.

    Args:
        state: from ``init_correction_state``.
        wm_rewards, real_rewards: float[N, G] (entries not graded are ignored;
            NaN/inf count as ungraded).
        wm_graded, real_graded: bool[N, G].
        is_anchor: bool[N], groups also executed for real.
        eps, min_graded, standardize: as ``group_advantages``; ``standardize``
            may be a traced bool.

    Returns:
        (state, out) with out: ``rewards`` float[N, G] (real for anchors,
        calibrated WM otherwise; 0 where ungraded), ``graded`` bool[N, G],
        ``advantages`` float[N, G], ``used`` bool[N], ``anchor_weight``, and
        diagnostics ``calibrated``, ``n_fits``, ``bias_before``, ``bias_after``,
        ``bias_reduction``, ``disagreement`` (EWMA), ``pairs_in_buffer``,
        ``anchor_fraction`` (realised, over the run).
    """
    wm_rewards = jnp.asarray(wm_rewards)
    if wm_rewards.ndim != 2:
        raise ValueError(f"wm_rewards: shape {tuple(wm_rewards.shape)}, expected [N groups, G rollouts]")
    n, g = wm_rewards.shape
    wm_rewards = _check("wm_rewards", wm_rewards, (n, g), "float")
    wm_graded = _check("wm_graded", wm_graded, (n, g), "bool")
    real_rewards = _check("real_rewards", real_rewards, (n, g), "float")
    real_graded = _check("real_graded", real_graded, (n, g), "bool")
    is_anchor = _check("is_anchor", is_anchor, (n,), "bool")
    dtype = state.buf_x.dtype
    wm_ok = wm_graded & jnp.isfinite(wm_rewards)
    real_ok = real_graded & jnp.isfinite(real_rewards)
    wm = jnp.where(wm_ok, wm_rewards, 0.0).astype(dtype)
    real = jnp.where(real_ok, real_rewards, 0.0).astype(dtype)

    def one_group(st, inp):
        wm_i, wm_ok_i, real_i, real_ok_i, anchor_i = inp
        pair = anchor_i & wm_ok_i & real_ok_i
        st = _push_many(st, wm_i, real_i, pair)
        calibrated = apply_calibration(st.fitted, wm_i)
        s2, ok = group_disagreement(calibrated, real_i, pair)
        st = _observe(st, s2, anchor_i & ok)
        rewards = jnp.where(anchor_i, real_i, calibrated)
        graded = jnp.where(anchor_i, real_ok_i, wm_ok_i)
        return st, (jnp.where(graded, rewards, 0.0), graded)

    def in_order(st):
        return lax.scan(one_group, st, (wm, wm_ok, real, real_ok, is_anchor))

    def without_refit(st):
        # No refit anywhere in this step: the map is the same for every group,
        # so the step vectorises; only the scalar EWMA recursion stays serial.
        pair = is_anchor[:, None] & wm_ok & real_ok
        st = _write(st, wm.reshape(-1), real.reshape(-1), pair.reshape(-1))
        calibrated = apply_calibration(st.fitted, wm)
        s2, ok = jax.vmap(group_disagreement)(calibrated, real, pair)
        st = _observe_many(st, s2, is_anchor & ok)
        rewards = jnp.where(is_anchor[:, None], real, calibrated)
        graded = jnp.where(is_anchor[:, None], real_ok, wm_ok)
        return st, (jnp.where(graded, rewards, 0.0), graded)

    all_pairs = (is_anchor[:, None] & wm_ok & real_ok).reshape(-1)
    state, (rewards, graded) = lax.cond(_refit_possible(state, all_pairs), in_order, without_refit,
                                        state)
    state = dataclasses.replace(
        state,
        n_steps=state.n_steps + 1,
        n_groups_seen=state.n_groups_seen + n,
        n_anchor_seen=state.n_anchor_seen + is_anchor.sum().astype(jnp.int32),
    )
    weight = anchor_weight(state)
    adv, used = group_advantages(rewards, graded, is_anchor, weight, eps=eps,
                                 min_graded=min_graded, standardize=True)
    if not isinstance(standardize, bool) or not standardize:
        # standardize may be traced: both variants are [N, G]-cheap, and one
        # compiled step then serves both ablation arms.
        centred, _ = group_advantages(rewards, graded, is_anchor, weight, eps=eps,
                                      min_graded=min_graded, standardize=False)
        adv = jnp.where(standardize, adv, centred)
    out = dict(rewards=rewards, graded=graded, advantages=adv, used=used, anchor_weight=weight)
    out.update(_diagnostics(state))
    return state, out


def _diagnostics(st: CorrectionState) -> dict:
    return dict(
        calibrated=st.fitted.valid,
        n_fits=st.n_fits,
        bias_before=st.bias_before,
        bias_after=st.bias_after,
        bias_reduction=st.bias_reduction,
        disagreement=st.ewma,
        pairs_in_buffer=st.buf_len,
        anchor_fraction=st.n_anchor_seen / jnp.maximum(st.n_groups_seen, 1),
    )


def correction_stats(st: CorrectionState) -> dict:
    """The four numbers worth logging every step, and what each one tells you.

    * ``anchor_fraction`` -- realised share of groups executed for real; it
      drifts below target when the sandbox pool's concurrency cap binds.
    * ``calibrated`` -- False means the run is still training on raw WM scores.
    * ``bias_reduction`` -- share of within-group bias the current map removes
      (on its own buffer); near 0 means the WM is already calibrated, or stale.
    * ``anchor_weight`` -- 1 until c is fixed, then rises and falls with the
      measured disagreement: a climbing weight is a WM getting worse.
    """
    d = _diagnostics(st)
    return dict(anchor_fraction=d["anchor_fraction"], calibrated=d["calibrated"],
                bias_reduction=d["bias_reduction"], anchor_weight=anchor_weight(st))


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

