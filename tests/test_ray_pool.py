"""RayPool keeps SandboxPool's contract on a Ray cluster: a local Ray instance started here (2 CPUs).

The same solutions go through both pools and must come back with the same
outcomes (status, reward, score, error, feedback up to the measured time);
a run that times out, a solution that crashes, a Ray worker that dies under
a run, a task folder the node cannot see, the cache and the counters.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

import pytest
import ray   # in the [test] extra: a missing Ray fails this module, it is never skipped

import sandbox
from helpers_sandbox import GOOD, copy_task
from sandbox import ray_pool

# ray.init starts its daemons with Popen(preexec_fn=...), which runs JAX's at-fork hook ("os.fork() was called
# ... will likely lead to a deadlock") once an earlier test has started JAX. The child execs at once and never
# runs JAX, so there is no deadlock to warn about.
pytestmark = pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")

SOLUTIONS = [GOOD, "raise ValueError('boom')", "import time\ntime.sleep(60)", "print('no file')", GOOD]


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance for the module (start-up is ~10 s on 2 cores); it ships this sandbox package."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=ray_pool.runtime_env())
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return copy_task(tmp_path_factory.mktemp("tasks") / "playground-series-s3e16")


def _comparable(r: sandbox.ExecutionResult) -> tuple:
    """The outcome, without what a clock measured (wall/cpu seconds, the time line of the feedback)."""
    feedback = re.sub(r"execution time: [0-9.]+s", "execution time: <t>s", r.feedback)
    return r.status, r.reward, r.raw_score, r.position_score, r.error_type, r.error_line, feedback, r.cached


@pytest.fixture(scope="module")
def both(cluster, task):
    """(RayPool results, SandboxPool results, RayPool stats, SandboxPool stats) for SOLUTIONS, 3 s time limit."""
    out = {}
    for name, make in (("ray", lambda: sandbox.RayPool(workers=2, timeout_s=3, memory_mb=1024)),
                       ("local", lambda: sandbox.SandboxPool(workers=2, timeout_s=3, memory_mb=1024))):
        with make() as pool:
            futures = [pool.submit(task, code) for code in SOLUTIONS]
            out[name] = ([f.result(timeout=120) for f in futures], pool.stats())
    return out


def test_results_equal_the_local_pools(both):
    ray_results, local_results = both["ray"][0], both["local"][0]
    assert [r.status for r in ray_results] == ["valid", "runtime_err", "runtime_err", "ran_no_sub", "valid"]
    assert [_comparable(r) for r in ray_results] == [_comparable(r) for r in local_results]
    assert ray_results[0].isolation["backend"] == "bwrap"          # isolated on the node as locally


def test_timeout_and_crash_are_statuses_as_locally(both):
    crashed, timed_out = both["ray"][0][1], both["ray"][0][2]
    assert (crashed.status, crashed.reward, crashed.error_type, crashed.error_line) == ("runtime_err", 0.1,
                                                                                        "ValueError", 1)
    assert "boom" in crashed.feedback
    assert (timed_out.error_type, timed_out.reward) == ("TimeoutError", 0.1)
    assert "time limit of 3s exceeded" in timed_out.feedback and 2.9 < timed_out.wall_s < 30


def test_cache_and_counters_as_locally(both):
    (ray_results, ray_stats), (_, local_stats) = both["ray"], both["local"]
    assert ray_results[-1].cached and not ray_results[0].cached      # the second GOOD is never run
    for key in ("executions", "cache_hits", "by_status", "in_flight", "cancelled"):
        assert ray_stats[key] == local_stats[key], key
    assert ray_stats["executions"] == 4 and ray_stats["cache_hits"] == 1
    # CPU-seconds are the sandboxes' own (measured on the node), summed over executed runs only.
    assert ray_stats["cpu_s"] == pytest.approx(sum(r.cpu_s for r in ray_results[:4]))
    assert ray_stats["cpu_s"] > 0 and ray_stats["wall_s"] > 3


def test_a_dead_worker_is_an_ungraded_run_not_an_exception(cluster, task):
    def die(task, code, **kwargs):   # the Ray worker process dies under the run
        os._exit(3)

    with sandbox.RayPool(workers=1, run_fn=die, max_retries=0) as pool:
        first = pool.submit(task, "x = 1").result(timeout=120)
        again = pool.submit(task, "x = 1").result(timeout=120)
        stats = pool.stats()
    assert (first.status, first.reward, first.error_type) == ("unknown", None, "RayError")
    assert "WorkerCrashedError" in first.feedback and "infrastructure problem" in first.feedback
    assert not again.cached and stats["executions"] == 2           # infrastructure failures are not cached


def test_a_task_folder_the_node_cannot_see_is_raised_by_name(cluster, task):
    elsewhere = dataclasses.replace(task, root=pathlib.Path("/nonexistent/crab"),
                                    public_dir=pathlib.Path("/nonexistent/crab/data/public"))
    with sandbox.RayPool(workers=1) as pool:
        future = pool.submit(elsewhere, "print(1)")
        with pytest.raises(FileNotFoundError, match="/nonexistent/crab .*filesystem every node mounts"):
            future.result(timeout=120)


def test_make_pool_selects_the_backend_and_rejects_bad_ones(cluster):
    with sandbox.make_pool("ray", workers=3, timeout_s=5) as pool:
        assert isinstance(pool, sandbox.RayPool) and pool.workers == 3
        assert repr(pool).startswith("RayPool(workers=3")
    assert ray.is_initialized()      # a pool that joined a running session leaves it running
    with sandbox.make_pool("local", workers=2) as pool:
        assert type(pool) is sandbox.SandboxPool
    with pytest.raises(ValueError, match="expected one of"):
        sandbox.make_pool("slurm")
    with pytest.raises(ValueError, match="ray_address"):
        sandbox.make_pool("local", ray_address="auto")


def test_config_validation_of_the_backend():
    from configs import tiny_cpu
    from wmrl_jax.train.config import validate

    c = tiny_cpu.get_config()
    c.sandbox.backend = "ray"
    c.sandbox.ray_address = "auto"
    validate(c, device_count=1)
    c.sandbox.backend = "kubernetes"
    with pytest.raises(ValueError, match="config.sandbox.backend"):
        validate(c, device_count=1)
    c.sandbox.backend = "local"
    with pytest.raises(ValueError, match="config.sandbox.ray_address"):
        validate(c, device_count=1)
