"""`SimPool`: LIBERO environments stepped in parallel, one per process, for a batched policy.

The caller (later a JAX policy on an accelerator) computes the actions of all
N environments in one call per step; the pool sends each row to its own
simulator process, which steps while the others do, and gathers the N replies.
Physics and software rendering are CPU-bound and single-threaded per env, so
processes (not threads) are what scale, up to about one per core.

Robustness, as in `sandbox/`: a simulator process that crashes (segfault,
exception, killed) or does not answer within its timeout costs only its own
episode, which becomes status "unknown" (with the reason, excluded from
success rates, never a failure); the process is restarted and the rest of the
batch continues. `step` reports an unknown outcome as success NaN, never 0.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import Connection

import numpy as np
import tqdm

from simulator import suites
from simulator.episode import Episode, success_rate

RENDER_BACKENDS = ("egl", "osmesa")   # headless MuJoCo rendering on Linux (glfw needs a display)
# What each backend needs on Debian/Ubuntu (.ci/run installs the EGL set).
_RENDER_NEEDS = {"egl": "Mesa's software EGL: apt-get install libegl1 libegl-mesa0 libgl1-mesa-dri libgbm1 libopengl0",
                 "osmesa": "OSMesa: apt-get install libosmesa6"}
# OpenVLA's LIBERO evaluation script waits this many steps (its `num_steps_wait`) after setting the initial
# state, with zero motion and the gripper open, "because the simulator drops objects"; they are not policy steps.
SETTLE_STEPS = 10


class _Lost(Exception):
    """A simulator process that will not answer (its `str` is the reason)."""


class _NoRender(_Lost):
    """A simulator process whose render probe failed (its `str` is the error)."""


class _Worker:
    """One simulator process and its socket; its stdout/stderr go to a log file whose tail explains crashes."""

    def __init__(self, index: int, env: dict, log_dir: pathlib.Path):
        self.index, self._env, self.log = index, env, log_dir / f"worker{index}.log"
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.ready = False

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "simulator._worker", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), env=self._env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        if self.ready:
            return
        msg = self.recv(timeout, "start")
        if msg[0] == "error":
            raise _NoRender(msg[2])
        self.ready = True

    def send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise _Lost(self.death(f"send failed ({type(e).__name__})")) from None

    def recv(self, timeout: float, what: str):
        """The next message, or `_Lost` when the process died or stayed silent for `timeout` seconds."""
        try:
            if not self.conn.poll(max(0.0, timeout)):
                raise _Lost(f"no reply to {what} within {timeout:.0f} s (hung; killed)")
            msg = self.conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            raise _Lost(self.death(f"during {what}")) from None
        if msg[0] == "error" and msg[1] == "env":
            raise _Lost(f"exception during {what}: {msg[2].strip().splitlines()[-1]}")
        return msg

    def death(self, when: str) -> str:
        try:
            rc = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
        how = ("still running" if rc is None else f"killed by {signal.Signals(-rc).name}" if rc < 0
               else f"exited with code {rc}")
        return f"process {how} {when}; log: {self.log_tail()}"

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = [l for l in self.log.read_text(errors="replace").splitlines() if l.strip()]
        except OSError:
            return "(none)"
        return " | ".join(text[-lines:])[-400:] or "(empty)"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)   # its own session: takes any children with it
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self.conn is not None:
            self.conn.close()
        self.ready = False

    def close(self, timeout: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.conn.send(("close",))
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def _kill_all(workers, log_dir: pathlib.Path) -> None:   # weakref.finalize: nothing outlives its pool
    for w in workers:
        w.kill()
    shutil.rmtree(log_dir, ignore_errors=True)


@dataclasses.dataclass
class _Row:
    episode: Episode
    done: bool = False
    success: float = 0.0


class SimPool:
    """N LIBERO environments, one simulator process each, stepped together.

    Args:
      suite: a LIBERO suite (`simulator.list_suites()`); "libero_10" is LIBERO-Long.
      workers: simulator processes = the largest batch `reset` accepts (about one per CPU core).
      cameras: any of "agentview" (third-person) and "wrist"; () renders nothing (much faster).
      camera_size: square frame side in pixels.
      max_steps: policy steps before an episode is a failure (default: the suite's standard budget, 520 for
        LIBERO-Long).
      settle_steps: no-op steps after each reset, not counted in max_steps.
      record_every: keep every k-th frame in the `Episode` records (0: keep none; proprio and actions are
        always kept).
      step_timeout_s: seconds a process may take per env step before it counts as hung.
      start_timeout_s: seconds for a process to start, build its env and reset (the first reset of a task
        builds the scene: ~6-12 s on a loaded 2-core host).
      render: the MuJoCo GL backend the processes use (`MUJOCO_GL`).
      env_factory: "module:callable" building the env inside the process (tests inject faults with it);
        default: the benchmark's `OffScreenRenderEnv`.
      worker_env: extra environment variables for the processes.
      seed: the env seed, set before every reset (upstream sets 0 once, after construction).
    """

    def __init__(self, suite: str = "libero_10", workers: int = 2, *, cameras=("agentview", "wrist"),
                 camera_size: int = 128, max_steps: int | None = None, settle_steps: int = SETTLE_STEPS,
                 record_every: int = 1, step_timeout_s: float = 60.0, start_timeout_s: float = 300.0,
                 render: str = "egl", env_factory: str | None = None, worker_env: dict | None = None,
                 seed: int = 0):
        # Every argument is checked before any process starts.
        suites.require_benchmark()
        self.suite = suites.check_suite(suite)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers={workers!r}: expected an int >= 1")
        if isinstance(cameras, str):
            cameras = (cameras,)
        cameras = tuple(cameras)
        if any(c not in suites.CAMERA_KEYS for c in cameras) or len(set(cameras)) < len(cameras):
            raise ValueError(f"cameras={cameras!r}: expected distinct names from {tuple(suites.CAMERA_KEYS)}, or ()")
        if isinstance(camera_size, bool) or not isinstance(camera_size, int) or not 8 <= camera_size <= 1024:
            raise ValueError(f"camera_size={camera_size!r}: expected an int in 8..1024 (pixels)")
        max_steps = suites.default_max_steps(suite) if max_steps is None else max_steps
        for name, v, lo in (("max_steps", max_steps, 1), ("settle_steps", settle_steps, 0),
                            ("record_every", record_every, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r}: expected an int >= {lo}")
        for name, v in (("step_timeout_s", step_timeout_s), ("start_timeout_s", start_timeout_s)):
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name}={v!r}: expected seconds > 0")
        if render not in RENDER_BACKENDS:
            raise ValueError(f"render={render!r}: expected one of {RENDER_BACKENDS} (the MUJOCO_GL backend)")
        if env_factory is not None and (not isinstance(env_factory, str) or ":" not in env_factory):
            raise ValueError(f"env_factory={env_factory!r}: expected 'module:callable' (importable in the process)")

        self.workers, self.cameras, self.camera_size = workers, cameras, camera_size
        self.max_steps, self.settle_steps, self.record_every = max_steps, settle_steps, record_every
        self.step_timeout_s, self.start_timeout_s = float(step_timeout_s), float(start_timeout_s)
        self.render, self.env_factory, self.seed = render, env_factory, seed
        self._rows: list[_Row] = []
        self._obs: dict | None = None
        self._closed = False
        self._counts = {"episodes": 0, "env_steps": 0, "restarts": 0, "step_calls": 0, "step_wall_s": 0.0}

        env = {**os.environ, **(worker_env or {}), "MUJOCO_GL": render, "PYOPENGL_PLATFORM": render,
               "SIMULATOR_RENDER_PROBE": str(camera_size if cameras else 0),
               # the process imports `simulator` (and a test's env_factory) from where the caller does
               "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        self._log_dir = pathlib.Path(tempfile.mkdtemp(prefix="simpool-"))
        self._w = [_Worker(i, env, self._log_dir) for i in range(workers)]
        self._finalizer = weakref.finalize(self, _kill_all, self._w, self._log_dir)
        for w in self._w:
            w.start()
        for w in self._w:   # the render probe runs first in every process: a broken backend fails here
            try:
                w.wait_ready(self.start_timeout_s)
            except _NoRender as e:
                self.close()
                why = " ".join(str(e).split()).rstrip(".")
                raise RuntimeError(
                    f"simulator process could not start its render backend MUJOCO_GL={render} (tried an "
                    f"offscreen {camera_size}x{camera_size} context through robosuite's {render} binding): "
                    f"{why}. Needs {_RENDER_NEEDS[render]}; or pass cameras=() to simulate without "
                    f"rendering") from None
            except _Lost as e:
                self.close()
                raise RuntimeError(f"simulator process {w.index} did not start: {e}") from None

    # ------------------------------------------------------------------ episodes
    def reset(self, starts) -> dict:
        """Start one episode per (task, initial-state index) pair, task by index or name; row i runs in
        process i. Returns the batched observation after the settle steps (see `step`)."""
        if self._closed:
            raise RuntimeError("SimPool.reset: the pool is closed")
        starts = list(starts)
        if not 1 <= len(starts) <= self.workers:
            raise ValueError(f"reset: {len(starts)} starts for {self.workers} simulator processes: "
                             f"expected 1..{self.workers} (task, init_state_index) pairs")
        specs, rows = [], []
        for i, start in enumerate(starts):
            if not (isinstance(start, (tuple, list)) and len(start) == 2):
                raise ValueError(f"reset: start {i} is {start!r}: expected a (task, init_state_index) pair")
            info = suites.get_task(self.suite, start[0])
            state = suites.init_state(self.suite, info.task_id, start[1])
            rows.append(_Row(Episode(suite=self.suite, task_id=info.task_id, task_name=info.name,
                                     instruction=info.instruction, init_state_index=start[1])))
            specs.append({"factory": self.env_factory, "init_state": np.asarray(state), "seed": self.seed,
                          "settle_steps": self.settle_steps, "max_steps": self.max_steps,
                          "record_every": self.record_every, "cameras": self.cameras,
                          "env_kwargs": {"bddl_file": info.bddl_file, "cameras": self.cameras,
                                         "camera_size": self.camera_size,
                                         "horizon": self.settle_steps + self.max_steps + 10}})
        self._rows = rows
        self._obs = None
        self._counts["episodes"] += len(rows)
        self._exchange(list(range(len(rows))), [("reset", s) for s in specs], self.start_timeout_s, "reset")
        return self._batched_obs()

    def step(self, actions):
        """Advance every running episode by one action [N, 7] or a chunk [N, k, 7] (executed in order,
        stopping early at success or max_steps); finished rows ignore theirs.

        Returns (obs, done [N] bool, success [N] float32): success is 1.0 (succeeded), 0.0 (not, or not yet)
        or NaN (outcome unknown: the process crashed or hung; the row's episode says why). obs: camera
        name -> uint8 [N, H, W, 3] upright, "proprio" float32 [N, 8], "instruction" list of N strings,
        "task_id" int [N]. A finished row keeps its last observation.
        """
        if self._closed:
            raise RuntimeError("SimPool.step: the pool is closed")
        if not self._rows:
            raise RuntimeError("SimPool.step: no episodes (call reset first)")
        n = len(self._rows)
        a = np.asarray(actions, dtype=np.float32)
        if a.ndim == 2:
            a = a[:, None]
        if a.ndim != 3 or a.shape[0] != n or a.shape[2] != 7 or a.shape[1] < 1:
            raise ValueError(f"SimPool.step: actions of shape {np.shape(actions)}: expected [{n}, 7] or "
                             f"[{n}, chunk, 7] (delta position xyz, delta rotation xyz, gripper)")
        bad = np.flatnonzero(~np.isfinite(a).all(axis=(1, 2)))
        if bad.size:
            raise ValueError(f"SimPool.step: actions of rows {bad.tolist()} hold NaN or inf")
        live = [i for i, r in enumerate(self._rows) if not r.done]
        t0 = time.perf_counter()
        self._exchange(live, [("step", a[i]) for i in live], self.step_timeout_s * a.shape[1], "step")
        self._counts["step_calls"] += 1
        self._counts["step_wall_s"] += time.perf_counter() - t0
        return (self._batched_obs(), np.array([r.done for r in self._rows]),
                np.array([r.success for r in self._rows], np.float32))

    def _exchange(self, rows: list[int], msgs: list, timeout: float, what: str) -> None:
        """Send msgs[j] to the process of rows[j], all before any reply is read (they run in parallel)."""
        sent = []
        for i, msg in zip(rows, msgs):
            w = self._w[i]
            try:
                if w.proc is None or w.proc.poll() is not None or w.conn.closed:
                    if msg[0] == "step":   # it died while its episode waited for the policy
                        raise _Lost(w.death("before step"))
                    self._restart(i)   # an idle process that died: a fresh one takes the new episode
                w.wait_ready(self.start_timeout_s)
                w.send(msg)
                sent.append(i)
            except _Lost as e:
                self._lose(i, str(e))
        deadline = time.monotonic() + timeout
        for i in sent:
            try:
                _, obs, info = self._w[i].recv(deadline - time.monotonic(), f"{what} (row {i})")
            except _Lost as e:
                self._lose(i, str(e))
                continue
            self._take(i, obs, info)

    def _take(self, i: int, obs: dict, info: dict) -> None:
        row = self._rows[i]
        row.episode.steps = info["steps"]
        if self._obs is None:
            self._obs = {k: np.zeros((len(self._rows), *np.shape(v)), np.asarray(v).dtype) for k, v in obs.items()}
        for k, v in obs.items():
            self._obs[k][i] = v
        if info["episode"] is not None:
            for k, v in info["episode"].items():
                setattr(row.episode, k, v)
            self._counts["env_steps"] += info["steps"]
            row.done, row.success = True, float(info["success"])

    def _lose(self, i: int, reason: str) -> None:
        row = self._rows[i]
        row.episode.status, row.episode.reason = "unknown", f"process {i}: {reason}"
        row.done, row.success = True, float("nan")
        self._restart(i)

    def _restart(self, i: int) -> None:
        """Kill process i and start a fresh one (its readiness is awaited at its next use)."""
        self._w[i].kill()
        self._w[i].start()
        self._counts["restarts"] += 1

    def _batched_obs(self) -> dict:
        n = len(self._rows)
        if self._obs is None:   # every row failed at reset: zeros of the right shapes
            self._obs = {c: np.zeros((n, self.camera_size, self.camera_size, 3), np.uint8) for c in self.cameras}
            self._obs["proprio"] = np.zeros((n, 8), np.float32)
        return {**{k: v.copy() for k, v in self._obs.items()},
                "instruction": [r.episode.instruction for r in self._rows],
                "task_id": np.array([r.episode.task_id for r in self._rows])}

    @property
    def episodes(self) -> list[Episode]:
        """The current batch's episodes: full records once finished; status "running" until then."""
        return [r.episode for r in self._rows]

    @property
    def pids(self) -> list[int | None]:
        """The simulator processes' ids (row i runs in pids[i])."""
        return [w.proc.pid if w.proc is not None and w.proc.poll() is None else None for w in self._w]

    def stats(self) -> dict:
        """episodes started, env_steps (of finished episodes), restarts (crashed or hung processes),
        step_calls and step_wall_s (time inside `step`, policy excluded), success_rate / known / unknown
        over the current batch."""
        rate, known, unknown = success_rate(self.episodes)
        return {**self._counts, "success_rate": rate, "known": known, "unknown": unknown}

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Ask every process to exit (killed after 5 s), then remove their logs."""
        self._closed = True
        for w in self._w:
            w.close()
        self._finalizer()

    def __enter__(self) -> "SimPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        alive = "closed" if self._closed else f"{sum(p is not None for p in self.pids)} alive"
        cams = f"{','.join(self.cameras)} {self.camera_size}px" if self.cameras else "none"
        return (f"SimPool({self.suite}, workers={self.workers} ({alive}), cameras={cams}, max_steps={self.max_steps}, episodes={self._counts['episodes']}, "
                f"restarts={self._counts['restarts']})")


def run_episodes(pool: SimPool, policy_fn, starts, *, progress: bool = True) -> list[Episode]:
    """Run an episode from every (task, init_state_index) in `starts`, `pool.workers` at a time.

    policy_fn(obs) -> actions [n, 7] or [n, chunk, 7] for the batch's n rows (see `SimPool.step`; rows
    already finished are ignored). Returns the episodes in the order of `starts`; a tqdm bar shows the
    success rate over known outcomes and the number of unknown ones.
    """
    starts = list(starts)
    out: list[Episode] = []
    with tqdm.tqdm(total=len(starts), desc=f"{pool.suite} episodes", disable=not progress, unit="ep") as bar:
        for b in range(0, len(starts), pool.workers):
            obs = pool.reset(starts[b:b + pool.workers])
            done = np.array([e.status != "running" for e in pool.episodes])
            counted = int(done.sum())
            bar.update(counted)
            while not done.all():
                obs, done, _ = pool.step(policy_fn(obs))
                bar.update(int(done.sum()) - counted)
                counted = int(done.sum())
                rate, _, unknown = success_rate(out + pool.episodes)
                bar.set_postfix(success="-" if rate is None else f"{rate:.0%}", unknown=unknown)
            out.extend(pool.episodes)
    return out
