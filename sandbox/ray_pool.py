"""`RayPool`: the `SandboxPool` contract, each execution a Ray task on a cluster's CPU nodes.

    pool = RayPool(workers=64, address="auto", timeout_s=600, memory_mb=16384, cpus=4)
    result = pool.submit(task, code).result()          # ExecutionResult, exactly as SandboxPool's

The pool *is* a `SandboxPool` (same class underneath): the bounded queue,
the futures and their cancellation, the execution cache (also for in-flight
runs), the concurrency cap and the counters (`stats()`, with the sandboxes'
CPU-seconds) are the local pool's code. Only where a run happens changes:
each of the `workers` local threads hands its run to one Ray task and waits
for it, so `workers` is the number of sandboxes in flight on the cluster.

On the node, the Ray task calls the same `run_solution` as the local pool:
a fresh bubblewrap sandbox with the same limits (`timeout_s`, `memory_mb`,
`cpus`), graded on that node. Ray schedules the task with `num_cpus=cpus`,
so a node never holds more sandboxes than it has CPUs for. Each node needs
what a local sandbox host needs: `bwrap`, and the solutions' Python
(pandas, scikit-learn, ... -- the `wmrl-jax` install or an equivalent image).

**Task folders must be on a filesystem every node mounts at the same path**
(NFS, a cluster file store). The task goes to the node as a `sandbox.Task`,
which holds paths, not data: the node mounts `task.public_dir` read-only into
the sandbox and grades against `task.answer_path`. A node that cannot see
them fails the run with a `FileNotFoundError` naming the node and the path
(the future raises it), rather than grading nothing.

The nodes run the driver's `sandbox` code, not whatever version they have
installed, when the Ray job ships it: `runtime_env()` is the job's Ray
`runtime_env` that does (`py_modules` = this package). A RayPool that starts
or joins Ray itself passes it to `ray.init` (`ship_code=True`); a program that
calls `ray.init` itself should pass `runtime_env=sandbox.ray_pool.runtime_env()`
(Ray takes local folders only at the job level), or install the same
wmrl-jax on every node.

Failures, as the local pool reports them:
* the solution's own errors and time-outs are statuses of the
  ExecutionResult ("runtime_err", error_type "TimeoutError"), from the
  sandbox on the node;
* an exception raised by the run function on the node (bad arguments, a
  missing task folder) is raised by the future, like an exception of the
  local pool's `run_fn`;
* the infrastructure failing under a run (the Ray worker or its node dies
  and Ray's `max_retries` are spent, or `hang_timeout_s` passes) gives an
  ExecutionResult with status "unknown" and reward None: ungraded, never 0,
  and not cached, so the same solution is run again when resubmitted.

Ray is an optional extra (`pip install -e '.[ray]'`), imported only when a
RayPool is made. Nothing here imports JAX. Layout and choices:
docs/design.md, "Sandbox fleet on Ray".
"""

from __future__ import annotations

import logging
import pathlib
import socket
import threading
from typing import Any, Callable

from sandbox import grading
from sandbox.isolation import Limits
from sandbox.pool import SandboxPool
from sandbox.runner import ExecutionResult, code_sha256, run_solution
from sandbox.tasks import Task

_log = logging.getLogger(__name__)


def import_ray():
    """The `ray` module, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("sandbox backend 'ray' needs Ray: pip install -e '.[ray]' (or pip install 'ray>=2.40'), "
                          "or use sandbox.backend='local'") from exc
    return ray


def runtime_env() -> dict:
    """The Ray job `runtime_env` that ships this `sandbox` package to every node (pass it to `ray.init`)."""
    package = pathlib.Path(__file__).resolve().parent
    return {"py_modules": [str(package)], "excludes": ["__pycache__", "*.pyc"]}


def _execute(task: Task, code: Any, kwargs: dict, run_fn: Callable[..., ExecutionResult]) -> ExecutionResult:
    """Runs on a Ray node: checks that the task's files are visible here, then `run_fn(task, code, **kwargs)`."""
    for what, path in (("task folder", task.root), ("public data", task.public_dir), ("answers", task.answer_path)):
        if not pathlib.Path(path).exists():
            raise FileNotFoundError(
                f"Ray node {socket.gethostname()}: {what} {path} of task {task.name!r} does not exist here; "
                f"RayPool needs the task folders on a filesystem every node mounts at the same path")
    return run_fn(task, code, **kwargs)


def _infrastructure_failure(task: Task, code: Any, detail: str, timeout_s: float) -> ExecutionResult:
    """What run_solution returns when the sandbox, not the code, failed: status "unknown", reward None."""
    return ExecutionResult(
        task_id=task.task_id, code_sha256=code_sha256(code), status="unknown",
        reward=grading.ladder_reward("unknown"), error_type="RayError",
        feedback=grading.execution_feedback(status="unknown", wall_s=0.0, stdout="", stderr=detail, grade=None,
                                            error_type=None, timeout_s=timeout_s))


class RayPool(SandboxPool):
    """Run solutions concurrently as Ray tasks, each in a sandbox on a cluster node.

    Args (as `SandboxPool`'s, plus the Ray ones):
      workers: runs in flight on the cluster at once (the local pool's concurrency cap).
      address: the Ray cluster to join when Ray is not initialised yet: "auto"
        (a cluster started with `ray start` on this machine), "ray://host:10001"
        or "host:6379"; "" / None: RAY_ADDRESS if set, else a new local instance.
        When this process has already called `ray.init`, that session is used.
      max_pending, cache, timeout_s, memory_mb, cpus: as `SandboxPool`.
      run_fn: what runs on the node (default `run_solution`); pickled to the node.
      ship_code: when this pool calls `ray.init`, ship this `sandbox` package to
        the nodes (`runtime_env()`); a session started elsewhere keeps its own.
      max_retries: Ray's retries of a run whose worker or node died.
      hang_timeout_s: give up on a run (status "unknown", the Ray task is
        cancelled) after this many seconds from submission; None waits for
        the sandbox's own time limit. Off by default because the clock also
        counts time queued in Ray when the cluster's CPUs are all busy.
    """

    def __init__(self, workers: int = 2, *, address: str | None = None, max_pending: int | None = None,
                 cache: bool = True, timeout_s: float = 600.0, memory_mb: int = 4096, cpus: int = 1,
                 run_fn: Callable[..., ExecutionResult] = run_solution, ship_code: bool = True,
                 max_retries: int = 1, hang_timeout_s: float | None = None):
        ray = import_ray()
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries={max_retries!r}: expected an int >= 0")
        if hang_timeout_s is not None and not hang_timeout_s > 0:
            raise ValueError(f"hang_timeout_s={hang_timeout_s!r}: expected None or a number > 0")
        super().__init__(workers, max_pending=max_pending, cache=cache, timeout_s=timeout_s, memory_mb=memory_mb,
                         cpus=cpus, run_fn=self._run_on_ray)
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                     runtime_env=runtime_env() if ship_code else None)
        self.address = address or ""
        self._remote = ray.remote(_execute)
        self._max_retries = max_retries
        self._remote_run_fn = run_fn
        self._hang_timeout_s = hang_timeout_s
        self._refs: set = set()
        self._refs_lock = threading.Lock()
        self._warned_missing = False

    def _run_on_ray(self, task: Task, code: Any, **kwargs) -> ExecutionResult:
        """One run (called on a pool thread): start the Ray task, wait for it, map Ray's failures."""
        import ray
        from ray import exceptions as rex

        limits = kwargs.get("limits")
        cpus = limits.cpus if isinstance(limits, Limits) else kwargs.get("cpus", self._defaults["cpus"])
        timeout_s = limits.timeout_s if isinstance(limits, Limits) else kwargs.get("timeout_s",
                                                                                      self._defaults["timeout_s"])
        ref = self._remote.options(num_cpus=cpus, max_retries=self._max_retries).remote(task, code, kwargs, self._remote_run_fn)
        with self._refs_lock:
            self._refs.add(ref)
        try:
            return ray.get(ref, timeout=self._hang_timeout_s)
        except rex.GetTimeoutError:
            ray.cancel(ref, force=True)
            return _infrastructure_failure(task, code, f"Ray: no result after hang_timeout_s={self._hang_timeout_s:g}"
                                                       f" s; the task was cancelled", timeout_s)
        except rex.RayTaskError as exc:   # run_fn raised on the node: raise it here, as the local pool would
            cause = exc.as_instanceof_cause()
            if isinstance(cause, FileNotFoundError) and not self._warned_missing:
                self._warned_missing = True
                _log.warning("RayPool: %s", str(exc.cause if getattr(exc, "cause", None) else exc).splitlines()[-1])
            raise cause from None
        except rex.RayError as exc:       # worker/node died (retries spent), object lost, cancelled
            return _infrastructure_failure(task, code, f"Ray: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                                           timeout_s)
        finally:
            with self._refs_lock:
                self._refs.discard(ref)

    def close(self, wait: bool = True, cancel_pending: bool = False) -> None:
        """As SandboxPool.close; `cancel_pending` also cancels the Ray tasks already running.

        Shuts Ray down only if this pool started it.
        """
        import ray

        if cancel_pending:
            with self._refs_lock:
                running = list(self._refs)
            for ref in running:
                ray.cancel(ref, force=True)
        super().close(wait=wait, cancel_pending=cancel_pending)
        if self._owns_ray and ray.is_initialized():
            if not wait:   # threads may still be in ray.get: let them see the cancellations first
                super().close(wait=True)
            ray.shutdown()
            self._owns_ray = False

    def __repr__(self) -> str:
        s = self.stats()
        return (f"RayPool(workers={self.workers}, address={self.address or 'local'!r}, "
                f"executions={s['executions']}, in_flight={s['in_flight']})")


__all__ = ["RayPool", "import_ray", "runtime_env"]
