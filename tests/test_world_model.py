"""The world model: the gate against the real sandbox, the answer parser, rewards on the grader's ladder.

References: `sandbox.run_solution` (its statuses for code it refuses to
launch), `sandbox.grading.ladder_reward` (the reward ladder), and answers
written out by hand.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

import sandbox
from sandbox import grading, suite
from tests.helpers_hf import save_tiny_qwen3
from wmrl_jax import chat, world_model

CONFIG = world_model.WorldModelConfig(overview_chars=300, inventory_chars=100, code_chars=500, max_new_tokens=8)


@pytest.fixture(scope="module")
def task():
    return sandbox.load_task(suite.suite_dir() / "iris_species")


@pytest.mark.parametrize("code, status", [
    (None, "malformed"),
    ("", "malformed"),
    ("   \n", "malformed"),
    ("Here is my plan, no code.\n```python\n```", "malformed"),
    ("def f(:\n    pass\n", "syntax_err"),
    ("```python\nfor i in range(3)\n    print(i)\n```", "syntax_err"),
    ("x = 1\n", None),
    ("Plan.\n```python\nimport os\nprint(os.environ['DATA_DIR'])\n```", None),
])
def test_gate_agrees_with_the_real_sandbox(task, code, status):
    decided = world_model.gate(code)
    assert (decided[0] if decided else None) == status
    if status is not None:   # the sandbox classifies these without launching anything
        real = sandbox.run_solution(task, code)
        assert real.status == status
        assert world_model.ladder_reward(status, None, CONFIG) == real.reward
        assert decided[1:] == (real.error_type, real.feedback)   # the same verdict and text as the sandbox


@pytest.mark.parametrize("status", world_model.STATUSES)
def test_format_and_parse_round_trip(status):
    buckets = world_model.BUCKETS if status == "valid" else (None,)
    for bucket in buckets:
        error = None if status == "valid" else "KeyError (line 12)"
        text = world_model.format_answer(status, error=error, bucket=bucket)
        parsed = world_model.parse_answer(text)
        assert parsed[:3] == (status, error, bucket)
        assert parsed[3] == world_model.default_feedback(status, error, bucket)


@pytest.mark.parametrize("text, expected", [
    ("STATUS: valid\nERROR: none\nQUALITY: high\nFEEDBACK: fine", ("valid", None, "high", "fine")),
    ("status: Runtime_Err\nerror: KeyError\n", ("runtime_err", "KeyError", None,
                                               world_model.default_feedback("runtime_err", "KeyError"))),
    # Truncated, but the status (and the bucket of a valid one) made it: used.
    ("STATUS: ran_no_sub\nERR", ("ran_no_sub", None, None, world_model.default_feedback("ran_no_sub"))),
    ("STATUS: valid\nERROR: none\nQUALITY: mid", ("valid", None, "mid", world_model.default_feedback("valid", None, "mid"))),
    # Truncated before the bucket of a valid run, or garbage: unusable.
    ("STATUS: valid\nERROR: none\nQUAL", None),
    ("STATUS: valid\nQUALITY: excellent", None),
    ("STATUS: exploded\nQUALITY: high", None),
    ("The code looks fine to me.", None),
    ("", None),
    (None, None),
])
def test_parse_answer(text, expected):
    assert world_model.parse_answer(text) == expected


def test_rewards_follow_the_graders_ladder_with_documented_bucket_positions():
    positions = dict(CONFIG.bucket_positions)
    assert positions == {"low": 0.125, "fair": 0.375, "mid": 0.625, "high": 0.875}
    for bucket, pos in positions.items():
        assert world_model.ladder_reward("valid", bucket, CONFIG) == pytest.approx(0.5 + 0.5 * pos)
        assert world_model.quality_bucket(pos) == bucket
    for status in ("syntax_err", "runtime_err", "ran_no_sub"):
        assert world_model.ladder_reward(status, None, CONFIG) == grading.ladder_reward(status, None)
    assert [world_model.quality_bucket(p) for p in (0.0, 0.2499, 0.25, 0.5, 0.75, 1.0)] == \
        ["low", "low", "fair", "mid", "high", "high"]


def test_combining_k_samples_averages_rewards_and_takes_the_most_common_status():
    answers = [world_model.format_answer("valid", bucket="high"), world_model.format_answer("valid", bucket="low"),
               world_model.format_answer("runtime_err", error="KeyError"), "garbage"]
    pred = world_model._combine(answers, CONFIG)
    assert pred.status == "valid" and pred.bucket == "high"
    assert pred.reward == pytest.approx((0.5 + 0.5 * 0.875 + 0.5 + 0.5 * 0.125 + 0.1) / 3)
    assert world_model._combine(["garbage", ""], CONFIG).reward is None


def test_predict_gates_without_the_model_and_never_scores_garbage_as_zero(tmp_path, task):
    lm = chat.load_chat_model(save_tiny_qwen3(tmp_path / "m", seed=1))   # random weights: garbage answers
    codes = [None, "def f(:\n", "import pandas\nprint('ok')\n", "x = 2\n"]
    preds = world_model.predict(lm, [task] * len(codes), codes, config=dataclasses.replace(CONFIG, num_samples=2),
                                seed=0)
    assert [p.status for p in preds[:2]] == ["malformed", "syntax_err"] and all(p.gated for p in preds[:2])
    assert [p.reward for p in preds[:2]] == [0.0, 0.0]
    for p in preds[2:]:
        assert not p.gated and p.raw_text.count("\n---\n") == 1   # two samples asked
        if world_model.parse_answer(p.raw_text.split("\n---\n")[0]) is None and \
                world_model.parse_answer(p.raw_text.split("\n---\n")[1]) is None:
            assert p.reward is None and p.status is None    # ungraded, not 0
    assert repr(preds[0]).startswith("Prediction(status='malformed'") and len(repr(preds[0])) < 150


def test_prompt_shows_task_inventory_and_numbered_code(task):
    messages = world_model.messages(task, "import os\nx = 1\n", CONFIG)
    user = messages[1]["content"]
    assert "# Task\n" in user and "# Data\n" in user and "# Solution\nimport os  # 1\nx = 1  # 2" in user
    assert "STATUS:" in messages[0]["content"] and "QUALITY:" in messages[0]["content"]


def test_bad_input(task, tmp_path):
    lm = chat.load_chat_model(save_tiny_qwen3(tmp_path / "m", seed=1))
    with pytest.raises(ValueError, match="codes: empty batch"):
        world_model.predict(lm, [], [], config=CONFIG)
    with pytest.raises(ValueError, match="equal lengths"):
        world_model.predict(lm, [task], ["x = 1", "y = 2"], config=CONFIG)
    with pytest.raises(ValueError, match="bucket_positions"):
        world_model.WorldModelConfig(bucket_positions=(("low", 0.1),))
    with pytest.raises(ValueError, match="status"):
        world_model.format_answer("exploded")
    with pytest.raises(ValueError, match="bucket"):
        world_model.format_answer("valid")


def test_listing_lines_start_as_the_agent_writes_them():
    """Line numbers are trailing comments: every listed line starts with the code itself and still compiles."""
    code = "import os\n\nfor i in range(3):\n    x = i  # note\n"
    listing = world_model.numbered(code)
    assert listing.split("\n") == ["import os  # 1", "# 2", "for i in range(3):  # 3", "    x = i  # note  # 4"]
    compile(listing, "listing.py", "exec")


def test_column_inventory_lists_every_column_once(task):
    text = world_model.column_inventory(task, 4000)
    assert text.startswith("Target columns (in train.csv, not in test.csv):")
    train_line = next(line for line in text.split("\n") if line.startswith("train.csv:"))
    import pandas as pd

    columns = pd.read_csv(pathlib.Path(task.public_dir) / "train.csv", nrows=1).columns
    assert all(f"{c} (" in train_line for c in columns)
    assert "test.csv:" in text and "range [" not in text
