"""The simulator process: one LIBERO environment, driven over a socket by `SimPool`.

Started as `python -m simulator._worker FD` (a fresh interpreter: the caller's
JAX and model weights are not inherited). The render backend comes from the
environment the pool sets (`MUJOCO_GL`), and is probed before the first
message when the pool asks for camera frames, so a backend that cannot start
is reported at once instead of in the middle of a batch.

Protocol (pickled tuples over `multiprocessing.connection.Connection`):
  worker -> pool, once:  ("ready", pid) | ("error", "render", message)
  ("reset", spec)     -> ("obs", obs, info)
  ("step", [k, 7])    -> ("obs", obs, info)   k actions in order, stopping at success or max_steps
  ("close",)          -> the process exits
  any exception       -> ("error", "env", traceback); the process exits (the pool restarts it)
info: {"done", "success", "steps", "episode": the record of a finished episode, else None}.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import sys
import time
import traceback

import numpy as np

from simulator.suites import CAMERA_KEYS

# The no-op the standard LIBERO evaluation steps while objects settle: zero motion, gripper open (-1).
SETTLE_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)


def libero_env(*, bddl_file: str, cameras: tuple, camera_size: int, horizon: int):
    """The benchmark's own environment (7-d OSC_POSE control at 20 Hz, Panda arm)."""
    from libero.libero.envs import OffScreenRenderEnv
    from libero.libero.envs.env_wrapper import ControlEnv

    # ignore_done: episode ends are decided here (success or max_steps), never by robosuite's horizon.
    common = dict(bddl_file_name=bddl_file, horizon=horizon, ignore_done=True)
    if not cameras:   # no renderer at all: no GL context, ~10x more steps/s
        return ControlEnv(**common, use_camera_obs=False, has_offscreen_renderer=False)
    return OffScreenRenderEnv(**common, camera_names=[CAMERA_KEYS[c] for c in cameras],
                              camera_heights=camera_size, camera_widths=camera_size)


def resolve_factory(name: str | None):
    """`"module:attribute"` -> the callable (None -> `libero_env`)."""
    if name is None:
        return libero_env
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def quat_to_axis_angle(q) -> np.ndarray:
    """Unit quaternion (x, y, z, w), robosuite's order -> axis * angle (rad, [3])."""
    q = np.asarray(q, np.float64)
    w = float(np.clip(q[3], -1.0, 1.0))
    s = np.sqrt(max(0.0, 1.0 - w * w))
    if s < 1e-9:   # (near) identity rotation: the axis is undefined, the vector is 0
        return np.zeros(3)
    return q[:3] * (2.0 * np.arccos(w) / s)


def observe(raw: dict, cameras) -> dict:
    """robosuite observation -> ours: upright frames (the renderer's images are upside down and mirrored,
    so the standard evaluation rotates them by 180 degrees) and the 8-d proprio vector."""
    obs = {cam: np.ascontiguousarray(raw[CAMERA_KEYS[cam] + "_image"][::-1, ::-1]) for cam in cameras}
    obs["proprio"] = np.concatenate([raw["robot0_eef_pos"], quat_to_axis_angle(raw["robot0_eef_quat"]),
                                     raw["robot0_gripper_qpos"]]).astype(np.float32)
    return obs


class _Episode:
    """What the worker records while an episode runs (the pool adds the task's names)."""

    def __init__(self, spec: dict):
        self.cameras = tuple(spec["cameras"])
        self.max_steps = spec["max_steps"]
        self.record_every = spec["record_every"]
        self.t0 = time.perf_counter()
        self.steps = 0
        self.actions, self.proprio, self.frame_steps = [], [], []
        self.frames = {cam: [] for cam in self.cameras}
        self.success = False

    def add(self, obs: dict) -> None:
        self.proprio.append(obs["proprio"])
        if self.record_every and self.steps % self.record_every == 0:
            self.frame_steps.append(self.steps)
            for cam in self.cameras:
                self.frames[cam].append(obs[cam])

    @property
    def done(self) -> bool:
        return self.success or self.steps >= self.max_steps

    def record(self) -> dict:
        return {"status": "success" if self.success else "failure", "steps": self.steps,
                "wall_s": time.perf_counter() - self.t0,
                "actions": np.asarray(self.actions, np.float32).reshape(-1, 7),
                "proprio": np.asarray(self.proprio, np.float32).reshape(-1, 8),
                "frames": {cam: np.asarray(v, np.uint8) for cam, v in self.frames.items() if v},
                "frame_steps": np.asarray(self.frame_steps, np.int32)}

    def info(self) -> dict:
        return {"done": self.done, "success": self.success, "steps": self.steps,
                "episode": self.record() if self.done else None}


class _Simulator:
    def __init__(self):
        self.env, self.env_key, self.episode = None, None, None

    def reset(self, spec: dict):
        key = (spec["factory"], tuple(sorted(spec["env_kwargs"].items())))
        if key != self.env_key:   # building an env costs seconds: keep it while the task stays the same
            if self.env is not None:
                self.env.close()
            self.env, self.env_key = None, None
            self.env = resolve_factory(spec["factory"])(**spec["env_kwargs"])
            self.env_key = key
        self.episode = ep = _Episode(spec)
        self.env.seed(spec["seed"])   # before every reset (upstream: once, after construction), so a start
        self.env.reset()              # is a function of (seed, task, state) alone, whatever ran before it
        raw = self.env.set_init_state(spec["init_state"])
        for _ in range(spec["settle_steps"]):
            raw, _, _, _ = self.env.step(SETTLE_ACTION)
        obs = observe(raw, ep.cameras)
        ep.add(obs)
        return obs, ep.info()

    def step(self, actions: np.ndarray):
        ep = self.episode
        if ep is None or ep.done:
            raise RuntimeError("step: no running episode (reset first)")
        obs = None
        for action in actions:
            raw, _, _, _ = self.env.step(np.asarray(action, np.float64))
            ep.steps += 1
            ep.actions.append(action)
            ep.success = bool(self.env.check_success())
            obs = observe(raw, ep.cameras)
            ep.add(obs)
            if ep.done:
                break
        return obs, ep.info()


def probe_renderer(size: int) -> None:
    """Create and free one offscreen GL context through robosuite's own binding (what the env will use)."""
    from robosuite.utils.binding_utils import GLContext

    ctx = GLContext(max_width=size, max_height=size, device_id=-1)
    ctx.make_current()
    ctx.free()


def main(fd: int) -> None:
    from multiprocessing.connection import Connection

    faulthandler.enable()   # a segfault leaves its Python traceback in the worker's log
    conn = Connection(fd)
    probe = int(os.environ.get("SIMULATOR_RENDER_PROBE", "0"))
    if probe:
        try:
            probe_renderer(probe)
        except BaseException as e:   # noqa: BLE001 -- any failure to start GL is reported, never raised here
            conn.send(("error", "render", f"{type(e).__name__}: {e}".strip()))
            return
    conn.send(("ready", os.getpid()))
    sim = _Simulator()
    while True:
        try:
            msg = conn.recv()
        except EOFError:   # the pool went away
            return
        if msg[0] == "close":
            return
        try:
            obs, info = sim.reset(msg[1]) if msg[0] == "reset" else sim.step(msg[1])
        except Exception:   # noqa: BLE001 -- the env's state is unknown now: report, and let the pool restart us
            conn.send(("error", "env", traceback.format_exc(limit=6)))
            return
        conn.send(("obs", obs, info))


if __name__ == "__main__":
    main(int(sys.argv[1]))
