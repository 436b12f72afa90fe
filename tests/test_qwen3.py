"""Qwen3 in JAX against transformers' Qwen3ForCausalLM (tiny random models, no downloads)."""

import copy

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from helpers_hf import build_tiny_qwen3, hf_logits, left_pad, masked_max_err, save_tiny_qwen3, tiny_qwen3_config
from wmrl_jax import models
from wmrl_jax.models import layers, qwen3

# tied/untied × GQA 4:2 / 4:1 × head_dim 12 != 32/4, non-default theta and eps.
VARIANTS = {
    "untied_gqa2": dict(),
    "tied_gqa4": dict(tie_word_embeddings=True, num_key_value_heads=1, rope_theta=20000.0, rms_norm_eps=3e-6),
}
PROMPTS = [[5, 17, 33, 200, 41, 7, 99, 12], [8, 9, 250], [3, 4, 5, 6, 7, 300]]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    cfg = tiny_qwen3_config(**VARIANTS[request.param])
    path = save_tiny_qwen3(tmp_path_factory.mktemp(request.param), cfg, seed=len(request.param), tokenizer=False)
    hf = build_tiny_qwen3(cfg, seed=len(request.param))  # the same weights, kept in memory as the reference
    return path, hf


def test_f32_logits_match_transformers(checkpoint):
    path, hf = checkpoint
    model = models.load_hf(path)
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert ("lm_head_dv" in model.params) != hf.config.tie_word_embeddings

    full = np.asarray([PROMPTS[0], PROMPTS[0][::-1]])
    np.testing.assert_allclose(np.asarray(model.logits(full)), hf_logits(hf, full), atol=1e-4, rtol=0)

    tokens, mask = left_pad(PROMPTS)
    ours = np.asarray(model.logits(tokens, mask.astype(bool)))
    assert ours.dtype == np.float32 and ours.shape == (3, 8, hf.config.vocab_size)
    assert masked_max_err(ours, hf_logits(hf, tokens, mask), mask) < 1e-4


@pytest.mark.parametrize("layout", ["stacked", "per_layer", "per_layer_fused"])
def test_cached_decoding_equals_full_forward(checkpoint, layout):
    """Prefill into a prompt-sized cache, grow it, decode one token at a time: the sampler's path.

    "per_layer*" run the 1-token steps in `qwen3.decode_layout` (unstacked layers, per-layer
    KV buffers, optionally fused q|k|v and gate|up matmuls), converted after the prefill, as `sample` does.
    """
    from wmrl_jax.sampling import grow_cache

    path, _ = checkpoint
    model = models.load_hf(path)
    params, cfg = model.params, model.config
    tokens, mask = left_pad(PROMPTS)
    tokens, valid = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, bool)
    positions = layers.positions_from_valid(valid)
    full, none = qwen3.forward(params, cfg, tokens, positions, valid)
    assert none is None

    forward = jax.jit(qwen3.forward, static_argnums=1)
    cache = qwen3.init_cache(cfg, batch=3, max_len=5, dtype=jnp.float32)
    hidden, cache = forward(params, cfg, tokens[:, :5], positions[:, :5], valid[:, :5], cache)
    cache = grow_cache(qwen3.cache_axes(cfg), cache, 12)
    if layout != "stacked":
        params, cache = qwen3.decode_layout(cfg, params, cache, fuse_matmuls=layout.endswith("fused"))
        assert isinstance(params["layers"], tuple) and len(cache["k"]) == cfg.num_layers
        assert ("qkv_proj_dx" in params["layers"][0]) == layout.endswith("fused")
    steps = [hidden]
    for t in range(5, 8):
        hidden, cache = forward(params, cfg, tokens[:, t : t + 1], positions[:, t : t + 1], valid[:, t : t + 1], cache)
        steps.append(hidden)
    cached = jnp.concatenate(steps, axis=1)
    assert int(cache["index"]) == 8
    np.testing.assert_array_equal(np.asarray(cache["valid"][:, :8]), mask.astype(bool))
    assert not np.asarray(cache["valid"][:, 8:]).any()
    assert masked_max_err(np.asarray(cached), np.asarray(full), mask) < 1e-5


def test_attention_cache_layouts_agree():
    """gqa_attention on fresh [B, S, K, H] keys == the head-major and transposed-key cache layouts (by hand too)."""
    rng = np.random.default_rng(3)
    b, t, s, n, k, h = 2, 3, 7, 4, 2, 5
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    keys = rng.standard_normal((b, s, k, h)).astype(np.float32)
    values = rng.standard_normal((b, s, k, h)).astype(np.float32)
    mask = rng.random((b, t, s)) < 0.7
    mask[..., 0] = True
    fresh = np.asarray(layers.gqa_attention(q, keys, values, mask, 0.3))
    head_major = layers.gqa_attention(q, keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3), mask, 0.3, kv_layout="bksh")
    transposed = layers.gqa_attention(q, keys.transpose(0, 2, 3, 1), values.transpose(0, 2, 1, 3), mask, 0.3, kv_layout="bkhs")
    np.testing.assert_allclose(np.asarray(head_major), fresh, atol=1e-6)
    np.testing.assert_allclose(np.asarray(transposed), fresh, atol=1e-6)
    # By hand: query head i reads KV head i // (n // k).
    scores = np.einsum("btnh,bsnh->bnts", q, np.repeat(keys, n // k, axis=2)) * 0.3
    scores = np.where(mask[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(fresh, np.einsum("bnts,bsnh->btnh", probs, np.repeat(values, n // k, axis=2)), atol=1e-5)
    with pytest.raises(ValueError, match="kv_layout"):
        layers.gqa_attention(q, keys, values, mask, 0.3, kv_layout="bhsk")


def test_few_rows_matmul_and_one_token_unembed_match_numpy():
    """The CPU decode step's multiply-and-reduce products equal float64 numpy, in and out of jit, f32 and bf16."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w = rng.standard_normal((100, 64)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(np.asarray(layers.few_rows_matmul(x, w)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(layers.few_rows_matmul)(x, w)), want, rtol=1e-5, atol=1e-5)
    # bf16 operands: exact products, accumulated in f32 (as a dot with f32 accumulation).
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    got = layers.few_rows_matmul(xb, wb)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(xb, np.float64) @ np.asarray(wb, np.float64).T, atol=1e-4)

    assert layers.few_rows_path(8) and not layers.few_rows_path(layers.FEW_ROWS + 1)  # no mesh
    params = {"lm_head_dv": w.T.copy(), "embed_vd": w}
    for t in (1, 5):  # 8 rows (few-rows path in a decode layout) and 40 (the einsum)
        hidden = rng.standard_normal((8, t, 64)).astype(np.float32)
        want = np.einsum("btd,vd->btv", hidden.astype(np.float64), w.astype(np.float64))
        for tied in (False, True):
            for head in (False, True):  # the stored head, and a decode layout's `OutIn` one
                unembed = lambda h, p, tied=tied, head=head: layers.unembed(
                    h, layers.seal_decode_params(p, tied=tied, head=head), tied
                )
                got = jax.jit(unembed)(hidden, params)
                assert got.shape == (8, t, 100) and got.dtype == jnp.float32
                np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    mesh = jax.make_mesh((1,), ("data",))
    with jax.set_mesh(mesh):
        assert not layers.few_rows_path(8)  # under a mesh the products stay dots


def test_grow_cache_pads_only_cache_length_axes():
    from wmrl_jax.sampling import grow_cache

    cfg = qwen3.config_from_hf(tiny_qwen3_config().to_dict())
    cache = qwen3.init_cache(cfg, batch=2, max_len=3)
    cache = {**cache, "valid": jnp.ones((2, 3), bool), "index": jnp.int32(3)}
    grown = grow_cache(qwen3.cache_axes(cfg), cache, 8)
    assert grown["k"].shape == cache["k"].shape[:-1] + (8,) and grown["v"].shape[3] == 8
    assert int(grown["index"]) == 3 and np.asarray(grown["valid"]).sum() == 6 and grown["valid"].shape == (2, 8)
    with pytest.raises(ValueError, match="cannot grow"):
        grow_cache(qwen3.cache_axes(cfg), cache, 2)


def test_bf16_path_close_to_f32(checkpoint):
    path, hf = checkpoint
    tokens, mask = left_pad(PROMPTS)
    ref = hf_logits(hf, tokens, mask)
    ours = models.load_hf(path, dtype="bfloat16")
    assert ours.params["layers"]["q_proj_dnh"].dtype == jnp.bfloat16
    ours_err = masked_max_err(np.asarray(ours.logits(tokens, mask.astype(bool))), ref, mask)
    # Tolerance: bf16 keeps 8 mantissa bits (relative rounding 2^-9 per op), so the error is a property of
    # the weights and depth, not a fixed number. The independent yardstick is transformers' own bf16 model
    # on the same weights: ours (f32 norms/softmax/RoPE angles, bf16 matmuls) must be no worse than 2x it.
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    hf_err = masked_max_err(hf_logits(hf_bf16, tokens, mask), ref, mask)
    print(f"bf16 max |logit err|: ours {ours_err:.4f}, transformers bf16 {hf_err:.4f}")
    assert 0 < ours_err <= 2 * hf_err + 1e-3, (ours_err, hf_err)


def test_init_matches_axes_and_runs():
    cfg = qwen3.config_from_hf(tiny_qwen3_config(tie_word_embeddings=False).to_dict())
    model = models.init(cfg, jax.random.key(0), dtype="bfloat16")
    shapes = jax.tree.map(lambda x: x.shape, model.params)
    axes = qwen3.param_axes(cfg)
    assert jax.tree.structure(shapes, is_leaf=lambda s: isinstance(s, tuple)) == jax.tree.structure(
        axes, is_leaf=lambda a: isinstance(a, tuple)
    )
    jax.tree.map(lambda s, a: (len(s) == len(a)) or pytest.fail(f"{s} vs {a}"), shapes, axes, is_leaf=lambda t: isinstance(t, tuple))
    assert shapes["layers"]["q_proj_dnh"] == (2, 32, 4, 12)
    assert model.params["embed_vd"].dtype == jnp.bfloat16
    std = float(jnp.std(model.params["layers"]["up_proj_df"].astype(jnp.float32)))
    assert abs(std - 0.02) < 0.003  # transformers' initializer_range
    assert np.isfinite(np.asarray(model.logits(np.asarray([[1, 2, 3]])))).all()


def test_partial_rope_and_offset_norm_match_transformers_qwen3_5():
    """The shared pieces the Qwen3.5 family reuses, against transformers' own Qwen3.5 functions."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref
    from transformers import Qwen3_5TextConfig

    hf_cfg = Qwen3_5TextConfig(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 777.0, "partial_rotary_factor": 0.25})
    theta, rotary_dim = layers.rope_settings(hf_cfg.rope_parameters, 16)
    assert (theta, rotary_dim) == (777.0, 4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    pos = np.asarray([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])
    inv_freq = 1.0 / (777.0 ** (torch.arange(0, 4, 2, dtype=torch.float) / 4))
    freqs = torch.as_tensor(pos)[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    xt = torch.as_tensor(x).transpose(1, 2)  # HF layout [B, N, T, H]
    want, _ = ref.apply_rotary_pos_emb(xt, xt, emb.cos(), emb.sin())
    got = layers.apply_rope(jnp.asarray(x), jnp.asarray(pos), theta, rotary_dim)
    np.testing.assert_allclose(np.asarray(got), want.transpose(1, 2).numpy(), atol=1e-6)

    norm = ref.Qwen3_5RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.as_tensor(rng.standard_normal(16).astype(np.float32)))
    got = layers.rms_norm(jnp.asarray(x), jnp.asarray(norm.weight.detach().numpy()), 1e-5, offset=1.0)
    np.testing.assert_allclose(np.asarray(got), norm(torch.as_tensor(x)).detach().numpy(), atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(NotImplementedError, match="rope_type='yarn'"):
        layers.rope_settings({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, 128)
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        qwen3.Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=6, num_kv_heads=4, head_dim=4)
    cfg = qwen3.config_from_hf(tiny_qwen3_config(num_hidden_layers=1).to_dict())
    model = models.Model(cfg, params={}, family=qwen3)  # shapes are checked before params are touched
    with pytest.raises(ValueError, match=r"tokens: expected int32\[B, T\], got shape \(3,\)"):
        model.logits(np.asarray([1, 2, 3]))
    with pytest.raises(ValueError, match=r"valid: shape \(1, 2\), expected the tokens' shape \(1, 3\)"):
        model.logits(np.asarray([[1, 2, 3]]), np.ones((1, 2), bool))
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        qwen3.config_from_hf(tiny_qwen3_config(use_sliding_window=True).to_dict())
