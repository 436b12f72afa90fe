"""Speed of the corrections against named peers, measured in the same run.

    python launch/bench_corrections.py            # ~1 min on 2 CPU cores
    python launch/bench_corrections.py --quick    # fewer repeats

1. ``correct_step`` at paper size -- 8 groups x 8 rollouts, 2 anchor groups
   per step, FIFO cap 5000 already full and fitted, a refit every 4th step (16
   pairs a step, refit_every 64) -- per step, against
   ``wmrl_jax._reference_numpy.CorrectionLoop`` (plain numpy, the same
   semantics). Measured two ways: called as a user calls it (the public
   function, one call per step from a plain Python loop, no jit of the
   caller's own, output blocked on), and 64 steps in one jitted ``lax.scan``
   (how it runs inside a jitted train step).
2. ``isotonic_fit`` (jitted, exact, weighted) against
   ``sklearn.isotonic.IsotonicRegression(out_of_bounds="clip").fit`` and
   ``np.argsort`` + ``scipy.optimize.isotonic_regression`` at n = 5000 and
   50 000. Target: no slower than 2x sklearn.

Timings: warm-up first, ``block_until_ready`` on every JAX result, medians
over repeats. Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs)


def _median_times(fns, repeats):
    """Median seconds of each fn. The fns take turns, so load from other
    processes falls on all alike, and each timed call follows an untimed one
    of the same fn: XLA's CPU worker threads park while numpy runs, and the
    first call after that measures their wake-up, not the code."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            fn()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def _step_data(rng, steps, n=8, g=8, anchors=2):
    """(wm, wm_graded, real, real_graded, is_anchor) numpy inputs of ``steps`` steps."""
    import numpy as np

    out = []
    for _ in range(steps):
        real = rng.uniform(0, 1, (n, g))
        wm = np.clip(np.sqrt(real) + rng.normal(0, 0.1, (n, g)), 0, 1)
        graded = rng.uniform(size=(n, g)) > 0.05
        anchor = np.zeros(n, bool)
        anchor[rng.choice(n, anchors, replace=False)] = True
        out.append((wm.astype(np.float32), graded, real.astype(np.float32), graded.copy(), anchor))
    return out


def bench_step(repeats: int, steps_per_repeat: int = 64, cap: int = 5000):
    """Seconds per step: (public correct_step per call, inside a jitted scan, numpy)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from wmrl_jax import _reference_numpy as ref
    from wmrl_jax import corrections as C

    def scan(state, xs):
        return jax.lax.scan(lambda s, x: C.correct_step(s, *x), state, xs)

    scanned = jax.jit(scan)
    stack = lambda data: tuple(jnp.stack([jnp.asarray(a) for a in xs]) for xs in zip(*data))  # noqa: E731
    lists = lambda data: [(ref.to_lists(d[0], d[1]), ref.to_lists(d[2], d[3]), list(d[4])) for d in data]  # noqa: E731

    # Both fill the FIFO with the same all-anchor steps (> cap pairs): full, fitted.
    rng = np.random.default_rng(0)
    fill = _step_data(rng, cap // 60 + 4, anchors=8)  # ~61 graded pairs a step
    state, _ = jax.jit(scan)(C.init_correction_state(cap=cap), stack(fill))
    loop = ref.CorrectionLoop(cap=cap)
    for wm, real, anchor in lists(fill):
        loop.step(wm, real, anchor)
    assert int(state.buf_len) == cap == len(loop.debiaser.pairs), "the FIFO must be full"
    assert int(state.n_fits) == loop.debiaser.n_fits

    data = _step_data(rng, steps_per_repeat)
    host, stacked, data_lists = data, stack(data), lists(data)
    live = [jax.tree.map(jnp.copy, state)]  # the per-call loop's state (donated, so its own copy)

    def run_per_call():  # the README's usage: numpy inputs, the public function
        s = live[0]
        for d in host:
            s, out = C.correct_step(s, *d)
        jax.block_until_ready(out)
        live[0] = s

    def run_scan():
        jax.block_until_ready(scanned(state, stacked))

    def run_numpy():
        for wm, real, anchor in data_lists:
            loop.step(wm, real, anchor)

    fits = loop.debiaser.n_fits
    times = _median_times([run_per_call, run_scan, run_numpy], repeats)
    assert loop.debiaser.n_fits > fits, "the timed steps must refit"
    return tuple(t / steps_per_repeat for t in times)


def bench_isotonic(n: int, repeats: int):
    """Seconds per fit: (jax, sklearn, scipy)."""
    import jax
    import numpy as np
    from scipy.optimize import isotonic_regression
    from sklearn.isotonic import IsotonicRegression

    from wmrl_jax import corrections as C

    rng = np.random.default_rng(n)
    x = rng.uniform(0, 1, n)
    y = x**2 + rng.normal(0, 0.3, n)
    w = rng.uniform(0.5, 2.0, n)
    x32, y32, w32 = (jax.numpy.asarray(a, jax.numpy.float32) for a in (x, y, w))
    fit = jax.jit(C.isotonic_fit)
    jax.block_until_ready(fit(x32, y32, w32))

    def run_scipy():
        order = np.argsort(x)
        return isotonic_regression(y[order], weights=w[order])

    return _median_times([
        lambda: jax.block_until_ready(fit(x32, y32, w32)),
        lambda: IsotonicRegression(out_of_bounds="clip").fit(x, y, sample_weight=w),
        run_scipy,
    ], repeats)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args(argv)
    reps = 5 if args.quick else 15
    if "jax" not in sys.modules:
        # One XLA CPU thread, like the single-threaded peers: these kernels are
        # latency-bound (8 x 8 rewards, 5000-pair buffer) and intra-op
        # threading only adds hand-offs, which a shared machine makes slow.
        flags = os.environ.get("XLA_FLAGS", "")
        if "multi_thread_eigen" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false").strip()
    import jax

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; medians of {reps} repeats; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    t_call, t_scan, t_np = bench_step(reps)
    print("\ncorrect_step, 8 groups x 8, cap 5000 full, refit every 4th step (per step)")
    row = "  {:<44}{:9.3f} ms   numpy / jax = {:6.1f}x"
    print(row.format("jax, public correct_step, one call per step", t_call * 1e3, t_np / t_call))
    print(row.format("jax, 64 steps in one jitted lax.scan", t_scan * 1e3, t_np / t_scan))
    print(f"  {'numpy reference (_reference_numpy)':<44}{t_np * 1e3:9.3f} ms")
    print("\nisotonic_fit, exact weighted (per fit)")
    print(f"  {'n':>7} {'jax (jit)':>12} {'sklearn':>12} {'scipy':>12} {'jax/sklearn':>12} {'jax/scipy':>10}")
    for n in (5000, 50000):
        t_j, t_sk, t_sp = bench_isotonic(n, reps * 2)
        print(f"  {n:>7} {t_j * 1e3:>9.2f} ms {t_sk * 1e3:>9.2f} ms {t_sp * 1e3:>9.2f} ms "
              f"{t_j / t_sk:>11.2f}x {t_j / t_sp:>9.2f}x   (target jax/sklearn <= 2)")


if __name__ == "__main__":
    main()
