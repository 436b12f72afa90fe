"""The paper's qualitative claims, checked on the known-truth bandit (wmrl_jax.bandit).

One shared run (module fixture) of exactly what `launch/bandit.py` runs (the
default config, all six arms); the cost is one compilation of the step, the
simulation itself takes seconds. The seeds differ from the launch script's so
the claims are checked on draws the demo was not looked at with.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wmrl_jax import bandit

SEEDS = list(range(100, 108))
CFG = bandit.BanditConfig()
ARMS = tuple(bandit.ARMS)


@pytest.fixture(scope="module")
def results():
    return bandit.run_all(SEEDS, CFG, arms=ARMS, progress=False)


def _final(results, arm, last=20):
    return results[arm]["true_reward"][:, -last:].mean(axis=1)  # [seeds]


def test_world_model_is_a_monotone_non_affine_drifting_distortion_that_misranks_one_class():
    tasks = bandit.make_tasks(0, CFG)
    wm_mean = jax.jit(bandit.world_model_mean, static_argnums=2)
    q, over = np.asarray(tasks["quality"]), np.asarray(tasks["overrated"])
    assert over.sum(axis=1).tolist() == [1] * CFG.n_tasks
    # Truth: the best solution is never the over-rated one.
    assert not over[np.arange(CFG.n_tasks), q.argmax(1)].any()
    for progress in (0.0, 1.0):
        w = np.asarray(wm_mean(tasks, jnp.float32(progress), CFG))
        # ... but the world model ranks it first in every task (the bias).
        assert over[np.arange(CFG.n_tasks), w.argmax(1)].all()
        # On the ordinary class it is monotone in the truth ...
        normal = ~over
        order = np.argsort(q[normal])
        assert np.all(np.diff(w[normal][order]) >= 0)
        # ... and not affine (an affine map would cancel in GRPO's standardisation).
        slope, icpt = np.polyfit(q[normal], w[normal], 1)
        assert np.abs(w[normal] - (slope * q[normal] + icpt)).max() > 0.01
    w0 = np.asarray(wm_mean(tasks, jnp.float32(0.0), CFG))
    w1 = np.asarray(wm_mean(tasks, jnp.float32(1.0), CFG))
    assert np.abs(w1 - w0).max() > 0.1, "the distortion must drift over training"


def test_wm_only_plateaus_below_the_optimum(results):
    curve = results["wm-only"]["true_reward"]
    regret = results["wm-only"]["optimum"] - _final(results, "wm-only")
    assert np.all(regret > 0.2), f"wm-only regret per seed {regret}: no bias floor"
    # A floor, not slow progress: the last third is no better than the middle third.
    n = curve.shape[1]
    middle, last = curve[:, n // 3: 2 * n // 3].mean(), curve[:, 2 * n // 3:].mean()
    assert last < middle + 0.02, (middle, last)


def test_wmrl_matches_real_only_grpo_with_a_third_of_the_real_executions(results):
    execs_wmrl = results["wmrl"]["executions"][:, -1]
    execs_real = results["real-only"]["executions"][:, -1]
    # Every rollout of real-only GRPO is executed: steps × groups × G.
    assert np.all(execs_real == CFG.steps * CFG.n_tasks * CFG.group_size)
    assert np.all(execs_wmrl * 3 <= execs_real), (execs_wmrl, execs_real)
    wmrl, real = _final(results, "wmrl"), _final(results, "real-only")
    regret_wmrl = results["wmrl"]["optimum"] - wmrl
    assert wmrl.mean() > real.mean() - 0.03, (wmrl, real)
    assert np.all(regret_wmrl < 0.05), regret_wmrl


def test_wmrl_beats_the_naive_mix(results):
    wmrl, naive = _final(results, "wmrl"), _final(results, "naive-mix")
    assert wmrl.mean() > naive.mean() + 0.03, (wmrl, naive)
    assert np.all(wmrl > naive - 0.01), (wmrl, naive)


def test_table_and_plot(results, tmp_path):
    table = bandit.summarize(results)
    text = bandit.format_table(table, len(SEEDS))
    for arm in ARMS:
        assert arm in text
    execs, sd = table["wmrl"]["executions"]
    assert execs == CFG.steps * CFG.anchors_per_step * CFG.group_size and sd == 0.0
    path = tmp_path / "bandit.png"
    bandit.plot(results, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_launch_script_runs_the_table_and_writes_the_plot(results, tmp_path, capsys, launch_script):
    """The README's main command, in process (the fixture already compiled the step)."""
    from absl import flags

    module = launch_script("bandit")  # importing runs nothing (it quiets logging)
    assert capsys.readouterr().out == ""
    out = tmp_path / "sub" / "bandit.png"
    flags.FLAGS(["bandit.py", "--seeds=2", f"--out={out}"])
    try:
        module.main([])
    finally:
        flags.FLAGS.unparse_flags()
    printed = capsys.readouterr().out
    for arm in ARMS:
        assert arm in printed
    assert "2 seeds" in printed and out.read_bytes()[:4] == b"\x89PNG"


def test_bad_arm_is_named():
    with pytest.raises(ValueError, match="arm"):
        bandit.run_all([0], CFG, arms=("wm-only", "best-arm"), progress=False)
