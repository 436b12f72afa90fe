"""Qwen3.5 family vs transformers' `Qwen3_5ForCausalLM` / `Qwen3_5ForConditionalGeneration` (PyTorch fallbacks).

Tiny random models built here and saved with `save_pretrained` (no downloads): hybrid layer
patterns (with a remainder after the scanned blocks, and without), value/key head ratios 2 and 1,
tied and untied heads, random non-zero norm weights, A_log and dt_bias, sequence lengths that are
not a multiple of the delta-rule chunk (set to 8 so that several chunks run).

Tolerance: the gated RMSNorm divides by rms(o) of the delta-rule output, which for some
(token, head) pairs is ~1e-4, so f32 rounding in the delta rule (~5e-8, the same size as
transformers' own f32 error against an f64 recurrence) is amplified; with key head dim 16
and weights N(0, 0.15²) logits agree to a few 1e-5, inside a 1e-4 tolerance.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from helpers_hf import hf_logits, left_pad

from wmrl_jax.models import layers, load_hf, make_mesh, qwen35, save_hf

L, F = qwen35.LINEAR, qwen35.FULL
VOCAB = 96
CHUNK = 8


def _text_config(layer_types, value_heads, *, tie=False):
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=tie,
        eos_token_id=2,
        pad_token_id=0,
    )


def _randomize(model, seed):
    """Every weight random: matrices N(0, 0.15²), (1 + w) norms N(0, 0.3²), the gated norm 1 + N(0, 0.3²)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "linear_attn.norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif "norm" in name:
                p.copy_(0.3 * noise)
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(noise)
            else:
                p.copy_(0.15 * noise)
    return model.float().eval()


ZOO = {
    # pattern (L, F) scanned once + a remainder of one linear layer; 4 value heads on 2 key heads
    "hybrid_tail": dict(layer_types=(L, F, L), value_heads=4, tie=False),
    # pattern (L, F) scanned twice, no remainder; value heads == key heads; tied head
    "alternating": dict(layer_types=(L, F, L, F), value_heads=2, tie=True),
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    out = {}
    for seed, (name, spec) in enumerate(ZOO.items()):
        cfg = transformers.Qwen3_5TextConfig(**_text_config(spec["layer_types"], spec["value_heads"], tie=spec["tie"]))
        cfg._attn_implementation = "eager"
        torch.manual_seed(seed)
        hf = _randomize(transformers.Qwen3_5ForCausalLM(cfg), seed)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        model = load_hf(path)
        model.config = dataclasses.replace(model.config, chunk_size=CHUNK)
        out[name] = (hf, path, model)
    return out


_PADDED_PROMPTS = (21, 13, 6)  # the same shapes in the padded and cached tests: one compile for both


def _tokens(batch, length, seed=0):
    return np.random.default_rng(seed).integers(3, VOCAB, (batch, length))


def _hf_full(hf, tokens):
    with torch.no_grad():
        return hf(input_ids=torch.as_tensor(tokens), use_cache=False).logits.numpy()


@pytest.mark.parametrize("name", list(ZOO))
def test_logits_match_transformers(zoo, name):
    hf, _, model = zoo[name]
    c = model.config
    assert c.pattern == (L, F) and c.num_repeats == (1 if name == "hybrid_tail" else 2)
    assert c.tail_types == ((L,) if name == "hybrid_tail" else ())
    tokens = _tokens(2, 21)  # 21 = 2 chunks of 8 + 5
    np.testing.assert_allclose(model.logits(tokens), _hf_full(hf, tokens), atol=1e-4, rtol=0)


def test_left_padded_batch_equals_unpadded_rows(zoo):
    hf, _, model = zoo["hybrid_tail"]
    prompts = [list(_tokens(1, n, seed=n)[0]) for n in _PADDED_PROMPTS]
    tokens, mask = left_pad(prompts, pad_id=0)
    padded = np.asarray(model.logits(tokens, valid=mask.astype(bool)))
    np.testing.assert_allclose(
        padded[mask.astype(bool)], hf_logits(hf, tokens, mask)[mask.astype(bool)], atol=1e-4, rtol=0
    )
    for row, prompt in enumerate(prompts):  # each row alone, unpadded, through transformers
        alone = _hf_full(hf, np.asarray([prompt]))[0]
        np.testing.assert_allclose(padded[row, -len(prompt) :], alone, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["stored", "decode", "decode_fused"])
def test_cached_decoding_equals_full_forward(zoo, layout):
    """Prefill in 6-token chunks (chunked rule; the 2nd and 3rd from a non-zero state), then 1-token steps
    (recurrent rule); finally a step where one row is padding leaves that row's linear state exactly as it was.

    "decode*" run the 1-token steps in `qwen35.decode_layout` (repeats unstacked, optionally fused
    projections stored output dims first), converted after the prefill, as the sampler does.
    """
    _, _, model = zoo["hybrid_tail"]
    fam, c, params = model.family, model.config, model.params
    prompts = [list(_tokens(1, n, seed=n)[0]) for n in _PADDED_PROMPTS]
    tokens, mask = left_pad(prompts, pad_id=0)
    valid = mask.astype(bool)
    positions = np.asarray(layers.positions_from_valid(jnp.asarray(valid)))
    full = np.asarray(model.logits(tokens, valid=valid))

    step = jax.jit(fam.forward, static_argnums=(1,))
    cache = fam.init_cache(c, 3, 24, jnp.float32)
    pieces = []
    for start, stop in [(0, 6), (6, 12), (12, 18), (18, 19), (19, 20), (20, 21)]:
        if start == 18 and layout != "stored":
            params, cache = jax.jit(fam.decode_layout, static_argnums=0, static_argnames="fuse_matmuls")(
                c, params, cache, fuse_matmuls=layout == "decode_fused"
            )
            assert isinstance(params["blocks"], tuple) and len(cache["blocks"]) == c.num_repeats
            assert isinstance(params["lm_head_dv"], layers.OutIn) == (layout == "decode_fused")
        sl = slice(start, stop)
        hidden, cache = step(params, c, tokens[:, sl], positions[:, sl], valid[:, sl], cache)
        pieces.append(np.asarray(fam.unembed(params, c, hidden)))
    cached = np.concatenate(pieces, axis=1)
    assert int(cache["index"]) == 21
    np.testing.assert_array_equal(np.asarray(cache["valid"])[:, :21], valid)
    np.testing.assert_allclose(cached[valid], full[valid], atol=2e-5, rtol=0)

    hold = np.array([[True], [False], [True]])
    _, after = step(params, c, tokens[:, :1], positions[:, -1:] + 1, hold, cache)
    blocks = (lambda x: x[0]) if layout != "stored" else (lambda x: x)  # the first repeat, or the stack
    for layer, layer_after, axis in (
        (blocks(cache["blocks"])["0"], blocks(after["blocks"])["0"], 1 if layout == "stored" else 0),
        (cache["tail"]["0"], after["tail"]["0"], 0),
    ):
        for name in ("conv", "state"):
            before_l, after_l = np.asarray(layer[name]), np.asarray(layer_after[name])
            np.testing.assert_array_equal(np.take(after_l, 1, axis), np.take(before_l, 1, axis))
            assert np.abs(np.take(after_l, 0, axis) - np.take(before_l, 0, axis)).max() > 0


def test_save_hf_round_trip_through_transformers(zoo, tmp_path):
    hf, _, model = zoo["alternating"]
    save_hf(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["layer_types"] == [L, F, L, F]
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = _tokens(2, 11, seed=4)
    np.testing.assert_array_equal(_hf_full(back, tokens), _hf_full(hf, tokens))


def _tiny_conditional_generation(seed=7):
    text = _text_config((L, L, F, L, L, F), 4)
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
        temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16,
    )
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return _randomize(transformers.Qwen3_5ForConditionalGeneration(cfg), seed)


def test_conditional_generation_checkpoint_loads_and_saves(tmp_path, capsys):
    """The real checkpoints' layout (built as the full multimodal model, tiny vision tower) plus an `mtp.*` tensor."""
    from safetensors.torch import load_file, save_file

    hf = _tiny_conditional_generation()
    hf.save_pretrained(tmp_path / "cg")
    weights = load_file(tmp_path / "cg" / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in weights) and "model.language_model.norm.weight" in weights
    weights["mtp.fc.weight"] = torch.zeros(32, 64)
    save_file(weights, tmp_path / "cg" / "model.safetensors", metadata={"format": "pt"})

    model = load_hf(tmp_path / "cg")
    notice = capsys.readouterr().out
    assert "ignoring" in notice and ("model.visual." in notice or "mtp." in notice)
    assert model.config.hf_layout == qwen35.CONDITIONAL_GENERATION
    assert model.config.pattern == (L, L, F) and model.config.num_repeats == 2
    tokens = _tokens(2, 19, seed=5)
    ref = _hf_full(hf, tokens)
    np.testing.assert_allclose(model.logits(tokens), ref, atol=1e-4, rtol=0)

    save_hf(model, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "qwen3_5"
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "saved", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    np.testing.assert_allclose(_hf_full(back, tokens), ref, atol=1e-6, rtol=0)


def test_sharded_2x4_equals_one_device(zoo):
    hf, path, single = zoo["hybrid_tail"]
    mesh = make_mesh((2, 4), ("fsdp", "tensor"))
    model = load_hf(path, mesh=mesh)
    model.config = single.config
    z = model.params["blocks"]["0"]["z_proj_dmu"]  # [R, D=32, M=4, U]: embed over fsdp, value heads over tensor
    assert z.sharding.spec[1] == "fsdp" and z.sharding.spec[2] == "tensor"
    assert len(z.addressable_shards) == 8 and z.addressable_shards[0].data.shape == (1, 16, 1, 8)
    tokens = _tokens(2, 21)
    # float32 sums in another order (sharded contractions): measured max |diff| 1.26e-5 on an Intel Xeon,
    # under 1e-5 on AMD EPYC, for logits of magnitude ~3; a wrong layout is off by O(1).
    np.testing.assert_allclose(model.logits(tokens), single.logits(tokens), atol=5e-5, rtol=0)


@pytest.mark.parametrize("preset", ["qwen3.5-4b", "qwen3.5-9b"])
def test_preset_parameter_counts_match_transformers(preset):
    """The presets' sizes vs the same config instantiated by transformers on the meta device."""
    config = qwen35.PRESETS[preset]
    text = {k: v for k, v in qwen35.config_to_hf(config)["text_config"].items() if k != "model_type"}
    with torch.device("meta"):
        ref = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    assert qwen35.num_params(config) == sum(p.numel() for p in ref.parameters())


def test_bad_configs_name_the_field():
    base = dict(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
        layer_types=(L, F), linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
        linear_value_head_dim=4,
    )
    with pytest.raises(ValueError, match="linear_num_value_heads=3"):
        qwen35.Config(**{**base, "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match="layer_types"):
        qwen35.Config(**{**base, "layer_types": (L, "sliding_attention")})
    with pytest.raises(ValueError, match="model_type"):
        qwen35.config_from_hf({"model_type": "qwen3"})


def test_bench_qwen35_quick_runs_and_matches_transformers(launch_script):
    """launch/bench_qwen35.py --quick end to end (not timed: figures come from the script itself)."""
    out = launch_script("bench_qwen35").main(["--quick"])
    assert out["agree"] == 1.0  # greedy, f32 on both sides: every token equal
    for key in ("prefill_ours_s", "prefill_hf_s", "prefill_floor_s", "prefill_torch_floor_s",
                "decode_ours_tps", "decode_hf_tps", "decode_floor_s", "decode_torch_floor_s"):
        assert out[key] > 0, key
