"""The progress world model (issue #30): collapse modes against hand formulas, AUC / Spearman against sklearn and
scipy, targets and reliability bins by hand, a tiny model memorising progress on synthetic episodes (frames whose
content encodes time and outcome), the saved-folder round trip and its refusals, and launch/vla_progress.py's
bad-input lines and an end-to-end run. The slow test replays a perturbed "demonstration" in a real LIBERO-Long
scene (the benchmark must be installed: a missing one fails, it does not skip).
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import jax

from simulator.episode import Episode
from wmrl_jax.vla import progress, sft
from wmrl_jax.vla import model as vla

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUITE, SIZE, CAMERAS = "libero_10", 16, ("agentview", "wrist")
sys.path.insert(0, str(ROOT / "launch"))


@pytest.fixture(scope="module")
def tokenizer():
    from helpers_hf import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def config(tokenizer):
    from helpers_hf import tiny_vla_config

    return progress.Config(body=tiny_vla_config(tokenizer, SIZE, CAMERAS))


def write_episode(root, task, state, *, success=True, steps=12, size=SIZE, name=None, status=None):
    """A synthetic Episode whose frames encode time and outcome: channel 0 = 255 t/T, channel 1 = 200 on a
    success and 40 on a failure, channel 2 noise (so no two episodes are alike); wall_s = 30 s."""
    rng = np.random.default_rng(1000 * task + 10 * state + success)
    t = np.arange(steps + 1) / steps
    frames = np.zeros((steps + 1, size, size, 3), np.uint8)
    frames[..., 0] = np.round(255 * t)[:, None, None]
    frames[..., 1] = 200 if success else 40
    frames[..., 2] = rng.integers(0, 256, (steps + 1, size, size))
    ep = Episode(suite=SUITE, task_id=task, task_name=f"TASK_{task}", instruction=f"put object {task} in the basket",
                 init_state_index=state, status=status or ("success" if success else "failure"), steps=steps,
                 wall_s=30.0, actions=np.zeros((steps, 7), np.float32), proprio=np.zeros((steps + 1, 8), np.float32),
                 frame_steps=np.arange(steps + 1, dtype=np.int32), frames={c: frames for c in CAMERAS})
    path = pathlib.Path(root) / SUITE / f"task{task:02d}" / (name or f"state{state:02d}.npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    return ep.save(path)


def synthetic(root, states=range(4)):
    """Demos (successes) and rollouts (failures) of tasks 0 and 1 over `states`: (demos folder, rollouts folder)."""
    root = pathlib.Path(root)
    for task in (0, 1):
        for s in states:
            write_episode(root / "demos", task, s, steps=10 + s)
            write_episode(root / "rollouts", task, s, success=False, steps=14, name=f"state{s:02d}.noise0.50.npz")
    return root / "demos", root / "rollouts"


# --------------------------------------------------------------------------------------------- pure functions


def test_collapse_modes_by_hand():
    p = np.array([[0.0, 0.1, 0.2, 0.5, 0.4, 0.7, 0.8, 0.9],
                  [0.3, 0.2, 0.1, 0.1, 0.6, 0.1, 0.2, 0.45]], np.float32)
    np.testing.assert_allclose(progress.collapse(p), [(0.7 + 0.8 + 0.9) / 3 - (0.0 + 0.1 + 0.2) / 3,
                                                      (0.1 + 0.2 + 0.45) / 3 - (0.3 + 0.2 + 0.1) / 3], atol=1e-6)
    np.testing.assert_allclose(progress.collapse(p, "potential", k=1), [0.9 - 0.0, 0.45 - 0.3], atol=1e-6)
    np.testing.assert_allclose(progress.collapse(p, "final"), [0.9, 0.45])
    np.testing.assert_allclose(progress.collapse(p, "max"), [0.9, 0.6])
    np.testing.assert_array_equal(progress.collapse(p, "success"), [1.0, 0.0])
    np.testing.assert_array_equal(progress.collapse(p, "success", threshold=0.4), [1.0, 1.0])
    # a model equal to its targets on 8 evenly sampled frames of a success: 18/21 - 3/21
    perfect = np.arange(8) / 7
    assert float(progress.collapse(perfect)) == pytest.approx(15 / 21)
    jitted = jax.jit(progress.collapse, static_argnames=("mode", "k"))
    np.testing.assert_allclose(jitted(p, mode="max"), [0.9, 0.6])
    with pytest.raises(ValueError, match=r"collapse mode 'mean': expected one of \('potential', 'final', 'max', 'success'\)"):
        progress.collapse(p, "mean")
    with pytest.raises(ValueError, match=r"k=9: expected \[..., F\] with 1 <= k <= F"):
        progress.collapse(p, "potential", k=9)


def test_sample_frames_and_targets_by_hand():
    np.testing.assert_array_equal(progress.sample_frames(15), [0, 2, 4, 6, 8, 10, 12, 14])
    np.testing.assert_array_equal(progress.sample_frames(3, 4), [0, 1, 1, 2])   # round half to even: 0.667 -> 1
    np.testing.assert_allclose(progress.targets([0, 2, 5], 5, True), [0.0, 0.4, 1.0])
    np.testing.assert_array_equal(progress.targets([0, 2, 5], 5, False), [0.0, 0.0, 0.0])
    np.testing.assert_allclose(progress.targets([0, 2, 5], 5, False, "time"), [0.0, 0.4, 1.0])


def test_auc_and_spearman_against_sklearn_and_scipy():
    from scipy.stats import spearmanr
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(4, 40))
        y = rng.random(n) < 0.4
        y[0], y[1] = True, False
        s = np.round(rng.random(n) + 0.5 * y, 1)   # rounded: ties
        assert progress.auc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
        assert progress.spearman(s, y.astype(float)) == pytest.approx(spearmanr(s, y).statistic, abs=1e-12)
        x = rng.integers(0, 5, n)
        assert progress.spearman(x, s) == pytest.approx(spearmanr(x, s).statistic, abs=1e-12)
    assert np.isnan(progress.auc([0.1, 0.2], [True, True]))


def test_auc_interval_against_scipy_bootstrap():
    """The stratified percentile bootstrap of the AUC against scipy.stats.bootstrap resampling the two samples
    independently (Monte Carlo error ~0.01 at 4000 resamples); separated scores give [1, 1]."""
    from scipy.stats import bootstrap

    rng = np.random.default_rng(1)
    y = np.r_[np.ones(7, bool), np.zeros(12, bool)]
    s = np.round(rng.random(19) + 0.4 * y, 1)
    lo, hi = progress.auc_interval(s, y)
    ref = bootstrap((s[y], s[~y]), lambda a, b: progress.auc(np.r_[a, b], np.r_[np.ones(a.size, bool), np.zeros(b.size, bool)]),
                    method="percentile", n_resamples=4000, vectorized=False, random_state=2).confidence_interval
    assert lo == pytest.approx(ref.low, abs=0.03) and hi == pytest.approx(ref.high, abs=0.03)
    assert lo < progress.auc(s, y) < hi
    assert progress.auc_interval([0.9, 0.8, 0.1, 0.2], [True, True, False, False]) == (1.0, 1.0)
    assert np.isnan(progress.spearman([1.0, 1.0, 1.0], [0.0, 1.0, 1.0]))


def test_reliability_bins_and_fidelity_by_hand():
    r = progress.reliability([0.1, 0.15, 0.5, 0.9, 1.0], [0, 1, 1, 1, 0], bins=2)
    assert [b["count"] for b in r["bins"]] == [2, 3]
    assert r["bins"][0]["mean_pred"] == pytest.approx(0.125) and r["bins"][0]["rate"] == pytest.approx(0.5)
    assert r["bins"][1]["mean_pred"] == pytest.approx(0.8) and r["bins"][1]["rate"] == pytest.approx(2 / 3)
    assert r["ece"] == pytest.approx(2 / 5 * 0.375 + 3 / 5 * (0.8 - 2 / 3))
    p = np.array([[0.0, 0.2, 0.4, 0.9], [0.0, 0.1, 0.1, 0.2], [0.1, 0.3, 0.2, 0.6]])
    fid = progress.fidelity(p, [True, False, False], k=2, bins=2)
    pot = [0.65 - 0.1, 0.15 - 0.05, 0.4 - 0.2]
    assert fid["modes"]["potential"]["auc"] == 1.0
    assert fid["modes"]["potential"]["mean_failure"] == pytest.approx((pot[1] + pot[2]) / 2)
    assert fid["modes"]["success"]["auc"] == pytest.approx(0.75)   # scores 1, 0, 1: one tie of two pairs
    assert fid["calibration"]["bins"][1]["count"] == 2 and fid["calibration"]["bins"][1]["rate"] == 0.5


# --------------------------------------------------------------------------------------------- the model


def test_tiny_model_memorises_progress_and_beats_chance(tmp_path, tokenizer, config):
    demos_dir, rollouts_dir = synthetic(tmp_path, states=range(5))
    data, report = progress.load_episodes([demos_dir, rollouts_dir], config, tokenizer)
    assert (report["episodes"], report["successes"], report["failures"]) == (20, 10, 10)
    train_eps, held_eps = data.episode_ids(exclude_states=[4]), data.episode_ids(states=[4])
    assert len(held_eps) == 4
    tc = sft.SFTConfig(steps=100, batch_size=32, lr=3e-3, warmup_steps=10, eval_every=0, save_every=1000)
    result = progress.train(config, data, data.rows(train_eps), tc, held_out_rows=data.rows(held_eps), progress=False)
    assert result.history["loss"][-1] < result.history["loss"][0]
    train_fit = progress.evaluate(result.params, config, data, data.rows(train_eps), batch_size=32)
    assert train_fit["mae"] < 0.08, train_fit        # the targets: t/T on successes, 0 on failures
    held = result.history["held_out"][-1]
    assert held["mae"] < 0.12, held
    scores = progress.score_episodes(result.params, config, data, held_eps)
    success = np.array([data.episodes[i]["success"] for i in held_eps])
    fid = progress.fidelity(scores, success)
    for mode in ("potential", "final", "max"):
        assert fid["modes"][mode]["auc"] == 1.0 and fid["modes"][mode]["spearman"] > 0.8, fid["modes"][mode]
    assert fid["modes"]["potential"]["mean_success"] > 0.5 > 0.2 > abs(fid["modes"]["potential"]["mean_failure"])
    # an untrained model is at chance: every frame 0.5
    flat = progress.score_episodes(progress.init(config, jax.random.key(0)), config, data, held_eps)
    np.testing.assert_allclose(flat, 0.5, atol=1e-6)
    assert progress.fidelity(flat, success)["modes"]["final"]["auc"] == 0.5


def test_save_load_round_trip_and_refusals(tmp_path, tokenizer, config):
    params = progress.init(config, jax.random.key(3))
    params["head"]["w_d"] = params["head"]["w_d"] + 0.5   # not the zero init: predictions vary by frame
    folder = progress.save_model(tmp_path / "m", params, config, tokenizer, {"steps": 7})
    loaded = progress.load_model(tmp_path / "m")
    assert loaded.config == config and loaded.meta == {"steps": 7}
    demos_dir, _ = synthetic(tmp_path / "d", states=[0])
    data, _ = progress.load_episodes([demos_dir], config, tokenizer)
    rows = data.rows([0])
    np.testing.assert_array_equal(progress.predict(params, config, data, rows),
                                  progress.predict(loaded.params, config, data, rows))
    with pytest.raises(FileNotFoundError, match=r"nowhere: no such folder \(expected a progress model"):
        progress.load_model(tmp_path / "nowhere")
    (folder / "meta.json").rename(folder / "meta.bak")
    with pytest.raises(FileNotFoundError, match=r"not a progress model folder \(missing meta.json\)"):
        progress.load_model(folder)
    (folder / "meta.bak").rename(folder / "meta.json")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json / meta.json unreadable \(JSONDecodeError"):
        progress.load_model(folder)
    progress.save_model(folder, params, config, tokenizer, {})
    (folder / "params.npz").write_bytes(b"truncated")
    with pytest.raises(ValueError, match=r"params.npz: not an .npz archive \(corrupt or truncated\)"):
        progress.load_model(folder)
    bad = sft.flatten(jax.device_get(params))
    bad["head/w_d"] = np.zeros(5, np.float32)
    np.savez(folder / "params.npz", **bad)
    with pytest.raises(ValueError, match=r"head/w_d has shape \(5,\), expected \(32,\) for its config.json"):
        progress.load_model(folder)


def test_load_episodes_refusals(tmp_path, tokenizer, config):
    from wmrl_jax.vla.demos import DemoError

    with pytest.raises(DemoError, match=r"missing: no such folder \(expected a folder of Episode .npz files"):
        progress.load_episodes([tmp_path / "missing"], config, tokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DemoError, match=r"empty: no Episode .npz files"):
        progress.load_episodes([tmp_path / "empty"], config, tokenizer)
    write_episode(tmp_path / "big", 0, 0, size=32)
    with pytest.raises(DemoError, match=r"frames\['agentview'\] are uint8 \(32, 32, 3\), expected uint8 \(16, 16, 3\)"):
        progress.load_episodes([tmp_path / "big"], config, tokenizer)
    write_episode(tmp_path / "unk", 0, 0, status="unknown")
    with pytest.raises(DemoError, match=r"none of the 1 episodes has a known outcome \(\{'unknown': 1\}\)"):
        progress.load_episodes([tmp_path / "unk"], config, tokenizer)
    with pytest.raises(ValueError, match=r"failure_label='half': expected one of \('zero', 'time'\)"):
        progress.Config(body=config.body, failure_label="half")


# --------------------------------------------------------------------------------------------- launch script


def test_launch_bad_input_is_one_line(tmp_path, capsys):
    import vla_progress

    demos_dir, rollouts_dir = synthetic(tmp_path, states=[0, 1])
    write_episode(tmp_path / "big", 0, 0, size=32)
    (tmp_path / "empty").mkdir()
    cases = [
        (["--demos", tmp_path / "missing"], r"missing: no such folder \(expected a folder of Episode .npz files"),
        (["--demos", tmp_path / "empty"], r"empty: no Episode .npz files"),
        (["--demos", demos_dir, "--collapse", "mean"],
         r"collapse mode 'mean': expected one of \('potential', 'final', 'max', 'success'\)"),
        (["--demos", demos_dir, "--image_size", "64"],
         r"--image_size 64: the demos' agentview frames are 16x16 \(expected the same size"),
        (["--demos", demos_dir, "--rollouts", tmp_path / "big"],
         r"big: agentview frames of 32x32, expected the demos' 16x16"),
        (["--demos", demos_dir, "--rollouts", tmp_path / "nowhere"], r"nowhere: no such folder"),
        (["--demos", demos_dir, "--preset", "huge"], r"--preset 'huge': expected one of \['small', 'tiny'\]"),
        (["--demos", demos_dir, "--failure_label", "half"], r"--failure_label 'half': expected one of"),
        (["--demos", demos_dir, "--k", "9"], r"--k 9 --frames 8: expected 1 <= k <= frames"),
        (["--demos", demos_dir, "--perturb_noise", "0.3"], r"expected --rollouts, the folder to write them to"),
        (["--demos", demos_dir, "--rollouts", rollouts_dir, "--perturb_noise", "-0.1"],
         r"--perturb_noise \[-0.1\]: expected standard deviations >= 0 \(0: the demo replayed exactly"),
        (["--demos", demos_dir, "--rollouts_only"], r"--rollouts_only: expected --rollouts"),
        (["--demos", demos_dir, "--rollouts", rollouts_dir, "--perturb_only"],
         r"--perturb_only without --perturb_noise"),
        (["--demos", tmp_path / "d12", "--preset", "small"], r"image_size=12: expected a multiple of 8"),
    ]
    write_episode(tmp_path / "d12", 0, 0, size=12)
    for argv, pattern in cases:
        assert vla_progress.main([str(a) for a in argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("vla_progress: "), err
        assert __import__("re").search(pattern, err), (pattern, err)
    # every episode held out: refused after loading, before training
    assert vla_progress.main(["--demos", str(demos_dir), "--held_out_states", "0-1", "--out", str(tmp_path / "o")]) == 2
    assert "every episode is held out" in capsys.readouterr().err
    # --rollouts_only: the demos are not read as training episodes
    assert vla_progress.main(["--demos", str(demos_dir), "--rollouts", str(rollouts_dir), "--rollouts_only",
                              "--held_out_states", "0-1", "--out", str(tmp_path / "o")]) == 2
    assert "episodes: 4 of 4 files (0 successes, 4 failures" in capsys.readouterr().out


def test_launch_end_to_end_and_resume(tmp_path, capsys):
    import vla_progress

    demos_dir, rollouts_dir = synthetic(tmp_path, states=range(3))
    argv = ["--demos", str(demos_dir), "--rollouts", str(rollouts_dir), "--held_out_states", "2", "--out",
            str(tmp_path / "out"), "--steps", "6", "--batch", "8", "--eval_every", "3", "--save_every", "3",
            "--no_progress"]
    assert vla_progress.main(argv) == 0, capsys.readouterr().err
    out = tmp_path / "out"
    record = json.loads((out / "fidelity.json").read_text())
    assert record["held_out"]["episodes"] == 4 and record["held_out"]["successes"] == 2
    assert record["train"]["episodes"] == 8 and record["resumed_from"] == 0
    assert set(record["held_out"]["modes"]) == set(progress.COLLAPSE_MODES)
    assert record["cost"]["real_episode_s"] == 30.0 and record["cost"]["prediction_s"] > 0
    assert len(record["held_out"]["episodes_list"][0]["progress"]) == 8
    assert (out / "fidelity.png").stat().st_size > 1000 and "| potential (headline) |" in (out / "fidelity.md").read_text()
    model = progress.load_model(out)
    assert model.meta["held_out_states"] == [2] and model.meta["steps"] == 6
    first = record["held_out"]["modes"]
    assert vla_progress.main(argv) == 0   # rerun: resumed at the end, the same numbers
    again = json.loads((out / "fidelity.json").read_text())
    assert again["resumed_from"] == 6 and again["held_out"]["modes"] == first
    assert vla_progress.main(argv[:-1] + ["--lr", "0.01", "--no_progress"]) == 2
    assert "holds step 6 of another run (train.lr" in capsys.readouterr().err


def test_vla_eval_saves_rollouts_the_progress_model_reads(tmp_path, tokenizer, config):
    """vla_eval --save_episodes through the real pool processes around the stand-in env: task 0 succeeds at its
    second policy step (env step 12 = 10 settle steps + 2), as does task 1; both saved with every frame (the
    default out would be the policy's eval/; --out moves it) and read back by the progress model's loader."""
    policy = sft.save_policy(tmp_path / "policy", vla.init(config.body, jax.random.key(0)), config.body, tokenizer,
                             {"suite": SUITE, "tasks": [0, 1], "held_out_states": [2], "train_states": [0]})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), "SIM_SUCCESS_AT": "12"}
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "vla_eval.py"), "--checkpoint", str(policy),
                        "--max_steps", "3", "--no_progress", "--seed", "4", "--env_factory", "helpers_simulator:FaultyEnv",
                        "--save_episodes", str(tmp_path / "rollouts"), "--out", str(tmp_path / "eval")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    saved = sorted(p.relative_to(tmp_path / "rollouts").as_posix() for p in (tmp_path / "rollouts").rglob("*.npz"))
    assert saved == [f"{SUITE}/task00/state02.seed4.npz", f"{SUITE}/task01/state02.seed4.npz"]
    data, report = progress.load_episodes([tmp_path / "rollouts"], config, tokenizer)
    assert (report["successes"], report["failures"]) == (2, 0)
    assert [(e["task"], e["state"], e["steps"], e["frames"]) for e in data.episodes] == [(0, 2, 2, 3), (1, 2, 2, 3)]
    np.testing.assert_allclose(data.target, [0.0, 0.5, 1.0] * 2)


@pytest.mark.slow
def test_perturbed_replay_in_a_real_libero_scene(tmp_path):
    """A 3-step "demonstration" of LIBERO-Long task 0, state 0 (16 px cameras), replayed with action noise in the
    real simulator: a failure (no success within the demo's 3 steps), every frame at the demos' size, and a rerun
    skips it."""
    write_episode(tmp_path / "demos", 0, 0, steps=3)
    cmd = [sys.executable, str(ROOT / "launch" / "vla_progress.py"), "--demos", str(tmp_path / "demos"), "--rollouts",
           str(tmp_path / "rollouts"), "--perturb_noise", "0.5", "--perturb_only", "--no_progress"]
    env = {**os.environ, "MUJOCO_GL": "egl"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    path = tmp_path / "rollouts" / SUITE / "task00" / "state00.noise0.50.npz"
    ep = Episode.load(path)
    assert ep.status == "failure" and ep.steps == 3 and ep.frame_steps.tolist() == [0, 1, 2, 3]
    assert ep.frames["agentview"].shape == (4, SIZE, SIZE, 3) and ep.wall_s > 0
    rng = np.random.default_rng([0, 0, 0, 500])
    np.testing.assert_allclose(ep.actions, np.clip(0.5 * rng.standard_normal((3, 7)), -1, 1), atol=1e-6)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert r.returncode == 0 and "0 written" in r.stdout and "1 already there" in r.stdout, r.stdout
