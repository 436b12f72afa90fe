"""train.multihost without a second process: who starts jax.distributed, and ProcessZeroPool's protocol.

The protocol test runs a process-0 pool and a process-1 pool side by side in
this one process, with the broadcast replaced by a hand-over (what process 0
sends, process 1 receives). The real two-process run is tests/test_multihost.py.
"""

from __future__ import annotations

import threading

import pytest

import sandbox
from sandbox.runner import code_sha256
from wmrl_jax.train import multihost

LAUNCHER_VARS = ("WMRL_COORDINATOR_ADDRESS", "WMRL_NUM_PROCESSES", "WMRL_PROCESS_ID", "JAX_COORDINATOR_ADDRESS",
                 "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
                 "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_plain_run_is_single_process(clean_env):
    assert multihost.resolve() is None
    assert multihost.resolve(num_processes=1) is None
    assert multihost.resolve("10.0.0.1:1234", 2, 0, mode="off") is None


def test_flags_then_environment(clean_env):
    assert multihost.resolve("10.0.0.1:1234", 2, 1) == {"coordinator_address": "10.0.0.1:1234",
                                                         "num_processes": 2, "process_id": 1}
    clean_env.setenv("WMRL_COORDINATOR_ADDRESS", "host0:999")
    clean_env.setenv("WMRL_NUM_PROCESSES", "4")
    clean_env.setenv("WMRL_PROCESS_ID", "3")
    assert multihost.resolve() == {"coordinator_address": "host0:999", "num_processes": 4, "process_id": 3}
    assert multihost.resolve(process_id=2)["process_id"] == 2          # a flag wins over the environment


def test_launchers_jax_detects_itself(clean_env):
    for name, value in (("SLURM_JOB_ID", "7"), ("SLURM_STEP_NODELIST", "n[1-2]"), ("SLURM_NTASKS", "2"),
                        ("SLURM_PROCID", "1"), ("SLURM_LOCALID", "0")):
        clean_env.setenv(name, value)
    # Everything left to JAX's Slurm detection.
    assert multihost.resolve() == {"coordinator_address": None, "num_processes": None, "process_id": None}
    clean_env.setenv("SLURM_NTASKS", "1")
    assert multihost.resolve() is None                                 # one task: a plain run
    assert multihost.resolve(mode="on") is not None                    # "on": always ask JAX


@pytest.mark.parametrize("args,match", [
    (dict(coordinator_address="10.0.0.1"), "HOST:PORT"),
    (dict(num_processes=0), "num_processes"),
    (dict(num_processes=2, process_id=2), r"process_id=2: expected an int in \[0, num_processes=2\)"),
    (dict(mode="maybe"), "distributed='maybe'"),
])
def test_bad_settings_name_what_is_wrong(clean_env, args, match):
    with pytest.raises(ValueError, match=match):
        multihost.resolve(**args)


def test_bad_environment_is_named(clean_env):
    clean_env.setenv("WMRL_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="WMRL_NUM_PROCESSES='two'"):
        multihost.resolve()


class FakeRunner:
    """Stands in for run_solution: status from the code, can be held, or raises."""

    def __init__(self):
        self.calls = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, task, code, **kwargs):
        self.calls.append(code)
        self.gate.wait(10)
        if code == "infrastructure":
            raise OSError("the sandbox host is gone")
        status = "valid" if code.startswith("good") else "runtime_err"
        return sandbox.ExecutionResult(task_id=task.task_id, code_sha256=code_sha256(code), status=status,
                                       reward=sandbox.ladder_reward(status, 0.5), wall_s=0.5, cpu_s=0.25,
                                       feedback=f"ran {code}")


@pytest.fixture
def pair(monkeypatch):
    """(process-0 pool, process-1 pool, runner): a hand-over stands in for the broadcast."""
    sent = []

    def hand_over(data):
        if data is not None:         # process 0 sends
            sent.append(data)
            return data
        return sent.pop(0)           # process 1 receives what process 0 sent, in order

    monkeypatch.setattr(multihost, "broadcast_bytes", hand_over)
    runner = FakeRunner()
    zero = multihost.ProcessZeroPool(sandbox.SandboxPool(workers=2, run_fn=runner), primary=True)
    one = multihost.ProcessZeroPool(None, primary=False)
    yield zero, one, runner
    runner.gate.set()
    zero.close()


def _task():
    from sandbox import suite

    return sandbox.load_task(suite.list_tasks("train")[0])


def test_process_one_receives_process_zeros_results(pair):
    zero, one, runner = pair
    task = _task()
    codes = ["good 1", "bad", "good 1", "infrastructure"]
    fz = [zero.submit(task, c) for c in codes]
    f1 = [one.submit(task, c) for c in codes]
    assert zero.in_flight == one.in_flight == 4
    assert fz[0].result().status == "valid"      # process 0 syncs (and sends) here ...
    assert f1[1].result().status == "runtime_err"   # ... process 1 at its first result: the same sync
    assert sorted(runner.calls) == ["bad", "good 1", "infrastructure"]   # executed once, on process 0 only
    for a, b in zip(fz[:3], f1[:3]):
        assert a.result() == b.result()
    assert f1[2].result().cached and f1[2].result().feedback == "ran good 1"
    for f in (fz[3], f1[3]):
        with pytest.raises(OSError, match="sandbox host is gone"):
            f.result()
    assert zero.stats() == one.stats() == {"executions": 2, "cache_hits": 1, "cpu_s": 0.5, "wall_s": 1.0,
                                           "cancelled": 0, "in_flight": 0,
                                           "by_status": {"valid": 1, "runtime_err": 1}}


def test_process_zero_futures_finish_when_their_run_does(pair):
    """Done-callbacks (the loop times the sandboxes with them) fire when the run ends, before any sync."""
    zero, _, runner = pair
    done = threading.Event()
    future = zero.submit(_task(), "good 2")
    future.add_done_callback(lambda _: done.set())
    assert done.wait(10) and zero.in_flight == 1      # finished, not yet shared with the others


def test_map_and_later_syncs_cover_only_new_submissions(pair):
    zero, one, _ = pair
    task = _task()
    assert [r.status for r in zero.map([(task, "good a"), (task, "x")])] == ["valid", "runtime_err"]
    assert [r.status for r in one.map([(task, "good a"), (task, "x")])] == ["valid", "runtime_err"]
    late_zero, late_one = zero.submit(task, "good b"), one.submit(task, "good b")
    assert late_zero.result() == late_one.result()
    assert zero.stats() == one.stats()


def test_a_process_that_diverged_is_told_so(pair):
    zero, one, _ = pair
    task = _task()
    zero.submit(task, "good c")
    one.submit(task, "good c")
    one.submit(task, "one more")                      # process 1 submitted something process 0 did not
    zero.sync()
    with pytest.raises(RuntimeError, match="diverged"):
        one.sync()


def test_roles_are_checked():
    with pytest.raises(ValueError, match="process 0 needs the real pool"):
        multihost.ProcessZeroPool(None, primary=True)
    with pytest.raises(ValueError, match="only process 0 runs sandboxes"):
        multihost.ProcessZeroPool(sandbox.SandboxPool(workers=1), primary=False)
    assert "receives process 0's results" in repr(multihost.ProcessZeroPool(None, primary=False))


def test_single_process_broadcast_is_the_identity():
    assert multihost.broadcast_bytes(b"\x00abc") == b"\x00abc"
    assert multihost.broadcast_bytes(b"") == b""
