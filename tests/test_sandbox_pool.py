"""SandboxPool: cache (also for in-flight runs), bounded queue, cancellation, concurrency cap, counters."""

import pathlib
import queue
import threading
import time

import pytest

import sandbox
from sandbox.runner import code_sha256

FIX = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def task():
    return sandbox.load_task(FIX / "mle-dojo" / "playground-series-s3e16")


class FakeRunner:
    """Stands in for run_solution: counts calls, tracks concurrency, can be held."""

    def __init__(self, status="ran_no_sub", hold=False, delay=0.0):
        self.calls = []
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        self.delay = delay
        self.status = status
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()

    def __call__(self, task, code, **kwargs):
        with self.lock:
            self.calls.append(code)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        self.gate.wait(10)
        time.sleep(self.delay)
        with self.lock:
            self.active -= 1
        return sandbox.ExecutionResult(task_id=task.task_id, code_sha256=code_sha256(code), status=self.status,
                                       reward=sandbox.ladder_reward(self.status), wall_s=0.5, cpu_s=0.25)


def test_identical_solution_runs_once(task):
    fake = FakeRunner()
    with sandbox.SandboxPool(workers=2, run_fn=fake) as pool:
        first = pool.submit(task, "print(1)").result()
        second = pool.submit(task, "print(1)").result()
        other = pool.submit(task, "print(2)").result()
        stats = pool.stats()
    assert fake.calls == ["print(1)", "print(2)"]
    assert (first.cached, second.cached, other.cached) == (False, True, False)
    assert second.status == first.status and second.code_sha256 == first.code_sha256
    assert (stats["executions"], stats["cache_hits"]) == (2, 1)
    assert stats["cpu_s"] == pytest.approx(0.5) and stats["wall_s"] == pytest.approx(1.0)
    assert stats["by_status"] == {"ran_no_sub": 2}


def test_in_flight_duplicate_shares_the_running_execution(task):
    fake = FakeRunner(hold=True)
    with sandbox.SandboxPool(workers=2, run_fn=fake) as pool:
        a = pool.submit(task, "x = 1")
        b = pool.submit(task, "x = 1")
        assert pool.stats()["cache_hits"] == 1
        fake.gate.set()
        ra, rb = a.result(), b.result()
    assert len(fake.calls) == 1 and rb.cached and not ra.cached


def test_bounded_queue_blocks_or_raises(task):
    fake = FakeRunner(hold=True)
    pool = sandbox.SandboxPool(workers=1, max_pending=2, run_fn=fake)
    try:
        pool.submit(task, "a = 1")
        pool.submit(task, "b = 1")
        assert pool.in_flight == 2
        with pytest.raises(queue.Full, match="max_pending"):
            pool.submit(task, "c = 1", block=False)
        t0 = time.perf_counter()
        with pytest.raises(queue.Full):
            pool.submit(task, "c = 1", timeout=0.2)
        assert time.perf_counter() - t0 >= 0.19
        fake.gate.set()
        assert pool.submit(task, "c = 1").result().status == "ran_no_sub"   # a slot frees up
    finally:
        fake.gate.set()
        pool.close()


def test_cancellation_of_queued_work(task):
    fake = FakeRunner(hold=True)
    with sandbox.SandboxPool(workers=1, max_pending=8, run_fn=fake) as pool:
        running = pool.submit(task, "r = 1")
        while not fake.calls:
            time.sleep(0.01)
        queued = [pool.submit(task, f"q = {i}") for i in range(3)]
        assert queued[0].cancel()
        assert pool.cancel_pending() == 2
        fake.gate.set()
        assert running.result().status == "ran_no_sub"
        assert all(f.cancelled() for f in queued)
        stats = pool.stats()
    assert fake.calls == ["r = 1"] and stats["cancelled"] == 3 and stats["executions"] == 1
    assert stats["in_flight"] == 0


def test_concurrency_cap(task):
    fake = FakeRunner(delay=0.05)
    with sandbox.SandboxPool(workers=2, max_pending=3, run_fn=fake) as pool:
        results = pool.map([(task, f"y = {i}") for i in range(8)])
    assert len(results) == 8 and fake.max_active == 2 and len(fake.calls) == 8


def test_infrastructure_failures_are_not_cached(task):
    fake = FakeRunner(status="unknown")
    with sandbox.SandboxPool(workers=1, run_fn=fake) as pool:
        assert pool.submit(task, "z = 1").result().reward is None
        pool.submit(task, "z = 1").result()
    assert len(fake.calls) == 2


def test_argument_errors():
    with pytest.raises(ValueError, match="workers"):
        sandbox.SandboxPool(workers=0)
    with pytest.raises(ValueError, match="max_pending"):
        sandbox.SandboxPool(workers=4, max_pending=2)
    with sandbox.SandboxPool(workers=1) as pool, pytest.raises(TypeError, match="sandbox.Task"):
        pool.submit("not a task", "print(1)")


def test_real_runs_through_the_pool(task):
    codes = ["print('a')", "raise ValueError('b')", "print('a')", "import sys; sys.exit(0)"]
    with sandbox.SandboxPool(workers=2, timeout_s=60) as pool:
        results = [f.result() for f in [pool.submit(task, c) for c in codes]]
        stats = pool.stats()
    assert [r.status for r in results] == ["ran_no_sub", "runtime_err", "ran_no_sub", "ran_no_sub"]
    assert results[2].cached and stats["executions"] == 3 and stats["cache_hits"] == 1
    assert stats["cpu_s"] > 0 and stats["wall_s"] > 0
