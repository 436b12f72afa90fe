"""`wmrl_jax.corrections` against the plain-numpy transcription of the paper's
semantics (`wmrl_jax._reference_numpy`), plus hand-worked cases."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wmrl_jax import _reference_numpy as ref
from wmrl_jax import corrections as C

# Small settings so that refits, FIFO eviction and the frozen constant all
# happen within a few hundred groups (the paper's values need thousands).
SMALL = dict(cap=120, bins=10, min_pairs=40, refit_every=16, half_life=8.0, warmup=6,
             w_max=4.0, target_weight=2.0)


def _stream(seed, steps, n=4, g=6):
    """Random steps shaped like the real thing: ladder-valued real rewards with
    ties, a drifting monotone non-affine WM distortion plus noise, ungraded and
    NaN entries, degenerate and nearly-empty groups."""
    rng = np.random.default_rng(seed)
    for t in range(steps):
        pos = rng.uniform(size=(n, g))
        ladder = rng.choice([0.0, 0.1, 0.2, 0.5], size=(n, g), p=[0.2, 0.2, 0.2, 0.4])
        real = np.where(ladder == 0.5, 0.5 + 0.5 * pos, ladder)
        drift = 0.3 * np.sin(t / 40.0)
        wm = np.sqrt(real) * (0.8 + drift) + 0.1 + rng.normal(0, 0.08, (n, g))
        wm = np.clip(wm, -0.05, 1.05)  # outside [0, 1] sometimes: end bins
        real_graded = rng.uniform(size=(n, g)) > 0.1
        wm_graded = rng.uniform(size=(n, g)) > 0.1
        wm[rng.uniform(size=(n, g)) < 0.02] = np.nan  # NaN = ungraded
        k = rng.integers(n)
        real[k] = 0.2  # a degenerate group (constant real rewards)
        k2 = rng.integers(n)
        real_graded[k2, 1:] = False
        wm_graded[k2, 1:] = False  # < 2 graded
        anchor = rng.uniform(size=n) < 0.5
        yield (wm.astype(np.float32), wm_graded, real.astype(np.float32), real_graded, anchor)


def _run(mode, steps, seed, dtype_tol):
    standardize = mode.pop("standardize", True)
    state = C.init_correction_state(**SMALL, **mode)
    loop = ref.CorrectionLoop(**SMALL, **mode)
    step = jax.jit(lambda s, *a: C.correct_step(s, *a, standardize=standardize))
    seen = dict(fits=0, c=False, evicted=False)
    for wm, wmg, real, realg, anchor in _stream(seed, steps):
        state, out = step(state, wm, wmg, real, realg, anchor)
        want = loop.step(ref.to_lists(wm, wmg), ref.to_lists(real, realg), list(anchor),
                         standardize=standardize)
        graded = np.asarray(out["graded"])
        want_graded = np.array([[r is not None for r in row] for row in want["rewards"]])
        np.testing.assert_array_equal(graded, want_graded)
        want_r = np.array([[0.0 if r is None else r for r in row] for row in want["rewards"]])
        np.testing.assert_allclose(np.asarray(out["rewards"]), want_r, atol=dtype_tol, rtol=0)
        np.testing.assert_allclose(float(out["anchor_weight"]), want["anchor_weight"],
                                   atol=dtype_tol, rtol=0)
        np.testing.assert_array_equal(np.asarray(out["used"]), np.array(want["used"]))
        np.testing.assert_allclose(np.asarray(out["advantages"]), np.array(want["advantages"]),
                                   atol=20 * dtype_tol, rtol=20 * dtype_tol)
        assert int(out["n_fits"]) == want["n_fits"]
        assert int(out["pairs_in_buffer"]) == want["pairs"]
        assert bool(out["calibrated"]) == want["calibrated"]
        if want["calibrated"]:
            np.testing.assert_allclose(float(out["bias_reduction"]), want["bias"][2], atol=10 * dtype_tol)
        seen["fits"] = want["n_fits"]
        seen["c"] |= loop.weighter.c is not None
        seen["evicted"] |= len(loop.debiaser.pairs) == SMALL["cap"]
    return seen


MODES = [
    dict(),
    dict(debias=False),
    dict(denoise=False),
    dict(standardize=False),
    dict(debias=False, denoise=False, standardize=False),
    dict(calibration="exact"),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()) or "paper")
def test_correct_step_matches_reference_stream(mode):
    seen = _run(dict(mode), steps=150, seed=len(str(mode)), dtype_tol=2e-5)
    if mode.get("debias", True):
        assert seen["fits"] >= 5, "the stream must exercise refits"
    assert seen["evicted"], "the stream must overflow the FIFO"
    assert seen["c"], "the stream must fix the constant c"
