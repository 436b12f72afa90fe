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
    assert "# Task\n" in user and "# Data\n" in user and "# Solution\n```python\n1 | import os\n2 | x = 1\n```" in user
    other = dataclasses.replace(CONFIG, listing="comment", inventory="columns", inventory_chars=600)
    commented = world_model.messages(task, "import os\nx = 1\n", other)
    user = commented[1]["content"]
    assert "# Solution\n```python\nimport os  # 1\nx = 1  # 2\n```" in user and "train.csv:" in user and "range [" not in user
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
    listing = world_model.numbered(code, "comment")
    assert listing.split("\n") == ["import os  # 1", "# 2", "for i in range(3):  # 3", "    x = i  # note  # 4"]
    compile(listing, "listing.py", "exec")
    assert world_model.numbered(code).split("\n")[0] == "1 | import os"
    with pytest.raises(ValueError, match="listing: got 'suffix'"):
        world_model.numbered(code, "suffix")
    with pytest.raises(ValueError, match=r"WorldModelConfig.listing: got 'x', expected one of \('prefix', 'comment'\)"):
        world_model.WorldModelConfig(listing="x")
    with pytest.raises(ValueError, match="WorldModelConfig.inventory: got 'x'"):
        world_model.WorldModelConfig(inventory="x")


def test_column_inventory_lists_every_column_once(task):
    text = world_model.column_inventory(task, 4000)
    assert text.startswith("Target columns (in train.csv, not in test.csv):")
    train_line = next(line for line in text.split("\n") if line.startswith("train.csv:"))
    import pandas as pd

    columns = pd.read_csv(pathlib.Path(task.public_dir) / "train.csv", nrows=1).columns
    assert all(f"{c} (" in train_line for c in columns)
    assert "test.csv:" in text and "range [" not in text


# --------------------------------------------------------------------------- decomposed design

DECOMPOSED = dataclasses.replace(CONFIG, design="decomposed")
PASS = world_model.format_check_answer("pass", 0.9)


def _answers(**fails) -> list[str]:
    """One answer per check in `CHECKS` order: pass, except the named checks, which get the given answer text."""
    return [fails.get(name, PASS) for name in world_model.CHECKS]


def test_design_is_validated():
    with pytest.raises(ValueError, match=r"WorldModelConfig\.design: got 'mixed', expected one of "
                                         r"\('holistic', 'decomposed'\)"):
        world_model.WorldModelConfig(design="mixed")
    assert world_model.WorldModelConfig().design == "holistic"


@pytest.mark.parametrize("verdict, confidence, error, feedback", [
    ("pass", 0.9, None, None),
    ("fail", 0.75, "KeyError line 12", "Execution failed: KeyError: 'Speceis'"),
    ("fail", 1.0, "TimeoutError", "Execution failed: the program timed\n out after 120 s."),
    ("pass", 0.0, None, "Looks fine."),
])
def test_check_answer_round_trip(verdict, confidence, error, feedback):
    text = world_model.format_check_answer(verdict, confidence, error, feedback)
    expected_feedback = None if feedback is None else " ".join(feedback.split())
    assert world_model.parse_check_answer(text) == (verdict, confidence, error, expected_feedback)


@pytest.mark.parametrize("text, expected", [
    ("verdict: FAIL\nconfidence: .6\nerror: NameError line 3\nfeedback: none", ("fail", 0.6, "NameError line 3", None)),
    ("VERDICT: pass\nCONFIDENCE: 0.8\nERR", ("pass", 0.8, None, None)),   # truncated after the two that matter
    ("VERDICT: pass\nERROR: none", None),                                # no confidence
    ("VERDICT: pass\nCONFIDENCE: high", None),
    ("VERDICT: pass\nCONFIDENCE: 1.5", None),
    ("VERDICT: maybe\nCONFIDENCE: 0.5", None),
    ("It will probably work.", None),
    ("", None),
    (None, None),
])
def test_parse_check_answer(text, expected):
    assert world_model.parse_check_answer(text) == expected


def test_quality_answer_round_trip():
    for bucket in world_model.BUCKETS:
        assert world_model.parse_quality_answer(world_model.format_quality_answer(bucket)) == bucket
    assert world_model.parse_quality_answer("quality: Mid, I think") == "mid"
    assert world_model.parse_quality_answer("QUALITY: excellent") is None
    assert world_model.parse_quality_answer("") is None
    with pytest.raises(ValueError, match="bucket"):
        world_model.format_quality_answer("excellent")
    with pytest.raises(ValueError, match="verdict"):
        world_model.format_check_answer("maybe", 0.5)
    with pytest.raises(ValueError, match="confidence"):
        world_model.format_check_answer("pass", 1.5)


def test_checks_combine_by_precedence_on_the_ladder():
    """Worked by hand: runtime fail > submission fail > valid with the rubric's bucket; garbage is ungraded."""
    data = world_model.format_check_answer("fail", 0.8, "KeyError line 12", "Execution failed: KeyError: 'Sepal'")
    shape = world_model.format_check_answer("fail", 0.6, "ValueError line 20")
    sub = world_model.format_check_answer("fail", 0.95, "missing column Species")

    pred = world_model.combine_checks(_answers(data_references=data, submission=sub), "QUALITY: high", CONFIG)
    assert (pred.status, pred.reward, pred.bucket, pred.error_type) == ("runtime_err", 0.1, None, "KeyError line 12")
    assert pred.feedback == "Execution failed: KeyError: 'Sepal'"
    assert dict((c[0], c[1:]) for c in pred.checks)["data_references"] == ("fail", 0.8, "KeyError line 12")
    # Two runtime fails: the more confident one names the error (0.8 > 0.6), whatever the order.
    pred = world_model.combine_checks(_answers(shapes_and_types=shape, data_references=data), "", CONFIG)
    assert pred.error_type == "KeyError line 12"

    pred = world_model.combine_checks(_answers(submission=sub), "QUALITY: high", CONFIG)
    assert (pred.status, pred.reward, pred.bucket) == ("ran_no_sub", 0.2, None)
    assert pred.error_type == "missing column Species"
    assert pred.feedback == world_model.default_feedback("ran_no_sub", "missing column Species")

    pred = world_model.combine_checks(_answers(), "QUALITY: high", CONFIG)
    assert (pred.status, pred.bucket) == ("valid", "high") and pred.reward == pytest.approx(0.5 + 0.5 * 0.875)
    assert pred.reward == grading.ladder_reward("valid", 0.875)
    # Checks that do not parse abstain; the ones that do decide.
    pred = world_model.combine_checks(_answers(submission="garbage", api_calls=""), "QUALITY: low", CONFIG)
    assert (pred.status, pred.reward) == ("valid", 0.5 + 0.5 * 0.125)
    assert dict((c[0], c[1:]) for c in pred.checks)["submission"] == (None, None, None)

    # Ungraded, never 0: every check unparseable; or valid with an unparseable rubric.
    for answers, quality in ((["garbage"] * len(world_model.CHECKS), "QUALITY: high"), (_answers(), "QUALITY: ?")):
        pred = world_model.combine_checks(answers, quality, CONFIG)
        assert pred.reward is None and pred.status is None
    # A runtime fail needs no rubric.
    assert world_model.combine_checks(_answers(data_references=data), "garbage", CONFIG).reward == 0.1


def test_check_prompts_share_the_holistic_user_message(task):
    code = "import os\nx = 1\n"
    user = world_model.messages(task, code, CONFIG)[1]["content"]
    systems = set()
    for check in (*world_model.CHECKS, world_model.RUBRIC):
        msgs = world_model.check_messages(task, code, CONFIG, check)
        assert msgs[1] == {"role": "user", "content": user}
        systems.add(msgs[0]["content"])
        assert ("QUALITY:" if check == world_model.RUBRIC else "VERDICT: pass | fail") in msgs[0]["content"]
    assert len(systems) == len(world_model.CHECKS) + 1                 # one system prompt per check
    assert set(world_model.RUNTIME_CHECKS) == set(world_model.CHECKS) - {"submission"}
    assert "scikit-learn " in world_model.check_system_prompt("api_calls")   # with its installed version
    with pytest.raises(ValueError, match="check: got 'style'"):
        world_model.check_messages(task, code, CONFIG, "style")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return chat.load_chat_model(save_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=1))


def test_decomposed_predict_asks_every_check_of_every_solution_in_one_generate_call(monkeypatch, task, tiny_lm):
    """A fake generator answers by (solution, question): it reads both from the decoded prompt."""
    from wmrl_jax import sampling

    data = world_model.format_check_answer("fail", 0.8, "KeyError line 1")
    sub = world_model.format_check_answer("fail", 0.7, "no submission file")
    canned = {   # solution marker -> (answers per check, rubric answer)
        "a = 1": (_answers(data_references=data, submission=sub), "QUALITY: high"),
        "b = 2": (_answers(submission=sub), "QUALITY: high"),
        "c = 3": (_answers(), "QUALITY: high"),
        "d = 4": (["nonsense"] * len(world_model.CHECKS), "no idea"),
    }
    calls = []

    def fake_generate(lm, prompts, num_samples=1, **kwargs):
        calls.append(len(prompts) * num_samples)
        tokens = []
        for ids in (p for p in prompts for _ in range(num_samples)):   # K samples a prompt, prompt-major
            text = tiny_lm.decode(ids)
            marker = next(m for m in canned if f"1 | {m}" in text)
            checks, quality = canned[marker]
            if world_model.WM_SYSTEM_PROMPT in text:
                answer = world_model.format_answer("valid", bucket="low")
            elif world_model.QUALITY_SYSTEM_PROMPT in text:
                answer = quality
            else:
                answer = next(a for c, a in zip(world_model.CHECKS, checks)
                              if world_model.check_system_prompt(c) in text)
            tokens.append(tiny_lm.encode(answer))
        return sampling.GenerateResult(tokens=tokens, logprobs=[], lengths=None, finished=None)

    monkeypatch.setattr(sampling, "generate", fake_generate)
    codes = [None, "a = 1\n", "def f(:\n", "b = 2\n", "c = 3\n", "d = 4\n"]
    config = dataclasses.replace(DECOMPOSED, num_samples=2)
    preds = world_model.predict(tiny_lm, [task] * len(codes), codes, config=config)
    asked = 4
    assert calls == [asked * (len(world_model.CHECKS) + 1) * 2]      # one call: 4 solutions x 8 questions x K=2
    assert [(p.status, p.gated) for p in preds[::2][:2]] == [("malformed", True), ("syntax_err", True)]
    assert [p.reward for p in preds] == [0.0, 0.1, 0.0, 0.2, pytest.approx(0.5 + 0.5 * 0.875), None]
    assert [p.status for p in preds] == ["malformed", "runtime_err", "syntax_err", "ran_no_sub", "valid", None]
    assert preds[1].error_type == "KeyError line 1" and preds[3].error_type == "no submission file"
    assert preds[0].checks is None and len(preds[1].checks) == len(world_model.CHECKS)
    assert preds[1].raw_text.count("\n=====\n") == 1                 # the K=2 samples, both kept
    assert len(repr(preds[1])) < 200

    # The holistic design still asks one question per solution (x K) in one call.
    calls.clear()
    preds = world_model.predict(tiny_lm, [task] * len(codes), codes,
                                config=dataclasses.replace(config, design="holistic"))
    assert calls == [asked * 2]
    assert [p.status for p in preds] == ["malformed", "valid", "syntax_err", "valid", "valid", "valid"]
    assert all(p.checks is None for p in preds)


def test_decomposed_gate_needs_no_model_call(monkeypatch, task, tiny_lm):
    from wmrl_jax import sampling

    def no_generate(*args, **kwargs):
        raise AssertionError("the gate decides these without the model")

    monkeypatch.setattr(sampling, "generate", no_generate)
    preds = world_model.predict(tiny_lm, [task] * 3, [None, "", "def f(:\n"], config=DECOMPOSED)
    assert [(p.status, p.reward, p.gated, p.checks) for p in preds] == \
        [("malformed", 0.0, True, None), ("malformed", 0.0, True, None), ("syntax_err", 0.0, True, None)]


# --------------------------------------------------------------------------- the expected readout

@pytest.fixture(scope="module")
def micro_lm():
    from wmrl_jax import micro_world

    return world_model.load(micro_world.shipped_path())   # the micro-world's own world model


def _scored_distribution(lm, prompt, answers):
    """Renormalised P(answer's first own token) from token_logprobs on prompt + each full answer (by hand)."""
    import jax
    import numpy as np

    from wmrl_jax import logprobs

    ids = [lm.encode(a) for a in answers]
    at = next(n for n in range(min(map(len, ids))) if len({i[n] for i in ids}) > 1)
    rows = [list(prompt) + a for a in ids]
    width = max(map(len, rows))
    tokens = np.zeros((len(rows), width), np.int32)
    valid = np.zeros((len(rows), width), bool)
    for r, row in enumerate(rows):   # left-padded, as the sampler lays out a batch
        tokens[r, width - len(row):], valid[r, width - len(row):] = row, True
    score = jax.jit(logprobs.token_logprobs, static_argnums=(1, 2))
    lp, _ = score(lm.model.params, lm.model.config, lm.model.family, tokens, valid)
    logp = np.array([lp[r, width - len(row) + len(prompt) + at] for r, row in enumerate(rows)])
    p = np.exp(logp - logp.max())
    return p / p.sum()


CODES = [
    "import os\nimport pandas as pd\nfrom sklearn.ensemble import RandomForestClassifier\n"
    "d = os.environ['DATA_DIR']\ntrain = pd.read_csv(d + '/train.csv')\ntest = pd.read_csv(d + '/test.csv')\n"
    "X = train.drop(columns=['id', 'Species'])\nmodel = RandomForestClassifier(random_state=0)\n"
    "model.fit(X, train['Species'])\n"
    "pd.DataFrame({'id': test['id'], 'Species': model.predict(test[X.columns])})"
    ".to_csv(os.environ['SUBMISSION_PATH'], index=False)\n",
    "import pandas as pd\ntrain = pd.read_csv('train.csv')\nprint(train['Specie'].mean())\n",
]


def test_expected_readout_is_the_ladder_expectation_of_the_models_answer_distribution(task, micro_lm):
    """Reference: each full answer scored separately with `logprobs.token_logprobs`, the ladder by hand."""
    import numpy as np

    config = dataclasses.replace(CONFIG, readout="expected")
    preds = world_model.predict(micro_lm, [task] * 3, [*CODES, "def f(:\n"], config=config)
    assert preds[2].gated and preds[2].reward == 0.0                       # the gate still decides first
    positions = dict(world_model.DEFAULT_BUCKET_POSITIONS)
    for code, pred in zip(CODES, preds):
        prompt = micro_lm.prompt_ids(world_model.messages(task, code, config))
        p_status = _scored_distribution(micro_lm, prompt, [
            world_model.format_answer(s, bucket="low" if s == "valid" else None) for s in world_model.STATUSES])
        p_bucket = _scored_distribution(micro_lm, prompt, [
            world_model.format_answer("valid", bucket=b) for b in world_model.BUCKETS])
        valid = sum(p * (0.5 + 0.5 * positions[b]) for p, b in zip(p_bucket, world_model.BUCKETS))
        by_status = dict(zip(world_model.STATUSES, p_status))
        expected = 0.1 * by_status["runtime_err"] + 0.2 * by_status["ran_no_sub"] + by_status["valid"] * valid
        assert pred.reward == pytest.approx(expected, abs=1e-4)
        assert pred.status == world_model.STATUSES[int(np.argmax(p_status))] and not pred.gated
        assert (pred.bucket is None) == (pred.status != "valid")
        assert pred.feedback == world_model.default_feedback(pred.status, None, pred.bucket)
        assert "P(status)" in pred.raw_text and len(repr(pred)) < 200


def test_expected_readout_of_the_decomposed_design(task, micro_lm):
    """Precedence on probabilities, by hand: P(runtime) = 1 - prod(1 - p_c), then the submission, then valid."""
    import numpy as np

    config = world_model.WorldModelConfig()
    quality = np.array([0.1, 0.2, 0.3, 0.4])
    valid = sum(q * (0.5 + 0.5 * p) for q, (_, p) in zip(quality, world_model.DEFAULT_BUCKET_POSITIONS))
    p_fail = np.array([0.1, 0.0, 0.2, 0.0, 0.0, 0.0, 0.6])
    pred = world_model._expected_decomposed(p_fail, quality, config)
    p_runtime = 1 - 0.9 * 0.8
    assert pred.reward == pytest.approx(0.1 * p_runtime + 0.2 * (1 - p_runtime) * 0.6 + (1 - p_runtime) * 0.4 * valid)
    assert pred.status == "ran_no_sub" and pred.bucket is None           # 0.43 > 0.29 (valid) > 0.28 (runtime)
    assert [c[1] for c in pred.checks] == ["pass"] * 6 + ["fail"]
    assert world_model._expected_decomposed(np.zeros(7), quality, config).reward == pytest.approx(valid)
    assert world_model._expected_decomposed(np.eye(7)[0], quality, config).status == "runtime_err"

    # Through predict on the shipped model: one forward, rewards on the ladder's range, a check tuple each.
    config = dataclasses.replace(CONFIG, design="decomposed", readout="expected")
    preds = world_model.predict(micro_lm, [task] * 2, CODES, config=config)
    assert all(0.1 <= p.reward <= 1.0 and len(p.checks) == len(world_model.CHECKS) for p in preds)


def test_expected_readout_needs_answers_that_branch_at_one_token(task, tiny_lm):
    """The tiny test tokenizer spells ' runtime' and ' ran' with the same first token: a clear error, no guess."""
    with pytest.raises(ValueError, match="readout='sample'"):
        world_model.predict(tiny_lm, [task], ["x = 1\n"], config=dataclasses.replace(CONFIG, readout="expected"))
    with pytest.raises(ValueError, match="WorldModelConfig.readout: got 'mean'"):
        world_model.WorldModelConfig(readout="mean")
