"""Reports: the fidelity summary against hand-counted figures and scipy, TensorBoard events read back."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from wmrl_jax import fidelity, world_model
from wmrl_jax.train.metrics import SummaryWriter, read_scalars


def _pred(status, reward, gated=False, bucket=None):
    return world_model.Prediction(status=status, bucket=bucket, reward=reward, feedback="", raw_text="", gated=gated)


def test_fidelity_summary_counts_by_hand():
    S = fidelity.Sample
    samples = [
        S("test", "a", "sampled", "x", "valid", 0.9, 0.8, _pred("valid", 0.9375, bucket="high")),
        S("test", "a", "sampled", "x", "valid", 0.6, 0.2, _pred("valid", 0.8125, bucket="mid")),
        S("test", "a", "logged", "x", "runtime_err", 0.1, None, _pred("valid", 0.6875, bucket="fair")),
        S("test", "a", "logged", None, "malformed", 0.0, None, _pred("malformed", 0.0, gated=True)),
        S("test", "a", "sampled", "x", "ran_no_sub", 0.2, None, _pred(None, None)),
        S("test", "a", "sampled", "x", "unknown", None, None, _pred("valid", 0.5625, bucket="low")),
    ]
    figs = fidelity.summarize(samples)
    assert figs["solutions"] == 6 and figs["real_unknown"] == 1
    assert figs["status_accuracy"] == pytest.approx(3 / 5)            # valid, valid, malformed right
    assert figs["status_accuracy_model_only"] == pytest.approx(2 / 4)
    assert figs["ungraded"] == 1
    real, wm = [0.9, 0.6, 0.1, 0.0], [0.9375, 0.8125, 0.6875, 0.0]
    assert figs["spearman"] == pytest.approx(stats.spearmanr(wm, real).statistic)
    assert figs["mean_bias"] == pytest.approx(np.mean(np.subtract(wm, real)))
    assert figs["bias_by_real_bucket"]["high"] == {"n": 1, "mean_bias": pytest.approx(0.0375)}
    assert figs["bias_by_real_bucket"]["low"] == {"n": 1, "mean_bias": pytest.approx(0.2125)}
    conf = np.array(figs["confusion"]["counts"])
    assert conf.sum() == 5 and conf[fidelity.REAL_STATUSES.index("runtime_err"), fidelity.PREDICTED.index("valid")] == 1
    assert conf[fidelity.REAL_STATUSES.index("ran_no_sub"), fidelity.PREDICTED.index("ungraded")] == 1
    report = {"splits": {"test": figs}, "cost": {"wm_predictions_per_s": 2.0, "real_executions_per_s": 1.0,
                                                  "speedup": 2.0, "sandbox_cpu_s": 3.0, "real_executions": 4}}
    text = fidelity.format_report(report)
    assert "Spearman(wm, real)" in text and "2.0x" in text


def test_detection_rates_and_lookup_table_by_hand():
    S = fidelity.Sample
    ridge = "import os\nmodel = make_pipeline(StandardScaler(), linear_model.Ridge(alpha=1.0))\n"
    forest = "model = ensemble.RandomForestRegressor(n_estimators=100)\n"
    knn = "model = multioutput.MultiOutputRegressor(neighbors.KNeighborsRegressor())\n"
    assert [fidelity.estimator_class(c) for c in (ridge, forest, knn, "x = 1", None)] == \
        ["Ridge", "RandomForestRegressor", "KNeighborsRegressor", None, None]
    table = fidelity.lookup_table([{"code": ridge, "reward": 0.6}, {"code": ridge, "reward": 0.8},
                                   {"code": forest, "reward": 0.9}, {"code": "x", "reward": 0.1},
                                   {"code": forest, "reward": None}])
    assert table["by_class"] == {"Ridge": pytest.approx(0.7), "RandomForestRegressor": pytest.approx(0.9)}
    assert table["default"] == pytest.approx(0.6) and fidelity.table_reward(table, knn) == pytest.approx(0.6)
    runtime = world_model.Prediction(status="runtime_err", bucket=None, reward=0.1, feedback="", raw_text="",
                                     error_type="KeyError")
    samples = [
        S("test", "a", "sampled", ridge, "runtime_err", 0.1, None, runtime, real_error_type="KeyError"),
        S("test", "a", "sampled", ridge, "runtime_err", 0.1, None, _pred("valid", 0.8, bucket="mid"),
          real_error_type="NameError"),
        S("test", "a", "sampled", forest, "ran_no_sub", 0.2, None, _pred("ran_no_sub", 0.2)),
        S("test", "a", "sampled", forest, "valid", 0.9, 0.8, _pred("valid", 0.9, bucket="high")),
        S("test", "a", "sampled", knn, "valid", 0.7, 0.4, _pred("ran_no_sub", 0.2)),
        S("test", "a", "logged", None, "malformed", 0.0, None, _pred("malformed", 0.0, gated=True)),
    ]
    figs = fidelity.summarize(samples, table)
    assert (figs["failing"], figs["valid"], figs["runtime_err"]) == (3, 2, 2)
    assert figs["failing_predicted_failing"] == pytest.approx(2 / 3)
    assert figs["valid_predicted_valid"] == pytest.approx(1 / 2)
    assert figs["runtime_error_type_accuracy"] == pytest.approx(1 / 2)
    graded = [s for s in samples]
    expected = stats.spearmanr([fidelity.table_reward(table, s.code) for s in graded],
                               [s.real_reward for s in graded]).statistic
    assert figs["table_spearman"] == pytest.approx(expected)


def test_policy_spread_by_hand():
    S = fidelity.Sample
    codes = ["model = tree.A(max_depth=1)\n", "model = tree.A(max_depth=2)\n", "model = tree.B()\n",
             "model = tree.A(max_depth=1)\n"]
    rewards = [0.5, 0.7, 0.9, 0.5]
    samples = [S("train", "t", "sampled", c, "valid", r, 0.5) for c, r in zip(codes, rewards)]
    samples += [S("train", "u", "sampled", "model = tree.A()\n", "valid", 0.6, 0.5) for _ in range(4)]
    samples += [S("train", "u", "logged", "model = tree.C()\n", "valid", 0.1, 0.5)]     # not a rollout
    spread = fidelity.policy_spread(samples, group_size=4)
    assert spread["groups"] == 2
    assert spread["distinct_estimators"] == pytest.approx((2 + 1) / 2)
    assert spread["distinct_model_lines"] == pytest.approx((3 + 1) / 2)
    assert spread["reward_sd"] == pytest.approx((np.std(rewards) + 0.0) / 2)
    assert spread["identical_reward_groups"] == pytest.approx(0.5)
    samples.append(S("train", "u", "sampled", "model = tree.A()\n", "runtime_err", 0.0, None))
    assert fidelity.policy_spread(samples, group_size=4)["valid_rate_by_task"] == {"t": 1.0, "u": 0.8}


def test_spearman_is_nan_for_constant_input():
    assert np.isnan(fidelity.spearman([1, 1, 1], [0, 1, 2]))


def test_tensorboard_scalars_and_text_read_back(tmp_path):
    w = SummaryWriter(tmp_path)
    w.scalars(1, {"reward/real_mean": 0.5, "wmrl/anchor_weight": 1.0, "skipped": None})
    w.scalars(2, {"reward/real_mean": float("nan")})
    w.text(1, "rollouts", "```python\nprint(1)\n```")
    w.close()
    got = read_scalars(tmp_path)
    assert got["reward/real_mean"][0] == (1, 0.5) and np.isnan(got["reward/real_mean"][1][1])
    assert got["wmrl/anchor_weight"] == [(1, 1.0)] and "skipped" not in got


def test_step_scalars_report_what_the_world_model_groups_teach():
    """Mean |advantage| of anchor and world-model rollouts in the loss, and the calibrated rewards' spread
    within world-model groups, against numbers worked by hand."""
    import types

    from wmrl_jax.train.report import step_scalars
    from wmrl_jax.train.rewards import Scores
    from wmrl_jax.train.run import Counters

    graded = np.array([[True, True, True], [True, True, False], [True, True, True]])
    scores = Scores(wm_rewards=np.full((3, 3), 0.5), wm_graded=graded, real_rewards=np.zeros((3, 3)),
                    real_graded=np.array([[True] * 3, [False] * 3, [False] * 3]),
                    is_anchor=np.array([True, False, False]), real_results={}, wm_predictions=[], times={})
    out = types.SimpleNamespace(
        rewards=np.array([[1.0, 0.0, 0.5], [0.7, 0.9, 0.0], [0.6, 0.6, 0.6]]), graded=graded,
        used=np.array([True, True, True]),
        advantages=np.array([[2.0, -2.0, 0.0], [-1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
        anchor_fraction=1 / 3, calibrated=1.0, bias_reduction=0.0, anchor_weight=1.0, disagreement=0.0,
        pairs_in_buffer=3)
    s = step_scalars(scores, out, [], {}, Counters(), {})
    assert s["advantage/anchor_abs_mean"] == pytest.approx(4 / 3)
    assert s["advantage/world_model_abs_mean"] == pytest.approx(2 / 5)   # 1, 1 (group 1's two), 0, 0, 0
    assert s["wmrl/calibrated_group_sd"] == pytest.approx((0.1 + 0.0) / 2)   # sd of (0.7, 0.9); a flat group
