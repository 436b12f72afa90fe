r"""Scripted-expert demonstrations for LIBERO (issue #30): search physics-only, then record with cameras.

  MUJOCO_GL=egl python launch/build_demos.py --tasks 0 2 4 5 6 7 8 --states 0-49 --out /tmp/wmrl/demos
  python launch/build_demos.py --tasks 0 2 --states 0-9 --search_only    # success table, nothing written

For every (task, initial state): `simulator.expert` runs the task in a
camera-less env (5-15 s an episode on one loaded core); a successful action
sequence is then replayed open loop through `SimPool` (one simulator process
for the whole run) with the agentview and wrist cameras, and the replayed
`Episode` (frames, actions, proprio) is saved as
`<out>/<suite>/task<TT>/state<SS>.npz`. An expert failure, or a replay that
does not succeed again, is saved as `state<SS>.failed.json` (why, at which
step), so it is not retried. Files are written to a temporary name and
renamed: a killed run leaves no partial file, and rerunning the command skips
everything finished and continues (deterministic: the same command gives the
same actions). A progress bar counts episodes; a table of successes per task
ends the run. Exit status 2, with one line, for an unknown suite, task or
state, or a missing benchmark install.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import bench_common  # noqa: F401  (the launch scripts' shared helper: quiets absl/JAX INFO logs)

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_states(specs) -> list[int]:
    """["0-9", "20", "30-31"] -> [0, ..., 9, 20, 30, 31] (sorted, unique)."""
    out = set()
    for spec in specs:
        for part in str(spec).split(","):
            lo, _, hi = part.partition("-")
            try:
                out.update(range(int(lo), int(hi or lo) + 1))
            except ValueError:
                raise ValueError(f"--states {spec!r}: expected indices or ranges such as 0-9 or 3,5") from None
    return sorted(out)


def episode_path(out: pathlib.Path, suite: str, task_id: int, state: int) -> pathlib.Path:
    return out / suite / f"task{task_id:02d}" / f"state{state:02d}.npz"


def replay(pool, task_id: int, state: int, actions):
    """The expert's actions, open loop, through `pool` (cameras on): the recorded `Episode`. The pool
    stops at success; an episode still "running" after the last action did not succeed again."""
    import numpy as np

    pool.reset([(task_id, state)])
    pool.step(np.asarray(actions, np.float32)[None])
    return pool.episodes[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="libero_10", help="a LIBERO suite (libero_10 is LIBERO-Long)")
    p.add_argument("--tasks", nargs="+", default=None, help="task indices or BDDL names (default: all)")
    p.add_argument("--states", nargs="+", default=["0-49"], help="initial-state indices or ranges, e.g. 0-9")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/wmrl/demos"))
    p.add_argument("--camera_size", type=int, default=128, help="square frame side, pixels")
    p.add_argument("--record_every", type=int, default=1, help="keep every k-th frame")
    p.add_argument("--max_steps", type=int, default=None, help="policy-step budget (default: the suite's)")
    p.add_argument("--search_only", action="store_true",
                   help="run the expert physics-only and print the success table; write nothing")
    args = p.parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", "egl")

    import numpy as np
    import tqdm

    import simulator
    from wmrl_jax import files
    from simulator import expert, suites

    try:   # every name and index is checked before any scene is built
        simulator.require_benchmark()
        suite = suites.check_suite(args.suite)
        infos = [simulator.get_task(suite, int(t) if str(t).isdigit() else t) for t in args.tasks] \
            if args.tasks else list(simulator.list_tasks(suite))
        states = parse_states(args.states)
        for info in infos:
            for s in states:
                simulator.init_state(suite, info.task_id, s)
    except (RuntimeError, ValueError) as e:
        print(f"build_demos: {e}", file=sys.stderr)
        return 2
    max_steps = args.max_steps or suites.default_max_steps(suite)

    table = {info.task_id: {"ok": 0, "tried": 0, "steps": []} for info in infos}
    todo = [(info, s) for info in infos for s in states]
    bar = tqdm.tqdm(todo, desc=f"{suite} demos", unit="ep")
    env_task, env, pool = None, None, None
    for info, s in bar:
        path = episode_path(args.out, suite, info.task_id, s)
        failed = path.with_name(f"state{s:02d}.failed.json")
        row = table[info.task_id]
        if not args.search_only and path.exists():
            row["ok"] += 1
            row["tried"] += 1
            row["steps"].append(int(np.load(path)["actions"].shape[0]))
            continue
        if not args.search_only and failed.exists():
            row["tried"] += 1
            continue
        if env_task != info.task_id:   # one camera-less env per task, reused across its states
            if env is not None:
                env.close()
            env, env_task = expert.physics_env(info.bddl_file, max_steps), info.task_id
        t0 = time.perf_counter()
        result = expert.Expert(env, max_steps).run(simulator.init_state(suite, info.task_id, s))
        row["tried"] += 1
        why = "" if result.success else f"expert failed at {result.failed_at} (step {result.steps})"
        if result.success and not args.search_only:
            if pool is None:   # one simulator process for every replay: it keeps its scene per task
                pool = simulator.SimPool(suite, workers=1, camera_size=args.camera_size, max_steps=max_steps,
                                         record_every=args.record_every)
            ep = replay(pool, info.task_id, s, result.actions)
            if ep.status == "success":
                path.parent.mkdir(parents=True, exist_ok=True)
                ep.save(path)   # atomic
            else:
                why = f"replay with cameras ended {ep.status} after {ep.steps} steps {ep.reason}".strip()
        if why and not args.search_only:
            files.write_text_atomic(failed, json.dumps({"task": info.task_id, "state": s, "reason": why,
                                                        "expert_steps": result.steps}))
        if not why:
            row["ok"] += 1
            row["steps"].append(result.steps)
        elif args.search_only:
            tqdm.tqdm.write(f"task {info.task_id} state {s}: {why} ({time.perf_counter() - t0:.1f} s)")
        done = sum(r["tried"] for r in table.values())
        bar.set_postfix(success=f"{sum(r['ok'] for r in table.values())}/{done}")
    bar.close()
    if env is not None:
        env.close()
    if pool is not None:
        pool.close()

    print("\n| task | instruction | successes / states | mean steps |\n|---|---|---|---|")
    for info in infos:
        r = table[info.task_id]
        mean = f"{np.mean(r['steps']):.0f}" if r["steps"] else "-"
        print(f"| {info.task_id} | {info.instruction} | {r['ok']} / {r['tried']} | {mean} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
