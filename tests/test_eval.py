"""Held-out evaluation: avg@k by hand from the raw sandbox results, the report's fields, loading a policy, errors."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from wmrl_jax import evaluate as ev

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _hand_avg_at_k(results: dict, k: int):
    """docs/design.md, "avg@8": per task valid rate x mean over valid attempts of the best valid turn's position."""
    per_task = {}
    for name, attempts in results.items():
        assert len(attempts) == k
        best = []
        for turns in attempts:
            valid = [t.position_score for t in turns if t.status == "valid" and t.position_score is not None]
            best.append(max(valid) if valid else None)
        n_valid = sum(b is not None for b in best)
        per_task[name] = (n_valid / k) * (sum(b for b in best if b is not None) / n_valid if n_valid else 0.0)
    return per_task, float(np.mean(list(per_task.values())))


def test_report_of_a_hand_made_result(tmp_path):
    """to_markdown / write_report on numbers whose avg@k is known: the JSON keeps them, the Markdown shows them."""
    r = ev.EvalResult(score=0.3, per_task={"a": 0.5, "b": 0.1}, valid_rate={"a": 0.5, "b": 0.5},
                      per_category={"tabular": 0.3}, attempts=2, results={}, executions=4, sandbox_cpu_s=3.5,
                      seconds=10.0, tokens_generated=321, compute_cpu_s=7.25,
                      categories={"a": "tabular", "b": "tabular"},
                      attempt_best={"a": [1.0, None], "b": [None, 0.2]},
                      attempt_status={"a": [["valid"], ["runtime_err"]], "b": [["syntax_err"], ["valid"]]})
    assert "avg@2=30.00 %" in repr(r) and "valid_rate=0.50" in repr(r)
    json_path, md_path = ev.write_report(r, tmp_path, title="T", extra={"policy": "p"})
    data = json.loads(json_path.read_text())
    for key in ("score", "attempts", "per_task", "valid_rate", "mean_valid_rate", "per_category", "categories",
                "attempt_best", "attempt_status", "executions", "sandbox_cpu_s", "tokens_generated",
                "compute_cpu_s", "seconds", "policy"):
        assert key in data, key
    assert data["attempt_best"]["a"] == [1.0, None] and data["policy"] == "p"
    md = md_path.read_text()
    assert "**avg@2 = 30.00**" in md
    assert "| a | tabular | 1/2 | 100.0 | 50.00 |" in md and "| b | tabular | 1/2 | 20.0 | 10.00 |" in md
    assert "| tabular | 30.00 |" in md and "| generated tokens | 321 |" in md and "| sandbox executions | 4 |" in md


@pytest.mark.slow
def test_evaluate_micro_world_avg_at_k_matches_a_hand_computation():
    """k=2 attempts on 2 held-out tasks through the real sandbox; every number recomputed from the raw results."""
    import sandbox
    from configs import tiny_cpu
    from wmrl_jax import chat, micro_world
    from wmrl_jax.train import run
    from wmrl_jax.train.config import agent_config

    c = tiny_cpu.get_config()
    tasks = [t for t in run.load_tasks(c, "test") if t.name in ("two_moons_noisy", "star98_math")]
    assert len(tasks) == 2
    lm = chat.load_chat_model(micro_world.shipped_path())
    with sandbox.SandboxPool(workers=2, timeout_s=c.sandbox.timeout_s, memory_mb=2048, cpus=1) as pool:
        r = ev.evaluate(lm, tasks, pool, config=agent_config(c), attempts=2, seed=5, progress=True)
        again = ev.evaluate(lm, tasks, pool, config=agent_config(c), attempts=2, seed=5, batch_tasks=1)
    per_task, score = _hand_avg_at_k(r.results, 2)
    print(r, r.attempt_status)
    assert r.per_task == pytest.approx(per_task, abs=1e-12) and r.score == pytest.approx(score, abs=1e-12)
    for name, attempts in r.results.items():
        statuses = [[t.status for t in turns] for turns in attempts]
        assert r.attempt_status[name] == statuses
        assert r.valid_rate[name] == sum("valid" in s for s in statuses) / 2
    cats = {}
    for t in tasks:
        cats.setdefault(t.category, []).append(per_task[t.name])
    assert r.per_category == pytest.approx({k: float(np.mean(v)) for k, v in cats.items()})
    assert r.tokens_generated > 0 and r.compute_cpu_s > 0 and r.seconds > 0 and r.executions <= 4
    # Same seed, tasks sampled one at a time: the first task's rows reproduce; the cache answers repeats.
    assert again.attempt_status[tasks[0].name] == r.attempt_status[tasks[0].name]


def _eval_cli(*args, timeout=600):
    return subprocess.run([sys.executable, str(ROOT / "launch" / "eval.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_eval_cli_writes_json_and_markdown(tmp_path):
    from sandbox import suite
    from wmrl_jax import micro_world

    task = suite.suite_dir() / "two_moons_noisy"
    proc = _eval_cli(f"--checkpoint={micro_world.shipped_path()}", f"--tasks={task}", "--attempts=2",
                     f"--out={tmp_path / 'ev'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert data["attempts"] == 2 and list(data["per_task"]) == ["two_moons_noisy"]
    best = [b for b in data["attempt_best"]["two_moons_noisy"] if b is not None]
    assert data["score"] == pytest.approx(len(best) / 2 * (np.mean(best) if best else 0.0))
    md = (tmp_path / "ev" / "eval.md").read_text()
    assert "avg@2 =" in md and "two_moons_noisy" in md and "sandbox CPU-seconds" in md
    assert "avg@2" in proc.stdout and "avg@2" in proc.stderr   # the Markdown printed; the tqdm bar


def test_eval_cli_names_a_bad_checkpoint_or_task_folder(tmp_path):
    proc = _eval_cli(f"--checkpoint={tmp_path / 'nowhere'}", "--tasks=test", timeout=300)
    assert proc.returncode != 0 and "does not exist" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _eval_cli(f"--checkpoint={empty}", f"--tasks={empty}", timeout=300)
    assert proc.returncode != 0 and "an empty folder (expected task folders" in proc.stderr
    proc = _eval_cli(f"--checkpoint={empty}", "--tasks=test", timeout=300)
    assert proc.returncode != 0 and "neither an HF checkpoint folder" in proc.stderr
    proc = _eval_cli(f"--checkpoint={empty}", "--tasks=valid", timeout=300)
    assert proc.returncode != 0 and "split 'valid'" in proc.stderr


def test_load_policy_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ev.load_policy(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        ev.load_policy(tmp_path / "file")
    (tmp_path / "w" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ev.load_policy(tmp_path / "w")
    with pytest.raises(ValueError, match="prefer"):
        ev.load_policy(tmp_path / "w", prefer="newest")


def test_load_policy_restores_a_workdirs_newest_checkpoint(tmp_path):
    """A workdir without export/: the newest checkpoint's master params, on the base model its config names."""
    import jax
    import jax.numpy as jnp

    from configs import tiny_cpu
    from wmrl_jax import chat, micro_world
    from wmrl_jax.train import update
    from wmrl_jax.train.checkpoint import Checkpointer
    from wmrl_jax.train.run import MODES, correction_state

    c = tiny_cpu.get_config()
    c.workdir = str(tmp_path / "w")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text(c.to_json_best_effort())
    base = chat.load_chat_model(micro_world.shipped_path())
    optimizer = update.make_optimizer(c.optim)
    state = update.init_train_state(jax.tree.map(lambda x: x + 0.5, base.model.params), optimizer,
                                    param_dtype="float32")
    ckpt = Checkpointer(tmp_path / "w" / "checkpoints")
    ckpt.save(3, {"train": state, "corrections": correction_state(c.rewards, MODES["wmrl"]),
                  "rng": jax.random.key_data(jax.random.key(0))}, {"cursor": 0})
    ckpt.close()
    policy = ev.load_policy(tmp_path / "w")
    assert policy.step == 3 and "checkpoint step 3" in policy.source and "Policy(" in repr(policy)
    for a, b in zip(jax.tree.leaves(policy.params), jax.tree.leaves(base.model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b) + np.float32(0.5))
    assert jnp.asarray(jax.tree.leaves(policy.params)[0]).dtype == jnp.float32
