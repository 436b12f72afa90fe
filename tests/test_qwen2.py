"""Qwen2 / Qwen2.5 in JAX against transformers' Qwen2ForCausalLM (tiny random models, no downloads)."""

import dataclasses
import json

import numpy as np
import pytest
import transformers

import jax
import jax.numpy as jnp

from helpers_hf import build_tiny_lm, hf_logits, left_pad, masked_max_err
from wmrl_jax import models
from wmrl_jax.models import layers, qwen2, qwen3

VOCAB = 160
# untied with GQA 4:2 and the derived head_dim (32 / 4); tied (Qwen2.5-0.5B's choice) with GQA 4:1, an explicit
# head_dim 12 != 32 / 4, non-default theta and eps.
VARIANTS = {
    "untied_gqa2": dict(),
    # The sliding-window fields as Qwen2.5's config.json has them (a window size, but use_sliding_window false).
    "tied_gqa4": dict(tie_word_embeddings=True, num_key_value_heads=1, head_dim=12, rope_theta=20000.0, rms_norm_eps=3e-6,
                      use_sliding_window=False, sliding_window=32768, max_window_layers=1),
}
PROMPTS = [[5, 17, 33, 150, 41, 7, 99, 12], [8, 9, 120], [3, 4, 5, 6, 7, 100]]


def tiny_qwen2_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    kwargs.update(overrides)
    return transformers.Qwen2Config(**kwargs)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    hf = build_tiny_lm(transformers.Qwen2ForCausalLM, tiny_qwen2_config(**VARIANTS[request.param]), seed=3)
    # build_tiny_lm draws every non-norm tensor from N(0, 0.15²): the q/k/v biases are far from zero.
    assert float(hf.model.layers[0].self_attn.k_proj.bias.detach().abs().mean()) > 0.05
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf


def test_f32_logits_match_transformers(checkpoint):
    path, hf = checkpoint
    model = models.load_hf(path)
    assert type(model.config) is qwen2.Qwen2Config and model.family is qwen2
    assert model.config.head_dim == hf.model.layers[0].self_attn.head_dim
    assert "q_norm_h" not in model.params["layers"] and model.params["layers"]["k_bias_kh"].shape[1:] == (
        hf.config.num_key_value_heads, model.config.head_dim)
    assert ("lm_head_dv" in model.params) != hf.config.tie_word_embeddings

    tokens, mask = left_pad(PROMPTS)
    ours = np.asarray(model.logits(tokens, mask.astype(bool)))
    assert ours.shape == (3, 8, VOCAB)
    assert masked_max_err(ours, hf_logits(hf, tokens, mask), mask) < 1e-4
    full = np.asarray([PROMPTS[0]])
    np.testing.assert_allclose(np.asarray(model.logits(full)), hf_logits(hf, full), atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["stacked", "per_layer_fused"])
def test_cached_decoding_equals_full_forward(checkpoint, layout):
    """Prefill 5 slots, grow the cache, then one token at a time (fused q|k|v keeps the biases)."""
    from wmrl_jax.sampling import grow_cache

    model = models.load_hf(checkpoint[0])
    params, cfg = model.params, model.config
    tokens, mask = left_pad(PROMPTS)
    tokens, valid = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, bool)
    positions = layers.positions_from_valid(valid)
    full, _ = qwen2.forward(params, cfg, tokens, positions, valid)

    forward = jax.jit(qwen2.forward, static_argnums=1)
    cache = qwen2.init_cache(cfg, batch=3, max_len=5, dtype=jnp.float32)
    hidden, cache = forward(params, cfg, tokens[:, :5], positions[:, :5], valid[:, :5], cache)
    cache = grow_cache(qwen2.cache_axes(cfg), cache, 12)
    if layout != "stacked":
        params, cache = qwen2.decode_layout(cfg, params, cache, fuse_matmuls=True)
        assert "qkv_proj_dx" in params["layers"][0] and "q_bias_nh" in params["layers"][0]
    steps = [hidden]
    for t in range(5, 8):
        hidden, cache = forward(params, cfg, tokens[:, t : t + 1], positions[:, t : t + 1], valid[:, t : t + 1], cache)
        steps.append(hidden)
    assert int(cache["index"]) == 8
    assert masked_max_err(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), mask) < 1e-5


def test_save_load_round_trip_through_transformers(checkpoint, tmp_path):
    """Ours -> save_hf -> transformers loads it (same logits) -> load_hf gives back the same params."""
    path, hf = checkpoint
    model = models.load_hf(path)
    out = models.save_hf(model, tmp_path / "saved")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "qwen2" and saved["architectures"] == ["Qwen2ForCausalLM"]
    assert saved["tie_word_embeddings"] == hf.config.tie_word_embeddings
    assert ("head_dim" in saved) == (model.config.head_dim != 32 // 4)  # written only where it is not derived
    tokens, mask = left_pad(PROMPTS)
    assert masked_max_err(hf_logits(out, tokens, mask), hf_logits(hf, tokens, mask), mask) < 1e-5
    again = models.load_hf(out)
    assert again.config == model.config
    jax.tree.map(np.testing.assert_array_equal, again.params, model.params)


def test_sampler_runs_on_qwen2(checkpoint):
    """`generate` (the project's sampler) on a Qwen2 model: greedy ids equal a step-by-step argmax of full logits."""
    from wmrl_jax.sampling import generate

    model = models.load_hf(checkpoint[0])
    prompts = [PROMPTS[1], PROMPTS[2]]
    out = generate(model, prompts, max_new_tokens=4, temperature=0.0, eos_ids=())
    # Greedy: each new id is the argmax of one full forward over prompt + the ids before it (one batch, left-padded).
    tokens, mask = left_pad([p + got for p, got in zip(prompts, out.tokens)])
    argmax = np.argmax(np.asarray(model.logits(tokens, mask.astype(bool))), axis=-1)
    for row, got in enumerate(out.tokens):
        assert len(got) == 4 and argmax[row, -5:-1].tolist() == got
    assert all(np.isfinite(lp).all() and (lp <= 0).all() for lp in out.logprobs)


def test_init_axes_and_embeds_input():
    cfg = qwen2.config_from_hf(tiny_qwen2_config(tie_word_embeddings=True).to_dict())
    model = models.init(cfg, jax.random.key(0))
    assert model.family is qwen2 and "lm_head_dv" not in model.params
    shapes = jax.tree.map(lambda x: x.shape, model.params)
    axes = qwen2.param_axes(cfg)
    is_tuple = lambda t: isinstance(t, tuple)  # noqa: E731
    assert jax.tree.structure(shapes, is_leaf=is_tuple) == jax.tree.structure(axes, is_leaf=is_tuple)
    assert not np.asarray(model.params["layers"]["q_bias_nh"]).any()  # transformers zero-inits Linear biases
    # `embeds` in place of the token embeddings: the same hidden states as the tokens themselves.
    tokens, mask = left_pad(PROMPTS)
    tokens, valid = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, bool)
    positions = layers.positions_from_valid(valid)
    want, _ = qwen2.forward(model.params, cfg, tokens, positions, valid)
    got, _ = qwen2.forward(model.params, cfg, jnp.zeros_like(tokens), positions, valid,
                           embeds=model.params["embed_vd"][tokens])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match=r"embeds: shape \(3, 8, 5\), expected \(3, 8, 32\)"):
        qwen2.forward(model.params, cfg, tokens, positions, valid, embeds=jnp.zeros((3, 8, 5)))


def test_qwen3_layout_unchanged_by_the_switches():
    """Qwen3 keeps q/k norms and has no biases; Qwen2 the reverse; both configs are distinct types."""
    q3 = qwen3.Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    q2 = qwen2.Qwen2Config(**dataclasses.asdict(q3))
    assert q2 != q3 and hash(q2) is not None and repr(q2).startswith("Qwen2Config(vocab_size=8")
    keys3 = {e.key for e in qwen3.hf_table(q3)}
    keys2 = {e.key for e in qwen2.hf_table(q2)}
    assert keys3 - keys2 == {"model.layers.{layer}.self_attn.q_norm.weight", "model.layers.{layer}.self_attn.k_norm.weight"}
    assert keys2 - keys3 == {f"model.layers.{{layer}}.self_attn.{x}_proj.bias" for x in "qkv"}


def test_bad_configs_raise_clear_errors():
    with pytest.raises(NotImplementedError, match="sliding-window attention is not implemented"):
        qwen2.config_from_hf(tiny_qwen2_config(use_sliding_window=True, max_window_layers=0).to_dict())
    with pytest.raises(ValueError, match=r"model_type='qwen3', expected one of \('qwen2',\)"):
        qwen2.config_from_hf({"model_type": "qwen3"})
    with pytest.raises(NotImplementedError, match="hidden_act='gelu'"):
        qwen2.config_from_hf(tiny_qwen2_config(hidden_act="gelu").to_dict())
