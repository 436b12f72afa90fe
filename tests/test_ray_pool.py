"""RayPool keeps SandboxPool's contract on a Ray cluster: a local Ray instance (2 CPUs) in a process of its own.

The same solutions go through both pools and must come back with the same
outcomes (status, reward, score, error, feedback up to the measured time);
a run that times out, a solution that crashes, a Ray worker that dies under
a run, a task folder the node cannot see, the cache and the counters.

The Ray driver runs in a subprocess (`ray_driver.py`, which says why): Ray
hosted in the test session left the session to a segmentation fault later on.
"""

from __future__ import annotations

import pathlib
import pickle
import re
import subprocess
import sys

import pytest
import ray   # in the [test] extra: a missing Ray fails this module, it is never skipped

import sandbox
from helpers_sandbox import copy_task
from ray_driver import SOLUTIONS   # what the driver submits; the local pool here gets the same

DRIVER = pathlib.Path(__file__).with_name("ray_driver.py")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return copy_task(tmp_path_factory.mktemp("tasks") / "playground-series-s3e16")


@pytest.fixture(scope="module")
def driven(task, tmp_path_factory):
    """What `ray_driver.py` found on the Ray cluster (start-up ~10 s on 2 cores), for SOLUTIONS at a 3 s limit."""
    out = tmp_path_factory.mktemp("ray") / "found.pkl"
    done = subprocess.run([sys.executable, str(DRIVER), str(task.root), str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"ray_driver.py failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return pickle.loads(out.read_bytes())


@pytest.fixture(scope="module")
def local(task):
    """(SandboxPool results, stats) for the same SOLUTIONS and limits, in this process."""
    with sandbox.SandboxPool(workers=2, timeout_s=3, memory_mb=1024) as pool:
        futures = [pool.submit(task, code) for code in SOLUTIONS]
        return [f.result(timeout=120) for f in futures], pool.stats()


def _comparable(r: sandbox.ExecutionResult) -> tuple:
    """The outcome, without what a clock measured (wall/cpu seconds, the time line of the feedback)."""
    feedback = re.sub(r"execution time: [0-9.]+s", "execution time: <t>s", r.feedback)
    return r.status, r.reward, r.raw_score, r.position_score, r.error_type, r.error_line, feedback, r.cached


def test_results_equal_the_local_pools(driven, local):
    ray_results, local_results = driven["results"], local[0]
    assert [r.status for r in ray_results] == ["valid", "runtime_err", "runtime_err", "ran_no_sub", "valid"]
    assert [_comparable(r) for r in ray_results] == [_comparable(r) for r in local_results]
    assert ray_results[0].isolation["backend"] == "bwrap"          # isolated on the node as locally


def test_timeout_and_crash_are_statuses_as_locally(driven):
    crashed, timed_out = driven["results"][1], driven["results"][2]
    assert (crashed.status, crashed.reward, crashed.error_type, crashed.error_line) == ("runtime_err", 0.1,
                                                                                        "ValueError", 1)
    assert "boom" in crashed.feedback
    assert (timed_out.error_type, timed_out.reward) == ("TimeoutError", 0.1)
    assert "time limit of 3s exceeded" in timed_out.feedback and 2.9 < timed_out.wall_s < 30


def test_cache_and_counters_as_locally(driven, local):
    ray_results, ray_stats, local_stats = driven["results"], driven["stats"], local[1]
    assert ray_results[-1].cached and not ray_results[0].cached      # the second GOOD is never run
    for key in ("executions", "cache_hits", "by_status", "in_flight", "cancelled"):
        assert ray_stats[key] == local_stats[key], key
    assert ray_stats["executions"] == 4 and ray_stats["cache_hits"] == 1
    # CPU-seconds are the sandboxes' own (measured on the node), summed over executed runs only.
    assert ray_stats["cpu_s"] == pytest.approx(sum(r.cpu_s for r in ray_results[:4]))
    assert ray_stats["cpu_s"] > 0 and ray_stats["wall_s"] > 3


def test_a_dead_worker_is_an_ungraded_run_not_an_exception(driven):
    (first, again), stats = driven["dead"], driven["dead_stats"]
    assert (first.status, first.reward, first.error_type) == ("unknown", None, "RayError")
    assert "WorkerCrashedError" in first.feedback and "infrastructure problem" in first.feedback
    assert not again.cached and stats["executions"] == 2           # infrastructure failures are not cached


def test_a_task_folder_the_node_cannot_see_is_raised_by_name(driven):
    kinds, message = driven["unseen_folder"]
    assert "FileNotFoundError" in kinds, (kinds, message)
    assert re.search(r"/nonexistent/crab .*filesystem every node mounts", message), message


def test_make_pool_selects_the_backend_and_rejects_bad_ones(driven):
    kind, workers, text = driven["made"]
    assert (kind, workers) == ("RayPool", 3) and text.startswith("RayPool(workers=3"), driven["made"]
    assert driven["still_initialized"]      # a pool that joined a running session leaves it running
    assert not ray.is_initialized()         # and this process never hosted a Ray driver
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
