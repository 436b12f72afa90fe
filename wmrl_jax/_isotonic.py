"""Isotonic (order-preserving) regression as jit-able JAX: the calibration maps.

Two fits, one map type:

* ``binned_isotonic_fit`` -- the paper's map (docs/design.md, "Semantics of
  the corrections"): 10 equal-width bins over [0, 1], weighted
  pool-adjacent-violators over the populated bins' mean y (weights = counts),
  knots at the bins' mean x.
* ``isotonic_fit`` -- the exact weighted isotonic regression of y on x (ties
  in x pooled first), the map ``sklearn.isotonic.IsotonicRegression(
  out_of_bounds="clip")`` predicts with.

Both return a :class:`MonotoneMap`: knots ``(x_k, y_k)`` padded to a static
length, of which the first ``n_knots`` are used, and a ``valid`` flag. A map is
applied by linear interpolation, flat beyond both ends (``np.interp``).

Why the exact fit is not the textbook stack-based PAV: a data-dependent stack
in ``lax.while_loop`` costs an XLA loop iteration per push and per pool --
measured 30x slower than sklearn at n = 50 000. Instead PAV runs in parallel
rounds on the cumulative-sum diagram P_k = (sum_{i<k} w_i, sum_{i<k} w_i y_i):
a block's mean is the slope between consecutive block boundaries, and every
boundary whose left block mean exceeds its right one is removed at once
(PAV's result does not depend on the order of pooling). Rounds = pooling
depth, ~10-15 on noisy data; one huge low outlier at the top of increasing
data needs a round per pooled block (correct, just slower).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from wmrl_jax.checks import check_array, check_int

Array = jax.Array


class MonotoneMap(NamedTuple):
    """A monotone piecewise-linear map, flat beyond its end knots.

    Attributes:
        knots_x: float[K] non-decreasing in its first ``n_knots`` entries (an
            exact fit repeats a tied x, always with the same knots_y).
        knots_y: float[K] non-decreasing in its first ``n_knots`` entries.
        n_knots: int32 scalar, how many knots are used (the rest is padding).
        valid: bool scalar; an invalid map is the identity wherever the caller
            falls back (``apply_calibration``).
    """

    knots_x: Array
    knots_y: Array
    n_knots: Array
    valid: Array


def _inputs(x, y, weights, mask):
    """Checked, promoted (x, y, weights, mask); non-finite values and
    non-positive weights carry no information, so they are masked out."""
    x = check_array("x", x, "float", (None,), "one value per pair")
    n = x.shape[0]
    y = check_array("y", y, "float", (n,))
    dtype = jnp.promote_types(x.dtype, y.dtype)
    w = jnp.ones((n,), dtype) if weights is None else check_array("weights", weights, "float", (n,))
    m = jnp.ones((n,), bool) if mask is None else check_array("mask", mask, "bool", (n,))
    x, y, w = x.astype(dtype), y.astype(dtype), w.astype(dtype)
    m = m & jnp.isfinite(x) & jnp.isfinite(y) & jnp.isfinite(w) & (w > 0)
    return x, y, w, m


# --------------------------------------------------------------------- predict


def interpolate(fitted: MonotoneMap, x_new: Array) -> Array:
    """Piecewise-linear interpolation through the used knots (``np.interp``).

        y = y_i + (x - x_i) (y_{i+1} - y_i) / (x_{i+1} - x_i),  x_i <= x < x_{i+1}
        y = y_0 for x < x_0,   y = y_{n-1} for x >= x_{n-1}

    Requires ``n_knots >= 1``; with one knot the map is that constant.
    """
    kx, ky, n = fitted.knots_x, fitted.knots_y, fitted.n_knots
    x_new = jnp.asarray(x_new, kx.dtype)
    k = kx.shape[0]
    # Segment i: the last used knot <= x, clipped to the used segments.
    # Padding knots sort after every query.
    # (compare_all for few knots, the binned map: one fused pass, no loop.)
    method = "compare_all" if k <= 64 else "scan"
    i = jnp.searchsorted(jnp.where(jnp.arange(k) < n, kx, jnp.inf), x_new, side="right", method=method) - 1
    i = jnp.clip(i, 0, jnp.maximum(n - 2, 0))
    j = jnp.minimum(i + 1, k - 1)
    x0, x1, y0, y1 = kx[i], kx[j], ky[i], ky[j]
    ok = (n >= 2) & (x1 > x0)
    t = jnp.clip((x_new - x0) / jnp.where(ok, x1 - x0, 1.0), 0.0, 1.0)
    return jnp.where(ok, y0 + t * (y1 - y0), y0)


def isotonic_predict(fitted: MonotoneMap, x_new: Array) -> Array:
    """Predictions of an exact isotonic fit, clipped to the fitted x range.

    Same as ``IsotonicRegression(out_of_bounds="clip").predict``. An empty fit
    (no valid points) predicts NaN.
    """
    return jnp.where(fitted.n_knots >= 1, interpolate(fitted, x_new), jnp.nan)


def apply_calibration(fitted: MonotoneMap, x_new: Array) -> Array:
    """The calibrated score: the map where ``fitted.valid``, identity otherwise."""
    x_new = jnp.asarray(x_new, fitted.knots_x.dtype)
    return jnp.where(fitted.valid, interpolate(fitted, x_new), x_new)


binned_isotonic_predict = apply_calibration


# ------------------------------------------------------------------ binned fit


def _inner_edges(bins: int, dtype) -> np.ndarray:
    """The inner bin edges of ``linspace(0, 1, bins + 1)``, rounded *up* to dtype.

    ``x >= e`` for a float32 x and the float64 edge e holds exactly when
    ``x >= e'`` with e' the smallest float32 >= e, so float32 inputs land in the
    same bin as the float64 reference puts them (x = 0.1f sits on an edge).
    """
    e64 = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    e = e64.astype(dtype)
    up = e.astype(np.float64) < e64
    e[up] = np.nextafter(e[up], np.asarray(np.inf, dtype))
    return e


def bin_index(x: Array, bins: int) -> Array:
    """``clip(digitize(x, inner edges), 0, bins - 1)``: x < 0 -> 0, x >= 0.9 -> 9
    (for NaN the bin is unspecified: callers mask NaN). int32, same shape as x."""
    edges = jnp.asarray(_inner_edges(bins, np.dtype(x.dtype)))
    # digitize(x, edges) for increasing edges = searchsorted(edges, x, "right").
    method = "compare_all" if bins <= 64 else "scan"  # few edges: one fused pass, no loop
    return jnp.searchsorted(edges, x, side="right", method=method).astype(jnp.int32)


def binned_sums(x: Array, y: Array, mask: Array, bins: int) -> tuple[Array, Array, Array]:
    """Per-bin (sum x, sum y, count) of the masked pairs, ``[bins]`` each."""
    idx = jnp.where(mask, bin_index(x, bins), bins)  # masked pairs: out of range, dropped
    rows = jnp.stack([x, y, jnp.ones_like(x)], axis=-1)
    s = jnp.zeros((bins, 3), x.dtype).at[idx].add(rows, mode="drop")
    return s[:, 0], s[:, 1], s[:, 2].astype(jnp.int32)  # counts exact in float up to 2^24


def binned_fit_from_sums(sum_x: Array, sum_y: Array, count: Array) -> MonotoneMap:
    """The binned map from per-bin sums (``[bins]`` each).

    Pool-adjacent-violators over the populated bins, written in its closed
    form (the unique weighted isotonic regression; Barlow et al. 1972):

        f_i = max_{j <= i} min_{k >= i} (sum_{l=j..k} Sy_l) / (sum_{l=j..k} C_l)

    over populated j, i, k. O(bins^3) but bins is 10: cheaper than any loop.
    """
    bins = count.shape[0]
    dtype = sum_y.dtype
    pop = count > 0
    cnt = count.astype(dtype)
    idx = jnp.arange(bins)
    # band[j, k, l] = j <= l <= k: the block sums of y and of counts.
    band = (idx[:, None, None] <= idx[None, None, :]) & (idx[None, None, :] <= idx[None, :, None])
    blk_y = jnp.where(band, sum_y, 0.0).sum(axis=-1)
    blk_c = jnp.where(band, cnt, 0.0).sum(axis=-1)
    pair_ok = pop[:, None] & pop[None, :] & (idx[:, None] <= idx[None, :])
    mean = jnp.where(pair_ok, blk_y / jnp.where(pair_ok, blk_c, 1.0), jnp.inf)  # [j, k]
    upper = idx[:, None] >= idx[None, :]  # [k, i]: k >= i
    min_k = jnp.min(jnp.where(upper[None], mean[:, :, None], jnp.inf), axis=1)  # [j, i]
    lower = (idx[:, None] <= idx[None, :]) & pop[:, None]  # [j, i]: populated j <= i
    fitted = jnp.max(jnp.where(lower, min_k, -jnp.inf), axis=0)  # [i]
    mean_x = sum_x / jnp.where(pop, cnt, 1.0)
    # Compact the populated bins to the front, in bin order.
    dest = jnp.where(pop, jnp.cumsum(pop) - 1, bins)
    knots_x = jnp.zeros((bins,), dtype).at[dest].set(mean_x, mode="drop")
    knots_y = jnp.zeros((bins,), dtype).at[dest].set(fitted, mode="drop")
    n = pop.sum().astype(jnp.int32)
    return MonotoneMap(knots_x, knots_y, n, n >= 2)


def binned_isotonic_fit(x: Array, y: Array, mask: Array | None = None, bins: int = 10) -> MonotoneMap:
    """The paper's calibration map from pairs (x = WM reward, y = real reward).

    Bins: edges ``linspace(0, 1, bins + 1)``, bin = ``clip(digitize(x, inner
    edges), 0, bins - 1)``. Per populated bin, in bin order: mean x, mean y,
    count. Weighted PAV over the bin means (weights = counts). Knots: (bin mean
    x, pooled y). ``valid`` is False (the caller uses the identity) when fewer
    than 2 bins are populated.

    Args:
        x, y: float[n] pairs; mask: bool[n] (None = all); non-finite pairs are
            ignored.
        bins: number of equal-width bins over [0, 1].

    Returns:
        A :class:`MonotoneMap` with ``bins`` knot slots.
    """
    check_int("bins", bins, 1)
    x, y, _, mask = _inputs(x, y, None, mask)
    return binned_fit_from_sums(*binned_sums(x, y, mask, int(bins)))


# ------------------------------------------------------------------- exact fit


def _order_keys(x: Array) -> Array:
    """Integers of x's width that sort as x does (-0 counted as +0).

    Why: XLA:CPU sorts one integer operand ~8x faster than floats or a
    key-value pair (2 vs 15-20 ms at n = 50 000). A float's bits read as a
    signed integer already sort the non-negative floats; flipping the
    magnitude bits of the negative ones orders those too.
    """
    itype = jnp.dtype(f"int{8 * x.dtype.itemsize}")
    b = lax.bitcast_convert_type(jnp.where(x == 0, jnp.zeros_like(x), x), itype)
    return jnp.where(b < 0, b ^ jnp.iinfo(itype).max, b)


def _from_order_keys(k: Array, dtype) -> Array:
    """The inverse of ``_order_keys``."""
    return lax.bitcast_convert_type(jnp.where(k < 0, k ^ jnp.iinfo(k.dtype).max, k), dtype)


def _two_sum_scan(v: Array) -> tuple[Array, Array]:
    """Inclusive prefix sums as double-float pairs (hi + lo), via exact TwoSum.

    A float32 prefix sum over 50 000 terms loses ~3 digits in the slope
    between nearby points; hi + lo keeps them.
    """

    def add(a, b):
        (ah, al), (bh, bl) = a, b
        s = ah + bh
        bb = s - ah
        err = (ah - (s - bb)) + (bh - bb)
        lo = al + bl + err
        hi = s + lo
        return hi, lo - (hi - s)

    return lax.associative_scan(add, (v, jnp.zeros_like(v)))


def isotonic_fit(x: Array, y: Array, weights: Array | None = None, mask: Array | None = None) -> MonotoneMap:
    """Exact weighted isotonic regression of y on x (increasing), ties pooled.

    Minimises sum_i w_i (f(x_i) - y_i)^2 over non-decreasing f. Entries with
    equal x are first pooled into one point (weight = sum of weights, value =
    weighted mean), as sklearn does; then the fitted value of each unique x is
    the slope of the greatest convex minorant of the cumulative-sum diagram.

    Args:
        x, y: float[n]; weights: float[n] > 0 (None = ones); mask: bool[n]
            (None = all). Masked, non-finite and zero-weight entries are ignored.

    Returns:
        A :class:`MonotoneMap` with n knot slots: the used x, sorted (ties
        repeated), and their fitted values; ``n_knots`` = number of used
        entries, ``valid`` when there are at least 2 distinct x (one distinct x
        is a constant map, which ``isotonic_predict`` still returns).
    """
    x, y, w, mask = _inputs(x, y, weights, mask)
    n, dtype = x.shape[0], x.dtype
    # Sort x alone (masked entries, key +inf, go to the end). Ties are pooled
    # anyway, so no permutation is needed: each entry's weight and weighted y
    # go to the first slot of its run of equal x, the other slots weigh 0.
    keys = _order_keys(jnp.where(mask, x, jnp.inf))
    sorted_keys = lax.sort(keys)
    xs = _from_order_keys(sorted_keys, dtype)
    n_valid = mask.sum().astype(jnp.int32)
    first = jnp.where(mask, jnp.searchsorted(sorted_keys, keys, side="left"), n)
    ws = jnp.zeros((n,), dtype).at[first].add(jnp.where(mask, w, 0.0), mode="drop")
    wys = jnp.zeros((n,), dtype).at[first].add(jnp.where(mask, w * y, 0.0), mode="drop")
    # Cumulative-sum diagram P_k = (sum_{i<k} w_i, sum_{i<k} w_i y_i), k = 0..n.
    zero = jnp.zeros((1,), dtype)
    wh, wl = _two_sum_scan(jnp.concatenate([zero, ws]))
    sh, sl = _two_sum_scan(jnp.concatenate([zero, wys]))

    def point(i):
        """The diagram's points P_i, as the (hi, lo) pairs of both sums."""
        return wh[i], wl[i], sh[i], sl[i]

    def slope(p, q):
        """Mean of the block between points p and q: the diagram's slope."""
        dw = (q[0] - p[0]) + (q[1] - p[1])
        ds = (q[2] - p[2]) + (q[3] - p[3])
        return ds / jnp.where(dw > 0, dw, 1.0)

    # Block boundaries: the two ends and every change of x. No boundary inside
    # a run of tied x: that is the pooling of ties.
    k = jnp.arange(n + 1, dtype=jnp.int32)
    x_left = jnp.concatenate([xs[:1], xs])  # x_{k-1}
    x_right = jnp.concatenate([xs, xs[-1:]])  # x_k
    inner = (k > 0) & (k < n_valid) & (x_left != x_right)

    def compact(keep, ids):
        """The kept entries of ``ids`` moved to the front, in order, and their count."""
        dest = jnp.where(keep, jnp.cumsum(keep) - 1, n + 1)
        return jnp.zeros_like(ids).at[dest].set(ids, mode="drop"), keep.sum().astype(jnp.int32)

    def violators(ids, count):
        """bool[n + 1]: boundaries whose left block's mean exceeds the right's."""
        p = point(ids)  # block j = [ids_j, ids_{j+1})
        block_mean = slope([a[:-1] for a in p], [a[1:] for a in p])
        viol = (k[1:-1] < count - 1) & (block_mean[:-1] > block_mean[1:])
        return jnp.concatenate([jnp.zeros((1,), bool), viol, jnp.zeros((1,), bool)])

    def pool_round(carry):
        ids, count, viol = carry
        ids, count = compact((k < count) & ~viol, ids)
        return ids, count, violators(ids, count)

    # Parallel pool-adjacent-violators over the compacted boundaries: each
    # round removes every violating boundary at once.
    ids, count = compact((k == 0) | (k == n_valid) | inner, k)
    ids, count, _ = lax.while_loop(lambda c: c[2].any(), pool_round, (ids, count, violators(ids, count)))
    alive = jnp.zeros((n + 1,), bool).at[jnp.where(k < count, ids, n + 1)].set(True, mode="drop")

    # Sorted element i spans P_i -> P_{i+1}; its block is [last boundary <= i,
    # first boundary >= i + 1). Ties share a block, so repeated knots_x carry
    # equal knots_y and interpolation stays well defined.
    prev_b = lax.cummax(jnp.where(alive, k, -1))[:-1]
    next_b = lax.cummin(jnp.where(alive, k, n + 1), reverse=True)[1:]
    in_use = jnp.arange(n) < n_valid
    knots_y = jnp.where(in_use, slope(point(jnp.clip(prev_b, 0, n)), point(jnp.clip(next_b, 0, n))), 0.0)
    knots_x = jnp.where(in_use, xs, 0.0)
    distinct = inner.sum() + 1
    return MonotoneMap(knots_x, knots_y, n_valid, (n_valid >= 1) & (distinct >= 2))
