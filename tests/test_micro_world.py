"""The shipped micro-world: an HF checkpoint that loads everywhere, built reproducibly, from train tasks only,
and good enough to be a base model (runnable solutions on held-out tasks) and a world model (parseable answers).

References: transformers' `Qwen3_5ForCausalLM` (logits) and `apply_chat_template`
(prompt ids), the real sandbox (validity of sampled solutions), the build
log shipped beside the weights (a rebuild's first steps).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import sandbox
from sandbox import suite
from wmrl_jax import agent, chat, micro_world, world_model
from wmrl_jax.models import load_hf

SHIPPED = micro_world.shipped_path()
CONFIG = micro_world.MicroWorldConfig()
REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lm():
    return chat.load_chat_model(SHIPPED)


@pytest.fixture(scope="module")
def wm():
    return world_model.load(SHIPPED)


@pytest.fixture(scope="module")
def heldout():
    return [sandbox.load_task(p) for p in suite.list_tasks("test")]


def test_shipped_folder_is_a_small_complete_hf_checkpoint():
    """The agent's folder, and its world model's (`world_model/`, same architecture and tokenizer), < 30 MB."""
    names = {p.name for p in SHIPPED.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", micro_world.BUILD_LOG} <= names
    assert sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file()) < 30 << 20
    wm_folder = world_model.checkpoint_path(SHIPPED)
    assert wm_folder == SHIPPED / world_model.FOLDER
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in wm_folder.iterdir()}
    assert (wm_folder / "tokenizer.json").read_bytes() == (SHIPPED / "tokenizer.json").read_bytes()
    for folder in (SHIPPED, wm_folder):
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"].startswith("qwen3_5") and "full_attention" in config["layer_types"]
        assert "linear_attention" in config["layer_types"]
    assert json.loads((wm_folder / "config.json").read_text()) == json.loads((SHIPPED / "config.json").read_text())


@pytest.mark.parametrize("role", ["agent", "world model"])
def test_shipped_model_logits_equal_transformers(lm, heldout, role):
    import torch
    import transformers

    folder = SHIPPED if role == "agent" else world_model.checkpoint_path(SHIPPED)
    messages = (agent.initial_messages(heldout[0], CONFIG.agent) if role == "agent"
                else world_model.messages(heldout[0], "import os\nx = 1\n", CONFIG.world_model))
    ids = lm.prompt_ids(messages)[-160:]
    ours = np.asarray(load_hf(folder).logits(np.asarray([ids])))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)


def test_prompt_ids_equal_transformers_apply_chat_template(lm, heldout):
    for task in heldout:
        for messages in (agent.initial_messages(task, CONFIG.agent),
                         world_model.messages(task, "import os\nx = 1\n", CONFIG.world_model)):
            expected = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            assert lm.prompt_ids(messages) == list(expected["input_ids"])


def test_corpora_come_from_train_tasks_only():
    agent_eps, wm_eps = micro_world.corpora(CONFIG)
    train = {p.name for p in suite.list_tasks("train")}
    test_tasks = suite.list_tasks("test")
    assert {name for name, *_ in agent_eps + wm_eps} <= train
    texts = "\n".join(m["content"] for _, msgs, _ in agent_eps + wm_eps for m in msgs) + \
        "\n".join(reply for *_, reply in agent_eps + wm_eps)
    for path in test_tasks:
        assert path.name not in texts
    assert len(agent_eps) == sum(e["origin"] == "reference" and e["status"] == "valid"
                                 for e in suite.execution_log("train"))
    # The world model never trains on what its gate decides.
    assert all(not a.startswith(("STATUS: malformed", "STATUS: syntax_err")) for *_, a in wm_eps)


def test_normalised_solutions_behave_like_the_logged_ones():
    """The corpus's rewrite (choices moved to the top, generic TARGETS line, no comments) changes no outcome.

    One reference solution per train task (a scaled pipeline where there is one) and one failed run of
    each kind the world model trains on: the rewritten script, run again, gives the logged status and score.
    """
    log = suite.execution_log("train")
    picks = {}
    for e in log:   # one reference solution per task, a pipeline where there is one
        if e["origin"] == "reference" and (e["task"] not in picks or "make_pipeline(" in e["code"]):
            picks[e["task"]] = e
    failed = {}   # one failed run of each kind the world model trains on
    for e in log:
        if e["status"] in ("runtime_err", "ran_no_sub"):
            failed.setdefault(e["label"], e)
    failed = list(failed.values())
    rows = {row["name"]: row for row in suite.manifest()["tasks"]}
    tasks = {p.name: sandbox.load_task(p) for p in suite.list_tasks("train")}
    entries = list(picks.values()) + failed
    codes = [micro_world.normalise_solution(e["code"], rows[e["task"]]["targets"]) for e in entries]
    for e, code in zip(picks.values(), codes):
        assert micro_world.GENERIC_TARGETS in code and "Reference solution" not in code and "\n#" not in code
        lines = code.splitlines()
        model = next(i for i, line in enumerate(lines) if line.startswith("model = "))
        header = "\n".join(lines[:model])
        assert "DATA_DIR" not in header and all(i in header for i in micro_world.PIPELINE_IMPORTS)
        assert f"from sklearn import {', '.join(micro_world.SKLEARN_MODULES)}" in header
        # The estimator is named once, module-qualified, on the model line.
        assert re.search(r"(?<![\w.])(" + "|".join(micro_world.SKLEARN_MODULES) + r")\.\w+\(", lines[model])
        assert not re.search(r"^from sklearn\.(?!pipeline|preprocessing)", code, re.M)
    assert any('TARGETS = ["target"]' in c for c in codes), "a wrong target literal is kept, not made generic"
    with sandbox.SandboxPool(workers=2, timeout_s=120, cache=False) as pool:
        results = pool.map([(tasks[e["task"]], c) for e, c in zip(entries, codes)])
    for e, r in zip(entries, results):
        assert r.status == e["status"], (e["task"], e["label"], r.feedback)
        if e["status"] == "valid":
            assert r.raw_score == pytest.approx(e["raw_score"], rel=1e-9), e["task"]


def test_agent_replies_state_the_task_type_before_the_model():
    agent_eps, _ = micro_world.corpora(CONFIG)
    rows = {row["name"]: row for row in suite.manifest()["tasks"]}
    for name, messages, reply in agent_eps[::25]:
        category = rows[name]["category"]
        assert f"This is a {category} task." in messages[1]["content"]
        # the last words before the reply
        assert messages[1]["content"].endswith(f"\n\nTask type: {category}; metric: {rows[name]['metric']}.")
        plan = reply.splitlines()[0]
        assert plan.startswith(f"Plan: {category} task; fit "), plan
        model_call = next(line for line in reply.splitlines() if line.startswith("model = "))
        estimator = plan.split("; fit ", 1)[1].split("(", 1)[0]
        assert f"{estimator}(" in model_call, (plan, model_call)
        regressor = any(m in plan for m in ("Regressor(", "LinearRegression(", "Ridge(", "Lasso(", "ElasticNet("))
        assert regressor == category.endswith("regression"), plan


def test_rule_examples_teach_type_to_estimator_and_plan_to_code():
    """The rule corpus: every task type and metric of the suite's table, no task's data, plan == code
    (the estimator, and what `predict` returns for the metric, stated in the plan: a binary-probability metric
    once taught `predict = model.predict` under "submit the probability of class 1", issue #26)."""
    from sandbox.suite.metrics import METRICS

    rules = micro_world.rule_examples(400, seed=1)
    text = "\n".join(p + r for p, r, _ in rules)
    assert not any(spec.name in text or spec.title in text for spec in suite.TASKS)
    seen = set()
    for prompt, reply, kind in rules:
        category, metric = re.search(r"Task type: (.+); metric: (\w+)\.<\|im_end\|>", prompt).groups()
        seen.add(metric)
        plan, model_line, predict_line = reply.splitlines()[0], reply.splitlines()[-2], reply.splitlines()[-1]
        assert plan.startswith(f"Plan: {category} task; fit ") and kind == "rule"
        assert plan.endswith(f"submit {micro_world.SUBMIT[METRICS[metric].kind]}.")
        estimator = plan.split("; fit ", 1)[1].split("(", 1)[0]
        assert model_line.startswith("model = ") and f"{estimator}(" in model_line
        assert ("Classifier(" in model_line or "Regression(C" in model_line or "GaussianNB" in model_line
                or "LinearDiscriminantAnalysis" in model_line) == (category == "classification"), model_line
        # What `predict` returns follows the metric: one column of P(class 1), a column per class, or predict();
        # the plan line states that expression and the `predict` line repeats it.
        kind = METRICS[metric].kind
        assert predict_line == f"predict = lambda X: {micro_world.SUBMIT[kind]}"
        assert predict_line == {
            "proba": "predict = lambda X: pd.DataFrame({TARGETS[0]: model.predict_proba(X)[:, "
                     "list(model.classes_).index(1)]})",
            "classes": "predict = lambda X: pd.DataFrame(model.predict_proba(X), columns=[str(c) for c in "
                       "model.classes_])",
            "values": "predict = lambda X: pd.DataFrame(np.asarray(model.predict(X)).reshape(len(X), -1), "
                      "columns=TARGETS)",
        }.get(kind, "predict = lambda X: pd.DataFrame({TARGETS[0]: model.predict(X)})"), \
            (metric, predict_line)
    assert seen == set(METRICS)


def test_full_rule_examples_are_whole_programs_with_one_tail_for_every_metric():
    """The agent stage's rule examples (`agent_stage_full_rules`): the head as above, then the whole program in
    the corpus's form, closed as an agent episode. Every metric's program ends with the same submission lines:
    what the metric asks for is the `predict` line's alone (a tail per kind once led an agent from a binary
    log-loss `predict` line into the multi-class tail, issue #26)."""
    heads = micro_world.rule_examples(60, seed=3)
    full = micro_world.rule_examples(60, seed=3, full=True)
    tail = ("submission = predict(X_test)\n"
            'submission.insert(0, "id", test["id"].to_numpy())\n'
            'submission.to_csv(os.environ["SUBMISSION_PATH"], index=False)\n```<|im_end|>')
    for (prompt, head, _), (full_prompt, reply, kind) in zip(heads, full):
        assert full_prompt == prompt and kind == "rule" and reply.startswith(head)
        assert reply.endswith(tail), reply[-300:]
        assert reply.count("X_test)") == 1 and reply.count("\npredict = lambda X: pd.DataFrame(") == 1


@pytest.mark.slow   # ~3 min on 2 cores
def test_rebuild_reproduces_the_first_steps(tmp_path):
    """`python launch/build_micro_world.py` retraces the shipped build: same tokenizer, same first losses --
    here resuming a build interrupted after its first step, which left no checkpoint folder behind."""
    out = tmp_path / "rebuild"
    seed = json.loads((SHIPPED / micro_world.BUILD_LOG).read_text())["seed"]   # the seed the train-split check picked
    interrupt = textwrap.dedent(f"""
        import dataclasses
        from wmrl_jax import micro_world
        real_step = micro_world.make_train_step
        def interrupted_after_one_step(*args, **kwargs):
            step, calls = real_step(*args, **kwargs), []
            def once(*a):
                if calls:
                    raise KeyboardInterrupt("simulated interruption")
                calls.append(1)
                return step(*a)
            return once
        micro_world.make_train_step = interrupted_after_one_step
        try:
            micro_world.build({str(out)!r}, dataclasses.replace(micro_world.MicroWorldConfig(), seed={seed}),
                              steps=2, progress=False, save_every=1)
        except KeyboardInterrupt:
            print("interrupted")
        """)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # the build runs on one device
    first = subprocess.run([sys.executable, "-c", interrupt], cwd=REPO, env=env, check=True, capture_output=True,
                           text=True, timeout=900)
    assert first.stdout.strip().endswith("interrupted"), first.stdout
    assert not out.exists() and not out.with_name("rebuild.new").exists()     # nothing half-written
    assert (out.with_name("rebuild.partial") / "state.pkl").is_file()
    subprocess.run([sys.executable, "launch/build_micro_world.py", f"--out={out}", "--steps=2", f"--seed={seed}"],
                   cwd=REPO, env=env,
                   check=True, capture_output=True, timeout=900)
    assert (out / "tokenizer.json").read_bytes() == (SHIPPED / "tokenizer.json").read_bytes()
    assert not out.with_name("rebuild.partial").exists()
    shipped = json.loads((SHIPPED / micro_world.BUILD_LOG).read_text())
    rebuilt = json.loads((out / micro_world.BUILD_LOG).read_text())
    assert rebuilt["planned_steps"] == shipped["planned_steps"] and rebuilt["width"] == shipped["width"]
    for key in ("reply_nll", "prompt_nll", "rule_nll"):
        if rebuilt["cpu"] == shipped["cpu"]:
            assert rebuilt[key] == shipped[key][:2], key       # bit for bit on the machine that built it
        else:   # another CPU may pick other XLA kernels: equal to float32 rounding
            np.testing.assert_allclose(rebuilt[key], shipped[key][:2], rtol=1e-5, err_msg=f"{key} on {rebuilt['cpu']}")


@pytest.fixture(scope="module")
def held_out_samples(lm, heldout):
    """8 one-turn samples a held-out task at the shipped sampling settings (seed 0), run in the sandbox."""
    per_task = 8
    one_turn = dataclasses.replace(CONFIG.agent, max_turns=1)
    episodes = agent.run_episodes(lm, heldout, per_task, config=one_turn, seed=0)
    with sandbox.SandboxPool(workers=2, timeout_s=120, cache=False) as pool:
        results = pool.map([(heldout[e.task_index], e.solution or "") for e in episodes])
    valid = {t.name: [r.status for r in results[b * per_task:(b + 1) * per_task]].count("valid")
             for b, t in enumerate(heldout)}
    return per_task, episodes, results, valid


def test_sampled_solutions_on_held_out_tasks_run_valid_with_mixed_quality(held_out_samples):
    """The base model writes runnable code on tasks it never saw (>= 60 % valid on each held-out task), of
    mixed quality: the valid ones rank from the bottom to the top of the leaderboards.

    When this build shipped, 16 samples a task (`launch/wm_fidelity.py`, seed 0) ran valid 15, 13, 16 and
    16 times (star98_math, hastie_signal, two_moons_noisy, wide_linear_signal).
    """
    per_task, episodes, results, valid = held_out_samples
    assert all(v >= 0.6 * per_task for v in valid.values()), valid
    positions = [r.position_score for r in results if r.status == "valid"]
    assert max(positions) - min(positions) >= 0.5, positions
    models = {next((line for line in e.solution.splitlines() if line.startswith("model = ")), None)
              for e in episodes if e.solution}
    assert len(models) >= 8, models   # not one template: many estimators and settings


def test_world_model_answers_parse_on_held_out_logged_solutions(wm, heldout):
    log = [e for e in suite.execution_log("test") if world_model.gate(e["code"]) is None][::12]
    tasks = {t.name: t for t in heldout}
    preds = world_model.predict(wm, [tasks[e["task"]] for e in log], [e["code"] for e in log],
                                config=CONFIG.world_model, seed=0)
    graded = [p for p in preds if p.reward is not None]
    assert len(graded) >= 0.9 * len(preds), [p.raw_text for p in preds if p.reward is None][:3]


def test_padded_vocabulary_ids_are_masked_and_never_sampled():
    """The shipped embedding has 2112 rows for 2095 tokens; the 17 zero rows must never be sampled.

    Unmasked, a zero row's logit is 0, above the median real logit (~-2): at temperature 1 the padding
    took up to 3.6 % of a step's mass in the agent's own code. `load_chat_model` masks ids past the
    tokenizer (`token_count`); `load_hf` alone keeps transformers' logits (0 there).
    """
    from wmrl_jax import sampling
    from wmrl_jax.models import layers

    lm = chat.load_chat_model(micro_world.shipped_path())
    n, vocab = len(lm.tokenizer), lm.model.config.vocab_size
    assert lm.model.config.token_count == n and n < vocab == 2112, (n, vocab)
    ids = lm.prompt_ids([{"role": "user", "content": "Plan: regression task"}])
    masked = np.asarray(lm.model.logits(np.array([ids])))
    assert (masked[..., n:] == layers.PADDED_LOGIT).all() and masked[..., :n].max() > 0
    plain_model = load_hf(micro_world.shipped_path())
    plain = np.asarray(plain_model.logits(np.array([ids])))
    assert plain_model.config.token_count is None and (plain[..., n:] == 0).all()
    np.testing.assert_allclose(masked[..., :n], plain[..., :n], rtol=0, atol=1e-6)
    # A flattened distribution (temperature 4): without the mask padding ids come up in a few dozen draws.
    out = sampling.generate(lm.model, [ids] * 4, max_new_tokens=48, temperature=4.0, seed=0, pad_id=lm.pad_id)
    drawn = np.concatenate([np.asarray(t) for t in out.tokens])
    assert drawn.size == 4 * 48 and drawn.max() < n, drawn.max()
    unmasked = sampling.generate(plain_model, [ids] * 4, max_new_tokens=48,
                                 temperature=4.0, seed=0, pad_id=lm.pad_id)
    assert max(int(np.max(t)) for t in unmasked.tokens) >= n   # the check above can fail


def test_config_of_reads_the_prompt_format_a_checkpoint_was_built_with(tmp_path):
    shipped = json.loads((SHIPPED / micro_world.BUILD_LOG).read_text())[micro_world.PROMPT_FORMAT]
    assert micro_world.prompt_format(micro_world.config_of(SHIPPED)) == shipped
    (tmp_path / micro_world.BUILD_LOG).write_text(json.dumps({"steps": 248}))   # the first micro-world's log
    assert micro_world.prompt_format(micro_world.config_of(tmp_path)) == micro_world.FIRST_PROMPT_FORMAT
    recorded = {"listing": "comment", "inventory": "columns", "inventory_chars": 640}
    (tmp_path / micro_world.BUILD_LOG).write_text(json.dumps({micro_world.PROMPT_FORMAT: recorded}))
    config = micro_world.config_of(tmp_path)
    assert {k: getattr(config.world_model, k) for k in recorded} == recorded
    assert config.agent == micro_world.MicroWorldConfig().agent
    (tmp_path / micro_world.BUILD_LOG).write_text(json.dumps({micro_world.PROMPT_FORMAT: {"temperature": 0.1}}))
    with pytest.raises(ValueError, match="unknown world-model prompt fields"):
        micro_world.config_of(tmp_path)
    with pytest.raises(ValueError, match="listing"):
        (tmp_path / micro_world.BUILD_LOG).write_text(json.dumps({micro_world.PROMPT_FORMAT: {"listing": "x"}}))
        micro_world.config_of(tmp_path)


def test_outcome_marks_keep_failing_programs_prompts_out_of_the_loss():
    ids = np.arange(6, dtype=np.int32)
    is_reply = np.array([False, False, False, False, True, True])
    (_, valid_marks), (_, failing_marks) = micro_world.outcome_marks([(ids, is_reply)] * 2, ["outcome", "outcome_failing"])
    assert valid_marks.tolist() == [2, 2, 2, 2, 1, 1] and failing_marks.tolist() == [0, 0, 0, 0, 1, 1]
    tokens, valid, marks = micro_world._pad_rows([(ids, valid_marks), (ids[:3], failing_marks[3:])], 8, pad_id=0)
    assert marks.dtype == np.int8 and marks.tolist() == [[0, 0, 2, 2, 2, 2, 1, 1], [0] * 5 + [0, 1, 1]]
    assert valid.sum(axis=1).tolist() == [6, 3]


def test_world_model_stage_batches_pad_to_their_own_longest_row():
    rows = [(np.arange(n, dtype=np.int32), np.ones(n, np.int8)) for n in (100, 300, 600, 900)]
    got = list(micro_world.stage_batches(rows, batch_size=2, steps=6, pad_id=0, seed=3))
    again = list(micro_world.stage_batches(rows, batch_size=2, steps=6, pad_id=0, seed=3))
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(got, again))            # seeded
    for tokens, valid, marks in got:
        longest = valid.sum(axis=1).max()
        assert tokens.shape[1] == -(-longest // 64) * 64 and marks.dtype == np.int8
    # The rows and their order are `batches`' (the mixed schedule's outcome stream switched to this padding).
    full = micro_world.batches(rows, batch_size=2, steps=6, width=960, pad_id=0, seed=3)
    for (tokens, valid, _), (wide, wide_valid, _) in zip(got, full):
        assert np.array_equal(tokens, wide[:, -tokens.shape[1]:]) and not wide_valid[:, :-tokens.shape[1]].any()
    # Every row once an epoch: the first 2 batches of 2 hold each of the 4 rows.
    assert sorted(v.sum() for t, val, _ in got[:2] for v in val) == [100, 300, 600, 900]


@pytest.mark.parametrize("replay", ["none", "summed", "alternate"])
@pytest.mark.slow   # 1-2 min a variant
def test_world_model_stage_resumes_where_it_was_interrupted(replay):
    """An interruption inside the stage, then a rerun from the saved state: the same params as one run
    (with replay, summed into the outcome step's gradient or alternated with it, the replayed batches pick
    up where they were too).

    Reference: the stage's loss recomputed by hand (each episode's mean answer-token NLL from
    `token_logprobs`, averaged) equals what its step reports."""
    import jax
    import jax.numpy as jnp

    from wmrl_jax.logprobs import token_logprobs
    from wmrl_jax.models import qwen35

    config = dataclasses.replace(micro_world.MicroWorldConfig(hidden_size=32, intermediate_size=64, num_layers=2,
                                                              num_heads=2, num_kv_heads=1, head_dim=16),
                                 outcome_stage_steps=4, outcome_stage_batch_size=2, separate_world_model=False,
                                 agent_stage_steps=0, outcome_stage_alternate=replay == "alternate")
    model_config = config.model_config(64, eos_id=2, pad_id=0)
    params = qwen35.init_params(model_config, jax.random.key(0))
    rng = np.random.default_rng(0)
    outcomes = [(rng.integers(3, 64, n).astype(np.int32), np.r_[np.full(n - 4, 2), np.ones(4)].astype(np.int8))
                for n in (20, 30, 40)]
    saved = {}

    def save(p, opt_state, losses, step):
        saved[step] = (p, opt_state, {k: list(v) for k, v in losses.items()})

    episodes = [(rng.integers(3, 64, n).astype(np.int32), np.arange(n) >= n - 5) for n in (24, 28, 32)]

    def replayed():   # what `stage_replay` gives: (episode batch, rule batch) per step, seeded
        if replay == "none":
            return None
        return zip(micro_world.batches(episodes, batch_size=2, steps=4, width=32, pad_id=0, seed=1),
                   micro_world.batches(episodes, batch_size=1, steps=4, width=32, pad_id=0, seed=2))

    kwargs = dict(first=5, pad_id=0, save=save, save_every=1, progress=False)
    whole = micro_world._outcome_stage(config, model_config, outcomes, params, None, {}, done=0, replay=replayed(),
                                       **kwargs)
    p2, opt2, losses2 = saved[5 + 2]                       # as if interrupted after the stage's 2nd step
    resumed = micro_world._outcome_stage(config, model_config, outcomes, p2, opt2, losses2, done=5 + 2,
                                         replay=replayed(), **kwargs)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), whole, resumed)
    assert len(losses2["outcome_stage_nll"]) == 4 and max(saved) == 5 + 3    # none after the last step
    short = micro_world._outcome_stage(config, model_config, outcomes, params, None, {}, done=0, replay=replayed(),
                                       **{**kwargs, "save": lambda *a: None}, stop=2)   # a build cut short
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), short, p2)

    tokens, valid, marks = next(micro_world.stage_batches(outcomes, batch_size=2, steps=1, pad_id=0,
                                                          seed=config.seed + 3,
                                                          multiple=config.outcome_pad_multiple))
    logp, _ = token_logprobs(params, model_config, qwen35, jnp.asarray(tokens), jnp.asarray(valid))
    logp = np.asarray(logp)
    by_hand = np.mean([-logp[b][marks[b] == 1].mean() for b in range(2)])
    assert saved[5 + 1][2]["outcome_stage_nll"][0] == pytest.approx(by_hand, rel=1e-5)
    assert ("outcome_stage_reply_nll" in losses2) == (replay != "none")
    if replay != "none":
        assert len(losses2["outcome_stage_reply_nll"]) == 4
    if replay == "alternate":   # two updates a step are not one summed gradient; and alternation needs replay
        summed = micro_world._outcome_stage(dataclasses.replace(config, outcome_stage_alternate=False), model_config,
                                            outcomes, params, None, {}, done=0, replay=replayed(),
                                            **{**kwargs, "save": lambda *a: None})
        assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(summed),
                                                                                     jax.tree.leaves(whole)))
        with pytest.raises(ValueError, match="outcome_stage_alternate needs replayed episodes"):
            micro_world._outcome_stage(config, model_config, outcomes, params, None, {}, done=0, replay=None,
                                       **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(1800)   # five small builds: ~8 min on 2 idle cores, 15+ beside other work
def test_separate_world_model_build_ships_two_folders_and_resumes_in_either_stage(tmp_path, monkeypatch):
    """separate_world_model: the agent in the folder, the world model in its world_model/ folder, each loadable;
    interrupted inside the world-model stage or the agent's stage, a rerun ends with the same weights."""
    from safetensors.numpy import load_file

    config = micro_world.MicroWorldConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=16, epochs=0.01, warmup_steps=1, outcome_batch_size=2, outcome_stage_steps=3,
        outcome_stage_batch_size=2, outcome_stage_replay=0, outcome_stage_alternate=False,
        separate_world_model=True, agent_stage_steps=3, agent_stage_batch_size=2)
    whole = micro_world.build(tmp_path / "whole", config, progress=False, save_every=1)
    mixed = whole["steps"]
    assert (whole["outcome_stage_steps"], whole["agent_stage_steps"], len(whole["agent_stage_reply_nll"])) == (3, 3, 3)
    assert whole["world_model_folder"] == world_model.FOLDER
    agent_lm = chat.load_chat_model(tmp_path / "whole")
    wm_lm = world_model.load(tmp_path / "whole", base=agent_lm)
    assert wm_lm is not agent_lm and wm_lm.path == tmp_path / "whole" / world_model.FOLDER
    assert (tmp_path / "whole" / "tokenizer.json").read_bytes() == (wm_lm.path / "tokenizer.json").read_bytes()

    def interrupted(stage: str, after: int):
        """A build that stops (KeyboardInterrupt) after `after` updates of `stage`, then a rerun."""
        name = "make_outcome_step" if stage == "world model" else "make_train_step"
        real = getattr(micro_world, name)
        calls = []

        def counting(*args, **kwargs):
            step = real(*args, **kwargs)
            stage_of_this = stage == "world model" or len(calls) > 0   # the agent stage's is the 2nd train step
            calls.append(None)

            def once(*a):
                if stage_of_this and len(counted) >= after:
                    raise KeyboardInterrupt
                if stage_of_this:
                    counted.append(None)
                return step(*a)
            return once

        counted = []
        out = tmp_path / stage.replace(" ", "_")
        with monkeypatch.context() as m:
            m.setattr(micro_world, name, counting)
            with pytest.raises(KeyboardInterrupt):
                micro_world.build(out, config, progress=False, save_every=1)
        assert not out.exists() and (out.with_name(out.name + ".partial") / "state.pkl").is_file()
        log = micro_world.build(out, config, progress=False, save_every=1)
        return out, log

    for stage, after in (("world model", 2), ("agent", 1)):
        out, log = interrupted(stage, after)
        for folder in ("", world_model.FOLDER):
            mine, ref = load_file(out / folder / "model.safetensors"), load_file(tmp_path / "whole" / folder /
                                                                                 "model.safetensors")
            assert mine.keys() == ref.keys() and all(np.array_equal(mine[k], ref[k]) for k in ref), (stage, folder)
        assert log["outcome_stage_nll"] == whole["outcome_stage_nll"] and log["steps"] == mixed
    with pytest.raises(ValueError, match="separate_world_model"):
        dataclasses.replace(config, outcome_stage_replay=4)
    with pytest.raises(ValueError, match="agent_stage_steps"):
        dataclasses.replace(config, separate_world_model=False, agent_stage_steps=3)


def test_world_model_stage_loss_can_leave_the_answers_opening_out():
    """skip=2: the answers' first two tokens (``STATUS:``) carry no loss; by hand from `token_logprobs`."""
    import jax
    import jax.numpy as jnp
    import optax

    from wmrl_jax.logprobs import token_logprobs
    from wmrl_jax.models import qwen35

    config = micro_world.MicroWorldConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                                          num_kv_heads=1, head_dim=16)
    model_config = config.model_config(64, eos_id=2, pad_id=0)
    params = qwen35.init_params(model_config, jax.random.key(1))
    rng = np.random.default_rng(1)
    rows = [(rng.integers(3, 64, n).astype(np.int32), np.r_[np.full(n - 6, 2), np.ones(6)].astype(np.int8))
            for n in (20, 26)]
    tokens, valid, marks = micro_world._pad_rows(rows, 32, pad_id=0)
    logp = np.asarray(token_logprobs(params, model_config, qwen35, jnp.asarray(tokens), jnp.asarray(valid))[0])
    for skip in (0, 2):
        step = micro_world.make_outcome_step(model_config, optax.sgd(0.0), skip)
        _, _, loss = step(params, optax.sgd(0.0).init(params), tokens, valid, marks)
        by_hand = np.mean([-logp[b][marks[b] == 1][skip:].mean() for b in range(2)])
        assert float(loss) == pytest.approx(by_hand, rel=1e-5), skip


def test_build_script_sets_config_fields_from_the_command_line(launch_script):
    """`build_micro_world.py --set=FIELD=VALUE`: top-level and nested fields, typed; bad settings name the problem."""
    build = launch_script("build_micro_world")
    config = build.config_from_flags(["outcome_stage_steps=200", "outcome_stage_alternate=true",
                                      "outcome_stage_learning_rate=5e-4", "world_model.listing=comment",
                                      "world_model.inventory=columns", "separate_world_model=false",
                                      "agent_stage_steps=0", "outcome_stage_replay=4"], seed=2)
    default = micro_world.MicroWorldConfig()
    assert (config.outcome_stage_steps, config.outcome_stage_alternate, config.outcome_stage_learning_rate) == (
        200, True, 5e-4)
    assert (config.world_model.listing, config.world_model.inventory, config.seed) == ("comment", "columns", 2)
    assert config.world_model.code_chars == default.world_model.code_chars and config.agent == default.agent
    assert build.config_from_flags([], seed=0) == default
    for setting, message in [("no_such_field=1", "expected FIELD=VALUE"), ("outcome_stage_steps", "FIELD=VALUE"),
                             ("outcome_stage_steps=2.5", "not a valid int"),
                             ("outcome_stage_alternate=maybe", "not a valid bool"),
                             ("seed=3", "--seed"), ("agent=1", "expected FIELD=VALUE"),
                             ("world_model.listing=zigzag", "WorldModelConfig.listing"),
                             ("outcome_stage_replay=4", "separate_world_model")]:
        with pytest.raises(ValueError, match=message):
            build.config_from_flags([setting], seed=0)


def test_outcome_step_projects_the_answer_tail_only_with_the_same_loss_and_update():
    """`make_outcome_step(tail=answer_tail(...))` (the vocabulary projection on the answers' positions only)
    gives the loss and update of the full projection (`token_logprobs` over every position)."""
    import jax
    import optax

    from wmrl_jax.models import qwen35

    config = micro_world.MicroWorldConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                                          num_kv_heads=1, head_dim=16)
    model_config = config.model_config(64, eos_id=2, pad_id=0)
    params = qwen35.init_params(model_config, jax.random.key(0))
    rng = np.random.default_rng(0)
    outcomes = [(rng.integers(3, 64, n).astype(np.int32), np.r_[np.full(n - a, 2), np.ones(a)].astype(np.int8))
                for n, a in ((40, 5), (52, 9), (33, 3))]
    assert micro_world.answer_tail(outcomes) == 16 and micro_world.answer_tail(outcomes, multiple=1) == 9
    batch = next(micro_world.stage_batches(outcomes, batch_size=3, steps=1, pad_id=0, seed=0, multiple=64))
    optimizer = optax.sgd(1.0)   # the update is minus the gradient (Adam would magnify float noise in ~0 entries)
    results = [micro_world.make_outcome_step(model_config, optimizer, skip=2, tail=tail)(
        params, optimizer.init(params), *batch) for tail in (None, micro_world.answer_tail(outcomes))]
    (full_params, _, full_loss), (tail_params, _, tail_loss) = results
    assert float(tail_loss) == pytest.approx(float(full_loss), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
                 full_params, tail_params)


@pytest.mark.slow   # ~1-3 min: it renders the whole outcome corpus before taking 64 episodes of it
def test_bench_micro_world_step_quick_runs_and_agrees(launch_script):
    """launch/bench_micro_world_step.py --quick end to end (not timed: figures come from the script itself):
    both steps run on both sides, and the same rows give the same outcome loss however they are padded."""
    results = launch_script("bench_micro_world_step").main(["--quick"])
    assert len(results) == 2
    for peer_s, our_s, peer_loss, our_loss in results.values():
        assert peer_s > 0 and our_s > 0 and our_loss == pytest.approx(peer_loss, rel=1e-5)


def test_renamed_columns_reach_the_world_models_prompt_and_nothing_else_changes(tmp_path):
    """The train-split check's renamed probe: new names in the inventory, the target line and the code's string
    literals; identifiers, `id`, misspelt names and the task text untouched."""
    task = sandbox.load_task(suite.suite_dir() / "iris_species")
    renaming = micro_world.column_renaming(task)
    assert "id" not in renaming and len(set(renaming.values())) == len(renaming)
    assert renaming["species"].startswith(micro_world.RENAMED_PREFIX)
    fit = {"fit": "var9", "species": renaming["species"]}   # a column named like a method must not rename it
    code = 'y = train["species"]\nmodel.fit(X, y)\nX = train.drop(columns=["id", "Species", \'fit\'])\n'
    assert micro_world.renamed_code(code, fit) == (f'y = train["{renaming["species"]}"]\nmodel.fit(X, y)\n'
                                                    f'X = train.drop(columns=["id", "Species", \'var9\'])\n')

    view = micro_world.renamed_task(task, renaming, tmp_path / "view")
    config = micro_world.MicroWorldConfig().world_model
    before = world_model.messages(task, code, config)[-1]["content"]
    after = world_model.messages(view, micro_world.renamed_code(code, renaming), config)[-1]["content"]
    data_before, data_after = (text.split("# Data\n")[1].split("# Solution")[0] for text in (before, after))
    assert f"[{renaming['species']!r}]" in data_after and "['species']" in data_before
    for old, new in renaming.items():
        assert re.search(rf"\b{re.escape(old)}\b", data_after) is None, f"{old} left in the renamed inventory"
        assert new in data_after
    assert before.split("# Data\n")[0] == after.split("# Data\n")[0]   # the task text is the task's


def test_the_seed_pick_takes_the_weaker_of_the_two_world_model_rankings():
    # Seed 1 of recipe v3: 0.79 on train programs as they are, 0.45 with the columns renamed (held-out: every
    # valid program called a runtime error); seed 0: 0.60 and 0.61.
    checks = {0: {"agent_valid_rate": 1.0, "world_model_spearman": 0.60, "world_model_spearman_renamed": 0.61},
              1: {"agent_valid_rate": 1.0, "world_model_spearman": 0.79, "world_model_spearman_renamed": 0.45},
              2: {"agent_valid_rate": 0.9, "world_model_spearman": 0.90, "world_model_spearman_renamed": 0.90}}
    assert max(checks, key=lambda s: micro_world.pick_key(checks[s])) == 0


def test_made_up_names_rename_the_data_columns_one_to_one_and_keep_misspellings_misspelt():
    tasks = {p.name: sandbox.load_task(p) for p in suite.list_tasks("train")}
    for i, (name, task) in enumerate(sorted(tasks.items())):
        data = set(agent._csv_header(pathlib.Path(task.public_dir) / "train.csv")) | set(
            agent._csv_header(pathlib.Path(task.public_dir) / "test.csv"))
        avoid = {"time", "score", "petal_lenght_cm"}
        renaming = micro_world.made_up_names(task, np.random.default_rng([0, i]), avoid=avoid)
        assert set(renaming) == data - {"id"}, name                  # the data's columns, nothing else
        new = list(renaming.values())
        assert len(set(new)) == len(new) and not set(new) & (data | avoid), name
        assert renaming == micro_world.made_up_names(task, np.random.default_rng([0, i]), avoid=avoid)
    # wine_cultivar's submission columns c0, c1, c2 are class values of its target: they stay (renamed, a correct
    # program's submission would miss them)
    assert not {"c0", "c1", "c2"} & set(micro_world.column_renaming(tasks["wine_cultivar"]))
    code = 'X = train.drop(columns=["petal_lenght_cm"])\ny = train["species"]\n'
    renaming = micro_world.made_up_names(tasks["iris_species"], np.random.default_rng(3),
                                         avoid=micro_world._literals([code]))
    assert micro_world.renamed_code(code, renaming) == (f'X = train.drop(columns=["petal_lenght_cm"])\n'
                                                         f'y = train["{renaming["species"]}"]\n')


def test_renamed_outcome_copies_keep_the_answer_and_change_only_the_names():
    plain = micro_world.outcome_examples(CONFIG)
    copies = micro_world.renamed_outcome_examples(CONFIG, 1.0, seed=6)
    assert len(copies) == len(plain)
    assert [(reply, kind) for _, reply, kind in copies] == [(reply, kind) for _, reply, kind in plain]
    changed = 0
    for (before, _, _), (after, _, _) in zip(plain, copies):
        assert before.split("# Data\n")[0] == after.split("# Data\n")[0]     # the system prompt and the task text
        changed += before != after
    assert changed == len(plain)          # every inventory names columns
    quarter = micro_world.renamed_outcome_examples(CONFIG, 0.25, seed=6)
    assert len(quarter) == round(0.25 * len(plain)) and set(quarter) < set(copies)   # a subset, the same names
    assert micro_world.renamed_outcome_examples(CONFIG, 0.25, seed=6) == quarter
    with pytest.raises(ValueError, match="outcome_stage_renamed"):
        dataclasses.replace(CONFIG, outcome_stage_renamed=2.0)


def test_renamed_programs_run_on_renamed_data_as_they_ran_on_the_task():
    """The premise of the renamed copies' labels, checked by execution: a program and its renamed copy on a
    renamed copy of the task (every CSV header, the metric's columns) end with the same status and score."""
    check = micro_world.renaming_invariance(8, seed=1, progress=False)
    assert check["programs"] == 8 and check["valid_pairs"] >= 1
    assert (check["same_status"], check["same_reward"]) == (1.0, 1.0), check["different"]


@pytest.mark.slow   # two small builds, ~2 min
def test_renamed_stage_copies_train_the_world_model_and_leave_the_agent_as_it_was(tmp_path):
    config = micro_world.MicroWorldConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=16, epochs=0.01, warmup_steps=1, outcome_batch_size=2, outcome_stage_steps=3,
        outcome_stage_batch_size=2, agent_stage_steps=2, agent_stage_batch_size=2)
    from safetensors.numpy import load_file

    plain = micro_world.build(tmp_path / "plain", config, progress=False)
    renamed = micro_world.build(tmp_path / "renamed", dataclasses.replace(config, outcome_stage_renamed=1.0),
                                progress=False)
    assert renamed["examples"]["outcome_renamed"] == renamed["examples"]["outcome"] == plain["examples"]["outcome"]
    assert "outcome_renamed" not in plain["examples"]
    assert renamed["outcome_stage_nll"] != plain["outcome_stage_nll"]
    weights = {name: load_file(tmp_path / name / "model.safetensors") for name in ("plain", "renamed")}
    assert all(np.array_equal(weights["plain"][k], weights["renamed"][k]) for k in weights["plain"])   # the agent
    world = {name: load_file(tmp_path / name / world_model.FOLDER / "model.safetensors") for name in ("plain", "renamed")}
    assert not all(np.array_equal(world["plain"][k], world["renamed"][k]) for k in world["plain"])
