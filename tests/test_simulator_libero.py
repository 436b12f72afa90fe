"""`SimPool` on the real LIBERO-Long scenes (MuJoCo, software EGL rendering), at 64x64 to stay quick.

The reference each pool is compared with is the benchmark's own `OffScreenRenderEnv`,
driven directly the way the standard evaluation drives it (seed 0, reset, the
initial state, 10 no-op steps), in a separate process.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from simulator import SimPool

SUITE, TASK, INIT, SIZE = "libero_10", 0, 3, 64
REFERENCE = textwrap.dedent("""
    import sys, numpy as np
    import simulator
    from libero.libero.envs import OffScreenRenderEnv
    suite, task, init, size, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    env = OffScreenRenderEnv(bddl_file_name=simulator.get_task(suite, task).bddl_file,
                             camera_heights=size, camera_widths=size)
    env.seed(0)
    env.reset()
    obs = env.set_init_state(simulator.init_state(suite, task, init))
    for _ in range(10):
        obs, _, _, _ = env.step([0, 0, 0, 0, 0, 0, -1])
    np.savez(out, agentview=obs["agentview_image"], wrist=obs["robot0_eye_in_hand_image"],
             eef_pos=obs["robot0_eef_pos"], gripper=obs["robot0_gripper_qpos"])
""")


def _start_reference(tmp_path):
    out = tmp_path / "reference.npz"
    proc = subprocess.Popen([sys.executable, "-c", REFERENCE, SUITE, str(TASK), str(INIT), str(SIZE), str(out)],
                            env={**os.environ, "MUJOCO_GL": "egl", "PYOPENGL_PLATFORM": "egl"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, out


def _reference(proc, out):
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return np.load(out)


def test_frames_upright_determinism_and_chunks(tmp_path):
    proc, out = _start_reference(tmp_path)
    with SimPool(SUITE, workers=2, camera_size=SIZE, max_steps=5) as pool:
        obs = pool.reset([(TASK, INIT), (TASK, INIT)])
        assert obs["agentview"].shape == (2, SIZE, SIZE, 3) and obs["agentview"].dtype == np.uint8
        assert obs["wrist"].shape == (2, SIZE, SIZE, 3) and obs["proprio"].shape == (2, 8)
        ref = _reference(proc, out)
        for row in range(2):   # both processes reproduce the reference; frames are its raw frames turned 180 degrees
            np.testing.assert_array_equal(obs["agentview"][row], ref["agentview"][::-1, ::-1])
            np.testing.assert_array_equal(obs["wrist"][row], ref["wrist"][::-1, ::-1])
            np.testing.assert_allclose(obs["proprio"][row, :3], ref["eef_pos"], rtol=0, atol=1e-6)
            np.testing.assert_allclose(obs["proprio"][row, 6:], ref["gripper"], rtol=0, atol=1e-6)
        assert not np.array_equal(ref["agentview"], ref["agentview"][::-1, ::-1])   # the rotation is not a no-op
        first = {k: obs[k][0].copy() for k in ("agentview", "wrist", "proprio")}

        rng = np.random.default_rng(0)
        chunk = np.clip(rng.normal(0, 0.5, (3, 7)), -1, 1).astype(np.float32)
        obs, done, success = pool.step(np.stack([chunk, chunk]))   # same actions: same outcome in both
        assert done.tolist() == [False, False] and success.tolist() == [0.0, 0.0]
        for k in ("agentview", "wrist", "proprio"):
            np.testing.assert_array_equal(obs[k][0], obs[k][1])
        assert np.abs(obs["proprio"][0, :3] - first["proprio"][:3]).max() > 1e-3   # the arm moved
        obs, done, success = pool.step(np.stack([chunk, chunk]))   # 5 of these 6 steps, then max_steps
        assert done.tolist() == [True, True] and success.tolist() == [0.0, 0.0]
        ep = pool.episodes[0]
        assert ep.status == "failure" and ep.steps == 5 and ep.actions.shape == (5, 7)
        assert ep.frames["agentview"].shape == (6, SIZE, SIZE, 3) and ep.frame_steps.tolist() == list(range(6))
        np.testing.assert_array_equal(ep.frames["wrist"][0], first["wrist"])

        obs = pool.reset([(TASK, INIT)])   # the same process, its env reused: the same start again
        for k in ("agentview", "wrist", "proprio"):
            np.testing.assert_array_equal(obs[k][0], first[k])
        # ... also after another initial state: the env is seeded before every reset, so a start is a function of
        # (seed, task, state) alone. Without that, task 5's state 1 started elsewhere in a scene that had started
        # state 0 before (frames up to 52 of 255 apart at 64 px; and an expert demonstration found in a reused
        # scene failed when replayed in a fresh one).
        fresh = pool.reset([(5, 1), (5, 0)])       # row i runs in process i
        reused = pool.reset([(5, 0), (5, 1)])      # process 1 has started state 0 before
        for k in ("agentview", "wrist", "proprio"):
            np.testing.assert_array_equal(reused[k][1], fresh[k][0])
        print(pool, pool.stats(), ep, sep="\n")


@pytest.mark.slow
def test_real_process_killed_mid_episode_restarts_and_physics_ignore_cameras(tmp_path):
    """A real simulator process killed mid-episode: unknown, restarted, the next episode reproduces the
    reference; a pool without cameras (no renderer) follows the same physics."""
    proc, out = _start_reference(tmp_path)
    actions = np.full((1, 4, 7), 0.3, np.float32)
    with SimPool(SUITE, workers=1, camera_size=SIZE, max_steps=8) as pool:
        pool.reset([(TASK, INIT)])
        pool.step(actions)
        os.kill(pool.pids[0], 9)
        _, done, success = pool.step(actions)
        assert done.tolist() == [True] and np.isnan(success[0]) and "SIGKILL" in pool.episodes[0].reason
        obs = pool.reset([(TASK, INIT)])   # a fresh process builds the scene again
        ref = _reference(proc, out)
        np.testing.assert_array_equal(obs["agentview"][0], ref["agentview"][::-1, ::-1])
        with_cameras, _, _ = pool.step(actions)
        assert pool.stats()["restarts"] == 1
    with SimPool(SUITE, workers=1, cameras=(), max_steps=8) as blind:
        obs = blind.reset([(TASK, INIT)])
        assert set(obs) == {"proprio", "instruction", "task_id"}
        np.testing.assert_allclose(obs["proprio"][0, :3], ref["eef_pos"], rtol=0, atol=1e-6)
        without, _, _ = blind.step(actions)
        np.testing.assert_allclose(without["proprio"], with_cameras["proprio"], rtol=0, atol=1e-6)
