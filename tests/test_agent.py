"""The research agent: prompts through the checkpoint's chat template, multi-turn token layout, loss masks.

References: transformers' `apply_chat_template` over the whole conversation
(rendered text and token ids), and the sampler's own outputs for which tokens
the agent produced.
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

import sandbox
from sandbox import suite
from tests.helpers_hf import save_tiny_qwen3
from wmrl_jax import agent, chat

CONFIG = agent.AgentConfig(max_turns=3, max_new_tokens=12, observation_max_tokens=20, overview_chars=300,
                           inventory_chars=120, temperature=1.0)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return chat.load_chat_model(save_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=0))


@pytest.fixture(scope="module")
def tasks():
    return [sandbox.load_task(p) for p in suite.list_tasks("test")[:2]]


def _template_ids(tokenizer, messages, **kwargs):
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_prompt_ids_equal_transformers_apply_chat_template(lm, tasks):
    messages = agent.initial_messages(tasks[0], CONFIG)
    assert lm.prompt_ids(messages) == _template_ids(lm.tokenizer, messages, add_generation_prompt=True)
    assert messages[0]["role"] == "system" and "DATA_DIR" in messages[0]["content"]
    assert "SUBMISSION_PATH" in messages[0]["content"] and "time limit 600 s" in messages[0]["content"]
    assert messages[1]["content"].startswith("# Task\n") and "\n# Data\n" in messages[1]["content"]


def test_continuation_ids_rebuild_the_whole_conversation(lm, tasks):
    """prompt + reply + continuation + reply ... equals the template's ids of the whole conversation."""
    first = agent.initial_messages(tasks[0], CONFIG)
    replies = ["Plan: ridge.\n```python\nprint(1)\n```", "```python\nprint(2)\n```"]
    obs = agent.observation_message("Execution failed: KeyError at line 3.")
    eos = lm.eos_ids[0]
    ids = lm.prompt_ids(first) + lm.encode(replies[0]) + [eos]
    ids += lm.continuation_ids(first, replies[0], [obs]) + lm.encode(replies[1]) + [eos]
    whole = [*first, {"role": "assistant", "content": replies[0]}, obs, {"role": "assistant", "content": replies[1]}]
    expected = _template_ids(lm.tokenizer, whole)
    assert ids + lm.encode("\n") == expected


def test_episodes_mask_exactly_the_agent_tokens(lm, tasks):
    seen = []

    def feedback(rows, solutions):
        seen.append(list(solutions))
        return [f"Execution failed: error number {r} " * 20 for r in rows]   # longer than the cap

    episodes = agent.run_episodes(lm, tasks, 2, config=CONFIG, feedback=feedback, seed=3)
    assert len(episodes) == 4 and [e.task_index for e in episodes] == [0, 0, 1, 1]
    assert len(seen) == CONFIG.max_turns - 1   # no feedback after the final turn
    for e in episodes:
        assert len(e.tokens) == len(e.loss_mask) == len(e.logprobs)
        assert not e.loss_mask[: e.prompt_len].any()
        assert len(e.replies) == CONFIG.max_turns and len(e.observations) == CONFIG.max_turns - 1
        # Each turn's masked run is that turn's sampled reply; the log-probs live only there.
        edges = np.flatnonzero(np.diff(np.r_[0, e.loss_mask.astype(int), 0])).reshape(-1, 2)
        assert len(edges) == CONFIG.max_turns
        for (lo, hi), reply, cut in zip(edges, e.replies, e.truncated):
            assert hi - lo <= CONFIG.max_new_tokens
            assert lm.decode(e.tokens[lo:hi]) == reply
            # A reply that ran out of tokens is closed by an EOS that is not the agent's (unmasked).
            assert cut == (e.tokens[hi - 1] not in lm.eos_ids)
            if cut and hi < len(e.tokens):
                assert e.tokens[hi] == lm.eos_ids[0] and not e.loss_mask[hi]
        assert np.all(e.logprobs[~e.loss_mask] == 0.0) and np.all(e.logprobs[e.loss_mask] <= 0.0)
        # Observations are capped and never in the loss.
        for obs in e.observations:
            assert len(lm.encode(obs)) <= CONFIG.observation_max_tokens
        # The whole sequence is exactly the template's rendering of the conversation. (A random
        # model samples special tokens too; the reply text keeps them here.)
        messages = agent.initial_messages(tasks[e.task_index], CONFIG)
        for turn, (lo, hi) in enumerate(edges):
            ids = e.tokens[lo:hi - 1] if e.tokens[hi - 1] in lm.eos_ids else e.tokens[lo:hi]
            messages.append({"role": "assistant", "content": lm.decode(ids, skip_special_tokens=False)})
            if turn < len(e.observations):
                messages.append(agent.observation_message(e.observations[turn]))
        rendered = lm.render(messages, add_generation_prompt=False)
        assert lm.decode(e.tokens, skip_special_tokens=False) + "\n" == rendered


def test_episodes_are_deterministic_given_the_seed(lm, tasks):
    one = dataclasses.replace(CONFIG, max_turns=1)
    a = agent.run_episodes(lm, tasks, 2, config=one, seed=5)
    b = agent.run_episodes(lm, tasks, 2, config=one, seed=5)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))


def test_episodes_with_cache_reuse_equal_those_that_reprefill(lm, tasks):
    """`AgentConfig.reuse_cache`: later turns continue the sampler cache instead of re-prefilling the whole
    conversation; the episodes are the same (tokens, masks; log-probs up to float rounding)."""
    def feedback(rows, solutions):
        return [f"Execution failed: error number {r}." for r in rows]

    runs = {reuse: agent.run_episodes(lm, tasks, 2, config=dataclasses.replace(CONFIG, reuse_cache=reuse),
                                      feedback=feedback, seed=4)
            for reuse in (False, True)}
    assert CONFIG.reuse_cache and CONFIG.max_turns == 3
    for off, on in zip(runs[False], runs[True]):
        np.testing.assert_array_equal(on.tokens, off.tokens)
        np.testing.assert_array_equal(on.loss_mask, off.loss_mask)
        np.testing.assert_allclose(on.logprobs, off.logprobs, atol=2e-5, rtol=0)
        assert on.replies == off.replies and on.truncated == off.truncated


def test_solution_is_the_last_python_block_of_the_final_turn():
    reply = "Plan.\n```python\nprint(1)\n```\nbetter:\n```python\nprint(2)\n```\n```\nnot python\n```"
    assert agent.extract_solution(reply) == "print(2)\n"
    assert agent.extract_solution("no code here") is None


def test_bad_input_names_what_is_missing(lm, tasks, tmp_path):
    with pytest.raises(ValueError, match="tasks: empty batch"):
        agent.run_episodes(lm, [], 2, config=CONFIG, feedback=lambda r, s: [])
    with pytest.raises(ValueError, match="feedback: None"):
        agent.run_episodes(lm, tasks, 2, config=CONFIG)
    with pytest.raises(ValueError, match="group_size"):
        agent.run_episodes(lm, tasks, 0, config=CONFIG, feedback=lambda r, s: [])
    with pytest.raises(ValueError, match="AgentConfig.max_turns"):
        agent.AgentConfig(max_turns=0)
    # A task folder without info/.
    copy = tmp_path / "iris_species"
    shutil.copytree(suite.suite_dir() / "iris_species", copy)
    shutil.rmtree(copy / "info")
    task = sandbox.load_task(copy)
    with pytest.raises(FileNotFoundError, match="no info/ folder"):
        agent.initial_messages(task, CONFIG)
    # A checkpoint folder without a chat template.
    folder = tmp_path / "no_template"
    shutil.copytree(lm.path, folder)
    for name in ("chat_template.jinja",):
        (folder / name).unlink(missing_ok=True)
    config = (folder / "tokenizer_config.json").read_text()
    (folder / "tokenizer_config.json").write_text(config.replace('"chat_template"', '"unused_template"'))
    with pytest.raises(ValueError, match="no chat_template"):
        chat.load_chat_model(folder)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        chat.load_chat_model(tmp_path / "missing")


def test_inventory_of_a_task_without_inventory_json_lists_files_and_columns(tmp_path):
    copy = tmp_path / "iris_species"
    shutil.copytree(suite.suite_dir() / "iris_species", copy)
    (copy / "info" / "inventory.json").unlink()
    text = agent.data_inventory(sandbox.load_task(copy), 4000)
    assert "train.csv:" in text and "columns: id," in text and "species" in text


def test_repr_is_short(lm, tasks):
    assert repr(lm).startswith("ChatModel(qwen3, vocab=") and len(repr(lm)) < 200
    e = agent.run_episodes(lm, tasks[:1], 1, config=dataclasses.replace(CONFIG, max_turns=1))[0]
    assert repr(e).startswith("Episode(task_index=0, tokens=") and len(repr(e)) < 200
