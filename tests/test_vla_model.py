"""The VLA model on tiny backbones: teacher forcing vs. cached decoding, the loss's support, batching, SFT."""

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from wmrl_jax.models import qwen2, qwen3, qwen35
from wmrl_jax.vla import model as vla
from wmrl_jax.vla import vision

VOCAB = 300  # the action ids are the last 256: [44, 300)
BACKBONE = qwen2.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8, rope_theta=5000.0, initializer_range=0.1)
VISION = vision.VisionConfig(image_size=16, patch_size=8, width=16, num_layers=1, num_heads=2, mlp_size=32,
                             initializer_range=0.1)
CFG = vla.Config(backbone=BACKBONE, vision=VISION, initializer_range=0.1)
TEXTS = [[5, 17, 33, 41, 7], [8, 9], [3, 4, 5, 6]]  # three instructions of unequal length, left-padded


def _obs(texts=TEXTS, seed=0):
    rng = np.random.default_rng(seed)
    width = max(len(t) for t in texts)
    text = np.zeros((len(texts), width), np.int32)
    valid = np.zeros((len(texts), width), bool)
    for i, t in enumerate(texts):
        text[i, width - len(t) :], valid[i, width - len(t) :] = t, True
    obs = {name: rng.integers(0, 256, (len(texts), 16, 16, 3), dtype=np.uint8) for name in CFG.cameras}
    obs.update(text=text, text_valid=valid, proprio=np.zeros((len(texts), 8), np.float32),
               instruction=["a"] * len(texts))  # what SimPool also returns: ignored
    return obs


def _batch(seed=0):
    obs = _obs(seed=seed)
    ids = np.random.default_rng(seed + 1).integers(VOCAB - 256, VOCAB, (3, 7)).astype(np.int32)
    return {**obs, "action_ids": ids}


@pytest.fixture(scope="module")
def params():
    return vla.init(CFG, jax.random.key(0))


# Jitted once per shape (eager op-by-op dispatch of the layer scans is ~10x slower on CPU).
LOGPROBS = jax.jit(vla.action_logprobs, static_argnums=1)
ACTION_LOGITS = jax.jit(vla.action_logits, static_argnums=1)
LOSS = jax.jit(vla.sft_loss, static_argnums=1)


def _arrays(batch):
    return {k: v for k, v in batch.items() if k != "instruction"}


def test_shapes_and_left_padded_layout(params):
    batch = _batch()
    embeds, valid = jax.jit(vla.embed_prompt, static_argnums=1)(params, CFG, _arrays(batch))
    p = CFG.image_tokens
    assert p == 2 * 4 and embeds.shape == (3, p + 5, 32) and valid.shape == (3, p + 5)
    for row, text in zip(np.asarray(valid), TEXTS):  # [pads | images | text]: real tokens form one right-aligned run
        n_pad = 5 - len(text)
        np.testing.assert_array_equal(row, [False] * n_pad + [True] * (p + len(text)))
    # The text tokens come last, in order, through the backbone's embedding.
    np.testing.assert_array_equal(np.asarray(embeds[1, -2:]), np.asarray(params["backbone"]["embed_vd"])[[8, 9]])
    assert jax.eval_shape(lambda p, b: vla.logits(p, CFG, b), params, _arrays(batch)).shape == (3, p + 5 + 7, VOCAB)
    assert ACTION_LOGITS(params, CFG, _arrays(batch)).shape == (3, 7, 256)
    assert LOGPROBS(params, CFG, _arrays(batch)).shape == (3, 7)
    out = jax.eval_shape(lambda p, o, r: vla.sample_actions(p, CFG, o, r), params, _arrays(batch), jax.random.key(1))
    assert out.ids.shape == out.logprobs.shape == out.actions.shape == (3, 7)


def test_action_logprobs_equal_log_softmax_of_full_logits_by_hand(params):
    """Action k's log-prob is the log-softmax over the action ids of the full logits at position S - 1 + k."""
    batch = _arrays(_batch())
    full = np.asarray(jax.jit(vla.logits, static_argnums=1)(params, CFG, batch), np.float64)
    s = CFG.image_tokens + 5
    z = full[:, s - 1 : s - 1 + 7, VOCAB - 256 :]
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    want = np.take_along_axis(logp, (batch["action_ids"] - (VOCAB - 256))[..., None], -1)[..., 0]
    got = LOGPROBS(params, CFG, batch)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    np.testing.assert_allclose(float(LOSS(params, CFG, batch)), -want.mean(), atol=1e-5)
    # Eager (unjitted), on the first row: the same numbers.
    eager = vla.action_logprobs(params, CFG, jax.tree.map(lambda x: x[:1], batch))
    np.testing.assert_allclose(np.asarray(eager), np.asarray(got)[:1], atol=1e-5)


def test_loss_is_over_action_tokens_only(params):
    """No prompt token is a target: the LM-head columns of every non-action id get exactly zero gradient (untied
    head), and changing action k changes the loss and log-probs k.., never those before k."""
    batch = _arrays(_batch())
    assert not BACKBONE.tie_word_embeddings
    grads = jax.jit(jax.grad(vla.sft_loss), static_argnums=1)(params, CFG, batch)
    head = np.asarray(grads["backbone"]["lm_head_dv"])
    assert not head[:, : VOCAB - 256].any() and np.abs(head[:, VOCAB - 256 :]).max() > 0
    # The prompt's own ids (text 3..41) are not in the action range: a prompt-target term would have hit them.
    assert max(max(t) for t in TEXTS) < VOCAB - 256

    base = np.asarray(LOGPROBS(params, CFG, batch))
    changed = {**batch, "action_ids": batch["action_ids"].copy()}
    changed["action_ids"][:, 3] = np.where(batch["action_ids"][:, 3] == VOCAB - 1, VOCAB - 2, VOCAB - 1)
    moved = np.asarray(LOGPROBS(params, CFG, changed))
    np.testing.assert_allclose(moved[:, :3], base[:, :3], atol=1e-6)
    assert np.abs(moved[:, 3:] - base[:, 3:]).max(axis=1).min() > 1e-4  # every row: a_3 and what follows it
    assert float(LOSS(params, CFG, changed)) != pytest.approx(float(LOSS(params, CFG, batch)), abs=1e-6)
    # The instruction conditions the actions: another prompt id changes the log-probs.
    other = {**batch, "text": batch["text"].copy()}
    other["text"][0, -1] = 12
    assert np.abs(np.asarray(LOGPROBS(params, CFG, other))[0] - base[0]).max() > 1e-4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_act_matches_teacher_forcing(params, temperature):
    """The cached decode's ids and log-probs equal a teacher-forced pass over the ids it chose."""
    obs = _obs()
    out = vla.sample_jit(params, CFG, vla.model_inputs(CFG, obs), jax.random.key(3), temperature)
    ids = np.asarray(out.ids)
    assert ids.min() >= VOCAB - 256 and ids.max() < VOCAB
    actions = vla.act(params, CFG, obs, jax.random.key(3), temperature)
    assert actions.shape == (3, 7) and actions.dtype == jnp.float32 and np.abs(np.asarray(actions)).max() <= 1
    np.testing.assert_allclose(np.asarray(actions), CFG.tokenizer.decode(ids), atol=0)
    batch = {**_arrays(obs), "action_ids": ids}
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(LOGPROBS(params, CFG, batch)), atol=1e-5)
    if temperature == 0:
        np.testing.assert_array_equal(np.argmax(np.asarray(ACTION_LOGITS(params, CFG, batch)), -1) + VOCAB - 256, ids)


def test_batched_rows_equal_rows_one_at_a_time(params):
    batch = _arrays(_batch(seed=5))
    logp = np.asarray(LOGPROBS(params, CFG, batch))
    greedy = np.asarray(vla.act(params, CFG, batch, jax.random.key(0)))
    for i in (1,):  # the most padded row (3 pads) alone, unpadded: one more compile per function, not three
        text = TEXTS[i]
        row = {name: batch[name][i : i + 1] for name in CFG.cameras}
        row.update(text=np.asarray([text], np.int32), text_valid=np.ones((1, len(text)), bool),
                   action_ids=batch["action_ids"][i : i + 1])
        np.testing.assert_allclose(np.asarray(LOGPROBS(params, CFG, row))[0], logp[i], atol=2e-5)
        np.testing.assert_array_equal(np.asarray(vla.act(params, CFG, row, jax.random.key(0)))[0], greedy[i])


def test_sft_steps_memorise_a_fixed_batch(params):
    import optax

    batch = _arrays(_batch(seed=9))
    opt = optax.adam(3e-3)

    @jax.jit
    def step(p, state):
        loss, grads = jax.value_and_grad(vla.sft_loss)(p, CFG, batch)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    p, state = params, opt.init(params)
    losses = []
    for _ in range(30):
        p, state, loss = step(p, state)
        losses.append(float(loss))
    print(f"SFT loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[0] > 4.0 and losses[-1] < 0.5 * losses[0]  # ln(256) = 5.5 at init


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_other_backbones_decode_like_teacher_forcing(family):
    """The `embeds` input and the cache through Qwen3 and Qwen3.5 (hybrid linear attention) backbones."""
    if family == "qwen3":
        backbone = qwen3.Config(**dataclasses.asdict(BACKBONE))
    else:
        backbone = qwen35.Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
                                 head_dim=8, layer_types=(qwen35.LINEAR, qwen35.FULL), linear_num_key_heads=2,
                                 linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                 partial_rotary_factor=0.5, initializer_range=0.1)
    cfg = dataclasses.replace(CFG, backbone=backbone)
    params = vla.init(cfg, jax.random.key(1))
    obs = _arrays(_obs())
    out = vla.sample_jit(params, cfg, vla.model_inputs(cfg, obs), jax.random.key(0), 0.0)
    batch = {**obs, "action_ids": np.asarray(out.ids)}
    z = np.asarray(ACTION_LOGITS(params, cfg, batch))
    np.testing.assert_array_equal(np.argmax(z, -1) + VOCAB - 256, np.asarray(out.ids))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(LOGPROBS(params, cfg, batch)), atol=1e-4)


def test_tokenize_instructions_left_pads_openvla_prompt():
    from helpers_hf import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    ids, valid = vla.tokenize_instructions(tok, ["Open the drawer", "put it away"])
    assert ids.shape == valid.shape and ids.dtype == np.int32 and valid[:, -1].all()
    for row, v, text in zip(ids, valid, ["open the drawer", "put it away"]):
        assert tok.decode(row[v].tolist()) == f"In: What action should the robot take to {text}?\nOut:"
        assert (row[~v] == tok.pad_token_id).all() and v[np.argmax(v):].all()


def test_bad_inputs_name_what_is_wrong(params):
    obs = _arrays(_obs())
    with pytest.raises(ValueError, match=r"obs\['wrist'\]: shape \(3, 32, 32, 3\), expected uint8 \[B, 16, 16, 3\]"):
        vla.act(params, CFG, {**obs, "wrist": np.zeros((3, 32, 32, 3), np.uint8)}, jax.random.key(0))
    with pytest.raises(ValueError, match=r"obs\['agentview'\]: dtype float32, expected uint8"):
        vla.act(params, CFG, {**obs, "agentview": np.zeros((3, 16, 16, 3), np.float32)}, jax.random.key(0))
    with pytest.raises(ValueError, match=r"obs: missing \['wrist'\]"):
        vla.act(params, CFG, {k: v for k, v in obs.items() if k != "wrist"}, jax.random.key(0))
    with pytest.raises(ValueError, match=r"action_ids: int32 \(3, 6\), expected int \[3, 7\] \(action_dim=7\)"):
        LOGPROBS(params, CFG, {**obs, "action_ids": np.zeros((3, 6), np.int32)})
    with pytest.raises(ValueError, match=r"obs\['text_valid'\]: shape \(3, 4\), expected the text's \(3, 5\)"):
        vla.act(params, CFG, {**obs, "text_valid": obs["text_valid"][:, 1:]}, jax.random.key(0))
    with pytest.raises(ValueError, match=r"action_vocab_size=400: the action ids \[144, 400\) must be real ids"):
        vla.Config(backbone=BACKBONE, vision=VISION, action_vocab_size=400)
    with pytest.raises(ValueError, match="cameras=\\('agentview',\\): expected 2 distinct names"):
        vla.Config(backbone=BACKBONE, vision=VISION, cameras=("agentview",))
    with pytest.raises(TypeError, match="is not the Config of a registered family"):
        vla.Config(backbone=VISION, vision=VISION)
    with pytest.raises(ValueError, match="image_size=20 is not a multiple of patch_size=8"):
        vision.VisionConfig(image_size=20, patch_size=8)
    wrong = vla.init(dataclasses.replace(CFG, backbone=dataclasses.replace(BACKBONE, vocab_size=320)), jax.random.key(0))
    with pytest.raises(ValueError, match=r"backbone_params\['embed_vd'\]: shape \(320, 32\), expected \(300, 32\)"):
        vla.init(CFG, jax.random.key(0), backbone_params=wrong["backbone"])
    assert repr(CFG).startswith("Config(backbone=Qwen2Config(vocab_size=300")


def test_backbone_from_a_qwen2_checkpoint_folder(tmp_path):
    """MiniVLA's path: a Qwen2 folder (tied head, as Qwen2.5-0.5B) through `load_hf` becomes the backbone."""
    import transformers

    from helpers_hf import build_tiny_lm
    from wmrl_jax import models

    hf_cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    build_tiny_lm(transformers.Qwen2ForCausalLM, hf_cfg, seed=1).save_pretrained(tmp_path)
    loaded = models.load_hf(tmp_path)
    cfg = dataclasses.replace(CFG, backbone=loaded.config)
    params = vla.init(cfg, jax.random.key(0), backbone_params=loaded.params)
    assert params["backbone"] is loaded.params
    actions = np.asarray(vla.act(params, cfg, _obs(), jax.random.key(0), 1.0))
    assert actions.shape == (3, 7) and np.abs(actions).max() < 1
