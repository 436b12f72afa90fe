"""`wmrl_jax.corrections` against the plain-numpy transcription of the paper's
semantics (`wmrl_jax._reference_numpy`), plus hand-worked cases."""

import dataclasses
import subprocess
import sys
import textwrap

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


# The public step is jitted: the ablation switches are state data, so only
# `standardize`, the shapes, the calibration kind and the dtype cost a compile.
STEP = C.correct_step


def _run(mode, steps, seed, dtype_tol, cast=np.float32, settings=SMALL, stream=None):
    standardize = mode.pop("standardize", True)
    state = C.init_correction_state(**settings, **mode)
    loop = ref.CorrectionLoop(**settings, **mode)
    seen = dict(fits=0, c=False, evicted=False)
    for wm, wmg, real, realg, anchor in stream or _stream(seed, steps):
        wm, real = wm.astype(cast), real.astype(cast)
        state, out = STEP(state, wm, wmg, real, realg, anchor, standardize=standardize)
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
        seen["evicted"] |= len(loop.debiaser.pairs) == settings["cap"]
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


def test_several_refits_per_step_failed_fits_and_more_pairs_than_slots():
    """A step pushing more pairs than the FIFO holds, with a refit due every
    3rd pair: several refits inside one step, each on the buffer as of its
    push; early steps with all WM scores in one bin make fits fail (< 2
    populated bins), so the next pair retries."""
    tiny = dict(SMALL, cap=10, min_pairs=4, refit_every=3)
    steps = list(_stream(11, 40))
    for k in range(4):
        wm, wmg, real, realg, anchor = steps[k]
        steps[k] = (np.full_like(wm, 0.55), wmg, real, realg, np.ones_like(anchor))
    seen = _run(dict(), steps=40, seed=11, dtype_tol=2e-5, settings=tiny, stream=steps)
    assert seen["fits"] >= 40 and seen["evicted"]


# ------------------------------------------------------------- hand-worked


def test_group_disagreement_by_hand():
    # d - mean d = [-1, 0, 1], s - mean s = [-2, 0, 2]: residual [1, 0, -1],
    # mean square 2/3, var(s) = 8/3 -> s^2 = 1/4. The masked 4th entry is ignored.
    f = jax.jit(jax.vmap(C.group_disagreement))
    s2, ok = f(jnp.array([[0.0, 1.0, 2.0, 9.0], [0.1, 0.7, 0.0, 0.0]]),
               jnp.array([[0.0, 2.0, 4.0, -9.0], [0.2, 0.2, 0.0, 0.0]]),
               jnp.array([[True, True, True, False], [True, True, False, False]]))
    assert bool(ok[0]) and float(s2[0]) == pytest.approx(0.25, abs=1e-6)
    assert not bool(ok[1]) and float(s2[1]) == 0.0  # degenerate: skipped, not 0-valued


def test_bias_stats_by_hand():
    # Centred x [-.5, .5], y [-1.5, 1.5]: residual [1, -1] -> before = 1.
    # A map sending 0 -> 0, 1 -> 3 removes it all: after = 0, reduction = 1.
    x, y = jnp.array([0.0, 1.0]), jnp.array([0.0, 3.0])
    ident = C.MonotoneMap(x, x, jnp.int32(2), jnp.array(False))  # invalid -> identity
    fitted = C.MonotoneMap(x, y, jnp.int32(2), jnp.array(True))
    got = jax.jit(lambda a, b: (C.bias_stats(x, y, a), C.bias_stats(x, y, b)))(ident, fitted)
    assert [float(v) for v in got[0]] == pytest.approx([1.0, 1.0, 0.0])
    assert [float(v) for v in got[1]] == pytest.approx([1.0, 0.0, 1.0], abs=1e-6)


def _pad(*arrays, shape=(4, 6)):
    """Embed hand-sized [n, g] inputs in the stream tests' shape (one compile):
    padding rollouts are ungraded, padding groups are not anchors."""
    out = []
    for a in arrays:
        a = np.asarray(a)
        full = np.zeros(shape[: a.ndim], a.dtype)
        full[tuple(slice(0, s) for s in a.shape)] = a
        out.append(full)
    return out


def _steps_by_hand(denoise):
    state = C.init_correction_state(**dict(SMALL, warmup=2, half_life=1.0), debias=False,
                                    denoise=denoise)
    t = np.ones((2, 3), bool)
    # step 1: s^2 = 1/4 then 0; alpha = 1 - 0.5 = 1/2 -> EWMA 1/8, c = (2-1)/(1/8) = 8.
    wm = np.array([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]], np.float32)
    real = np.array([[0.0, 2.0, 4.0], [0.0, 1.0, 2.0]], np.float32)
    state, out1 = STEP(state, *_pad(wm, t, real, t, np.array([True, True])), standardize=True)
    # step 2: reversed ranking, s^2 = (8/3)/(2/3) = 4 -> EWMA 1/16 + 2 = 2.0625.
    wm = np.array([[2.0, 1.0, 0.0], [0.3, 0.3, 0.3]], np.float32)
    real = np.array([[0.0, 1.0, 2.0], [0.5, 0.5, 0.5]], np.float32)  # 2nd: degenerate, skipped
    state, out2 = STEP(state, *_pad(wm, t, real, t, np.array([True, False])), standardize=True)
    return state, out1, out2


def test_inverse_variance_weight_by_hand():
    state, out1, out2 = _steps_by_hand(denoise=True)
    assert float(state.c) == pytest.approx(8.0)
    assert float(out1["anchor_weight"]) == pytest.approx(2.0)  # the target, at the moment c is fixed
    assert float(out2["disagreement"]) == pytest.approx(2.0625)
    assert float(out2["anchor_weight"]) == pytest.approx(4.0)  # 1 + 8 * 2.0625 clipped to w_max
    # Anchor advantages carry the weight: real [0, 1, 2] standardised, times 4.
    z = (np.array([0.0, 1.0, 2.0]) - 1.0) / (np.sqrt(2 / 3) + 1e-4)
    np.testing.assert_allclose(np.asarray(out2["advantages"][0, :3]), 4.0 * z, rtol=1e-5)
    _, _, out2 = _steps_by_hand(denoise=False)
    assert float(out2["anchor_weight"]) == 1.0
    assert float(out2["disagreement"]) == pytest.approx(2.0625)  # still tracked


def test_calibrated_group_uses_the_map_and_order_matters():
    """A refit triggered by an anchor group applies to the groups after it
    in the same step, not to those before it (the reference's order)."""
    state = C.init_correction_state(**dict(SMALL, min_pairs=4, refit_every=4))
    t = np.ones((3, 4), bool)
    wm = np.array([[0.05, 0.15, 0.55, 0.95]] * 3, np.float32)
    real = np.array([[0.0, 0.0, 1.0, 1.0]] * 3, np.float32)
    state, out = STEP(state, *_pad(wm, t, real, t, np.array([False, True, False])), standardize=True)
    rewards = np.asarray(out.rewards)[:3, :4]
    np.testing.assert_allclose(rewards[0], wm[0])  # before the fit: identity
    np.testing.assert_allclose(rewards[1], real[1])  # anchor: real rewards
    np.testing.assert_allclose(rewards[2], [0.0, 0.0, 1.0, 1.0], atol=1e-6)
    assert int(out.n_fits) == 1 and bool(out.calibrated)


# ----------------------------------------------------------------- bad input


def test_nonfinite_rewards_are_ungraded_and_never_reach_advantages():
    state = C.init_correction_state(**SMALL)
    wm = np.array([[0.1, np.nan, 0.3, 0.4], [0.5, 0.2, np.inf, 0.9]], np.float32)
    real = np.array([[0.0, 0.5, np.nan, 1.0], [0.1, 0.2, 0.3, 0.4]], np.float32)
    t = np.ones((2, 4), bool)
    state, out = STEP(state, *_pad(wm, t, real, t, np.array([True, False])), standardize=True)
    graded = np.asarray(out["graded"])[:2, :4]
    np.testing.assert_array_equal(graded, [[True, True, False, True], [True, True, False, True]])
    assert np.isfinite(np.asarray(out["advantages"])).all()
    assert np.isfinite(np.asarray(out["rewards"])).all()
    assert int(out["pairs_in_buffer"]) == 2  # pairs need both scores finite: cols 0 and 3


def test_bad_shapes_and_dtypes_name_the_argument():
    state = C.init_correction_state()
    r, g, a = np.zeros((2, 3), np.float32), np.ones((2, 3), bool), np.array([True, False])
    # Structure: chex asserts (AssertionError) naming the argument; values: ValueError.
    with pytest.raises(AssertionError, match=r"has shape \(2, 4\) but expected \(2, 3\)\. \[real_rewards: expected"):
        C.correct_step(state, r, g, np.zeros((2, 4), np.float32), g, a)
    with pytest.raises(AssertionError, match=r"has shape \(3,\) but expected \(2\)\. \[is_anchor: expected shape \[2\]"):
        C.correct_step(state, r, g, r, g, np.ones(3, bool))
    with pytest.raises(AssertionError, match=r"has type float32 .*\[wm_graded: expected a bool dtype\]"):
        C.correct_step(state, r, r, r, g, a)
    with pytest.raises(AssertionError, match=r"has type int32 .*\[wm_rewards: expected a float dtype\]"):
        C.correct_step(state, r.astype(np.int32), g, r, g, a)
    with pytest.raises(AssertionError, match=r"has rank 1 .*\[wm_rewards: expected shape \[n, m\]"):
        C.correct_step(state, np.zeros(3, np.float32), g, r, g, a)
    with pytest.raises(ValueError, match="state: dict, expected a CorrectionState"):
        C.correct_step({}, r, g, r, g, a)
    with pytest.raises(ValueError, match="calibration: 'spline'"):
        C.init_correction_state(calibration="spline")


# ------------------------------------------------------------ anchor schedule


def test_select_anchor_groups_counts_cap_and_determinism():
    # want = max(min_per_step, round(fraction * n)) = max(1, round(2.0)) = 2
    a = C.select_anchor_groups(123, 8, fraction=0.25, min_per_step=1)
    assert list(a) == sorted(set(a.tolist())) and len(a) == 2 and a.min() >= 0 and a.max() < 8
    np.testing.assert_array_equal(a, C.select_anchor_groups(123, 8, fraction=0.25, min_per_step=1))
    assert len(C.select_anchor_groups(0, 8, fraction=0.0, min_per_step=1)) == 1  # the floor
    assert len(C.select_anchor_groups(0, 3, fraction=0.5, min_per_step=5)) == 3  # <= n_groups
    assert len(C.select_anchor_groups(0, 8, fraction=1.0, min_per_step=1, max_concurrent=5,
                                      in_flight=2)) == 3  # cap - in flight
    assert len(C.select_anchor_groups(0, 8, fraction=1.0, min_per_step=1, max_concurrent=2,
                                      in_flight=4)) == 0
    gen1, gen2 = np.random.default_rng(5), np.random.default_rng(5)
    draws1 = [C.select_anchor_groups(gen1, 10, fraction=0.3, min_per_step=1) for _ in range(5)]
    draws2 = [C.select_anchor_groups(gen2, 10, fraction=0.3, min_per_step=1) for _ in range(5)]
    for d1, d2 in zip(draws1, draws2):
        np.testing.assert_array_equal(d1, d2)
    assert len({tuple(d) for d in draws1}) > 1  # a Generator advances between steps
    key = jax.random.key(3)
    k1 = C.select_anchor_groups(key, 16, fraction=0.25, min_per_step=1)
    np.testing.assert_array_equal(k1, C.select_anchor_groups(key, 16, fraction=0.25, min_per_step=1))
    assert len(set(k1.tolist())) == 4
    with pytest.raises(ValueError, match="fraction"):
        C.select_anchor_groups(0, 8, fraction=1.5, min_per_step=1)


def test_state_is_a_checkpointable_pytree_and_stats_are_the_four_numbers():
    state = C.init_correction_state(cap=16, bins=4)
    leaves, treedef = jax.tree.flatten(state)
    assert all(isinstance(x, jax.Array) for x in leaves)
    again = jax.tree.unflatten(treedef, leaves)
    assert again.config == state.config and again.config.cap == 16
    stats = C.correction_stats(state)
    assert set(stats) == {"anchor_fraction", "calibrated", "bias_reduction", "anchor_weight"}
    assert float(stats["anchor_weight"]) == 1.0 and not bool(stats["calibrated"])


def test_state_and_output_are_named_readable_pytrees():
    """The state and the step output are plain dataclasses of named arrays:
    every field reads back as the value it stands for, in its dtype, on the
    host, in their repr, inside a jit, and stacked by a scan."""
    stream = list(_stream(3, 40))
    state = C.init_correction_state(**SMALL)
    for args in stream[:-1]:
        state, out = STEP(state, *args, standardize=True)
    assert int(state.n_fits) >= 1 and bool(state.fitted.valid)
    want = dict(calibrated=state.fitted.valid, n_fits=state.n_fits, bias_before=state.bias_before,
                bias_after=state.bias_after, bias_reduction=state.bias_reduction,
                disagreement=state.ewma, pairs_in_buffer=state.buf_len,
                anchor_weight=C.anchor_weight(state),
                anchor_fraction=state.n_anchor_seen / state.n_groups_seen)
    host = jax.device_get(out)
    assert isinstance(host, C.StepOutput)
    for k, v in want.items():
        for o in (out, host):
            assert np.asarray(getattr(o, k)).dtype == np.asarray(v).dtype, k
            np.testing.assert_allclose(np.asarray(o[k]), np.asarray(v), rtol=1e-6, err_msg=k)
    assert out.rewards.shape == out.advantages.shape == out.graded.shape == (4, 6)
    assert out.used.shape == (4,) and out.graded.dtype == jnp.bool_
    with pytest.raises(KeyError, match="expected one of"):
        out["weight"]
    # The repr names every field and shows its value (no packed bits).
    text = repr(out)
    assert f"n_fits={int(out.n_fits)}," in text and f"pairs_in_buffer={int(state.buf_len)}," in text
    assert f"bias_reduction={float(out.bias_reduction):.6g}" in text and "advantages=[[" in text
    text = repr(state)
    assert "buf_x=float32[120]," in text and f"n_fits={int(state.n_fits)}," in text
    assert "config=CorrectionConfig(cap=120, bins=10, calibration='binned')" in text
    # Inside a jit the fields are just as readable, and a scan stacks them.
    xs = tuple(jnp.stack(a) for a in zip(*stream[-3:]))
    _, outs = jax.jit(lambda s, xs: jax.lax.scan(lambda c, x: C.correct_step(c, *x), s, xs))(state, xs)
    assert outs.n_fits.shape == (3,) and outs.rewards.shape == (3, *stream[0][0].shape)
    assert outs.bias_after.shape == (3,) and outs.bias_after.dtype == jnp.float32
    last = jax.jit(lambda s, a: C.correct_step(s, *a)[1].n_fits + 0)(state, stream[-1])
    assert int(last) == int(outs.n_fits[0])


def test_state_checkpoints_with_orbax_and_resumes_exactly(tmp_path):
    """The state is named arrays and a static config: Orbax saves and restores
    it as is, and the restored state takes the next step exactly like the
    live one (the documented resume contract)."""
    import orbax.checkpoint as ocp

    stream = list(_stream(5, 30))
    state = C.init_correction_state(**SMALL)
    for args in stream[:-1]:
        state, _ = STEP(state, *args)
    assert int(state.n_fits) >= 1
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    back = checkpointer.restore(tmp_path / "state", state)
    assert isinstance(back, C.CorrectionState) and back.config == state.config
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (s1, o1), (s2, o2) = STEP(state, *stream[-1]), STEP(back, *stream[-1])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path((s1, o1)), jax.tree.leaves((s2, o2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_bench_corrections_step_runs(launch_script):
    """The benchmark's step section runs end to end (its numbers are the
    benchmark's business, not a test's): three per-step times, all positive."""
    bench = launch_script("bench_corrections")
    times = bench.bench_step(repeats=1, steps_per_repeat=8, cap=300)
    assert len(times) == 3 and all(np.isfinite(t) and t > 0 for t in times)


# ------------------------------------------------------- called as a user does

# A fresh process calls each function repeatedly, eagerly, with equal shapes
# (the README's usage), counting XLA compilations and watching the process's
# memory mappings and RSS. correct_step once recompiled every
# call (~2 s) and grow ~280 mappings a call until LLVM ran out of memory.
_EAGER_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jax import monitoring
    from wmrl_jax import corrections, losses

    compiles = [0]
    def on_event(event, duration, **kwargs):
        compiles[0] += event == "/jax/core/compile/backend_compile_duration"
    monitoring.register_event_duration_secs_listener(on_event)

    def snapshot():
        maps = sum(1 for _ in open("/proc/self/maps"))
        rss = int(open("/proc/self/statm").read().split()[1]) * 4096
        return dict(compiles=compiles[0], maps=maps, rss=rss)

    rng = np.random.default_rng(0)
    n, g = 8, 8
    def step_inputs():
        graded = rng.uniform(size=(n, g)) > 0.1
        anchor = np.zeros(n, bool)
        anchor[rng.choice(n, 2, replace=False)] = True
        return (rng.uniform(0, 1, (n, g)).astype(np.float32), graded,
                rng.uniform(0, 1, (n, g)).astype(np.float32), graded.copy(), anchor)

    state = corrections.init_correction_state()
    def call_correct_step():
        global state
        state, out = corrections.correct_step(state, *step_inputs())
        jax.block_until_ready(out)

    def call_group_advantages():
        wm, graded, _, _, anchor = step_inputs()
        jax.block_until_ready(losses.group_advantages(wm, graded, anchor, 2.0))

    def call_grpo_loss():
        logp = rng.normal(size=(n * g, 16)).astype(np.float32)
        loss, metrics = losses.grpo_loss(logp, logp, logp + 0.1, rng.normal(size=n * g).astype(np.float32),
                                         rng.uniform(size=(n * g, 16)) > 0.2)
        jax.block_until_ready((loss, metrics))

    key = jax.random.key(0)
    def call_select_anchor_groups():
        corrections.select_anchor_groups(key, n, fraction=0.25, min_per_step=1)
        corrections.select_anchor_groups(int(rng.integers(1 << 30)), n, fraction=0.25, min_per_step=1)

    calls, warmup = int(sys.argv[1]), 20
    report = {}
    for fn in (call_correct_step, call_group_advantages, call_grpo_loss, call_select_anchor_groups):
        for _ in range(warmup):
            fn()
        before = snapshot()
        for _ in range(calls - warmup):
            fn()
        report[fn.__name__[5:]] = dict(before=before, after=snapshot())
    report["pairs"] = int(state.n_pairs)
    print(json.dumps(report))
""")


def test_repeated_eager_calls_compile_once_and_do_not_grow():
    """300 README-style calls of correct_step (and repeated calls of
    group_advantages, grpo_loss, select_anchor_groups): after 20 warm-up
    calls, no further compilation, and the mapping count and RSS stay flat."""
    import json

    calls = 300
    proc = subprocess.run([sys.executable, "-c", _EAGER_SCRIPT, str(calls)], capture_output=True, text=True,
                          timeout=300, cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report.pop("pairs") > 200 * 8  # the calls really ran, pushing pairs
    for name, r in report.items():
        before, after = r["before"], r["after"]
        assert after["compiles"] == before["compiles"], f"{name}: compiled again after warm-up: {r}"
        assert after["maps"] - before["maps"] <= 8, f"{name}: memory mappings grew: {r}"
        assert after["rss"] - before["rss"] <= 32 << 20, f"{name}: RSS grew: {r}"
    # correct_step's own compilations stay a small constant (the step, and
    # the handful of eager ops that build a fresh state).
    assert report["correct_step"]["before"]["compiles"] <= 40, report


# Last in the file: leaving the x64 context drops jit caches, so the float32
# tests above would otherwise compile twice.
def test_correct_step_matches_reference_in_float64():
    with jax.enable_x64(True):
        seen = _run(dict(), steps=110, seed=7, dtype_tol=1e-9, cast=np.float64)
        state = C.init_correction_state(**SMALL)
        assert state.buf_x.dtype == np.float64 and state.ewma.dtype == np.float64
    assert seen["fits"] >= 3 and seen["c"]
