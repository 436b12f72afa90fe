"""Multi-host training: starting `jax.distributed`, and the host-side work a process may or may not do.

JAX runs one Python process per host (or per accelerator), every process
running the same program (multi-controller SPMD). `jax.devices()` then lists
every process's devices, the mesh spans them all, and each jitted step is one
global computation. Everything *around* the jitted steps is ordinary Python
that runs in every process, so the training loop follows three rules
(docs/design.md, "Multi-host training"):

1. **Same data everywhere.** Every process samples the same tasks with the
   same seeds and builds the same full batch; `jax.device_put(numpy_batch,
   global_sharding)` then keeps, in each process, the rows its devices hold.
   No process holds data another lacks, so there is nothing to scatter, and
   every host-side decision (anchor groups, corrections, batch layout) comes
   out the same in every process without communication.
2. **One sandbox fleet, results broadcast.** Real executions run once, on
   process 0 (`ProcessZeroPool`), and every process receives the same
   ExecutionResults: an execution is not reproducible (time-outs, wall
   times in the feedback, a solution's own randomness), so N processes
   running their own copies would build N different batches.
3. **One writer.** Process 0 alone writes TensorBoard, config.json,
   summary.json, the exported policy and prints; checkpoints are written by
   Orbax, which every process calls (each writes the shards it holds; JSON
   items only from process 0).

Starting: `initialize()` (called by `launch/train.py`) resolves the
coordinator address, process count and process id from its arguments
(`--coordinator_address`, `--num_processes`, `--process_id`), then the
environment (`WMRL_COORDINATOR_ADDRESS`, `WMRL_NUM_PROCESSES`,
`WMRL_PROCESS_ID`; JAX's own `JAX_COORDINATOR_ADDRESS`), then JAX's cluster
auto-detection (Slurm `srun`, Open MPI `mpirun`, Cloud TPU, Kubernetes).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import pickle
import threading
from typing import Any

import numpy as np

ENV_COORDINATOR = "WMRL_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "WMRL_NUM_PROCESSES"
ENV_PROCESS_ID = "WMRL_PROCESS_ID"
DISTRIBUTED_MODES = ("auto", "on", "off")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment {name}={value!r}: expected an integer") from None


def _launcher_detected() -> str | None:
    """The multi-process launcher this process runs under (JAX auto-detects its parameters), or None."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in os.environ for v in slurm) and int(os.environ["SLURM_NTASKS"] or 1) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in os.environ and int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "openmpi"
    return None


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, mode: str = "auto") -> dict | None:
    """The `jax.distributed.initialize` arguments for this process, or None for a single-process run.

    mode "off": None. "on": always initialise (values not given here or in the
    environment are left to JAX's cluster auto-detection: TPU pods, Kubernetes,
    Slurm, Open MPI). "auto": initialise when a coordinator address or a
    process count > 1 is given (argument or environment), or under Slurm
    `srun` / Open MPI `mpirun` with more than one task.
    """
    if mode not in DISTRIBUTED_MODES:
        raise ValueError(f"distributed={mode!r}: expected one of {DISTRIBUTED_MODES}")
    if mode == "off":
        return None
    coordinator_address = (coordinator_address or os.environ.get(ENV_COORDINATOR, "").strip()
                           or os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip() or None)
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if num_processes is not None and (isinstance(num_processes, bool) or not isinstance(num_processes, int)
                                      or num_processes < 1):
        raise ValueError(f"num_processes={num_processes!r}: expected an int >= 1")
    if process_id is not None and (isinstance(process_id, bool) or not isinstance(process_id, int) or process_id < 0
                                   or (num_processes is not None and process_id >= num_processes)):
        raise ValueError(f"process_id={process_id!r}: expected an int in [0, num_processes="
                         f"{num_processes if num_processes is not None else '?'})")
    if coordinator_address is not None and (":" not in coordinator_address
                                            or not coordinator_address.rsplit(":", 1)[1].isdigit()):
        raise ValueError(f"coordinator_address={coordinator_address!r}: expected HOST:PORT of process 0, "
                         f"e.g. 10.0.0.1:1234")
    if mode == "auto":
        asked = coordinator_address is not None or (num_processes or 1) > 1
        if not asked and _launcher_detected() is None:
            return None
        if num_processes == 1:
            return None
    return {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, mode: str = "auto") -> bool:
    """Starts `jax.distributed` when this is a multi-process run (see `resolve`); True if it did.

    Must run before anything touches a JAX device. On CPU, cross-process
    collectives go through gloo (`jax_cpu_collectives_implementation`; an
    explicit JAX_CPU_COLLECTIVES_IMPLEMENTATION wins).
    """
    import jax

    args = resolve(coordinator_address, num_processes, process_id, mode)
    if args is None:
        return False
    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**args)
    return True


def is_primary() -> bool:
    """Whether this process writes files and logs (process 0; always True in a single-process run)."""
    import jax

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process reaches `barrier(name)` (no-op with one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def to_host(tree: Any) -> Any:
    """numpy copies of every array in `tree`, gathered from other processes where needed.

    Collective in a multi-process run (every process must call it); the
    caller typically writes the result from process 0 only.
    """
    import jax

    def one(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)


def replicate(tree: Any, mesh) -> Any:
    """`tree` (the same values in every process) as arrays replicated over `mesh`: global, checkpointable."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's `data` in every process (others pass None). Collective."""
    from jax.experimental import multihost_utils

    primary = is_primary()
    if primary and not isinstance(data, bytes):
        raise TypeError(f"broadcast_bytes: process 0 passed {type(data).__name__}, expected bytes")
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data) if primary else 0)))
    if size == 0:
        return b""
    buffer = np.frombuffer(data, np.uint8) if primary else np.zeros(size, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes()


class _SharedFuture(cf.Future):
    """A `ProcessZeroPool` future: `result()` first makes sure process 0's result reached this process."""

    def __init__(self, pool: "ProcessZeroPool"):
        super().__init__()
        self._pool = pool
        self.synced = False

    def result(self, timeout=None):
        if not self.synced:
            self._pool.sync()
        return super().result(timeout)

    def exception(self, timeout=None):
        if not self.synced:
            self._pool.sync()
        return super().exception(timeout)


class ProcessZeroPool:
    """The `SandboxPool` interface in every process of a multi-process run; executions happen on process 0.

    Process 0 passes its real pool (`sandbox.make_pool(...)`, local or Ray);
    the others pass None. `submit` records the submission in every process
    (process 0 also starts the run); the first `result()` (or `exception()`)
    on a not-yet-shared future makes every process call `sync()`: process 0
    waits for all the runs submitted since the last sync and broadcasts their
    results (pickled; exceptions as exceptions), the others resolve their
    futures with them. Every process submits and asks for results in the
    same order (rule 1 of the module docstring), so every process makes the
    same `sync()` calls: a collective in the same place in each.

    On process 0 a future completes as soon as its run does (so done-callbacks
    time the sandboxes as with a plain pool); `result()` still syncs first.
    `stats()` counts what every process has received (executions, cache hits,
    sandbox CPU- and wall-seconds, by status), so the run's cost counters are
    the same everywhere.
    """

    def __init__(self, pool=None, *, primary: bool | None = None):
        self.primary = is_primary() if primary is None else primary
        if self.primary and pool is None:
            raise ValueError("ProcessZeroPool: process 0 needs the real pool (sandbox.make_pool(...)), got None")
        if not self.primary and pool is not None:
            raise ValueError("ProcessZeroPool: only process 0 runs sandboxes; pass pool=None on the others")
        self._pool = pool
        self._lock = threading.RLock()
        self._unsynced: list[tuple[_SharedFuture, cf.Future | None]] = []
        self._stats = {"executions": 0, "cache_hits": 0, "cpu_s": 0.0, "wall_s": 0.0, "cancelled": 0}
        self._by_status: dict[str, int] = {}

    def submit(self, task, code, **kwargs) -> cf.Future:
        shared = _SharedFuture(self)
        inner = None
        if self.primary:
            inner = self._pool.submit(task, code, **kwargs)
            inner.add_done_callback(lambda f, shared=shared: _copy_outcome(f, shared))
        with self._lock:
            self._unsynced.append((shared, inner))
        return shared

    def map(self, task_code_pairs, **kwargs) -> list:
        futures = [self.submit(t, c, **kwargs) for t, c in task_code_pairs]
        return [f.result() for f in futures]

    def sync(self) -> None:
        """Collective: every submission not yet shared gets process 0's outcome in every process."""
        with self._lock:
            batch, self._unsynced = self._unsynced, []
            if self.primary:
                payload = pickle.dumps([_outcome(inner) for _, inner in batch])
            received = pickle.loads(broadcast_bytes(payload if self.primary else None))
            if len(received) != len(batch):
                raise RuntimeError(f"ProcessZeroPool.sync: process 0 shared {len(received)} results, this process "
                                   f"({len(batch)} submitted since the last sync) diverged from it")
            for (shared, _), (kind, value) in zip(batch, received):
                shared.synced = True
                self._count(kind, value)
                if not self.primary:
                    _resolve(shared, kind, value)

    def _count(self, kind: str, value) -> None:
        if kind == "cancelled":
            self._stats["cancelled"] += 1
        elif kind == "result":
            if value.cached:
                self._stats["cache_hits"] += 1
            else:
                self._stats["executions"] += 1
                self._stats["cpu_s"] += float(value.cpu_s)
                self._stats["wall_s"] += float(value.wall_s)
                self._by_status[value.status] = self._by_status.get(value.status, 0) + 1

    @property
    def in_flight(self) -> int:
        """Submissions not yet shared with every process."""
        with self._lock:
            return len(self._unsynced)

    def stats(self) -> dict:
        """As SandboxPool.stats, over the results every process has received."""
        with self._lock:
            return {**self._stats, "in_flight": len(self._unsynced), "by_status": dict(self._by_status)}

    def cancel_pending(self) -> int:
        return self._pool.cancel_pending() if self.primary else 0

    def close(self, wait: bool = True, cancel_pending: bool = False) -> None:
        if self.primary:
            self._pool.close(wait=wait, cancel_pending=cancel_pending)

    def __enter__(self) -> "ProcessZeroPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close(wait=True, cancel_pending=exc[0] is not None)

    def __repr__(self) -> str:
        role = f"runs on {self._pool!r}" if self.primary else "receives process 0's results"
        return f"ProcessZeroPool({role}, in_flight={self.in_flight})"


def _outcome(inner: cf.Future) -> tuple[str, Any]:
    """("result", ExecutionResult) | ("error", exception) | ("cancelled", None), waiting for the run."""
    try:
        return "result", inner.result()
    except cf.CancelledError:
        return "cancelled", None
    except Exception as exc:   # the run itself broke: every process raises it from its future
        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return "error", exc


def _resolve(shared: cf.Future, kind: str, value) -> None:
    if kind == "result":
        shared.set_result(value)
    elif kind == "error":
        shared.set_exception(value)
    else:
        shared.cancel()
        shared.set_running_or_notify_cancel()


def _copy_outcome(inner: cf.Future, shared: cf.Future) -> None:
    kind, value = _outcome(inner)
    _resolve(shared, kind, value)


__all__ = ["DISTRIBUTED_MODES", "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "ProcessZeroPool",
           "barrier", "broadcast_bytes", "initialize", "is_primary", "replicate", "resolve", "to_host"]
