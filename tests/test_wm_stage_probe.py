"""launch/wm_stage_probe.py: a continued world-model stage written as a checkpoint folder wm_fidelity reads."""

import filecmp
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "wm_stage_probe.py"


def _probe(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_a_folder_without_a_world_model_is_refused_before_any_compute(tmp_path):
    (tmp_path / "agent").mkdir()
    proc = _probe(f"--checkpoint={tmp_path / 'agent'}", f"--out={tmp_path / 'out'}")
    assert proc.returncode != 0
    assert "expected a micro-world build folder with build_log.json and a world_model/ folder" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = _probe(f"--checkpoint={tmp_path / 'agent'}")
    assert proc.returncode != 0 and "--checkpoint and --out are required" in proc.stderr


@pytest.mark.slow
def test_two_steps_with_own_programs_change_the_world_model_only(tmp_path):
    """The shipped micro-world, 2 steps and one own program per train task: the agent's files are copied byte for
    byte, the world model's weights move, and the folder loads as a checkpoint with its world model."""
    from wmrl_jax import micro_world, world_model
    from wmrl_jax.chat import load_chat_model

    src, out = micro_world.shipped_path(), tmp_path / "probe"
    proc = _probe(f"--checkpoint={src}", f"--out={out}", "--steps=2", "--own_per_task=1", "--own_repeat=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "own programs: 12 in" in proc.stdout and f"wrote {out}" in proc.stdout
    assert filecmp.cmp(src / "model.safetensors", out / "model.safetensors", shallow=False)
    record = json.loads((out / "probe.json").read_text())
    assert record["steps"] == 2 and len(record["outcome_nll"]) == 2 and sum(record["own_statuses"].values()) == 12
    before = load_chat_model(src / world_model.FOLDER).model.params["embed_vd"]
    after = load_chat_model(out / world_model.FOLDER).model.params["embed_vd"]
    assert before.shape == after.shape and not np.array_equal(np.asarray(before), np.asarray(after))
    assert not (tmp_path / "probe.new").exists()
