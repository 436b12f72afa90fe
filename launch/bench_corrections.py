"""Speed of the corrections against named peers, measured in the same run.

    python launch/bench_corrections.py            # ~1-2 min on 2 CPU cores
    python launch/bench_corrections.py --quick    # fewer repeats

1. ``correct_step`` (jitted) at paper size -- 8 groups x 8 rollouts, 2 anchor
   groups per step, FIFO cap 5000 already full, a refit every 4 steps (64
   pairs) -- per step, against ``wmrl_jax._reference_numpy.CorrectionLoop``
   (plain numpy, the same semantics). Target: >= 10x. Measured two ways: one
   jitted call per step, state donated and every output blocked on (how a host
   loop calls it; bound by per-call dispatch, not arithmetic), and 64 steps in
   one jitted ``lax.scan`` (how it runs inside a jitted train step). Also the
   per-call floor: a jitted program with the step's inputs, donated state and
   outputs that does no work (``_null_step``), timed the same way, and that
   floor again with the 13 outputs as separate arrays (what ``StepOutput``'s
   packing into three saves), and what one more XLA operation adds to a
   call with each dispatch (``bench_per_op``).
2. ``isotonic_fit`` (jitted, exact, weighted) against
   ``sklearn.isotonic.IsotonicRegression(out_of_bounds="clip").fit`` and
   ``np.argsort`` + ``scipy.optimize.isotonic_regression`` at n = 5000 and
   50 000. Target: no slower than 2x sklearn.

Timings: warm-up first, ``block_until_ready`` on every JAX result, medians
over repeats. Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import re
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


def _null_step(state, wm_rewards, wm_graded, real_rewards, real_graded, is_anchor):
    """``correct_step``'s signature and outputs with no work: the per-call floor of any jitted step.

    The state passes through (donated, aliased) and every output is a zero of
    the right shape, except that one 8 x 8 product (1 024 flops) is added to
    the float outputs: XLA:CPU runs a program of < 1 000 flops on the calling
    thread and any other on its worker thread, and a step that can refit is
    far above that line, so the floor pays the same hand-off the step does.
    """
    import jax
    import jax.numpy as jnp

    from wmrl_jax import corrections as C

    _, shapes = jax.eval_shape(C.correct_step, state, wm_rewards, wm_graded, real_rewards, real_graded, is_anchor)
    out = jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), shapes)
    return state, dataclasses.replace(out, floats=out.floats + (wm_rewards @ real_rewards).sum())


def _null_step_unpacked(state, wm_rewards, wm_graded, real_rewards, real_graded, is_anchor):
    """``_null_step`` returning ``out`` as the plain dict of its 13 arrays:
    what packing the outputs into a StepOutput (two arrays) saves a call."""
    state, out = _null_step(state, wm_rewards, wm_graded, real_rewards, real_graded, is_anchor)
    return state, dict(out)


def bench_step(repeats: int, steps_per_repeat: int = 64):
    """Seconds per step: (jax per call, jax inside a jitted scan, numpy, the per-call floor,
    the floor with 13 unpacked outputs)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from wmrl_jax import _correction_state as _state
    from wmrl_jax import _reference_numpy as ref
    from wmrl_jax import corrections as C

    rng = np.random.default_rng(0)
    cap = 5000
    fill_x = rng.uniform(0, 1, cap)
    fill_y = np.clip(fill_x**2 + rng.normal(0, 0.1, cap), 0, 1)

    # Both start with a full buffer and a fitted map; since = 0, so a refit
    # lands every 4th step (16 pairs per step, refit_every = 64).
    fields = dataclasses.replace(_state.unpack(C.init_correction_state(cap=cap)),
                                 buf_len=jnp.int32(cap), n_pairs=jnp.int32(cap))
    buffer = jnp.asarray(np.stack([fill_x, fill_y]), jnp.float32)
    state = jax.jit(lambda f, b: C.CorrectionState(b, C._refit(_state.pack(f), b, f.config), f.config))(
        fields, buffer)
    loop = ref.CorrectionLoop(cap=cap)
    loop.debiaser.pairs = [(float(a), float(b)) for a, b in zip(fill_x.astype(np.float32), fill_y.astype(np.float32))]
    loop.debiaser.refit()

    data = _step_data(rng, steps_per_repeat)
    dev = [tuple(jnp.asarray(a) for a in d) for d in data]
    stacked = tuple(jnp.stack(xs) for xs in zip(*dev))
    lists = [(ref.to_lists(d[0], d[1]), ref.to_lists(d[2], d[3]), list(d[4])) for d in data]
    # Per call, as a host loop would call it (state donated: updated in place).
    step = jax.jit(C.correct_step, donate_argnums=0)
    # Per step inside one program, as the jitted train step runs it: no
    # per-call dispatch of the state's leaves.
    scanned = jax.jit(lambda s, xs: jax.lax.scan(lambda c, x: C.correct_step(c, *x), s, xs))

    null = jax.jit(_null_step, donate_argnums=0)
    null_unpacked = jax.jit(_null_step_unpacked, donate_argnums=0)

    def run_jax(step=step):
        s = jax.tree.map(jnp.copy, state)
        for d in dev:
            s, o = step(s, *d)
            jax.block_until_ready(o)

    def run_scan():
        jax.block_until_ready(scanned(state, stacked))

    def run_numpy():
        for wm, real, anchor in lists:
            loop.step(wm, real, anchor)

    def run_null():
        run_jax(null)

    def run_null_unpacked():
        run_jax(null_unpacked)

    run_jax()
    run_scan()
    run_numpy()
    run_null()
    run_null_unpacked()
    assert loop.debiaser.n_fits > 1
    times = _median_times([run_jax, run_scan, run_numpy, run_null, run_null_unpacked], repeats)
    return tuple(t / steps_per_repeat for t in times)


def bench_per_op(repeats: int, ops: int = 40):
    """Microseconds one more XLA:CPU operation adds to a jitted call: the
    time of a program of ``ops`` chained small reductions minus that of one,
    over the difference in their compiled operations; both programs above
    the 1000-flop line (so dispatched like the step).

    It explains the per-call rows: under asynchronous dispatch each
    operation of a program costs several times what it does on the calling
    thread, so the step's ~60 operations weigh more than its arithmetic.
    """
    import jax
    import jax.numpy as jnp

    def chain(k):
        def f(x):
            acc = x
            for i in range(k):
                acc = jnp.where(acc > jnp.sum(acc * (i + 1.0)), acc, acc + 1.0)
            return acc + (x @ x.T).sum()

        return jax.jit(f)

    x = jnp.ones((8, 8), jnp.float32)
    short, long = chain(1), chain(ops)

    def n_ops(f):  # operations XLA compiled the program to
        return len(re.findall(r"^\s+%\S+ = \S+ fusion\(", f.lower(x).compile().as_text(), re.M))

    def calls(f):
        return lambda: [f(x).block_until_ready() for _ in range(64)]

    t_short, t_long = _median_times([calls(short), calls(long)], repeats)
    return (t_long - t_short) / 64 / (n_ops(long) - n_ops(short)) * 1e6


def _bench_step_sync_dispatch(repeats: int):
    """``bench_step`` with each jitted call executed on the calling thread.

    By default XLA:CPU runs any program costing >= 1000 flops on a worker
    thread; a host loop that blocks on every result then pays a hand-off to
    that thread and back per call (tens of microseconds on a loaded machine).
    Must run in a process whose JAX CPU client is not created yet.
    """
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return bench_step(repeats), bench_per_op(repeats)


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
    t_jax, t_scan, t_np, t_null, t_unpacked = bench_step(reps)
    # The same measurement in a fresh process whose CPU client runs each call
    # on the calling thread (the setting is read when the client is created).
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        (t_sync, _, t_np_sync, t_null_sync, t_unpacked_sync), op_sync = pool.apply(
            _bench_step_sync_dispatch, (reps,))
    op_async = bench_per_op(reps)
    print("\ncorrect_step, 8 groups x 8, cap 5000 full, refit every 4th step (per step)")
    row = "  {:<40}{:9.3f} ms   numpy / jax = {:6.1f}x{}"
    print(row.format("jax, jitted call per step", t_jax * 1e3, t_np / t_jax, ""))
    print(row.format("jax, same, synchronous dispatch [1]", t_sync * 1e3, t_np_sync / t_sync,
                     f"   (numpy in that process {t_np_sync * 1e3:.3f} ms)"))
    print(row.format("jax, 64 steps in one jitted scan", t_scan * 1e3, t_np / t_scan, ""))
    print(f"  {'numpy reference':<40}{t_np * 1e3:9.3f} ms   (target numpy / jax >= 10x)")
    print(f"  floor [2]: {t_null * 1e3:.3f} ms a call ({t_null_sync * 1e3:.3f} ms synchronous) against the "
          f"{t_np / 10 * 1e3:.3f} ms ({t_np_sync / 10 * 1e3:.3f} ms) that 10x allows")
    print("  [1] jax_cpu_enable_async_dispatch=False: a call that is blocked on at once gains\n"
          "      nothing from running on XLA's worker thread, and pays a thread hand-off per call.\n"
          "  [2] a jitted program with correct_step's inputs, donated state and outputs that does no\n"
          "      work (launch/bench_corrections._null_step): what any per-call step pays first.")
    print(f"  the same floor returning out as 13 separate arrays instead of a StepOutput's 2: "
          f"{t_unpacked * 1e3:.3f} ms ({t_unpacked_sync * 1e3:.3f} ms synchronous), "
          f"{t_unpacked / t_null:.2f}x ({t_unpacked_sync / t_null_sync:.2f}x)")
    print(f"  one more XLA:CPU operation in a jitted call (bench_per_op): {op_async:.2f} us "
          f"({op_sync:.2f} us synchronous)")
    print("\nisotonic_fit, exact weighted (per fit)")
    print(f"  {'n':>7} {'jax (jit)':>12} {'sklearn':>12} {'scipy':>12} {'jax/sklearn':>12} {'jax/scipy':>10}")
    for n in (5000, 50000):
        t_j, t_sk, t_sp = bench_isotonic(n, reps * 2)
        print(f"  {n:>7} {t_j * 1e3:>9.2f} ms {t_sk * 1e3:>9.2f} ms {t_sp * 1e3:>9.2f} ms "
              f"{t_j / t_sk:>11.2f}x {t_j / t_sp:>9.2f}x   (target jax/sklearn <= 2)")


if __name__ == "__main__":
    main()
