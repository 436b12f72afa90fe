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
ungraded. All state (ring buffer, map, EWMA, constant, counters) is one pytree
of two arrays, so Orbax checkpoints it with the model and a resumed run
continues exactly (few leaves: a jitted call per step pays per leaf).

Everything is jit-able with static shapes: the FIFO is a ring buffer with a
length, and a step's pairs are written in segments that end exactly where a
refit falls due, so a refit can happen in the middle of a step, seeing the
buffer as of its push, as in the reference; the O(cap) refit runs only when
due (a ``lax.while_loop``, one iteration per refit).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from wmrl_jax._correction_state import (
    CorrectionConfig,
    CorrectionState,
    Fields,
    StepOutput,
    init_correction_state,
    pack,
    step_output,
    unpack,
    unpack_packed,
)
from wmrl_jax._isotonic import (
    MonotoneMap,
    apply_calibration,
    binned_isotonic_fit,
    binned_fit_from_sums,
    binned_isotonic_predict,
    add_rows_by_bin,
    bin_index,
    by_bin,
    isotonic_fit,
    isotonic_predict,
    predict_in_bins,
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
    "StepOutput",
    "correction_stats",
    "anchor_weight",
    "select_anchor_groups",
]

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
    return _bias_from_sums(*_bias_sums(x, x if fitted is None else apply_calibration(fitted, x), y, m))


def _bias_sums(x, xh, y, m, sums=None):
    """The sums ``bias_stats`` needs, given the calibrated scores ``xh``:
    ``sums`` (count, sum x, sum xh, sum y; computed unless given) and the two
    centred sums of squares."""
    # Two passes, each one reduction over stacked rows (few XLA operations:
    # on CPU each costs more to launch than these sums cost to compute).
    if sums is None:
        sums = jnp.where(m, jnp.stack([jnp.ones_like(x), x, xh, y]), 0.0).sum(axis=1)
    x_bar, xh_bar, y_bar = sums[1:] / jnp.maximum(sums[0], 1.0)
    d = jnp.stack([(x - x_bar) - (y - y_bar), (xh - xh_bar) - (y - y_bar)])
    return sums, jnp.where(m, d * d, 0.0).sum(axis=1)


def _bias_from_sums(sums, squares):
    """(before, after, reduction) from ``_bias_sums`` (scalar work: the refit
    does it on its own, away from the buffer)."""
    before, after = squares / jnp.maximum(sums[0], 1.0)
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
    # (d - mean d) - (s - mean s) = u - mean u with u = d - s. Each pass is
    # one reduction over stacked rows: fewer XLA operations (on CPU each
    # costs more to launch than these sums cost to compute). Measured in
    # correct_step: a call without a refit 0.094 -> 0.065 ms, far more than
    # the two operations it saves (XLA:CPU's costs are not all per operation).
    us = jnp.where(m, jnp.stack([d - s, s]), 0.0)
    centred = jnp.where(m, us - (us.sum(axis=-1, keepdims=True) / c), 0.0)
    var_u, var_s = (centred**2).sum(axis=-1) / c
    ok = (cnt > 0) & (var_s >= _VAR_FLOOR)
    return jnp.where(ok, var_u / jnp.where(ok, var_s, 1.0), 0.0), ok


# ----------------------------------------------------------------------- state
# CorrectionState is two packed arrays (see _correction_state for why); the
# mechanics below work on its unpacked view, Fields, and the ring buffer
# ``buffer`` float[2, cap] (WM scores; real scores), passed only where touched.


# ------------------------------------------------------------------ mechanics


def _on_its_own(fn, *args):
    """``fn(*args)``, compiled as a nested computation of its own.

    Why: XLA:CPU runs the operations of one computation one after another on
    the calling thread only where they number <= 8 or all touch <= 512 bytes;
    otherwise its executor tracks their dependencies and hands ready ones to
    its thread pool, ~1 us an operation. A refit touches the 5000-pair buffer,
    so every small operation around it (counters, the [N, G] scores, the
    10-bin fit) would pay that too. Given a computation of its own -- a
    conditional whose predicate XLA cannot fold (always true; the other
    branch, zeros, never runs) -- small work runs sequentially again, and
    the computations that touch the buffer keep only the operations that do
    (measured: a step that refits, 0.35 -> 0.24 ms a call).
    """
    shapes = jax.eval_shape(fn, *args)
    zeros = lambda *_: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)  # noqa: E731
    return lax.cond(lax.optimization_barrier(jnp.bool_(True)), fn, zeros, *args)


def _keep_if_valid(st: Fields, new: MonotoneMap, before, after, red) -> Fields:
    """Adopt a fresh fit and its diagnostics, unless it is degenerate."""
    ok = new.valid
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


def _refit(packed: Array, buffer: Array, config: CorrectionConfig):
    """Fit on the whole buffer; keep the old map if the fit is degenerate.

    Works on the state's packed ``fields`` and returns them packed. The
    buffer-sized work (bin sums, bias statistics; the exact fit) stays here;
    the small work runs ``_on_its_own``.
    """
    x, y = buffer[0], buffer[1]
    live = jnp.arange(config.cap) < unpack_packed(packed, config).buf_len
    if config.calibration == "binned":
        # binned_isotonic_fit in its two halves, so the 10-bin fit runs on its
        # own (its input checks would change nothing: the buffer only ever
        # holds pairs whose two scores are finite). Every live pair's bin is
        # populated, so the fresh map calibrates them bin by bin, a few
        # operations each (``interpolate`` would unroll over all segments).
        # Why the bins are computed on their own: XLA would fuse them into
        # each of their users, and XLA:CPU splits any pass over the buffer
        # that costs more than ~8 operations an entry over two threads, which
        # here only adds a hand-off (measured: a refit step 0.25 -> 0.19 ms).
        idx = _on_its_own(lambda b: bin_index(b[0], config.bins), buffer)

        def fit(rows):
            count = rows[:, 2].astype(jnp.int32)
            new = binned_fit_from_sums(rows[:, 0], rows[:, 1], count)
            return new, by_bin(new, count), rows.sum(axis=0)

        # binned_sums without its masking pass: slots past buf_len were never
        # written, so hold zeros, and only their count needs masking.
        rows = jnp.stack([x, y, live.astype(x.dtype)], axis=-1)
        new, table, (sum_x, sum_y, count) = _on_its_own(fit, add_rows_by_bin(rows, idx, config.bins))
        xh = jnp.where(new.valid, predict_in_bins(table, x, idx), x)
        # The bins' totals are the bias statistics' first pass but for xh.
        sums = jnp.stack([count, sum_x, jnp.where(live, xh, 0.0).sum(), sum_y])
    else:
        new = isotonic_fit(x, y, mask=live)
        xh = apply_calibration(new, x)
        sums = None

    def adopt(packed, new, sums):
        return pack(_keep_if_valid(unpack_packed(packed, config), new, *_bias_from_sums(*sums)))

    return _on_its_own(adopt, packed, new, _bias_sums(x, xh, y, live, sums))


def _advance(st: Fields, sel: Array, ranked: tuple[Array, Array] | None = None) -> tuple[Fields, Array]:
    """Append the selected pairs (``sel`` bool[P], in order) to the FIFO's
    counters; returns each pair's slot (``cap``: not written).

    ``ranked``: (rank int32[P], each selected pair's 1-based position among
    them; m, how many are selected), where the caller has them; otherwise
    from ``cumsum(sel)`` (four XLA operations).
    """
    cap = st.config.cap
    if ranked is None:
        rank = jnp.cumsum(sel.astype(jnp.int32))
        m = rank[-1]
    else:
        rank, m = ranked
    # Of more than cap pairs only the newest cap survive: writing only those
    # keeps every slot written once (a scatter's duplicate order is undefined).
    slot = jnp.where(sel & (rank > m - cap), (st.buf_head + rank - 1) % cap, cap)
    st = dataclasses.replace(
        st,
        buf_head=(st.buf_head + m) % cap,
        buf_len=jnp.minimum(st.buf_len + m, cap),
        since=st.since + m,
        n_pairs=st.n_pairs + m,
    )
    return st, slot


_WRITE_PAIRS = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(1,),
                                           scatter_dims_to_operand_dims=(1,))


def _scatter(buffer: Array, slot: Array, pairs: Array) -> Array:
    """Write ``pairs`` float[P, 2] (WM, real) into ``buffer`` float[2, cap] at
    ``slot`` int32[P] (``cap``: dropped).

    As ``lax.scatter`` on pair-major rows: ``buffer.at[:, slot].set(pairs.T)``
    compiles to the same scatter plus two XLA operations that re-lay its
    indices and updates out first (jnp's negative-index handling, a transpose).
    """
    return lax.scatter(buffer, slot[:, None], pairs, _WRITE_PAIRS, mode=lax.GatherScatterMode.FILL_OR_DROP)


def _pushes_to_refit(st: Fields) -> Array:
    """How many more pushes until a refit is due (a huge number if never).

    Due after a push once the buffer holds >= min_pairs and >= refit_every
    pairs arrived since the last successful refit; both only grow with pushes.
    """
    never = jnp.iinfo(jnp.int32).max
    k = jnp.maximum(1, jnp.maximum(st.refit_every - st.since, st.min_pairs - st.buf_len))
    return jnp.where(st.debias & (st.min_pairs <= st.config.cap), k, never)


def _push_and_calibrate(state: CorrectionState, xy: Array, pair: Array):
    """Push the step's pairs in order, refitting after each push where due,
    and calibrate every group with the map current after its own pairs.

    The reference pushes one pair at a time and checks after each push whether
    a refit is due. Where the next one falls follows from the counters alone
    (``_pushes_to_refit``), so the pairs up to it are written in one scatter,
    the refit runs there, and the loop goes on from the next pair: one
    iteration per refit, not one per pair. A refit sees the buffer exactly as
    of its push; a failed (degenerate) fit leaves ``since`` due, so the next
    pair tries again, as in the reference.

    The small work (counters, the [N, G] scores) runs ``_on_its_own``, apart
    from the buffer-sized work, and the loop carries the state packed.

    Args:
        state: the state before the step.
        xy: float[N * G, 2] the step's (WM, real) scores, group-major;
        pair: bool[N, G], rollouts pushed as pairs.

    Returns:
        (packed state, calibrated float[N, G], (rank, m)): group i calibrated
        by the map after all refits up to its last pair (for a group without
        pairs: the map at its turn); each pair's 1-based rank among the
        step's pairs and their number, for ``_advance``. The buffer the
        refits saw is dropped: the step's pairs land where ``_advance`` of the
        whole step puts them, so the caller writes them all at once, in place.
    """
    n, g = pair.shape
    sel = pair.reshape(-1)
    wm = xy[:, 0].reshape(n, g)

    def prep(sel):
        ordinal = jnp.cumsum(sel.astype(jnp.int32))  # pair q is the q-th pushed (1-based)
        return ordinal, ordinal[-1], ordinal.reshape(n, g)[:, -1]

    ordinal, total, group_end = _on_its_own(prep, sel)

    def calibrate(st, p0, cal):
        # Groups ending at or after p0 see this map (later segments overwrite).
        return jnp.where((group_end >= p0)[:, None], apply_calibration(st.fitted, wm), cal)

    def due(carry):
        packed, _, p0, _ = carry
        return _pushes_to_refit(unpack_packed(packed, state.config)) <= total - p0

    def segment(packed, p0, cal):
        st = unpack_packed(packed, state.config)
        k = p0 + _pushes_to_refit(st)
        cal = calibrate(st, p0, cal)
        ranked = ordinal - p0, jnp.minimum(k, total) - p0  # pairs p0+1..k
        st, slot = _advance(st, sel & (ordinal > p0) & (ordinal <= k), ranked)
        return pack(st), slot, k, cal

    def body(carry):
        # The barrier keeps XLA from hoisting the settings' unpacking out of
        # the loop: as loop-carried scalars they would cost an operation each.
        packed, buffer, p0, cal = lax.optimization_barrier(carry)
        packed, slot, k, cal = _on_its_own(segment, packed, p0, cal)
        buffer = _scatter(buffer, slot, xy)
        return _refit(packed, buffer, state.config), buffer, k, cal

    packed, buffer, p0, cal = lax.while_loop(due, body, (state.fields, state.buffer, jnp.int32(0), wm))

    def post(packed, p0, cal):
        st = unpack_packed(packed, state.config)
        cal = calibrate(st, p0, cal)
        st, _ = _advance(st, sel & (ordinal > p0), (ordinal - p0, total - p0))
        return pack(st), cal

    packed, cal = _on_its_own(post, packed, p0, cal)
    return packed, cal, (ordinal, total)


def _ewma_update(ewma, n_obs, c_set, fix_at, alpha, warmup, s2, do):
    """Fold one group's disagreement into the EWMA; mark where c gets fixed.

    ``fix_at`` is the EWMA at the moment c is fixed (c itself, one division,
    is computed after all groups: see ``_observe_many``).
    """
    new = jnp.where(n_obs == 0, s2, (1.0 - alpha) * ewma + alpha * s2)
    ewma = jnp.where(do, new, ewma)
    n_obs = n_obs + do.astype(jnp.int32)
    fix = do & ~c_set & (n_obs >= warmup) & (ewma > _EWMA_FLOOR)
    return ewma, n_obs, c_set | fix, jnp.where(fix, ewma, fix_at)


def _observe_many(st: Fields, s2: Array, do: Array) -> Fields:
    """Fold each group's disagreement (where ``do``) into the EWMA, in order;
    fix c = (target_weight - 1) / EWMA once, after warm-up."""

    def body(carry, inp):
        return _ewma_update(*carry, st.alpha, st.warmup, *inp), None

    # Unrolled: N is small and static, and a loop costs more than its body.
    # c is fixed at most once, so its division waits until after the groups.
    init = (st.ewma, st.n_obs, st.c_set, jnp.ones_like(st.ewma))
    (ewma, n_obs, c_set, fix_at), _ = lax.scan(body, init, (s2, do), unroll=True)
    fixed = c_set & ~st.c_set
    c = jnp.where(fixed, (st.target_weight - 1.0) / fix_at, st.c)
    return dataclasses.replace(st, ewma=ewma, n_obs=n_obs, c=c, c_set=c_set)


def anchor_weight(st: CorrectionState) -> Array:
    """w = 1 until c is fixed, then clip(1 + c * EWMA, 1, w_max); 1 without denoising."""
    w = jnp.clip(1.0 + st.c * st.ewma, 1.0, st.w_max)
    return jnp.where(st.c_set & st.denoise, w, 1.0).astype(st.ewma.dtype)


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
        state: from ``init_correction_state``. A host loop calling the jitted
            step should donate it (``jax.jit(correct_step, donate_argnums=0)``).
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
        ``anchor_fraction`` (realised, over the run). ``out`` is a
        :class:`StepOutput`: it reads as that dict (``out["n_fits"]``,
        ``dict(out)``) while its pytree is two packed arrays, which a jitted
        call hands back far faster than thirteen.
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
    if not isinstance(state, CorrectionState):
        raise TypeError(f"state: {type(state).__name__}, expected CorrectionState (init_correction_state)")
    dtype = state.buffer.dtype

    def inputs():
        # Called inside each branch below (see the end): cheap, and kept out
        # of the top level on purpose.
        wm_ok = wm_graded & jnp.isfinite(wm_rewards)
        real_ok = real_graded & jnp.isfinite(real_rewards)
        wm = jnp.where(wm_ok, wm_rewards, 0.0).astype(dtype)
        real = jnp.where(real_ok, real_rewards, 0.0).astype(dtype)
        pair = is_anchor[:, None] & wm_ok & real_ok
        return wm, real, wm_ok, real_ok, pair

    def finish(st, calibrated):
        """Disagreement, EWMA, advantages: everything after calibration."""
        wm, real, wm_ok, real_ok, pair = inputs()
        s2, ok = jax.vmap(group_disagreement)(calibrated, real, pair)
        st = _observe_many(st, s2, is_anchor & ok)
        graded = jnp.where(is_anchor[:, None], real_ok, wm_ok)
        rewards = jnp.where(graded, jnp.where(is_anchor[:, None], real, calibrated), 0.0)
        st = dataclasses.replace(
            st,
            n_steps=st.n_steps + 1,
            n_groups_seen=st.n_groups_seen + n,
            n_anchor_seen=st.n_anchor_seen + is_anchor.sum().astype(jnp.int32),
        )
        weight = anchor_weight(st)
        adv, used = group_advantages(rewards, graded, is_anchor, weight, eps=eps,
                                     min_graded=min_graded, standardize=True)
        if not isinstance(standardize, bool) or not standardize:
            # standardize may be traced: both variants are [N, G]-cheap, and
            # one compiled step then serves both ablation arms.
            centred, _ = group_advantages(rewards, graded, is_anchor, weight, eps=eps,
                                          min_graded=min_graded, standardize=False)
            adv = jnp.where(standardize, adv, centred)
        out = step_output(rewards, graded, adv, used, anchor_weight=weight, **_diagnostics(st))
        return pack(st), out

    def xy_pairs():
        wm, real, _, _, pair = inputs()
        return jnp.stack([wm.reshape(-1), real.reshape(-1)], axis=1), pair  # [N G, 2]

    def no_refit():
        # One map for all groups: the step vectorises.
        xy, pair = xy_pairs()
        st, slot = _advance(unpack(state), pair.reshape(-1))
        return finish(st, apply_calibration(st.fitted, xy[:, 0].reshape(pair.shape))), slot, xy

    def in_order():
        xy, pair = xy_pairs()
        packed, calibrated, ranked = _push_and_calibrate(state, xy, pair)

        def post(packed, calibrated, ranked):  # the [N, G]-sized rest, on its own
            st = unpack_packed(packed, state.config)
            # Where the pairs land follows from the counters before the step.
            _, slot = _advance(unpack(state), pair.reshape(-1), ranked)
            return finish(st, calibrated), slot

        out, slot = _on_its_own(post, packed, calibrated, ranked)
        return out, slot, xy

    # The top level is the predicate, one conditional and one scatter of the
    # step's pairs into the donated ring buffer (in place: no copy of it per
    # call). XLA:CPU runs a program's operations one after another, without
    # its dependency-tracking executor, only where they number <= 8 or all
    # touch <= 512 bytes; a refit-capable step is far above both inside the
    # branches, so what stays at the top is kept to these few.
    refit = _pushes_to_refit(unpack(state)) <= inputs()[-1].sum()
    (fields, out), slot, xy = lax.cond(refit, in_order, no_refit)
    buffer = _scatter(state.buffer, slot, xy)
    return CorrectionState(buffer, fields, state.config), out


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

