"""The training loop end to end on the shipped micro-world: every reward mode, exact resume, bad input.

Each run is a few steps of configs/tiny_cpu.py shrunk (2 tasks x 4 rollouts,
short replies, no held-out evaluation). The 8 simulated devices of the test
session give the loop a data-parallel mesh of 8.
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from configs import tiny_cpu
from sandbox import suite
from wmrl_jax import micro_world
from wmrl_jax.train import loop, report, rewards, run
from wmrl_jax.train.metrics import read_scalars


def small_config(workdir, **overrides):
    c = tiny_cpu.get_config()
    c.workdir = str(workdir)
    c.steps = 2
    c.rollout.groups_per_step, c.rollout.group_size = 2, 4
    c.agent.max_new_tokens = 160     # long enough for some code, short enough to keep the test quick
    c.eval_attempts = 0
    c.optim.learning_rate = 5e-5     # the rate these tests' tolerances were measured at (tiny_cpu's is 2e-5)
    c.optim.warmup_steps = 1
    c.checkpoint.every = 1
    c.log.text_samples = 1
    c.rewards.min_pairs, c.rewards.refit_every, c.rewards.warmup = 4, 2, 1
    c.update_from_flattened_dict(overrides)   # dotted keys: {"rewards.mode": "real"}
    return c


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(run.MODES))
def test_every_reward_mode_runs(tmp_path, mode):
    summary = loop.train(small_config(tmp_path / mode, **{"rewards.mode": mode, "steps": 1}), progress=False)
    scalars = read_scalars(tmp_path / mode / "tb")
    for tag in ("reward/real_mean", "reward/wm_raw_mean", "reward/wm_calibrated_mean", "wmrl/anchor_fraction",
                "wmrl/calibrated", "wmrl/bias_reduction", "wmrl/anchor_weight", "wmrl/disagreement",
                "wmrl/spearman_wm_real", "agent/valid_rate", "cost/sandbox_cpu_s", "cost/real_executions",
                "cost/wm_predictions", "cost/tokens_generated", "time/step_s", "train/loss", "train/kl"):
        assert tag in scalars, tag
    c = summary.counters
    if mode == "real":
        assert c.real_executions == 8 and c.wm_predictions == 0
    elif mode == "wm_only":
        assert c.real_executions == 0
    else:
        assert c.real_executions == 4   # one anchor group of 4
    assert (tmp_path / mode / "export" / "config.json").is_file()
    assert "mode=real would run 8" in str(summary)


@pytest.mark.slow
def test_kill_and_resume_continues_exactly(tmp_path):
    straight = loop.train(small_config(tmp_path / "straight", steps=4), progress=False)
    loop.train(small_config(tmp_path / "resumed", steps=2), progress=False)           # "killed" after step 2
    # The newest checkpoint is damaged: the loop reports it and resumes from the one before.
    newest = tmp_path / "resumed" / "checkpoints" / "2"
    victim = max((p for p in newest.rglob("*") if p.is_file() and p.stat().st_size > 0), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    resumed = loop.train(small_config(tmp_path / "resumed", steps=4), progress=False)
    a, b = read_scalars(tmp_path / "straight" / "tb"), read_scalars(tmp_path / "resumed" / "tb")
    for tag in a:
        if tag.startswith(("time/", "cost/sandbox_cpu_s")):
            continue
        last_a = dict(a[tag])[4]
        last_b = dict(b[tag])[4]
        assert (np.isnan(last_a) and np.isnan(last_b)) or last_a == last_b, tag
    from wmrl_jax.models import load_hf

    pa = load_hf(tmp_path / "straight" / "export").params
    pb = load_hf(tmp_path / "resumed" / "export").params
    import jax

    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))
    assert straight.counters.real_executions == resumed.counters.real_executions


@pytest.mark.slow   # ~1.5 min
def test_learning_curve_points_and_shared_prompt_batches(tmp_path, monkeypatch):
    """`eval_every`: held-out (and train-task) avg@k after steps 0, 1, 2 in curve.jsonl, the first and last being
    the run's before/after evaluations. On a mesh whose data shards hold whole groups (data 1 x fsdp 2 x tensor
    4 here) the update's batch shares each group's prompt (`optim.share_prompt` "auto")."""
    seen = []
    real_batch = loop.make_batch

    def spy(*args, **kwargs):
        batch = real_batch(*args, **kwargs)
        seen.append(None if batch.prompt_tokens is None else batch.prompt_tokens.shape)
        return batch

    monkeypatch.setattr(loop, "make_batch", spy)
    evaluated = []
    real_evaluate = loop.evaluate

    def count(lm, tasks, *args, **kwargs):
        evaluated.append(len(tasks))
        return real_evaluate(lm, tasks, *args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", count)
    c = small_config(tmp_path / "curve", **{"eval_every": 1, "eval_attempts": 1, "eval_train_tasks": True,
                                            "mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 4,
                                            "rewards.mode": "real"})
    # The untrained policy's evaluations made outside the run (wmrl_jax.compare: once a seed for all arms):
    # step 0 takes them instead of evaluating again. Marked values, to see them come through.
    held, train = suite.list_tasks("test"), suite.list_tasks("train")
    given = {"model": str(micro_world.shipped_path()), "eval_seed": loop.sampling_seed(c),
             "held_out": {"score": 0.123, "attempts": 1, "per_task": {t.name: 0.123 for t in held},
                          "mean_valid_rate": 0.5},
             "train": {"score": 0.456, "attempts": 1, "per_task": {t.name: 0.456 for t in train},
                       "mean_valid_rate": 0.75}}
    (tmp_path / "curve").mkdir()
    (tmp_path / "curve" / loop.GIVEN_BEFORE).write_text(json.dumps(given))
    summary = loop.train(c, progress=False)
    assert seen == [(2, 480), (2, 480)], seen   # 2 groups; the longest train prompt (470 tokens) in 32s
    assert evaluated == [len(held), len(train)] * 2   # steps 1 and 2 only
    curve = loop.read_curve(tmp_path / "curve")
    assert sorted(curve) == [0, 1, 2]
    assert (curve[0]["held_out"], curve[0]["train"], summary.eval_before["score"]) == (0.123, 0.456, 0.123)
    assert curve[2]["held_out"] == summary.eval_after["score"]
    for point in curve.values():
        assert set(point["held_out_per_task"]) == {p.name for p in suite.list_tasks("test")}
        assert set(point["train_per_task"]) == {p.name for p in suite.list_tasks("train")}
        assert 0.0 <= point["train"] <= 1.0 and 0.0 <= point["held_out_valid"] <= 1.0
    with open(tmp_path / "curve" / loop.CURVE, "a") as f:
        f.write('{"step": 3, "held_o')                      # a line cut by a killed run
    with pytest.raises(ValueError, match=r"curve.jsonl:4: not a JSON line"):
        loop.read_curve(tmp_path / "curve")


def test_curve_evaluations_leave_the_training_unchanged(tmp_path):
    """An evaluation along the curve samples with its own seed and touches neither the run's key, its task
    cursor nor its state: a run with `eval_every` trains the same policy as one without (so a comparison may
    take a curve run's final policy for the run without a curve; docs/results.md does)."""
    common = {"steps": 2, "rewards.mode": "real", "eval_attempts": 1}
    without = loop.train(small_config(tmp_path / "plain", **common), progress=False)
    with_curve = loop.train(small_config(tmp_path / "curve", eval_every=1, **common), progress=False)
    assert sorted(loop.read_curve(tmp_path / "curve")) == [0, 1, 2]
    assert not loop.read_curve(tmp_path / "plain")
    from wmrl_jax.models import load_hf

    pa, pb = load_hf(tmp_path / "plain" / "export").params, load_hf(tmp_path / "curve" / "export").params
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))
    assert without.eval_after["score"] == with_curve.eval_after["score"]
    assert without.counters.tokens_generated == with_curve.counters.tokens_generated


def test_a_given_evaluation_of_the_untrained_policy_must_be_this_runs(tmp_path):
    """`eval_before.json` is taken only when it is what the run would compute; otherwise refused, naming why."""
    import types

    c = small_config(tmp_path, **{"eval_attempts": 2, "seed": 3})
    held, train = suite.list_tasks("test"), suite.list_tasks("train")
    run = types.SimpleNamespace(workdir=tmp_path, config=c, eval_attempts=2, eval_tasks=held, train_tasks=train)
    assert loop.given_before(run) is None   # absent: the run evaluates itself
    given = {"model": str(micro_world.shipped_path()), "eval_seed": loop.sampling_seed(c),
             "held_out": {"score": 0.1, "attempts": 2, "per_task": {t.name: 0.1 for t in held}}}
    path = tmp_path / loop.GIVEN_BEFORE
    path.write_text(json.dumps(given))
    assert loop.given_before(run)["held_out"]["score"] == 0.1
    for change, match in (({"eval_seed": 1}, r"eval_seed: 1, this run's"),
                          ({"held_out": {**given["held_out"], "attempts": 8}}, r"attempts: 8, this run's 2"),
                          ({"held_out": {**given["held_out"], "per_task": {"iris": 0.1}}}, r"held-out tasks"),
                          ({"model": "/elsewhere"}, r"model: '/elsewhere'"),
                          ({"train": {"attempts": 2, "per_task": {"iris": 0.1}}}, r"train tasks")):
        path.write_text(json.dumps({**given, **change}))
        with pytest.raises(ValueError, match=match):
            loop.given_before(run)
    path.write_text('{"model": ')
    with pytest.raises(ValueError, match=r"eval_before.json: unreadable"):
        loop.given_before(run)


def test_bad_input_is_reported_before_any_compute(tmp_path):
    c = small_config(tmp_path / "w", **{"rewards.mode": "wmrl_plus"})
    with pytest.raises(ValueError, match="config.rewards.mode"):
        loop.train(c, progress=False)
    broken = tmp_path / "tasks" / "train" / "iris_species"
    shutil.copytree(suite.suite_dir() / "iris_species", broken)
    for board in broken.rglob("*_leaderboard.csv"):
        board.unlink()
    c = small_config(tmp_path / "w", benchmark="mle_dojo", data_dir=str(tmp_path / "tasks"))
    with pytest.raises(ValueError, match="no leaderboard"):
        loop.train(c, progress=False)
    c = small_config(tmp_path / "w", model_path=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="config.model_path"):
        loop.train(c, progress=False)


def test_batch_masks_only_agent_tokens():
    from wmrl_jax.agent import Episode

    eps = [Episode(0, np.arange(1, 8, dtype=np.int32), np.array([0, 0, 0, 1, 1, 0, 1], bool), np.zeros(7, np.float32),
                   3, ["a", "b"], None, ["o"], [False, False]),
           Episode(0, np.arange(1, 5, dtype=np.int32), np.array([0, 0, 1, 1], bool), np.zeros(4, np.float32), 2,
                   ["c"], None, [], [False])]
    batch = loop.make_batch(eps, np.array([1.0, -1.0]), np.array([1.0, 0.0]), width=8, pad_id=0)
    assert batch.tokens.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 1, 2, 3, 4]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0, 1, 1]]
    assert batch.valid.sum() == 11 and batch.weights.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="more than the batch width"):
        loop.make_batch(eps, np.zeros(2), np.ones(2), width=6, pad_id=0)


def test_task_cursor_is_a_seeded_sequence_of_epochs():
    a = run.TaskCursor(5, seed=3)
    first = a.take(7) + a.take(3)
    b = run.TaskCursor(5, seed=3, position=7)
    assert b.take(3) == first[7:]
    assert sorted(first[:5]) == list(range(5)) and sorted(first[5:10]) == list(range(5))


@pytest.mark.slow
def test_the_loop_drives_a_qwen3_checkpoint_too(tmp_path):
    """Nothing in the loop is specific to the micro-world: a (random, tiny) Qwen3 HF folder trains as well."""
    from tests.helpers_hf import save_tiny_qwen3

    path = save_tiny_qwen3(tmp_path / "qwen3", seed=0)
    c = small_config(tmp_path / "run", model_path=str(path), model_preset="micro")
    c.agent.max_new_tokens = 24
    summary = loop.train(c, progress=False)
    assert summary.steps == 2 and summary.counters.rollouts == 16
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()


def test_a_checkpoint_with_its_own_world_model_folder_brings_that_world_model(tmp_path, monkeypatch):
    """world_model/ inside the checkpoint (the micro-world's layout): the loop predicts with it, the agent and
    the reference stay the checkpoint's own weights; without the folder, one copy serves both."""
    from tests.helpers_hf import save_tiny_qwen3
    from wmrl_jax import world_model

    path = save_tiny_qwen3(tmp_path / "agent", seed=0)
    asked = []   # the world model each step's reward router predicts with
    real_router = loop.RewardRouter

    def spy(*args, **kwargs):
        router = real_router(*args, **kwargs)
        asked.append(router.lm.path)
        return router

    monkeypatch.setattr(loop, "RewardRouter", spy)
    c = small_config(tmp_path / "shared", model_path=str(path), model_preset="micro", steps=1)
    c.agent.max_new_tokens = c.world_model.max_new_tokens = 16
    started = loop.start_run(c)
    try:
        assert started.wm_lm is started.lm
    finally:
        started.close()

    save_tiny_qwen3(path / world_model.FOLDER, seed=1)
    assert world_model.checkpoint_path(path) == path / world_model.FOLDER
    c = small_config(tmp_path / "own", model_path=str(path), model_preset="micro", steps=1)
    c.agent.max_new_tokens = c.world_model.max_new_tokens = 16
    started = loop.start_run(c)
    try:
        assert started.wm_lm.path == path / world_model.FOLDER and started.lm.path == path
        differ = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                  zip(jax.tree.leaves(started.wm_lm.model.params), jax.tree.leaves(started.ref_params))]
        assert any(differ)   # the reference policy is the agent's base, not the world model
    finally:
        started.close()
    summary = loop.train(c, progress=False)
    assert summary.steps == 1 and asked == [path / world_model.FOLDER]
    export = tmp_path / "own" / "export"   # the export carries the world model along
    assert world_model.checkpoint_path(export) == export / world_model.FOLDER
    assert (export / world_model.FOLDER / "model.safetensors").read_bytes() == (
        path / world_model.FOLDER / "model.safetensors").read_bytes()


def test_rollout_text_picks_rollouts_by_position_even_within_one_group():
    """More samples than groups: rollouts of one task share task_index, and Episodes hold arrays."""
    from wmrl_jax.agent import Episode

    eps = [Episode(0, np.arange(5, dtype=np.int32), np.ones(5, bool), np.zeros(5, np.float32), 1, ["r"],
                   f"print({i})", [], [False]) for i in range(8)]
    scores = rewards.Scores(*(np.zeros((2, 4)) for _ in range(4)), np.zeros(2, bool), {}, [], {})
    text = report.rollout_text(eps, scores, 4, 4)
    assert text.count("**group") == 4 and "group 0 rollout 2" in text and "print(6)" in text


# Run in a fresh interpreter: XLA reads the device count once, at backend start-up.
_LOOP_ON_DEVICES = """
import sys
import jax
from tests.test_train_loop import small_config
from wmrl_jax.train import loop

workdir, fsdp, tensor = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
assert jax.device_count() == fsdp * tensor, (jax.device_count(), fsdp, tensor)
config = small_config(workdir, **{"mesh.data": 1, "mesh.fsdp": fsdp, "mesh.tensor": tensor,
                                 "agent.max_new_tokens": 384})
print(f"{jax.device_count()} devices: {loop.train(config, progress=False).seconds:.0f} s")
"""


@pytest.mark.slow
def test_the_loop_on_8_devices_equals_1_device(tmp_path):
    """2 steps of the tiny loop on an (fsdp 4, tensor 2) mesh of 8 simulated devices and on 1 device.

    Replies of up to 384 tokens (tiny_cpu's): shorter ones never finish the
    micro-world's code, so every reward is 0 and the update has no
    policy-gradient term; here some solutions run and the advantages differ.
    Same seed, same rollouts: the policy samples from params equal up to the
    sharded matmuls' rounding (~1e-7), which flips no sampled token here, so
    every real reward and count is equal exactly, and the world model's
    rewards (a forward of the sharded model), the corrections computed from
    them and the update's figures up to rounding (rtol 1e-4).

    Params: Adam moves a weight by ~lr (5e-5) a step whatever its gradient's
    size, so for a weight whose gradient is ~0 rounding noise can change the
    step's direction. The bulk must agree to 1e-6 (~1% of the median move, ~8e-5
    here; measured: 377 of 3.9M weights differ by more, max 8.1e-6, on the first micro-world), and no
    weight may differ by more than one lr-sized step.
    """
    import os
    import pathlib
    import subprocess
    import sys

    import jax

    from wmrl_jax import micro_world
    from wmrl_jax.models import load_hf

    root = pathlib.Path(__file__).resolve().parents[1]
    runs = {"8": (4, 2), "1": (1, 1)}
    procs = {}
    for name, (fsdp, tensor) in runs.items():
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={fsdp * tensor}",
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        procs[name] = subprocess.Popen([sys.executable, "-c", _LOOP_ON_DEVICES, str(tmp_path / name), str(fsdp),
                                        str(tensor)], cwd=root, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"the {name}-device run failed:\n{out[-4000:]}"
        print(out.strip().splitlines()[-1])

    one, eight = (read_scalars(tmp_path / name / "tb") for name in ("1", "8"))
    assert sorted(one) == sorted(eight)
    compared = 0
    for tag in one:
        if tag.startswith("time/") or tag == "cost/sandbox_cpu_s":   # wall and CPU time: measured, not computed
            continue
        a, b = np.array(one[tag]), np.array(eight[tag])
        assert a[:, 0].tolist() == b[:, 0].tolist() == [1, 2], tag
        # Real rewards, counts and costs are computed on the host from the same rollouts: equal. The update's
        # figures (train/*) went through sharded reductions, and the world model's rewards (the expected
        # readout: one forward of the sharded frozen copy; measured 6e-8 apart) and every correction figure
        # computed from them through sharded matmuls: equal up to float rounding.
        rounded = tag.startswith(("train/", "reward/wm_", "wmrl/", "advantage/"))
        rtol = 1e-4 if rounded else 0.0
        np.testing.assert_allclose(b[:, 1], a[:, 1], rtol=rtol, atol=1e-7 if rtol else 0.0, err_msg=tag)
        compared += 1
    assert compared > 20 and "train/loss" in one and "cost/tokens_generated" in one

    p1, p8 = (load_hf(tmp_path / name / "export").params for name in ("1", "8"))
    diff = np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel() for x, y in zip(jax.tree.leaves(p1),
                                                                                         jax.tree.leaves(p8))])
    print(f"|params 8 devices - 1 device|: max {diff.max():.2e}, {np.mean(diff > 1e-6):.4%} of weights > 1e-6")
    assert diff.max() <= 5e-5 and np.mean(diff > 1e-6) < 1e-3, (diff.max(), np.mean(diff > 1e-6))
    # The comparison can fail: the rollouts had different rewards (a policy-gradient term, not only KL and
    # entropy), and the 2 updates (~lr each) moved the typical weight by 10x the bulk tolerance or more.
    assert np.abs(np.array(one["train/pg_loss"])[:, 1]).max() > 0, one["train/pg_loss"]
    base = load_hf(micro_world.shipped_path()).params
    moved = np.concatenate([np.abs(np.asarray(x, np.float32) - np.asarray(y)).ravel()
                            for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(p1))])
    assert np.median(moved) > 1e-5, np.median(moved)
