"""The Ray side of tests/test_ray_pool.py, run as its own process: `python ray_driver.py TASK_DIR OUT.pkl`.

A Ray driver leaves its mark on the process that hosts it: `ray.init` replaces
the SIGSEGV handler (pytest's faulthandler) and `ray.shutdown` resets it to the
default, and about seven native threads of the core worker outlive the
shutdown. Hosted inside the test session, that process went on to die of a
segmentation fault, without a traceback, two of four full-suite runs, each
time in JAX code well after the Ray tests (tests/test_train_update.py,
tests/test_world_model.py). So the driver lives here, in a process of its own;
the test module runs it once and asserts on what it pickles: the outcomes, the
pools' counters, and any exception as (its type's names, message).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
import sys

import ray

import sandbox
from helpers_sandbox import GOOD   # beside this file: a script's folder is first on its path
from sandbox import ray_pool

SOLUTIONS = [GOOD, "raise ValueError('boom')", "import time\ntime.sleep(60)", "print('no file')", GOOD]


def _die(task, code, **kwargs):
    """A run function whose Ray worker process dies under the run."""
    os._exit(3)


def _error(fn):
    """fn()'s exception as (the names of its type and that type's bases, message); None when it returns.

    The bases: Ray raises a task's exception as a class deriving from both RayTaskError and its own type.
    """
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- handed to the test, which checks the type by name
        return [t.__name__ for t in type(e).__mro__], str(e)
    return None


def main(task_dir: str, out: str) -> None:
    task = sandbox.load_task(pathlib.Path(task_dir))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=ray_pool.runtime_env())
    found = {}
    try:
        with sandbox.RayPool(workers=2, timeout_s=3, memory_mb=1024) as pool:
            futures = [pool.submit(task, code) for code in SOLUTIONS]
            found["results"] = [f.result(timeout=120) for f in futures]
            found["stats"] = pool.stats()

        with sandbox.RayPool(workers=1, run_fn=_die, max_retries=0) as pool:
            found["dead"] = [pool.submit(task, "x = 1").result(timeout=120) for _ in range(2)]
            found["dead_stats"] = pool.stats()

        elsewhere = dataclasses.replace(task, root=pathlib.Path("/nonexistent/crab"),
                                        public_dir=pathlib.Path("/nonexistent/crab/data/public"))
        with sandbox.RayPool(workers=1) as pool:
            future = pool.submit(elsewhere, "print(1)")
            found["unseen_folder"] = _error(lambda: future.result(timeout=120))

        with sandbox.make_pool("ray", workers=3, timeout_s=5) as pool:
            found["made"] = (type(pool).__name__, pool.workers, repr(pool))
        found["still_initialized"] = ray.is_initialized()   # a pool that joined a running session leaves it
    finally:
        ray.shutdown()
    pathlib.Path(out).write_bytes(pickle.dumps(found))


if __name__ == "__main__":
    main(*sys.argv[1:])
