"""The arm comparison: the table's numbers by hand, the plots, resume (a second invocation trains nothing)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from wmrl_jax import compare
from wmrl_jax.train.metrics import SummaryWriter


def _fake_run(spec, arm, seed, *, score, sandbox_cpu, trainer_cpu, real, wm, weights=(), pairs=()):
    """The files a finished run and its evaluation leave behind (summary.json, eval.json, tb/, pairs.jsonl)."""
    d = spec.run_dir(arm, seed)
    d.mkdir(parents=True)
    counters = {"real_executions": real, "sandbox_cpu_s": sandbox_cpu, "compute_cpu_s": trainer_cpu,
                "wm_predictions": wm, "tokens_generated": 100, "rollouts": 16, "ungraded_real": 0, "ungraded_wm": 0}
    (d / "summary.json").write_text(json.dumps({"mode": arm, "steps": spec.steps, "counters": counters,
                                                "seconds": 60.0 + seed, "final": {}}))
    (d / "eval.json").write_text(json.dumps({"score": score, "attempts": spec.attempts, "mean_valid_rate": 0.5,
                                             "per_task": {"t": score}, "seconds": 5.0, "sandbox_cpu_s": 1.0}))
    writer = SummaryWriter(d / "tb")
    for step, w in enumerate(weights, start=1):
        writer.scalars(step, {"wmrl/anchor_weight": w, "wmrl/bias_reduction": 0.1 * step, "wmrl/calibrated": 1.0})
    writer.close()
    with open(d / "pairs.jsonl", "w") as f:
        for step, (x, y, cal) in enumerate(pairs, start=1):
            f.write(json.dumps({"step": step, "wm": x, "real": y, "calibrated": cal, "map_fitted": step > 1}) + "\n")


def test_table_and_plots_from_finished_runs(tmp_path):
    spec = compare.CompareSpec(out=str(tmp_path / "out"), work=str(tmp_path / "work"), arms=("real", "wmrl"),
                               seeds=(0, 1), steps=3, attempts=2)
    pairs = [([0.1, 0.6], [0.0, 0.7], [0.1, 0.6]), ([0.2], [0.1], [0.15]), ([0.9, 0.6], [0.6, 0.55], [0.6, 0.5])]
    _fake_run(spec, "real", 0, score=0.10, sandbox_cpu=100.0, trainer_cpu=20.0, real=48, wm=0)
    _fake_run(spec, "real", 1, score=0.20, sandbox_cpu=120.0, trainer_cpu=20.0, real=48, wm=0)
    _fake_run(spec, "wmrl", 0, score=0.30, sandbox_cpu=30.0, trainer_cpu=40.0, real=12, wm=48,
              weights=(1.0, 1.5, 2.0), pairs=pairs)
    _fake_run(spec, "wmrl", 1, score=0.10, sandbox_cpu=20.0, trainer_cpu=40.0, real=12, wm=48,
              weights=(1.0, 1.0, 3.0), pairs=pairs)
    for seed, score in ((0, 0.05), (1, 0.07)):   # the untrained policy, with each seed's sampling seed
        base = compare.base_dir(spec, seed)
        base.mkdir(parents=True)
        (base / "eval.json").write_text(json.dumps({"score": score, "attempts": 2, "mean_valid_rate": 0.25,
                                                    "per_task": {"t": score}, "valid_rate": {"t": 0.25},
                                                    "per_category": {"c": score}, "executions": 2,
                                                    "sandbox_cpu_s": 1.0, "seconds": 3.0, "eval_seed": 7 + seed}))
    data = compare.write_report_files(spec)
    real, wmrl = data["arms"]["real"], data["arms"]["wmrl"]
    assert real["score"] == pytest.approx(0.15) and real["score_sd"] == pytest.approx(np.std([0.1, 0.2], ddof=1))
    assert wmrl["score"] == pytest.approx(0.2) and wmrl["score_sd"] == pytest.approx(np.std([0.3, 0.1], ddof=1))
    # Cost ratio: (sandbox + trainer) CPU-s over real's: (25 + 40) / (110 + 20).
    assert wmrl["cost_ratio"] == pytest.approx(65 / 130) and real["cost_ratio"] == pytest.approx(1.0)
    assert wmrl["sandbox_ratio"] == pytest.approx(25 / 110)
    table = (tmp_path / "out" / "table.md").read_text()
    print(table)
    assert "| `wmrl` (n=2) | 20.00 ± 14.14 | [10.00, 30.00] |" in table   # 2 seeds: the bootstrap's extremes
    assert "| `real` (n=2) | 15.00 ± 7.07 | [10.00, 20.00] |" in table
    assert "| base (untrained, n=2) | 6.00 ± 1.41 | [5.00, 7.00] |" in table and "0.50 (sandbox 0.23)" in table
    assert "| `wmrl` | 30.00 | 10.00 |" in table and "| base | 5.00 | 7.00 |" in table   # per seed
    assert data["base"]["per_seed"]["1"]["eval_seed"] == 8 and data["base"]["seeds"] == [0, 1]
    base_md = (tmp_path / "out" / "base_eval.md").read_text()
    assert "seed 0 (sampling seed 7)" in base_md and "seed 1 (sampling seed 8)" in base_md
    for png in ("score_vs_cost.png", "calibration.png", "corrections.png"):
        assert (tmp_path / "out" / png).stat().st_size > 10_000, png
    # Calibration windows: first and last third of 3 steps = step 1 and step 3, both seeds pooled.
    cal = data["calibration"]
    assert cal["start"]["wm"] == [0.1, 0.6, 0.1, 0.6] and cal["end"]["calibrated"] == [0.6, 0.5, 0.6, 0.5]
    assert cal["end"]["map_fitted_steps"] == 2 and cal["start"]["map_fitted_steps"] == 0
    assert cal["start"]["calibrated_prior"] == cal["start"]["wm"]   # before step 1: the identity
    assert cal["end"]["calibrated_prior"] is None                     # step 2's log has no knots to rebuild it from
    curves = data["corrections"]["wmrl"]
    assert curves["1"]["anchor_weight"] == [(1, 1.0), (2, 1.0), (3, 3.0)]
    # The claims whose arms ran, paired by seed: by hand, wmrl - real = (+0.2, -0.1); 2 seeds give 3 distinct
    # bootstrap means (-0.1, +0.05, +0.2), so the 95 % interval spans them: inconclusive.
    claims = {c["id"]: c for c in data["claims"]}
    assert set(claims) == {"0", "1", "2a", "2b"}
    one = claims["1"]
    assert one["mean"] == pytest.approx(0.05) and one["low"] == pytest.approx(-0.1) and one["high"] == pytest.approx(0.2)
    assert (one["positive"], one["negative"], one["sign_p"], one["verdict"]) == (1, 1, 1.0, "inconclusive")
    # Sandbox CPU-s: wmrl - real = (30 - 100, 20 - 120), both below 0: the "less" claim is reproduced.
    assert claims["2a"]["mean"] == pytest.approx(-85.0) and claims["2a"]["verdict"] == "reproduced"
    # Paired with the seed's own base evaluation: (0.10 - 0.05, 0.20 - 0.07).
    assert claims["0"]["mean"] == pytest.approx(0.09) and claims["0"]["verdict"] == "reproduced"
    # The world model on the wmrl runs' anchor rollouts (no config.json: a step's pairs are one group).
    fid = data["arms"]["wmrl"]["anchor_fidelity"]
    from scipy import stats

    wm, real = [0.1, 0.6, 0.2, 0.9, 0.6], [0.0, 0.7, 0.1, 0.6, 0.55]
    assert (fid["runs"], fid["pairs"]) == (2, 10) and "anchor_fidelity" not in data["arms"]["real"]
    assert fid["spearman"] == pytest.approx(stats.spearmanr(wm, real).statistic)
    # Per run 3 groups: none of 3 or more pairs (no within-group Spearman), the 1-pair one all alike.
    assert f"| `wmrl` | 2 | 10 | {fid['spearman']:.3f} | nan | 33 |" in table
    assert "| 1 | WMRL >= real-environment GRPO on held-out avg@2 (`wmrl` - `real`, n=2) | +5.00 pts | " \
           "[-10.00, +20.00] | 1+/1-, p=1.000 | p=0.795 | **inconclusive** |" in table


def test_learning_curves_from_the_runs_curve_files(tmp_path):
    """Per arm and step: mean over seeds, a bootstrap band, the paired change since step 0 (by hand), the PNG."""
    from wmrl_jax.train import loop

    spec = compare.CompareSpec(out=str(tmp_path / "out"), work=str(tmp_path / "work"), arms=("real",),
                               seeds=(0, 1, 2), steps=4, attempts=2, eval_every=2, eval_train_tasks=True)
    held = {0: (0.30, 0.40, 0.50), 1: (0.32, 0.46, 0.55), 2: (0.40, 0.50, 0.62)}   # seed -> steps 0, 2, 4
    for seed, scores in held.items():
        _fake_run(spec, "real", seed, score=scores[-1], sandbox_cpu=10.0, trainer_cpu=5.0, real=8, wm=0)
        with open(spec.run_dir("real", seed) / loop.CURVE, "w") as f:
            for step, score in zip((0, 2, 4), scores):
                f.write(json.dumps({"step": step, "held_out": score, "held_out_per_task": {"t": score},
                                    "held_out_valid": 1.0, "train": score / 2}) + "\n")
    data = compare.write_report_files(spec)
    rows = {r["step"]: r for r in data["curves"]["real"]}
    assert sorted(rows) == [0, 2, 4]
    assert rows[4]["held_out"]["mean"] == pytest.approx(np.mean([0.5, 0.55, 0.62]))
    change = rows[4]["held_out"]["change"]   # per seed: +0.20, +0.23, +0.22
    assert change["mean"] == pytest.approx(0.65 / 3) and change["low"] >= 0.2 - 1e-9 and change["positive"] == 3
    assert rows[0]["held_out"]["change"]["mean"] == 0.0
    assert rows[2]["train"]["mean"] == pytest.approx(np.mean([0.2, 0.23, 0.25]))
    assert (tmp_path / "out" / "learning_curves.png").stat().st_size > 10_000
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| `real` | 4 | 3 | 55.67 | +21.67 [" in table


def test_compare_with_curves_takes_the_loops_final_evaluation(tmp_path, monkeypatch):
    """With eval_every the loop evaluates the final policy (with the seed's sampling seed, as the seed's base
    evaluation): run_compare writes that as the run's eval.json instead of evaluating again."""
    from configs import tiny_cpu
    from wmrl_jax import evaluate as ev

    spec = compare.CompareSpec(out=str(tmp_path / "out"), work=str(tmp_path / "work"), arms=("real",), seeds=(0,),
                               steps=2, attempts=2, eval_every=1)
    base = tiny_cpu.get_config()
    c = compare.run_config(base, spec, "real", 0)
    assert (c.eval_every, c.eval_attempts, c.eval_sampling_seed) == (1, 2, compare.eval_seed(0))
    _fake_run(spec, "real", 0, score=0.4, sandbox_cpu=1.0, trainer_cpu=1.0, real=8, wm=0)
    d = spec.run_dir("real", 0)
    (d / "eval.json").unlink()
    summary = json.loads((d / "summary.json").read_text())
    summary["eval_after"] = {"score": 0.4, "attempts": 2, "per_task": {"t": 0.4}, "valid_rate": {"t": 1.0},
                             "mean_valid_rate": 1.0, "per_category": {}, "executions": 2, "sandbox_cpu_s": 1.0,
                             "seconds": 2.0}
    (d / "summary.json").write_text(json.dumps(summary))
    compare.base_dir(spec, 0).mkdir(parents=True)
    (compare.base_dir(spec, 0) / "eval.json").write_text(json.dumps({**summary["eval_after"], "score": 0.3}))

    def refuse(*args, **kwargs):
        raise AssertionError("evaluated again")

    monkeypatch.setattr(compare, "evaluate", refuse)
    monkeypatch.setattr(ev, "evaluate", refuse)
    report = compare.run_compare(spec, base, progress=False)
    assert json.loads((d / "eval.json").read_text())["score"] == 0.4 and report["arms"]["real"]["score"] == 0.4
    assert report["invocation"]["evaluated"] == 0 and report["invocation"]["trained"] == 0


def test_reliability_bins_by_hand():
    x = np.array([0.05, 0.08, 0.55, 0.95, 1.2, -0.1])
    y = np.array([0.0, 0.2, 0.5, 1.0, 0.8, 0.1])
    bx, by, bn = compare.reliability(x, y)
    # Bins (equal width over [0, 1], below 0 -> bin 0, >= 0.9 -> bin 9):
    # {0: 0.05, 0.08, -0.1}, {5: 0.55}, {9: 0.95, 1.2}.
    np.testing.assert_allclose(bx, [np.mean([0.05, 0.08, -0.1]), 0.55, np.mean([0.95, 1.2])])
    np.testing.assert_allclose(by, [0.1, 0.5, 0.9])
    assert bn.tolist() == [3, 1, 2]


def test_anchor_fidelity_by_hand():
    from scipy import stats

    records = {1: {"wm": [0.1, 0.5, 0.3, 0.9, 0.7, 0.7, 0.7, 0.7], "real": [0.0, 0.6, 0.2, 0.5, 0.1, 0.9, 0.3, 0.4]},
               2: {"wm": [0.2, 0.4, 0.6, 0.8], "real": [0.3, 0.3, 0.3, 0.3]}}
    f = compare.anchor_fidelity(records, group_size=4)
    wm = records[1]["wm"] + records[2]["wm"]
    real = records[1]["real"] + records[2]["real"]
    assert (f["pairs"], f["groups"]) == (12, 3)
    assert f["spearman"] == pytest.approx(stats.spearmanr(wm, real).statistic)
    assert f["rmse"] == pytest.approx(np.sqrt(np.mean((np.array(wm) - np.array(real)) ** 2)))
    # Group 1 ranks 3 of 4 alike with the real rewards (Spearman 0.8); group 2 is all alike to the world model
    # and group 3 to the sandbox: neither has a ranking to compare.
    assert f["within_group_spearman"] == pytest.approx(0.8) and f["within_group_n"] == 1
    assert f["wm_flat_groups"] == pytest.approx(1 / 3)
    whole = compare.anchor_fidelity(records)   # no group size: a step's pairs are one group
    assert whole["groups"] == 2 and whole["within_group_spearman"] == pytest.approx(
        stats.spearmanr(records[1]["wm"], records[1]["real"]).statistic)
    empty = compare.anchor_fidelity({})
    assert empty["pairs"] == 0 and np.isnan(empty["spearman"]) and np.isnan(empty["wm_flat_groups"])


def test_pairs_log_keeps_the_last_line_of_a_repeated_step(tmp_path):
    lines = [{"step": 1, "wm": [0.1], "real": [0.2], "calibrated": [0.1], "map_fitted": False},
             {"step": 2, "wm": [0.3], "real": [0.2], "calibrated": [0.3], "map_fitted": False},
             {"step": 2, "wm": [0.4], "real": [0.5], "calibrated": [0.45], "map_fitted": True}]   # resumed run
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = compare.read_pairs(tmp_path)
    assert sorted(records) == [1, 2] and records[2]["wm"] == [0.4]


def test_spec_and_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="arms"):
        compare.CompareSpec(out=str(tmp_path), arms=("real", "wmrl_plus"))
    with pytest.raises(ValueError, match="seeds"):
        compare.CompareSpec(out=str(tmp_path), seeds=())
    with pytest.raises(ValueError, match="steps"):
        compare.CompareSpec(out=str(tmp_path), steps=0)
    from configs import tiny_cpu

    base = tiny_cpu.get_config()
    spec = compare.CompareSpec(out=str(tmp_path), steps=2, attempts=2)
    c = compare.run_config(base, spec, "naive_mix", 2)
    assert (c.rewards.mode, c.seed, c.steps, c.optim.total_steps, c.eval_attempts) == ("naive_mix", 2, 2, 2, 0)
    assert c.eval_sampling_seed == compare.eval_seed(2) != compare.eval_seed(0)   # the seed's, as its base's
    assert c.workdir == str(tmp_path / "runs" / "naive_mix" / "seed2") and base.rewards.mode == "wmrl"
    compare._check_spec(spec, base)
    compare._check_spec(spec, base)                       # the same settings: fine
    other = tiny_cpu.get_config()
    other.rewards.min_pairs = 3
    with pytest.raises(ValueError, match="rewards.min_pairs"):
        compare._check_spec(spec, other)
    with pytest.raises(ValueError, match="steps"):
        compare._check_spec(compare.CompareSpec(out=str(tmp_path), steps=3, attempts=2), base)


@pytest.mark.slow
def test_compare_end_to_end_and_resume(tmp_path, monkeypatch):
    """2 arms x 1 seed x 1 step at the loop tests' smallest settings, k=2; then a rerun that trains nothing."""
    from tests.test_train_loop import small_config
    from wmrl_jax import evaluate as ev
    from wmrl_jax.train import loop

    base = small_config(tmp_path / "unused", steps=1)
    base.checkpoint.every = 1
    spec = compare.CompareSpec(out=str(tmp_path / "out"), work=str(tmp_path / "work"), arms=("real", "wmrl"),
                               seeds=(0,), steps=1, attempts=2, eval_tasks=("two_moons_noisy",))
    report = compare.run_compare(spec, base, progress=False)
    assert report["invocation"]["trained"] == 2 and report["invocation"]["evaluated"] == 3
    assert set(report["arms"]) == {"real", "wmrl"}
    assert report["arms"]["real"]["real_executions"] == 8 and report["arms"]["wmrl"]["real_executions"] == 4
    for arm in ("real", "wmrl"):   # the table's cost columns are the run's own counters
        counters = json.loads((spec.run_dir(arm, 0) / "summary.json").read_text())["counters"]
        a = report["arms"][arm]
        assert (a["wm_predictions"], a["sandbox_cpu_s"], a["trainer_cpu_s"]) == (
            counters["wm_predictions"], counters["sandbox_cpu_s"], counters["compute_cpu_s"])
        assert a["trainer_cpu_s"] > 0
    assert report["arms"]["real"]["wm_predictions"] == 0
    assert list(report["base"]["per_seed"]["0"]["per_task"]) == ["two_moons_noisy"]
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| `real` (n=1) |" in table and "| `wmrl` (n=1) |" in table and "| base (untrained, n=1) |" in table
    assert json.loads((compare.base_dir(spec, 0) / "eval.json").read_text())["eval_seed"] == compare.eval_seed(0)
    for png in ("score_vs_cost.png", "calibration.png", "corrections.png"):
        assert (tmp_path / "out" / png).is_file(), png
    assert compare.read_pairs(spec.run_dir("wmrl", 0))[1]["wm"]   # the loop logged its anchor pairs
    saved = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert saved["arms"]["wmrl"]["score"] == report["arms"]["wmrl"]["score"]

    def refuse(*args, **kwargs):
        raise AssertionError("a finished run or evaluation was redone")

    monkeypatch.setattr(loop, "train", refuse)
    monkeypatch.setattr(ev, "evaluate", refuse)
    again = compare.run_compare(spec, base, progress=False)
    assert again["invocation"]["trained"] == 0 and again["invocation"]["evaluated"] == 0
    assert again["arms"]["wmrl"]["score"] == report["arms"]["wmrl"]["score"]
    # A torn eval.json (killed while writing) is redone, and only that.
    (spec.run_dir("real", 0) / "eval.json").write_text("{")
    monkeypatch.undo()
    monkeypatch.setattr(loop, "train", refuse)
    third = compare.run_compare(spec, base, progress=False)
    assert third["invocation"]["trained"] == 0 and third["invocation"]["evaluated"] == 1


def test_compare_cli_names_a_bad_arm(tmp_path):
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "launch" / "compare.py"), "--arms=real,wmrl_plus",
                           f"--out={tmp_path / 'o'}", f"--work={tmp_path / 'w'}"], capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert proc.returncode != 0 and "wmrl_plus" in proc.stderr and "expected a non-empty subset" in proc.stderr
    assert not (tmp_path / "w").exists()   # refused before any work


def test_prior_map_is_the_previous_steps_knots():
    records = {1: {"step": 1, "wm": [0.2], "real": [0.1], "calibrated": [0.2], "map_fitted": False,
                   "map_x": [], "map_y": []},
               2: {"step": 2, "wm": [0.1, 0.9], "real": [0.0, 0.5], "calibrated": [0.05, 0.5], "map_fitted": True,
                   "map_x": [0.1, 0.9], "map_y": [0.05, 0.5]},
               3: {"step": 3, "wm": [0.5, 1.0, 0.0], "real": [0.3, 0.6, 0.1], "calibrated": [0.3, 0.6, 0.0],
                   "map_fitted": True, "map_x": [0.0, 1.0], "map_y": [0.0, 0.6]}}
    windows = compare.calibration_windows([records], 3)
    assert windows["start"]["calibrated_prior"] == [0.2]
    # Step 3's pairs through step 2's map: np.interp semantics, flat beyond the end knots.
    assert windows["end"]["calibrated_prior"] == pytest.approx([0.05 + 0.45 * 0.5, 0.5, 0.05])
