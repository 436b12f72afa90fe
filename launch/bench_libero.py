r"""LIBERO-Long simulation speed: `SimPool` (1 and 2 processes) against one env stepped in-process.

  python launch/bench_libero.py            # ~1.5-2 min on 2 loaded CPU cores (a scene build ~6-12 s)
  python launch/bench_libero.py --quick    # fewer steps (~1.5 min: the builds dominate)

Peer: the benchmark's own `OffScreenRenderEnv`, built and stepped directly in
this process, as the standard evaluation scripts do (one env, no process
boundary). Measured in the same run, with and without camera observations
(agentview + wrist at --camera_size; without cameras the pool builds no renderer
at all). Every side starts from the same initial state of one task, takes the
10 settle steps untimed, then steps the same small random actions; timed are the
env steps only (scene builds and resets are printed apart).

Printed: env steps/s (all rows together) per side, and each pool side's ratio to
the peer with the same cameras; and the pool's own cost, the round trip of one
`pool.step` around a stand-in env that does no physics (`NullEnv`, same frames). With W processes the ideal ratio is ~W minus
the per-step round trip (pickling two frames per row); on a loaded host the
2-process rows show the cores actually free.

Importable without side effects (argparse, everything under main()).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # runnable from a checkout without installing
    sys.path.insert(0, str(ROOT))

SUITE = "libero_10"


class NullEnv:
    """The env interface with no physics: fixed observations of the real shapes (the pool's own cost)."""

    def __init__(self, *, bddl_file, cameras, camera_size, horizon):
        keys = {"agentview": "agentview_image", "wrist": "robot0_eye_in_hand_image"}
        self.obs = {"robot0_eef_pos": np.zeros(3), "robot0_eef_quat": np.array([0, 0, 0, 1.0]),
                    "robot0_gripper_qpos": np.zeros(2),
                    **{keys[c]: np.zeros((camera_size, camera_size, 3), np.uint8) for c in cameras}}

    def seed(self, seed):
        pass

    def reset(self):
        pass

    def set_init_state(self, state):
        return self.obs

    def step(self, action):
        return self.obs, 0.0, False, {}

    def check_success(self):
        return False

    def close(self):
        pass


def round_trip_ms(cameras: tuple, size: int, n: int = 300) -> float:
    """Milliseconds per `pool.step` (one row, one action) around `NullEnv`."""
    import simulator

    with simulator.SimPool(SUITE, workers=1, cameras=cameras, camera_size=size, settle_steps=0, max_steps=n + 50,
                           record_every=0, env_factory="bench_libero:NullEnv") as pool:
        pool.reset([(0, 0)])
        for _ in range(20):
            pool.step(np.zeros((1, 7)))
        t0 = time.perf_counter()
        for _ in range(n):
            pool.step(np.zeros((1, 7)))
        return 1000 * (time.perf_counter() - t0) / n


def actions(n_steps: int, rows: int, seed: int = 0) -> np.ndarray:
    """Small random deltas, gripper open: [n_steps, rows, 7] (keeps the arm moving without leaving the table)."""
    a = np.random.default_rng(seed).uniform(-0.3, 0.3, (n_steps, rows, 7)).astype(np.float32)
    a[..., 6] = -1.0
    return a


def peer(task: int, init: int, cameras: bool, size: int, n_steps: int) -> dict:
    """One `OffScreenRenderEnv` in this process: build, reset, settle, then n_steps timed steps."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    import simulator
    from libero.libero.envs import OffScreenRenderEnv

    t0 = time.perf_counter()
    env = OffScreenRenderEnv(bddl_file_name=simulator.get_task(SUITE, task).bddl_file, use_camera_obs=cameras,
                             camera_heights=size, camera_widths=size)
    env.seed(0)
    env.reset()
    env.set_init_state(simulator.init_state(SUITE, task, init))
    for _ in range(10):
        env.step([0, 0, 0, 0, 0, 0, -1])
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    for a in actions(n_steps, 1)[:, 0]:
        env.step(a)
    wall = time.perf_counter() - t0
    env.close()
    return {"steps_s": n_steps / wall, "setup_s": setup}


def pool_side(pool, task: int, init: int, rows: int, n_steps: int, chunk: int) -> dict:
    """`rows` episodes of one pool stepped together, `chunk` actions per call; env steps/s over all rows."""
    t0 = time.perf_counter()
    pool.reset([(task, init)] * rows)
    setup = time.perf_counter() - t0
    a = actions(n_steps, rows).transpose(1, 0, 2)   # [rows, n_steps, 7]
    t0 = time.perf_counter()
    for s in range(0, n_steps, chunk):
        _, done, success = pool.step(a[:, s:s + chunk])
        if done.any():
            raise RuntimeError(f"an episode ended during the benchmark: {pool.episodes}")
    wall = time.perf_counter() - t0
    return {"steps_s": rows * n_steps / wall, "setup_s": setup}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer timed steps")
    p.add_argument("--task", type=int, default=0, help="LIBERO-Long task index")
    p.add_argument("--init", type=int, default=0, help="initial state index")
    p.add_argument("--camera_size", type=int, default=128)
    p.add_argument("--steps_cameras", type=int, default=32, help="timed steps per row with cameras")
    p.add_argument("--steps_blind", type=int, default=300, help="timed steps per row without cameras")
    p.add_argument("--chunk", type=int, default=1, help="actions per pool.step call (1: a round trip per step)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps_cameras, args.steps_blind = 16, 150

    import simulator

    print(f"LIBERO-Long task {args.task} ({simulator.get_task(SUITE, args.task).instruction!r}), init state "
          f"{args.init}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
    rows = []
    for cameras, n in ((False, args.steps_blind), (True, args.steps_cameras)):
        label = f"agentview+wrist {args.camera_size}px" if cameras else "no cameras"
        ref = peer(args.task, args.init, cameras, args.camera_size, n)
        rows.append((label, "peer: OffScreenRenderEnv in-process", ref, None))
        cams = ("agentview", "wrist") if cameras else ()
        with simulator.SimPool(SUITE, workers=2, cameras=cams, camera_size=args.camera_size,
                               max_steps=n + 1, record_every=0) as pool:
            for w in (1, 2):
                r = pool_side(pool, args.task, args.init, w, n, args.chunk)
                rows.append((label, f"SimPool, {w} process{'es' if w > 1 else ''}, chunk {args.chunk}", r,
                             r["steps_s"] / ref["steps_s"]))
    print(f"{'cameras':<24} {'side':<40} {'env steps/s':>12} {'vs peer':>8} {'build+reset s':>14}")
    for label, side, r, ratio in rows:
        print(f"{label:<24} {side:<40} {r['steps_s']:>12.1f} {'' if ratio is None else f'{ratio:.2f}x':>8} "
              f"{r['setup_s']:>14.1f}")
    print("(pool build+reset: the 1-process row builds the scene; the 2-process row reuses it in process 0 and "
          "builds it in process 1, in parallel)")
    for cams in ((), ("agentview", "wrist")):
        label = f"agentview+wrist {args.camera_size}px" if cams else "no cameras"
        print(f"pool overhead, {label}: {round_trip_ms(cams, args.camera_size):.2f} ms per pool.step round trip "
              f"(one row, NullEnv: no physics)")


if __name__ == "__main__":
    main()
