"""A stand-in LIBERO env for `SimPool`'s fault tests: same interface, no MuJoCo, faults on demand.

It runs inside the pool's real simulator processes (`env_factory="helpers_simulator:FaultyEnv"`);
only the physics is replaced, so crashes, hangs and restarts go through the real process machinery.
Configured by the processes' environment (`SimPool(worker_env=...)`):

  SIM_FAULT       "<kind>@<step>@<task name>": at env step <step> (1-based, settle steps included) of
                  that task, kind = segv (a real segmentation fault), raise, hang, exit.
  SIM_FAULT_ONCE  a path: the fault fires only while it does not exist (it is created on firing), so the
                  restarted process runs cleanly.
  SIM_SUCCESS_AT  the task succeeds from this env step on (default: never).
"""

import ctypes
import os
import pathlib
import time

import numpy as np


class FaultyEnv:
    def __init__(self, *, bddl_file, cameras, camera_size, horizon):
        self.task = pathlib.Path(bddl_file).stem
        self.cameras, self.size = cameras, camera_size
        self.t = 0

    def seed(self, seed):
        pass

    def reset(self):
        self.t = 0

    def set_init_state(self, state):
        self.t = 0
        self.state0 = float(np.asarray(state)[1])
        return self._obs()

    def _obs(self):
        obs = {"robot0_eef_pos": np.array([self.t, self.state0, 0.0]), "robot0_eef_quat": np.array([0, 0, 0, 1.0]),
               "robot0_gripper_qpos": np.zeros(2)}
        for cam in self.cameras:
            key = {"agentview": "agentview", "wrist": "robot0_eye_in_hand"}[cam] + "_image"
            obs[key] = np.full((self.size, self.size, 3), self.t % 256, np.uint8)
        return obs

    def step(self, action):
        self.t += 1
        spec = os.environ.get("SIM_FAULT", "")
        if spec:
            kind, step, task = spec.split("@", 2)
            once = os.environ.get("SIM_FAULT_ONCE")
            if self.t == int(step) and task == self.task and not (once and os.path.exists(once)):
                if once:
                    pathlib.Path(once).touch()
                if kind == "segv":
                    ctypes.string_at(0)   # reads address 0: SIGSEGV
                elif kind == "raise":
                    raise RuntimeError(f"injected fault at step {self.t}")
                elif kind == "hang":
                    time.sleep(3600)
                elif kind == "exit":
                    os._exit(3)
        return self._obs(), 0.0, False, {}

    def check_success(self):
        return self.t >= int(os.environ.get("SIM_SUCCESS_AT", 10**9))

    def close(self):
        pass
