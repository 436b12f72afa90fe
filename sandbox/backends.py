"""Which sandbox pool a run asks for: `make_pool(backend, ...)`, one factory over the local and the Ray pool.

Its own module so that `pool` (the local pool) and `ray_pool` (a subclass of
it) do not import each other: this one imports both. Ray itself is imported
only when a `RayPool` is constructed (an optional extra).
"""

from __future__ import annotations

from sandbox.pool import SandboxPool
from sandbox.ray_pool import RayPool

BACKENDS = ("local", "ray")


def make_pool(backend: str = "local", *, ray_address: str = "", workers: int = 2, timeout_s: float = 600.0,
              memory_mb: int = 4096, cpus: int = 1, **kwargs) -> SandboxPool:
    """The pool a run's `sandbox` config asks for (one factory, so the training loop never names a backend).

    backend "local": a `SandboxPool` on this machine. "ray": a `sandbox.ray_pool.RayPool`
    on the Ray cluster at `ray_address` ("" = RAY_ADDRESS or a new local
    instance, "auto" = the cluster `ray start` joined this machine to). Both
    keep the same interface; extra `kwargs` go to the pool's constructor.
    """
    if backend == "local":
        if ray_address:
            raise ValueError(f"ray_address={ray_address!r} with backend 'local'; expected backend 'ray' or no address")
        return SandboxPool(workers, timeout_s=timeout_s, memory_mb=memory_mb, cpus=cpus, **kwargs)
    if backend == "ray":
        return RayPool(workers, address=ray_address, timeout_s=timeout_s, memory_mb=memory_mb, cpus=cpus, **kwargs)
    raise ValueError(f"sandbox backend {backend!r}: expected one of {BACKENDS}")


__all__ = ["BACKENDS", "make_pool"]
