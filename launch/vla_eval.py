r"""Success rate of an SFT VLA policy in LIBERO, per task, with 95 % intervals (issue #30).

  MUJOCO_GL=egl python launch/vla_eval.py --checkpoint /tmp/wmrl/vla_sft      # its tasks x its held-out states
  python launch/vla_eval.py --checkpoint /tmp/wmrl/vla_sft --tasks 0 2 --states 45-49 --temperature 1.0 --seed 3

Runs the policy saved by launch/vla_sft.py (`--checkpoint`: its --out or the
policy/ folder) through `simulator.SimPool` with the cameras and frame size
the model reads, one episode per (task, initial state), `--workers`
simulator processes stepped together and the policy batched over them
(greedy by default; `--temperature` > 0 samples, reproducibly from `--seed`).
By default the tasks are those the policy was trained on and the states its
held-out ones (`meta.json`), so the scenes are ones it has not seen.

Reports, per task and overall, successes over episodes with a known outcome,
the success rate and its Wilson interval (`--level`, default 95 %); episodes
whose simulator process crashed or hung are "unknown": excluded from the rate
and counted, as the Episode contract says. Writes `<out>/eval.json` (the
table, every episode's status, steps and reason, the timing) and `eval.md`
(default out: `<checkpoint>/eval`); `--save_episodes DIR` also saves every
`Episode` with all its frames (the failed rollouts launch/vla_progress.py
trains the progress model on). Bad input (the benchmark not installed, an
unknown suite or task, a state out of range, a missing checkpoint, cameras the
simulator does not have) is one line and exit status 2, before the model
loads or any simulator starts.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs; launch/ is on the path as a script)

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=pathlib.Path, required=True, help="launch/vla_sft.py's --out, or its policy/")
    p.add_argument("--suite", default=None, help="a LIBERO suite (default: the one the policy was trained on)")
    p.add_argument("--tasks", nargs="+", default=None, help="task indices or BDDL names (default: the trained ones)")
    p.add_argument("--states", nargs="+", default=None, help="initial-state indices or ranges, e.g. 40-49 "
                   "(default: the policy's held-out states)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--workers", type=int, default=2, help="simulator processes (about one per CPU core)")
    p.add_argument("--max_steps", type=int, default=None, help="policy steps per episode (default: the suite's)")
    p.add_argument("--level", type=float, default=0.95, help="confidence level of the intervals")
    p.add_argument("--out", type=pathlib.Path, default=None, help="output folder (default: <checkpoint>/eval)")
    p.add_argument("--save_episodes", type=pathlib.Path, default=None,
                   help="also save every episode (all frames, as the policy saw them) under this folder as "
                        "<suite>/task<TT>/state<SS>.seed<N>.npz: rollouts for launch/vla_progress.py --rollouts")
    p.add_argument("--render", default="egl", help="MUJOCO_GL backend of the simulator processes")
    p.add_argument("--step_timeout_s", type=float, default=60.0, help="seconds per step before a process is hung")
    p.add_argument("--env_factory", default=None, help=argparse.SUPPRESS)   # tests: a stand-in env, module:callable
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def resolve(args):
    """(policy folder, meta, config dict, suite, task infos, states) from the arguments; ValueError /
    RuntimeError / FileNotFoundError with one line for anything wrong. Reads JSON files only."""
    import simulator
    from simulator import suites
    from wmrl_jax.vla import demos, sft

    simulator.require_benchmark()
    folder = sft.check_policy_folder(args.checkpoint)
    meta = json.loads((folder / "meta.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    suite = args.suite or meta.get("suite")
    if suite is None:
        raise ValueError(f"--suite: the policy was trained on several suites {meta.get('suites')}; name one")
    suite = suites.check_suite(suite)
    if args.tasks:
        infos = [simulator.get_task(suite, int(t) if str(t).isdigit() else t) for t in args.tasks]
    else:
        infos = [simulator.get_task(suite, int(t)) for t in meta.get("tasks", [])]
    if not infos:
        raise ValueError("--tasks: none given and none recorded in the policy's meta.json")
    states = demos.parse_indices(args.states) if args.states else list(meta.get("held_out_states", []))
    if not states:
        raise ValueError(f"--states: none given and the policy has no held-out states (trained on states "
                         f"{meta.get('train_states')}); pass --states")
    for info in infos:
        for s in states:
            simulator.init_state(suite, info.task_id, s)
    cameras = tuple(config["cameras"])
    unknown = [c for c in cameras if c not in suites.CAMERA_KEYS]
    if unknown:
        raise ValueError(f"{folder}/config.json: cameras {list(cameras)}; the simulator has {list(suites.CAMERA_KEYS)}")
    trained_on = set(meta.get("train_states", []))
    seen = sorted(trained_on & set(states))
    if seen and args.states:
        print(f"vla_eval: note: states {seen} were trained on (not held out)", file=sys.stderr)
    for name, value, ok in (("--workers", args.workers, args.workers >= 1),
                            ("--temperature", args.temperature, args.temperature >= 0),
                            ("--level", args.level, 0 < args.level < 1),
                            ("--max_steps", args.max_steps, args.max_steps is None or args.max_steps >= 1)):
        if not ok:
            raise ValueError(f"{name} {value}: out of range (workers >= 1, temperature >= 0, 0 < level < 1, "
                             f"max_steps >= 1)")
    return folder, meta, config, suite, infos, states


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", args.render)
    try:
        folder, meta, config, suite, infos, states = resolve(args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"vla_eval: {e}", file=sys.stderr)
        return 2

    import jax

    import simulator
    from wmrl_jax import files
    from wmrl_jax.vla import evaluate, sft

    policy = sft.load_policy(folder)
    starts = [(info.task_id, s) for info in infos for s in states]
    size = policy.config.vision.image_size
    print(f"{folder}: {len(starts)} episodes ({len(infos)} tasks x states {states}) in {suite}, cameras "
          f"{list(policy.config.cameras)} at {size}px, {'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}")
    fn = evaluate.policy_fn(policy, [i.instruction for i in infos], temperature=args.temperature, seed=args.seed)
    t0 = time.perf_counter()
    try:
        pool = simulator.SimPool(suite, workers=min(args.workers, len(starts)), cameras=policy.config.cameras,
                                 camera_size=size, max_steps=args.max_steps,
                                 record_every=1 if args.save_episodes else 0, render=args.render,
                                 step_timeout_s=args.step_timeout_s, env_factory=args.env_factory)
    except (RuntimeError, ValueError) as e:   # e.g. a render backend that cannot start
        print(f"vla_eval: {e}", file=sys.stderr)
        return 2
    with pool:
        episodes = simulator.run_episodes(pool, fn, starts, progress=not args.no_progress)
        pool_stats = pool.stats()
    wall = time.perf_counter() - t0
    for e in episodes if args.save_episodes else ():
        path = args.save_episodes / e.suite / f"task{e.task_id:02d}" / f"state{e.init_state_index:02d}.seed{args.seed}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        e.save(path)
    summary = evaluate.summarize(episodes, level=args.level, instructions={i.task_id: i.instruction for i in infos})
    out = args.out or (folder.parent if folder.name == "policy" else folder) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    record = {"checkpoint": str(folder), "suite": suite, "states": states, "temperature": args.temperature,
              "seed": args.seed, "max_steps": pool.max_steps, "camera_size": size, "trained_steps": meta.get("steps"),
              "train_states": meta.get("train_states"), **summary,
              "episodes": [{"task": e.task_id, "state": e.init_state_index, "status": e.status, "steps": e.steps,
                            "reason": e.reason} for e in episodes],
              "wall_s": round(wall, 1), "simulator_step_s": round(pool_stats["step_wall_s"], 1),
              "restarts": pool_stats["restarts"], "backend": jax.default_backend()}
    table = evaluate.markdown(summary)
    for name, text in (("eval.json", json.dumps(record, indent=1) + "\n"),
                       ("eval.md", f"# {folder}: {suite}, states {states}\n\n{table}\n")):
        files.write_text_atomic(out / name, text)
    print(table)
    o = summary["overall"]
    print(f"unknown episodes (excluded): {o['unknown']}; {wall:.0f} s; wrote {out / 'eval.json'} and {out / 'eval.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
