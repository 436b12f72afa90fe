"""Isotonic fits against independent sources: sklearn / scipy (exact), the
plain-numpy transcription of the paper (binned), and a hand-worked example."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import isotonic_regression
from sklearn.isotonic import IsotonicRegression

from wmrl_jax import _reference_numpy as ref
from wmrl_jax import corrections as C

N = 300  # one shape for every random case: one compile
FIT = jax.jit(C.isotonic_fit)
PREDICT = jax.jit(C.isotonic_predict)
BINNED = jax.jit(C.binned_isotonic_fit)
APPLY = jax.jit(C.binned_isotonic_predict)


def _data(seed, n=N, decimals=2):
    rng = np.random.default_rng(seed)
    x = np.round(rng.uniform(-0.1, 1.1, n), decimals)  # rounding: many ties
    y = np.sin(3 * x) + x + rng.normal(0, 0.4, n)
    w = rng.uniform(0.2, 3.0, n)
    mask = rng.uniform(size=n) > 0.2
    return x, y, w, mask


def _sklearn(x, y, w, mask, xq):
    ir = IsotonicRegression(out_of_bounds="clip").fit(x[mask], y[mask], sample_weight=w[mask])
    return ir.predict(xq)


@pytest.mark.parametrize("seed,decimals", [(0, 1), (1, 2), (2, 3), (3, 6)])
def test_exact_fit_matches_sklearn_with_ties_weights_masks(seed, decimals):
    x, y, w, mask = _data(seed, decimals=decimals)
    f32 = [a.astype(np.float32) for a in (x, y, w)]
    x, y, w = [a.astype(np.float64) for a in f32]  # the reference sees the same numbers
    # Garbage in masked slots must not matter.
    y_in = np.where(mask, f32[1], np.float32(1e6))
    fitted = FIT(f32[0], y_in, f32[2], mask)
    xq = np.concatenate([np.linspace(-0.3, 1.3, 200), x[:50]])
    got = np.asarray(PREDICT(fitted, xq.astype(np.float32)))
    np.testing.assert_allclose(got, _sklearn(x, y, w, mask, xq), atol=1e-5, rtol=0)
    assert int(fitted.n_knots) == mask.sum()


def test_exact_fitted_values_match_scipy_isotonic_regression():
    x, y, w, _ = _data(4, decimals=9)  # distinct x: scipy's problem is then the same
    order = np.argsort(x)
    want = isotonic_regression(y[order], weights=w[order]).x
    fitted = FIT(x.astype(np.float32), y.astype(np.float32), w.astype(np.float32), np.ones(N, bool))
    np.testing.assert_allclose(np.asarray(fitted.knots_y), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(fitted.knots_x), x[order], atol=1e-7)


def test_exact_fit_adversarial_pooling_depth():
    """Increasing data with one huge low outlier at the top end: the pool
    grows one block per parallel round, the worst case for round counts."""
    x = np.arange(N, dtype=np.float64) / N
    y = x.copy()
    y[-1] = -1e3
    w, mask = np.ones(N), np.ones(N, bool)
    fitted = FIT(x.astype(np.float32), y.astype(np.float32), w.astype(np.float32), mask)
    got = np.asarray(PREDICT(fitted, x.astype(np.float32)))
    np.testing.assert_allclose(got, _sklearn(x, y, w, mask, x), atol=1e-4, rtol=1e-6)


def test_binned_fit_by_hand():
    # Bins of width 0.1. Bin 0: x .05, y .2 (1 pair); bin 1: x .15, y .6 (1);
    # bin 2: x (.25+.27)/2 = .26, y (.1+.3)/2 = .2 (2). PAV: .6 > .2 pools bins
    # 1-2 with weights 1, 2 -> (.6 + 2*.2)/3 = 1/3. Map: (.05,.2) (.15,1/3) (.26,1/3).
    x, y, mask = np.zeros(N, np.float32), np.zeros(N, np.float32), np.zeros(N, bool)
    x[:4], y[:4], mask[:4] = [0.05, 0.15, 0.25, 0.27], [0.2, 0.6, 0.1, 0.3], True
    fitted = BINNED(x, y, mask)  # padded to N, masked: reuses the compiled fit
    assert bool(fitted.valid) and int(fitted.n_knots) == 3
    np.testing.assert_allclose(np.asarray(fitted.knots_x[:3]), [0.05, 0.15, 0.26], atol=1e-6)
    np.testing.assert_allclose(np.asarray(fitted.knots_y[:3]), [0.2, 1 / 3, 1 / 3], atol=1e-6)
    xq = np.zeros(101, np.float32)
    xq[:4] = [0.0, 0.1, 0.2, 1.0]
    got = np.asarray(APPLY(fitted, xq))[:4]
    # 0.1 is halfway between .05 and .15: .2 + (1/3 - .2) / 2
    np.testing.assert_allclose(got, [0.2, 0.2 + (1 / 3 - 0.2) / 2, 1 / 3, 1 / 3], atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_binned_fit_matches_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-0.2, 1.2, N)
    x[:40] = np.round(x[:40], 1)  # exactly on bin edges (0.1 in float32 is above 0.1)
    y = np.sqrt(np.clip(x, 0, None)) + rng.normal(0, 0.3, N)
    mask = rng.uniform(size=N) > 0.3
    x32, y32 = x.astype(np.float32), y.astype(np.float32)
    fitted = BINNED(x32, y32, mask)
    want = ref.fit_binned(zip(x32[mask].astype(float), y32[mask].astype(float)))
    k = int(fitted.n_knots)
    assert k == len(want[0])
    np.testing.assert_allclose(np.asarray(fitted.knots_x[:k]), want[0], atol=1e-6)
    np.testing.assert_allclose(np.asarray(fitted.knots_y[:k]), want[1], atol=1e-5)
    xq = np.linspace(-0.5, 1.5, 101).astype(np.float32)
    np.testing.assert_allclose(np.asarray(APPLY(fitted, xq)), ref.apply_map(want, xq.astype(float)),
                               atol=1e-5)


def _edge_probes(bins, dtype):
    """Every linspace edge, its rounding to dtype and 3 ulps either side, plus
    random values, the ends and the infinities."""
    e64 = np.linspace(0.0, 1.0, bins + 1)
    near = [e64.astype(dtype)]
    for direction in (-np.inf, np.inf):
        e = e64.astype(dtype)
        for _ in range(3):
            e = np.nextafter(e, np.asarray(direction, dtype))
            near.append(e)
    rng = np.random.default_rng(bins)
    extra = np.array([0.0, -0.0, 1.0, -1e30, 1e30, -np.inf, np.inf])
    return np.concatenate([*near, rng.uniform(-0.5, 1.5, 20000), extra]).astype(dtype)


@pytest.mark.parametrize("bins", [1, 2, 3, 7, 10, 13, 100, 1000])
def test_bin_index_matches_digitize_at_every_edge(bins):
    """``bin_index`` (a search among the edges rounded up to x's dtype) puts
    every value where the reference's
    ``clip(digitize(x, linspace inner edges), 0, bins - 1)`` does, in float32
    and float64 -- including values on, and a few ulps around, each edge.
    (Every float32 in [0, 1.01] was also checked once for bins = 7 and 10.)"""
    from wmrl_jax._isotonic import bin_index

    inner = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    for dtype in (np.float32, np.float64):
        x = _edge_probes(bins, dtype)
        want = np.clip(np.digitize(x.astype(np.float64), inner), 0, bins - 1)
        with jax.enable_x64(dtype == np.float64):
            got = np.asarray(jax.jit(lambda v: bin_index(v, bins))(jnp.asarray(x)))
        np.testing.assert_array_equal(got, want, err_msg=f"{np.dtype(dtype).name}")


def test_binned_fit_with_one_populated_bin_is_the_identity():
    x = np.full(N, 0.33, np.float32)
    fitted = BINNED(x, np.linspace(0, 1, N, dtype=np.float32), np.ones(N, bool))
    assert not bool(fitted.valid)
    assert ref.fit_binned(zip(x.astype(float), np.linspace(0, 1, N))) is None
    xq = np.array([0.1, 0.5, 0.9], np.float32)
    np.testing.assert_array_equal(np.asarray(APPLY(fitted, xq)), xq)


def test_bad_inputs_name_the_argument():
    # Structure: chex asserts (AssertionError) naming the argument (wmrl_jax.checks).
    with pytest.raises(AssertionError, match=r"has shape \(3,\) but expected \(4\)\. \[y: expected shape \[4\]\]"):
        C.isotonic_fit(jnp.zeros(4), jnp.zeros(3))
    with pytest.raises(AssertionError, match=r"has type float32 .*\[mask: expected a bool dtype\]"):
        C.isotonic_fit(jnp.zeros(4), jnp.zeros(4), mask=jnp.zeros(4))
    with pytest.raises(AssertionError, match=r"has type int32 .*\[x: expected a float dtype\]"):
        C.binned_isotonic_fit(jnp.zeros(4, jnp.int32), jnp.zeros(4))


# Last: leaving the x64 context drops jit caches.
def test_exact_fit_in_float64():
    x, y, w, mask = _data(5, decimals=2)
    with jax.enable_x64(True):
        fitted, got = jax.jit(lambda *a: (f := C.isotonic_fit(*a), C.isotonic_predict(f, a[0])))(
            x, y, w, mask)
        assert fitted.knots_y.dtype == jnp.float64
        got = np.asarray(got)
    np.testing.assert_allclose(got, _sklearn(x, y, w, mask, x), atol=1e-10, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 10, 64, 65])
def test_interpolate_matches_np_interp(k):
    """Interpolation against np.interp, for few and many knot slots and every
    count of used knots, with queries on the knots, between them and beyond
    both ends."""
    from wmrl_jax._isotonic import MonotoneMap, interpolate

    rng = np.random.default_rng(k)
    interp = jax.jit(interpolate)
    for n in sorted({1, 2, 3, k // 2, k - 1, k} & set(range(1, k + 1))):
        kx = np.sort(rng.uniform(0, 1, k)).astype(np.float32)
        ky = np.sort(rng.normal(0, 1, k)).astype(np.float32)
        kx[n:], ky[n:] = 0.0, 0.0  # padding past the used knots, as the fits leave it
        xq = np.concatenate([kx[:n], rng.uniform(-0.3, 1.3, 200), [-1.0, 2.0]]).astype(np.float32)
        got = np.asarray(interp(MonotoneMap(jnp.asarray(kx), jnp.asarray(ky), jnp.int32(n), jnp.bool_(True)), xq))
        want = np.interp(xq.astype(np.float64), kx[:n].astype(np.float64), ky[:n].astype(np.float64))
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=0, err_msg=f"k={k} n={n}")


def test_exact_fit_sorts_negative_zero_and_large_magnitudes_exactly():
    """The fit sorts x as integers: negatives, -0.0 == +0.0 (one tie) and
    magnitudes far apart must order and pool exactly as floats do. Peer:
    scipy's PAV on the weighted means of each distinct x (np.unique pools
    -0.0 with +0.0). Not sklearn: it also merges x closer than 1e-6."""
    rng = np.random.default_rng(11)
    values = np.array([-3e30, -2.5, -1e-30, -0.0, 0.0, 1e-30, 0.5, 7.0, 3e30], np.float32)
    x = rng.choice(values, N)
    y = (rng.normal(0, 1, N) + np.sign(x)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, N).astype(np.float32)
    mask = rng.uniform(size=N) > 0.1
    fitted = FIT(x, y, w, mask)
    got = np.asarray(PREDICT(fitted, values))
    ux, inv = np.unique(x[mask].astype(np.float64), return_inverse=True)
    wsum = np.bincount(inv, w[mask].astype(np.float64))
    ymean = np.bincount(inv, (w * y)[mask].astype(np.float64)) / wsum
    fit = isotonic_regression(ymean, weights=wsum).x
    want = fit[np.searchsorted(ux, values.astype(np.float64))]
    assert len(ux) == 8  # -0.0 and +0.0 are one x
    np.testing.assert_allclose(got, want, atol=1e-5)
