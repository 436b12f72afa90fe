r"""Sandbox cost: per-run isolation overhead and pool throughput, against bare subprocesses.

  python launch/bench_sandbox.py --quick        # ~2 min on 2 loaded CPU cores
  python launch/bench_sandbox.py                # ~4 min (30 trivial runs per mode, 8 reference solutions)

1. Isolation overhead. A trivial solution (`pass`) is started `--repeats`
   times each way, interleaved so machine load hits both alike:
     peer      bare `subprocess.run([python, solution.py])`
     sandbox   `isolation.execute` (bwrap namespaces + prlimit + setpriv + timing shell + python)
     full      `run_solution` (adds compile gate, run folder, grading of the missing submission)
   Printed: medians (ms), sandbox - peer (the isolation overhead; target <= 50 ms) and ratios.

2. Pool throughput. Reference solutions of the embedded suite
   (`sandbox/suite/embedded/execution_log.jsonl`, one entry per task first;
   falls back to the test fixtures and says so) run through
   `SandboxPool(workers=W, cache=False)`; peer: the same scripts as bare
   subprocesses, sequential, in the same task data (no isolation, no grading).
   Printed: executions/s, sandbox CPU-seconds, wall-seconds, ratio vs peer.

Importable without side effects (argparse, everything under main()).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # runnable from a checkout without installing
    sys.path.insert(0, str(ROOT))

FIXTURE_SOLUTION = '''
import csv, os
rows = list(csv.DictReader(open(os.path.join(os.environ["DATA_DIR"], "test.csv"))))
with open(os.environ["SUBMISSION_PATH"], "w") as f:
    f.write("id,Age\\n")
    for r in rows:
        f.write(f"{r['id']},{3 + 6 * float(r['Length'])}\\n")
'''


def _median_ms(xs):
    return 1000.0 * statistics.median(xs)


def measure_overhead(task, repeats: int) -> dict:
    """Median wall of a trivial run: bare subprocess (peer), sandboxed execute, full run_solution."""
    import sandbox
    from sandbox import isolation, runner

    data_dir = runner.mountable_data_dir(task)
    limits = isolation.Limits(timeout_s=60)
    bare, boxed, full = [], [], []
    scratch = tempfile.mkdtemp(prefix="wmrl-bench-")
    try:
        script = os.path.join(scratch, "solution.py")
        with open(script, "w") as f:
            f.write("pass\n")
        env = dict(os.environ, **isolation.thread_env(1))
        for i in range(repeats):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-u", script], cwd=scratch, env=env, check=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            bare.append(time.perf_counter() - t0)
            run_dir = tempfile.mkdtemp(dir=scratch)
            t0 = time.perf_counter()
            raw = isolation.run_python("pass\n", data_dir=data_dir, run_dir=run_dir, limits=limits)
            boxed.append(time.perf_counter() - t0)
            if raw.exit_code != 0:
                raise RuntimeError(f"sandboxed trivial run failed: {raw.stderr[-500:]}")
            t0 = time.perf_counter()
            r = sandbox.run_solution(task, "pass\n", limits=limits)
            full.append(time.perf_counter() - t0)
            if r.status != "ran_no_sub":
                raise RuntimeError(f"run_solution on a trivial solution: {r.status}\n{r.feedback}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"bare_ms": _median_ms(bare), "sandbox_ms": _median_ms(boxed), "full_ms": _median_ms(full),
            # Paired differences cancel most of the machine-load drift between the two starts.
            "paired_ms": _median_ms([b - a for a, b in zip(bare, boxed)]),
            "min_bare_ms": 1000 * min(bare), "min_sandbox_ms": 1000 * min(boxed),
            "backend": raw.isolation["backend"]}


def reference_jobs(n: int):
    """(task, code) pairs: embedded-suite reference solutions, or the fixtures (second value says which)."""
    import sandbox

    try:
        from sandbox.suite import execution_log, list_tasks
        paths = {p.name: p for p in list_tasks()}
        log = [e for e in execution_log() if e.get("origin", "reference") == "reference" and e["task"] in paths]
    except Exception:   # suite not built (yet): fall back, loudly
        log = []
    if log:
        tasks = {name: sandbox.load_task(p) for name, p in paths.items()}
        # Round-robin over tasks so a short run still covers the whole suite.
        by_task: dict[str, list] = {}
        for e in log:
            by_task.setdefault(e["task"], []).append(e["code"])
        jobs, i = [], 0
        while len(jobs) < n and any(by_task.values()):
            for name in sorted(by_task):
                if by_task[name] and len(jobs) < n:
                    jobs.append((tasks[name], by_task[name].pop(0)))
            i += 1
        return jobs, f"embedded suite reference solutions ({len(tasks)} tasks)"
    fix = ROOT / "tests" / "fixtures" / "mle-dojo" / "playground-series-s3e16"
    task = sandbox.load_task(fix)
    jobs = [(task, FIXTURE_SOLUTION + f"\n# variant {i}\n") for i in range(n)]
    return jobs, "test fixture (embedded suite not built yet)"


def measure_pool(jobs, workers: int, timeout_s: float) -> dict:
    import sandbox
    from sandbox import isolation, runner

    # Peer: the same scripts, bare and sequential, reading the same data (writes go to a scratch dir).
    scratch = tempfile.mkdtemp(prefix="wmrl-bench-peer-")
    try:
        t0 = time.perf_counter()
        for task, code in jobs:
            script = os.path.join(scratch, "solution.py")
            with open(script, "w") as f:
                f.write(runner.extract_code(code) or "pass\n")
            env = dict(os.environ, DATA_DIR=str(task.public_dir),
                       SUBMISSION_PATH=os.path.join(scratch, "submission.csv"), **isolation.thread_env(1))
            subprocess.run([sys.executable, "-u", script], cwd=scratch, env=env, timeout=timeout_s,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        peer_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    t0 = time.perf_counter()
    with sandbox.SandboxPool(workers=workers, cache=False, timeout_s=timeout_s,
                             max_pending=max(workers, 2 * workers)) as pool:
        results = pool.map(jobs)
        stats = pool.stats()
    pool_s = time.perf_counter() - t0
    return {"n": len(jobs), "peer_s": peer_s, "pool_s": pool_s, "stats": stats,
            "statuses": {s: sum(r.status == s for r in results) for s in sorted({r.status for r in results})}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    parser.add_argument("--repeats", type=int, default=None, help="trivial runs per mode (default 30; quick 10)")
    parser.add_argument("--pool-runs", type=int, default=None, help="reference solutions (default 8; quick 4)")
    parser.add_argument("--workers", type=int, default=2, help="pool concurrency")
    parser.add_argument("--timeout", type=float, default=300.0, help="per-solution limit, seconds")
    args = parser.parse_args(argv)
    repeats = args.repeats or (10 if args.quick else 30)
    pool_runs = args.pool_runs or (4 if args.quick else 8)

    import sandbox

    task = sandbox.load_task(ROOT / "tests" / "fixtures" / "mle-dojo" / "playground-series-s3e16")
    ov = measure_overhead(task, repeats)
    print(f"== per-run isolation overhead: trivial solution, median of {repeats}, backend {ov['backend']} ==")
    print(f"peer  bare subprocess      {ov['bare_ms']:8.1f} ms")
    print(f"      sandboxed execute    {ov['sandbox_ms']:8.1f} ms   ratio {ov['sandbox_ms'] / ov['bare_ms']:.2f}x"
          f"   overhead {ov['sandbox_ms'] - ov['bare_ms']:+.1f} ms (target <= 50)")
    print(f"      paired median overhead {ov['paired_ms']:+.1f} ms;  best case: bare {ov['min_bare_ms']:.1f} ms, "
          f"sandboxed {ov['min_sandbox_ms']:.1f} ms ({ov['min_sandbox_ms'] - ov['min_bare_ms']:+.1f} ms)")
    print(f"      full run_solution    {ov['full_ms']:8.1f} ms   ratio {ov['full_ms'] / ov['bare_ms']:.2f}x"
          f"   overhead {ov['full_ms'] - ov['bare_ms']:+.1f} ms")

    jobs, source = reference_jobs(pool_runs)
    pr = measure_pool(jobs, args.workers, args.timeout)
    st = pr["stats"]
    print(f"== pool throughput: {pr['n']} runs of {source}, workers={args.workers} ==")
    print(f"peer  bare sequential      {pr['n'] / pr['peer_s']:8.3f} exec/s   ({pr['peer_s']:.1f} s)")
    print(f"      SandboxPool          {pr['n'] / pr['pool_s']:8.3f} exec/s   ({pr['pool_s']:.1f} s)"
          f"   ratio {pr['peer_s'] / pr['pool_s']:.2f}x")
    print(f"      sandbox CPU-seconds {st['cpu_s']:.1f}, wall-seconds {st['wall_s']:.1f}, "
          f"executions {st['executions']}, statuses {json.dumps(pr['statuses'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
