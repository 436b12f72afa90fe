"""`SandboxPool`: concurrent real executions with a bounded queue, a cache and counters.

Real executions are the cost WMRL exists to cut, so the pool makes them
visible and never pays twice:

* a concurrency cap (`workers` sandboxes at once) and a bounded queue
  (`max_pending`): `submit` blocks (or raises `queue.Full` when
  `block=False`) instead of piling up work the host cannot run;
* futures (`concurrent.futures.Future`), cancellable while queued;
* an execution cache keyed by (task id, sha256 of the code, limits): an
  identical solution is never executed twice — also not while its first
  run is still in flight (the second caller shares it). Infrastructure
  failures ("unknown") are not cached, so they are retried;
* counters: executions, cache hits, sandbox CPU-seconds and wall-seconds,
  outcomes by status (`stats()`).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import queue
import threading
from typing import Any, Callable, Hashable

from sandbox.isolation import Limits
from sandbox.runner import ExecutionResult, code_sha256, run_solution
from sandbox.tasks import Task


@dataclasses.dataclass
class PoolStats:
    """What the pool did (all since construction)."""

    executions: int = 0          # sandboxes actually run
    cache_hits: int = 0          # submissions answered without running (incl. shared in-flight runs)
    cpu_s: float = 0.0           # CPU seconds spent inside sandboxes
    wall_s: float = 0.0          # sum of sandbox wall-clock seconds (not elapsed time)
    cancelled: int = 0
    by_status: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class SandboxPool:
    """Run solutions concurrently in sandboxes.

    Args:
      workers: concurrency cap (sandboxes running at once).
      max_pending: bound on queued + running submissions (default 4 * workers).
      cache: reuse results of identical (task, code, limits) submissions.
      timeout_s, memory_mb, cpus: default limits of each run (as in `run_solution`).
      run_fn: the executor (default `run_solution`; tests may inject another).
    """

    def __init__(self, workers: int = 2, *, max_pending: int | None = None, cache: bool = True,
                 timeout_s: float = 600.0, memory_mb: int = 4096, cpus: int = 1,
                 run_fn: Callable[..., ExecutionResult] = run_solution):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers={workers!r}: expected an int >= 1")
        max_pending = 4 * workers if max_pending is None else max_pending
        if not isinstance(max_pending, int) or max_pending < workers:
            raise ValueError(f"max_pending={max_pending!r}: expected an int >= workers ({workers})")
        self.workers = workers
        self.max_pending = max_pending
        self._defaults = {"timeout_s": timeout_s, "memory_mb": memory_mb, "cpus": cpus}
        self._run_fn = run_fn
        self._use_cache = cache
        self._executor = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
        self._slots = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._cache: dict[Hashable, ExecutionResult] = {}
        self._inflight: dict[Hashable, cf.Future] = {}
        self._pending: set[cf.Future] = set()
        self._stats = PoolStats()
        self._closed = False

    # ------------------------------------------------------------------ submit
    def _key(self, task: Task, code: Any, kwargs: dict) -> Hashable:
        limits = kwargs.get("limits")
        if limits is None:
            merged = {**self._defaults, **{k: kwargs[k] for k in self._defaults if k in kwargs}}
            limits = Limits(**merged)
        return (task.task_id, code_sha256(code), limits)

    def submit(self, task: Task, code: Any, *, block: bool = True, timeout: float | None = None,
               **kwargs) -> cf.Future:
        """Queue one execution; returns a Future of its ExecutionResult.

        Blocks while `max_pending` submissions are queued or running (or raises
        `queue.Full` with `block=False` / after `timeout` seconds).
        """
        if self._closed:
            raise RuntimeError("SandboxPool.submit: the pool is closed")
        if not isinstance(task, Task):
            raise TypeError(f"task: expected a sandbox.Task, got {type(task).__name__}")
        run_kwargs = {**self._defaults, **kwargs}
        key = self._key(task, code, kwargs)
        with self._lock:
            if self._use_cache and key in self._cache:
                self._stats.cache_hits += 1
                done: cf.Future = cf.Future()
                done.set_result(dataclasses.replace(self._cache[key], cached=True))
                return done
            if self._use_cache and key in self._inflight:
                self._stats.cache_hits += 1
                return self._follow(self._inflight[key])
        if not self._slots.acquire(blocking=block, timeout=timeout if block else None):
            raise queue.Full(f"SandboxPool: {self.max_pending} submissions pending (max_pending)")
        with self._lock:   # re-check: an identical run may have started while we waited
            if self._use_cache and key in self._inflight:
                self._slots.release()
                self._stats.cache_hits += 1
                return self._follow(self._inflight[key])
            fut = self._executor.submit(self._run, key, task, code, run_kwargs)
            self._inflight[key] = fut
            self._pending.add(fut)
        fut.add_done_callback(lambda f, key=key: self._finished(key, f))
        return fut

    def map(self, task_code_pairs, **kwargs) -> list[ExecutionResult]:
        """Run (task, code) pairs; results in input order."""
        futures = [self.submit(t, c, **kwargs) for t, c in task_code_pairs]
        return [f.result() for f in futures]

    @staticmethod
    def _follow(primary: cf.Future) -> cf.Future:
        """A Future that mirrors `primary` (so cancelling one caller's copy spares the other)."""
        mirror: cf.Future = cf.Future()

        def copy(p: cf.Future):
            if mirror.done():
                return
            if p.cancelled():
                mirror.cancel()
            elif p.exception() is not None:
                mirror.set_exception(p.exception())
            else:
                mirror.set_result(dataclasses.replace(p.result(), cached=True))

        primary.add_done_callback(copy)
        return mirror

    def _run(self, key, task, code, kwargs) -> ExecutionResult:
        result = self._run_fn(task, code, **kwargs)
        with self._lock:
            self._stats.executions += 1
            self._stats.cpu_s += float(result.cpu_s)
            self._stats.wall_s += float(result.wall_s)
            self._stats.by_status[result.status] += 1
            if self._use_cache and result.status != "unknown":
                self._cache[key] = result
        return result

    def _finished(self, key, fut: cf.Future) -> None:
        with self._lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]
            self._pending.discard(fut)
            if fut.cancelled():
                self._stats.cancelled += 1
        self._slots.release()

    # ------------------------------------------------------------------ control
    @property
    def in_flight(self) -> int:
        """Submissions queued or running (what the anchor schedule subtracts from the cap)."""
        with self._lock:
            return len(self._pending)

    def cancel_pending(self) -> int:
        """Cancel every queued (not yet running) submission; returns how many."""
        with self._lock:
            pending = list(self._pending)
        return sum(1 for f in pending if f.cancel())

    def stats(self) -> dict:
        """executions, cache_hits, cpu_s, wall_s, cancelled, in_flight, by_status."""
        with self._lock:
            s = self._stats
            return {"executions": s.executions, "cache_hits": s.cache_hits, "cpu_s": s.cpu_s,
                    "wall_s": s.wall_s, "cancelled": s.cancelled, "in_flight": len(self._pending),
                    "by_status": dict(s.by_status)}

    def close(self, wait: bool = True, cancel_pending: bool = False) -> None:
        self._closed = True
        if cancel_pending:
            self.cancel_pending()
        self._executor.shutdown(wait=wait)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close(wait=True, cancel_pending=exc[0] is not None)

    def __repr__(self) -> str:
        s = self.stats()
        return f"{type(self).__name__}(workers={self.workers}, executions={s['executions']}, in_flight={s['in_flight']})"


__all__ = ["PoolStats", "SandboxPool"]
