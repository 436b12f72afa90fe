"""`python -m sandbox.suite build --out DIR --seed 0 [--tasks a,b] [--population 50] [--workers 2]`."""

from __future__ import annotations

import argparse
import sys
import time

from sandbox.suite import build, suite_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox.suite", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the embedded task suite")
    b.add_argument("--out", default=str(suite_dir()), help="output folder (replaced); default: the shipped location")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--tasks", default="", help="comma-separated task names (default: all)")
    b.add_argument("--population", type=int, default=50, help="reference solutions per task; 0 = data only")
    b.add_argument("--workers", type=int, default=2, help="concurrent sandbox runs")
    b.add_argument("--timeout-s", type=float, default=300.0, help="per-solution time limit")
    args = parser.parse_args(argv)
    start = time.time()
    tasks = [t for t in args.tasks.split(",") if t] or None
    manifest = build(args.out, seed=args.seed, tasks=tasks, population=args.population, workers=args.workers,
                     timeout_s=args.timeout_s)
    built = len(tasks) if tasks else len(manifest["tasks"])
    print(f"built {built} task(s) in {time.time() - start:.0f} s; {args.out} holds {len(manifest['tasks'])} tasks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
