"""The jitted GRPO update (`wmrl_jax.train.update`) against independent references.

* the loss and gradient against a hand-written full-batch computation: full
  f32 [B, T, V] logits (tiny V), log-softmax, the GRPO formula written out
  (ratio 1, k3 KL, entropy bonus, token mean), plain `jax.value_and_grad`;
  the step runs with layer remat (the default, "full"), the reference without: remat on == off;
* micro_batches 2 and 4 (remat off, and "dots") against 1;
* 8 simulated devices (data 2 × fsdp 2 × tensor 2) against 1 device;
* masked tokens, padding and weight-0 rollouts perturbed: gradient unchanged;
* the frozen reference is never changed nor donated;
* short reprs; errors that name the field.

The step's gradient is read through `capture_grads`, an "optimizer" whose
state is the last gradient it was given (and whose update is 0), so the
gradient is compared exactly, not through an Adam step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from wmrl_jax.models import init, make_mesh, qwen3, qwen35
from wmrl_jax.models.layers import positions_from_valid
from wmrl_jax.models.sharding import tree_shardings
from wmrl_jax.models.family import REMAT_POLICIES
from wmrl_jax.train import config as train_config
from wmrl_jax.train import update

B, T, VOCAB = 8, 16, 96
TEMPERATURE, KL, ENT, CLIP = 0.8, 0.04, 0.002, 0.2
CONFIGS = {
    "qwen3": qwen3.Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8),
    "qwen35": qwen35.Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
                            head_dim=8, layer_types=(qwen35.LINEAR, qwen35.FULL), linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, chunk_size=8),
}


def capture_grads() -> optax.GradientTransformation:
    """State = the gradient of the last update; updates = 0 (params stay put)."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def adamw(lr=1e-2):
    return update.make_optimizer(ml_collections.ConfigDict(dict(
        learning_rate=lr, warmup_steps=1, total_steps=10, weight_decay=0.01, b1=0.9, b2=0.999, grad_clip=1.0)))


def make_batch(seed=0) -> update.Batch:
    """Left-padded rows: prompt, then a reply (loss tokens), then 2 trailing non-loss tokens; row 5 weight 0."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, 5, size=(B, 1))
    pos = np.arange(T)[None, :]
    valid = pos >= start
    tokens = np.where(valid, rng.integers(3, VOCAB, size=(B, T)), 0).astype(np.int32)
    loss_mask = (pos >= start + 4) & (pos < T - 2)
    loss_mask[:, 9] = False                                       # a hole inside the reply (an observation)
    weights = np.ones(B, np.float32)
    weights[5] = 0.0
    advantages = rng.normal(size=B).astype(np.float32)
    advantages[5] = 3.0   # an ungraded rollout's advantage must not matter however large
    return update.Batch(tokens=tokens, valid=valid, loss_mask=loss_mask, advantages=advantages, weights=weights)


def reference_loss(params, ref_params, config, family, batch: update.Batch):
    """The GRPO loss written out over the full batch: full logits, no chunks, no scan, no grpo_loss."""

    def logp_entropy(p):
        hidden, _ = family.forward(p, config, batch.tokens, positions_from_valid(batch.valid), batch.valid)
        logits = family.unembed(p, config, hidden).astype(jnp.float32) / TEMPERATURE
        logp_btv = jax.nn.log_softmax(logits)
        logp = jnp.take_along_axis(logp_btv[:, :-1], batch.tokens[:, 1:, None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)[:, :-1]
        return jnp.pad(logp, ((0, 0), (1, 0))), jnp.pad(entropy, ((0, 0), (1, 0)))

    m = (batch.loss_mask & (batch.weights > 0)[:, None]).astype(jnp.float32)
    logp, entropy = logp_entropy(params)
    ref_logp = jax.lax.stop_gradient(logp_entropy(ref_params)[0])
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))             # 1, with gradient 1 w.r.t. logp
    d = ref_logp - logp
    per_token = -batch.advantages[:, None] * ratio + KL * (jnp.exp(d) - d - 1) - ENT * entropy
    return jnp.sum(m * per_token) / jnp.sum(m)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def setup(request):
    config = CONFIGS[request.param]
    model = init(config, jax.random.key(1))
    ref = init(config, jax.random.key(2)).params   # differs from the policy: the KL term is not 0
    batch = jax.tree.map(jnp.asarray, make_batch())
    loss, grads = jax.jit(jax.value_and_grad(reference_loss), static_argnums=(2, 3))(
        model.params, ref, config, model.family, batch)
    return dict(name=request.param, config=config, model=model, ref=ref, batch=batch, loss=loss, grads=grads,
                steps={})


def grad_step(setup, micro_batches, remat=True):
    """A capture_grads step (compiled once per setting and reused)."""
    key = (micro_batches, remat)
    if key not in setup["steps"]:
        setup["steps"][key] = update.make_train_step(
            setup["model"].family, setup["config"], capture_grads(), kl_coef=KL, entropy_coef=ENT, clip_eps=CLIP,
            micro_batches=micro_batches, remat=remat, temperature=TEMPERATURE)
    return setup["steps"][key]


def grads_and_metrics(setup, micro_batches=1, batch=None, remat=True):
    params = jax.tree.map(jnp.copy, setup["model"].params)
    state = update.init_train_state(params, capture_grads())
    new, metrics = grad_step(setup, micro_batches, remat)(state, setup["ref"], batch or make_batch())
    return new.opt_state, jax.device_get(metrics)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-7):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


def test_loss_and_gradient_match_hand_written_full_batch(setup):
    """Layer remat on (the step's default) against plain autodiff of the forward without remat."""
    grads, metrics = grads_and_metrics(setup)
    np.testing.assert_allclose(metrics["loss"], setup["loss"], rtol=1e-5)
    assert_trees_close(grads, setup["grads"])
    batch = make_batch()
    expected_tokens = (batch.loss_mask & (batch.weights > 0)[:, None]).sum()
    assert metrics["tokens"] == expected_tokens and metrics["sequences"] == B - 1
    assert metrics["clip_frac"] == 0.0   # on-policy: the ratio is exactly 1
    assert metrics["kl"] > 0 and metrics["entropy"] > 0 and metrics["grad_norm"] > 0
    assert np.isnan(metrics["learning_rate"])   # capture_grads has no learning rate


@pytest.mark.parametrize("micro_batches, remat", [(2, False), (4, "dots")])
def test_micro_batches_equal_one_batch(setup, micro_batches, remat):
    grads, metrics = grads_and_metrics(setup, micro_batches, remat=remat)
    one_grads, one_metrics = grads_and_metrics(setup, 1)
    assert_trees_close(grads, one_grads)
    for key in ("loss", "pg_loss", "kl", "entropy", "tokens", "sequences"):
        np.testing.assert_allclose(metrics[key], one_metrics[key], rtol=1e-5, err_msg=key)


def test_masked_tokens_padding_and_unweighted_rows_get_no_gradient(setup):
    base = make_batch()
    rng = np.random.default_rng(7)
    tokens = base.tokens.copy()
    noise = rng.integers(3, VOCAB, size=tokens.shape).astype(np.int32)
    tokens[:, -2:] = noise[:, -2:]                   # trailing non-loss tokens (nothing after them reads them)
    tokens[~base.valid] = noise[~base.valid]         # padding
    tokens[5] = noise[5]                              # the weight-0 rollout, all of it
    advantages = base.advantages.copy()
    advantages[5] = -50.0
    perturbed = update.Batch(tokens=tokens, valid=base.valid, loss_mask=base.loss_mask, advantages=advantages,
                             weights=base.weights)
    grads, metrics = grads_and_metrics(setup, batch=perturbed)
    assert_trees_close(grads, setup["grads"])
    np.testing.assert_allclose(metrics["loss"], setup["loss"], rtol=1e-5)
    # The check can fail: the same change on a loss token moves the gradient.
    tokens = base.tokens.copy()
    tokens[0, T - 3] = (tokens[0, T - 3] + 1) % VOCAB
    moved, _ = grads_and_metrics(setup, batch=update.Batch(tokens, base.valid, base.loss_mask, base.advantages,
                                                          base.weights))
    assert not np.allclose(moved["embed_vd"], np.asarray(setup["grads"]["embed_vd"]), rtol=1e-5, atol=1e-7)


def test_reference_params_frozen_and_not_donated(setup):
    ref = setup["ref"]
    before = jax.tree.map(np.array, ref)
    step = update.make_train_step(setup["model"].family, setup["config"], adamw(), kl_coef=KL, entropy_coef=ENT,
                                  clip_eps=CLIP, temperature=TEMPERATURE)
    # The real setup: the policy starts AS the reference (a copy), so the first KL is 0.
    state = update.init_train_state(jax.tree.map(jnp.copy, ref), adamw())
    kls = []
    for _ in range(2):
        state, metrics = step(state, ref, make_batch())
        kls.append(float(metrics["kl"]))
    assert int(state.step) == 2
    assert all(not x.is_deleted() for x in jax.tree.leaves(ref))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, ref), before)
    assert kls[0] == 0.0 and kls[1] > 0.0   # the policy moved away from a reference that did not move
    assert float(metrics["learning_rate"]) == pytest.approx(1e-2)


def test_mesh_of_8_devices_equals_one_device(setup):
    """data 2 × fsdp 2 × tensor 2, two micro-batches: params after 2 AdamW steps equal the 1-device run."""
    family, config = setup["model"].family, setup["config"]
    kw = dict(kl_coef=KL, entropy_coef=ENT, clip_eps=CLIP, micro_batches=2, temperature=TEMPERATURE)
    mesh = make_mesh((2, 2, 2))
    axes = family.param_axes(config)
    results = []
    for m in (None, mesh):
        state = update.init_train_state(jax.tree.map(jnp.copy, setup["model"].params), adamw(), mesh=m,
                                        param_axes=None if m is None else axes)
        ref = setup["ref"] if m is None else jax.device_put(setup["ref"], tree_shardings(m, axes, setup["ref"]))
        step = update.make_train_step(family, config, adamw(), mesh=m, **kw)
        for seed in (0, 1):
            state, metrics = step(state, ref, make_batch(seed))
        results.append((state, jax.device_get(metrics)))
    (single, m1), (sharded, m8) = results
    # Adam divides by sqrt(v): a weight whose gradient is ~0 moves by up to lr either way on rounding
    # noise, so params are compared to 3e-3 of one lr-sized (1e-2) step.
    assert_trees_close(sharded.params, single.params, rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)
    # The layout is the rules' and survives the donated step: embed over fsdp, vocab over tensor; Adam's mu likewise.
    spec = sharded.params["embed_vd"].sharding.spec
    assert tuple(spec) == ("tensor", "fsdp"), spec
    mu = optax.tree_utils.tree_get(sharded.opt_state, "mu")
    assert mu["embed_vd"].sharding.spec == spec


def test_reprs_are_short():
    state = update.init_train_state(init(CONFIGS["qwen3"], jax.random.key(0)).params, adamw())
    text = repr(state)
    assert text.startswith("TrainState(step=0, params=14 arrays") and len(text) < 160, text
    text = repr(make_batch())
    assert "tokens=int32[8, 16]" in text and "7/8 rollouts weighted" in text and len(text) < 250, text


def test_bad_input_names_the_field():
    config = CONFIGS["qwen3"]
    family = init(config, jax.random.key(0)).family
    state = None   # never reached: the batch is checked first
    mk = dict(kl_coef=KL, entropy_coef=ENT, clip_eps=CLIP)
    step = update.make_train_step(family, config, adamw(), micro_batches=3, **mk)
    with pytest.raises(ValueError, match=r"batch.tokens: B=8 .*micro_batches=3"):
        step(state, None, make_batch())
    step = update.make_train_step(family, config, adamw(), micro_batches=4, mesh=make_mesh((2, 2, 2)), **mk)
    with pytest.raises(ValueError, match=r"data×fsdp size 4"):
        step(state, None, make_batch())
    good = make_batch()
    step = update.make_train_step(family, config, adamw(), **mk)
    for field, value, pattern in (
        ("loss_mask", good.loss_mask[:, :-1], r"batch.loss_mask: shape \(8, 15\), expected \(8, 16\)"),
        ("advantages", good.advantages[:4], r"batch.advantages: shape \(4,\), expected \(8,\)"),
        ("weights", good.weights[:, None], r"batch.weights: shape \(8, 1\)"),
        ("tokens", good.tokens[0], r"batch.tokens: shape \(16,\), expected int32\[B, T\]"),
    ):
        bad = update.Batch(**{**good.__dict__, field: value})
        with pytest.raises(ValueError, match=pattern):
            step(state, None, bad)
    with pytest.raises(TypeError, match=r"batch.valid: dtype int64, expected bool"):
        step(state, None, update.Batch(**{**good.__dict__, "valid": good.valid.astype(np.int64)}))
    with pytest.raises(ValueError, match="micro_batches: 0"):
        update.make_train_step(family, config, adamw(), micro_batches=0, **mk)
    with pytest.raises(ValueError, match=r"remat: 'layers', expected True, False, 'none' or one of \['dots', 'full'\]"):
        update.make_train_step(family, config, adamw(), remat="layers", **mk)
    # config.validate names the same policies (it imports no jax).
    assert train_config.REMAT_POLICIES == tuple(sorted(REMAT_POLICIES)) == ("dots", "full")
    with pytest.raises(ValueError, match="optim.grad_clip"):
        update.make_optimizer(ml_collections.ConfigDict(dict(
            learning_rate=1e-6, warmup_steps=0, total_steps=1, weight_decay=0.0, b1=0.9, b2=0.999, grad_clip=0.0)))


def test_float32_masters_move_where_bfloat16_weights_cannot():
    """At the paper's lr 1e-6 an Adam step rounds away in bf16 weights; float32 masters (bf16 compute) take it."""
    config = CONFIGS["qwen3"]
    model = init(config, jax.random.key(1), dtype="bfloat16")
    moved = {}
    for param_dtype, compute_dtype in ((None, None), ("float32", "bfloat16")):
        state = update.init_train_state(jax.tree.map(jnp.copy, model.params), adamw(lr=1e-6), param_dtype=param_dtype)
        step = update.make_train_step(model.family, config, adamw(lr=1e-6), kl_coef=KL, entropy_coef=ENT,
                                      clip_eps=CLIP, temperature=TEMPERATURE, compute_dtype=compute_dtype)
        new, metrics = step(state, model.params, make_batch())
        assert np.isfinite(metrics["loss"]) and new.params["embed_vd"].dtype == (param_dtype or jnp.bfloat16)
        before = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(model.params)])
        after = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(new.params)])
        moved[param_dtype] = np.mean(before != after)
    assert moved[None] < 0.05 and moved["float32"] > 0.9, moved


def grouped_episodes(seed=0, groups=4, k=2):
    """B = G·K episodes, K a group sharing its prompt (3..6 tokens); replies with a non-loss hole; row 5 weight 0."""
    from wmrl_jax import agent

    rng = np.random.default_rng(seed)
    episodes = []
    for g in range(groups):
        prompt = rng.integers(3, VOCAB, size=rng.integers(3, 7)).astype(np.int32)
        for _ in range(k):
            reply = rng.integers(3, VOCAB, size=rng.integers(2, 9)).astype(np.int32)
            mask = np.r_[np.zeros(len(prompt), bool), np.ones(len(reply), bool)]
            if len(reply) > 4:
                mask[len(prompt) + 2] = False          # an observation token inside the continuation
            episodes.append(agent.Episode(task_index=g, tokens=np.r_[prompt, reply], loss_mask=mask,
                                          logprobs=np.zeros(len(mask), np.float32), prompt_len=len(prompt),
                                          replies=[""], solution=None, observations=[], truncated=[False]))
    advantages = rng.normal(size=groups * k).astype(np.float32)
    weights = np.ones(groups * k, np.float32)
    weights[5] = 0.0
    return episodes, advantages, weights


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_shared_prompts_give_the_whole_rows_gradient(setup, micro_batches):
    """`optim.share_prompt`: each group's prompt runs once (`loop.make_batch(prompt_width=)`), the same loss,
    metrics and gradient as the rows written out whole; micro-batches hold whole groups."""
    from wmrl_jax.train.loop import make_batch as loop_batch

    episodes, advantages, weights = grouped_episodes()
    whole = loop_batch(episodes, advantages, weights, width=T, pad_id=0)
    shared = loop_batch(episodes, advantages, weights, width=9, pad_id=0, prompt_width=8, group_size=2)
    assert shared.prompt_tokens.shape == (4, 8) and shared.tokens.shape == (B, 9) and shared.group_size == 2
    assert "real tokens" in repr(shared) and int(whole.valid.sum()) == int(
        shared.valid.sum() + 2 * shared.prompt_valid.sum())
    grads, metrics = grads_and_metrics(setup, micro_batches, batch=shared)
    ref_grads, ref_metrics = grads_and_metrics(setup, 1, batch=whole)
    assert_trees_close(grads, ref_grads, rtol=2e-5, atol=2e-7)
    for key in ("loss", "pg_loss", "kl", "entropy", "tokens", "sequences"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=2e-5, err_msg=key)
    assert metrics["tokens"] == sum(int(e.loss_mask.sum()) for i, e in enumerate(episodes) if i != 5)


def test_shared_prompts_on_a_mesh_of_8_devices(setup):
    """data 2 × fsdp 2 × tensor 2: 4 groups, one per data shard; params after an AdamW step equal 1 device."""
    from wmrl_jax.train.loop import make_batch as loop_batch

    family, config = setup["model"].family, setup["config"]
    batch = loop_batch(*grouped_episodes(1), width=9, pad_id=0, prompt_width=8, group_size=2)
    mesh, axes = make_mesh((2, 2, 2)), family.param_axes(config)
    results = []
    for m in (None, mesh):
        state = update.init_train_state(jax.tree.map(jnp.copy, setup["model"].params), adamw(), mesh=m,
                                        param_axes=None if m is None else axes)
        ref = setup["ref"] if m is None else jax.device_put(setup["ref"], tree_shardings(m, axes, setup["ref"]))
        step = update.make_train_step(family, config, adamw(), mesh=m, kl_coef=KL, entropy_coef=ENT, clip_eps=CLIP,
                                      temperature=TEMPERATURE)
        results.append(step(state, ref, batch))
    (single, m1), (sharded, m8) = results
    assert_trees_close(sharded.params, single.params, rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)


def test_shared_prompt_batches_refuse_what_does_not_fit():
    from wmrl_jax.train.loop import make_batch as loop_batch

    episodes, advantages, weights = grouped_episodes()
    with pytest.raises(ValueError, match=r"episode 2: its prompt differs from episode 0's, the first of its group "
                                         r"of 4; expected one prompt a group \(or optim.share_prompt='never'\)"):
        loop_batch(episodes, advantages, weights, width=9, pad_id=0, prompt_width=8, group_size=4)
    with pytest.raises(ValueError, match=r"a \d-token prompt, more than the prompt width 2"):
        loop_batch(episodes, advantages, weights, width=9, pad_id=0, prompt_width=2, group_size=2)
    with pytest.raises(ValueError, match=r"tokens after its prompt, more than the batch width 3"):
        loop_batch(episodes, advantages, weights, width=3, pad_id=0, prompt_width=8, group_size=2)
    batch = loop_batch(episodes, advantages, weights, width=9, pad_id=0, prompt_width=8, group_size=2)
    with pytest.raises(ValueError, match=r"G=4 prompts do not split into micro_batches=8 slices of whole groups"):
        update.check_batch(batch, 8)
    with pytest.raises(ValueError, match=r"one is None; expected both"):
        update.check_batch(update.Batch(**{**batch.__dict__, "prompt_valid": None}), 1)


@pytest.mark.slow   # ~1.5 min
def test_bench_update_quick_runs_and_agrees(launch_script):
    """launch/bench_update.py --quick end to end (not timed: figures come from the script itself): every side's
    first update has the same loss, and shared prompts run fewer token slots through the backbone."""
    out = launch_script("bench_update").main(["--quick"])
    sides = out["sides"]
    losses = [s["first_loss"] for s in sides.values()]
    assert max(losses) - min(losses) < 1e-5, losses
    peer, ours = sides["peer: rows whole, remat full"], sides["shared prompts, remat full"]
    assert ours["token_slots"] < peer["token_slots"] and ours["gflop"] < peer["gflop"]
    assert out["matmul_gflops"] > 0
