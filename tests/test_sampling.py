"""Sampler tests: greedy parity with transformers `generate`, log-probs against a
teacher-forced pass, filtered distributions against transformers' warpers,
determinism, sharding.

References are independent of the sampler: transformers' PyTorch `generate`
(greedy tokens and its per-step logits), a teacher-forced full forward of the
whole sequence (no cache, no loop), and transformers' own temperature /
top-k / top-p logits warpers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.helpers_hf import build_tiny_qwen3, left_pad, tiny_qwen3_config
from wmrl_jax import sampling
from wmrl_jax.logprobs import token_logprobs
from wmrl_jax.models import load_hf, make_mesh

PROMPTS = [
    [17, 40, 233, 5, 91],
    [12, 300, 44, 7, 7, 150, 88, 61, 9],
    [250, 3],
    [100, 101, 102, 103, 104, 105, 106],
]
NEW = 10


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(HF torch model, our Model loaded from its save_pretrained folder)."""
    path = tmp_path_factory.mktemp("qwen3_sampling")
    hf = build_tiny_qwen3(tiny_qwen3_config(), seed=3)
    hf.save_pretrained(path)
    return hf, load_hf(path), path


def hf_greedy(hf, prompts, max_new_tokens, eos_id=None):
    """transformers greedy generate on a left-padded batch -> (new-token lists cut after EOS, per-step logits)."""
    tokens, mask = left_pad(prompts, pad_id=0)
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.as_tensor(tokens),
            attention_mask=torch.as_tensor(mask),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_id,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[:, tokens.shape[1] :].numpy()
    logits = torch.stack(out.logits, dim=1).float().numpy()  # [B, steps, V]
    rows = []
    for row in new.tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        rows.append(row)
    return rows, logits


def teacher_forced_logits(model, prompts, news, width=32):
    """Per row: float64[len(new), V] logits predicting each new token, from one full forward (no cache).

    Rows are right-padded to a fixed `width` (causal attention: padding after
    a token cannot change it), so every call reuses one compiled forward.
    """
    tokens = np.zeros((len(prompts), width), np.int32)
    valid = np.zeros((len(prompts), width), bool)
    for row, (prompt, new) in enumerate(zip(prompts, news)):
        seq = list(prompt) + list(new)
        tokens[row, : len(seq)], valid[row, : len(seq)] = seq, True
    logits = np.asarray(model.logits(tokens, valid), np.float64)
    return [logits[row, len(p) - 1 : len(p) + len(n) - 1] for row, (p, n) in enumerate(zip(prompts, news))]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def filtered_logprobs(logits, temperature, top_k=0, top_p=1.0):
    """Log-probs after transformers' own warpers (temperature, then top-k, then top-p); -inf = removed."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = torch.as_tensor(np.atleast_2d(logits), dtype=torch.float64)
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    for warp in warpers:
        scores = warp(None, scores)
    return torch.log_softmax(scores, dim=-1).numpy().reshape(np.shape(logits))


def test_greedy_equals_transformers_with_eos(qwen3):
    hf, model, _ = qwen3
    free, hf_logits = hf_greedy(hf, PROMPTS, NEW, eos_id=2)
    assert all(len(row) == NEW for row in free), "pick another seed: the reference run should not stop early"
    ours = sampling.generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.0, eos_ids=(2,))
    assert ours.tokens == free
    assert list(ours.lengths) == [NEW] * len(PROMPTS) and not ours.finished.any()
    # Greedy log-probs are the model's own: log_softmax of transformers' per-step logits.
    for row, tokens in enumerate(free):
        ref = log_softmax(hf_logits[row].astype(np.float64))[np.arange(NEW), tokens]
        np.testing.assert_allclose(ours.logprobs[row], ref, atol=1e-4)

    # An EOS id that row 1 emits at step 3 (others may too): those rows stop on it, the batch runs on.
    eos = free[1][3]
    ref_rows, _ = hf_greedy(hf, PROMPTS, NEW, eos_id=eos)
    ours = sampling.generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.0, eos_ids=(eos,))
    assert ours.tokens == ref_rows
    assert len(ref_rows[1]) <= 4 and ref_rows[1][-1] == eos
    assert any(len(r) == NEW and eos not in r for r in ref_rows), "some row should run to max_new_tokens"
    assert list(ours.lengths) == [len(r) for r in ref_rows]
    assert list(ours.finished) == [r[-1] == eos for r in ref_rows]
    assert [len(lp) for lp in ours.logprobs] == [len(r) for r in ref_rows]


def test_top_k_top_p_end_to_end_and_deterministic(qwen3):
    """The paper's WM sampling (T=0.7, top-k 20, top-p 0.8): log-probs under the filtered distribution."""
    _, model, _ = qwen3
    kwargs = dict(max_new_tokens=NEW, temperature=0.7, top_k=20, top_p=0.8)
    out = sampling.generate(model, PROMPTS, seed=11, **kwargs)
    for tokens, logp, logits in zip(out.tokens, out.logprobs, teacher_forced_logits(model, PROMPTS, out.tokens)):
        ref = filtered_logprobs(logits, 0.7, 20, 0.8)
        picked = ref[np.arange(len(tokens)), tokens]
        assert np.isfinite(picked).all(), "a token outside the top-k / top-p set was sampled"
        np.testing.assert_allclose(logp, picked, atol=1e-4)
    # Determinism: same seed, same everything; another seed, other tokens.
    again = sampling.generate(model, PROMPTS, seed=11, **kwargs)
    other = sampling.generate(model, PROMPTS, seed=12, **kwargs)
    assert again.tokens == out.tokens
    np.testing.assert_array_equal(np.concatenate(again.logprobs), np.concatenate(out.logprobs))
    assert other.tokens != out.tokens


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.5, 5, 1.0), (1.5, 0, 0.6), (1.5, 8, 0.9)])
def test_choose_tokens_distribution(qwen3, temperature, top_k, top_p):
    """2048 draws per next-token distribution of real model logits: support, log-probs and frequencies vs numpy."""
    _, model, _ = qwen3
    draws = 2048
    logits = np.stack([rows[-1] for rows in teacher_forced_logits(model, PROMPTS[:2], [[1], [1]])])  # [2, V]
    logits_nv = np.repeat(logits, draws, axis=0).astype(np.float32)
    choose = jax.jit(
        lambda x, rng: sampling.choose_tokens(x, rng, temperature=temperature, top_k=top_k, top_p=top_p)
    )
    ids, logp = map(np.asarray, choose(jnp.asarray(logits_nv), jax.random.key(3)))
    for row in range(2):
        ref = filtered_logprobs(logits[row], temperature, top_k, top_p)
        got = ids[row * draws : (row + 1) * draws]
        assert np.isfinite(ref[got]).all(), "a filtered-out token was drawn"
        np.testing.assert_allclose(logp[row * draws : (row + 1) * draws], ref[got], atol=1e-5)
        probs = np.exp(ref)
        kept = np.flatnonzero(probs > 0)
        assert kept.size >= 2 and (top_k == 0 or kept.size <= top_k)
        counts = np.bincount(got, minlength=probs.size)
        # Each kept token's count is Binomial(draws, p): within 4.5 standard deviations.
        sigma = np.sqrt(draws * probs[kept] * (1 - probs[kept]))
        np.testing.assert_array_less(np.abs(counts[kept] - draws * probs[kept]), 4.5 * sigma + 1)


def test_sample_inside_a_jitted_step_logprobs_equal_teacher_forced(qwen3):
    """`sample` under a caller's jit (static config), then the training-side log-probs of its output.

    Without filters the sampler's log-probs are ``log_softmax(logits / T)`` of
    the chosen tokens. Two recomputations from scratch on prompt + completion:
    `token_logprobs` in the same jitted step (chunked head), and one plain
    teacher-forced forward of `Model.logits` outside it (no cache, no loop).
    """
    _, model, _ = qwen3
    temperature = 0.7
    prompt_bp, mask_bp = left_pad(PROMPTS, pad_id=0)
    prompt_bp, mask_bp = jnp.asarray(prompt_bp, jnp.int32), jnp.asarray(mask_bp, bool)

    @jax.jit
    def rollout(params, prompt_bp, mask_bp, rng):
        out = sampling.sample(
            params, model.config, model.family, prompt_bp, mask_bp, rng, max_new_tokens=NEW, temperature=temperature
        )
        new_valid = jnp.arange(NEW)[None, :] < out.lengths[:, None]
        tokens = jnp.concatenate([prompt_bp, out.tokens], axis=1)
        valid = jnp.concatenate([mask_bp, new_valid], axis=1)
        completion = jnp.concatenate([jnp.zeros_like(mask_bp), new_valid], axis=1)
        logp, _ = token_logprobs(
            params, model.config, model.family, tokens, valid, completion, temperature=temperature, chunk=8
        )
        return out, logp[:, prompt_bp.shape[1] :]

    out, recomputed = rollout(model.params, prompt_bp, mask_bp, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out.lengths), NEW)
    np.testing.assert_allclose(np.asarray(recomputed), np.asarray(out.logprobs), atol=1e-4)
    new_tokens = np.asarray(out.tokens).tolist()
    for tokens, logp, logits in zip(new_tokens, np.asarray(out.logprobs), teacher_forced_logits(model, PROMPTS, new_tokens)):
        ref = log_softmax(logits / temperature)
        np.testing.assert_allclose(logp, ref[np.arange(NEW), tokens], atol=1e-4)
    assert np.asarray(out.logprobs).std() > 0.1  # a real distribution, not all-greedy


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """(HF torch Qwen3_5ForCausalLM, our Model loaded from its save_pretrained folder): 2 linear + 1 full layer."""
    import transformers

    from wmrl_jax.models import qwen35

    layer_types = [qwen35.LINEAR, qwen35.FULL, qwen35.LINEAR]
    config = transformers.Qwen3_5TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    hf = transformers.Qwen3_5ForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight random and O(0.1-1), so a wrong gate or norm shows
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.3 * noise if "linear_attn.norm" in name else 0.3 * noise if "norm" in name else 0.15 * noise)
    path = tmp_path_factory.mktemp("qwen35_sampling")
    hf.save_pretrained(path)
    return hf, load_hf(path)


def _prompts_for(model):
    return [[p % (model.config.vocab_size - 3) + 3 for p in prompt] for prompt in PROMPTS]


@pytest.mark.parametrize("family_fixture", ["qwen3", "qwen35"])
def test_both_families_decode_through_the_one_hook(request, monkeypatch, family_fixture):
    """The sampler's `decode_layout` (the family hook, the CPU default) samples what the stored layout does.

    Both families: same tokens and log-probs with the hook on (per-layer
    weights and cache, fused projections multiplied as row reductions) and off
    (the stored layer scan, the GPU/TPU path). And the choice is the
    sampler's alone: `forward` traces to the same program whichever backend
    JAX reports, and under a non-CPU backend the sampler's default is the
    stored scan, with no hook call (no second copy of the weights).
    """
    model = request.getfixturevalue(family_fixture)[1]
    fam, cfg = model.family, model.config
    prompt_bp, mask_bp = left_pad(_prompts_for(model), pad_id=0)
    prompt_bp, mask_bp = jnp.asarray(prompt_bp, jnp.int32), jnp.asarray(mask_bp, bool)
    knobs = dict(max_new_tokens=NEW, temperature=0.7, top_k=20, eos_ids=(2,))
    run = {
        flag: sampling._sample_jit(model.params, cfg, fam, prompt_bp, mask_bp, jax.random.key(1), decode_layout=flag, **knobs)
        for flag in (True, False)
    }
    np.testing.assert_array_equal(np.asarray(run[True].tokens), np.asarray(run[False].tokens))
    np.testing.assert_allclose(np.asarray(run[True].logprobs), np.asarray(run[False].logprobs), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(run[True].lengths), np.asarray(run[False].lengths))
    assert len(set(np.asarray(run[True].tokens).ravel().tolist())) > 3  # not one repeated token

    def sample_jaxpr(**kwargs):
        fn = lambda params, tokens, valid, rng: sampling.sample(params, cfg, fam, tokens, valid, rng, **knobs, **kwargs)
        return str(jax.make_jaxpr(fn)(model.params, prompt_bp, mask_bp, jax.random.key(1)))

    cache = fam.init_cache(cfg, 4, 8, jnp.float32)
    one = jnp.ones((4, 1), jnp.int32)

    def step_jaxpr():  # a one-token cached step of `forward`, stored layout
        return str(jax.make_jaxpr(fam.forward, static_argnums=1)(model.params, cfg, one, one, one.astype(bool), cache))

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")   # the same checks on a GPU machine
    cpu = {"step": step_jaxpr(), "default": sample_jaxpr(), "on": sample_jaxpr(decode_layout=True)}
    assert cpu["default"] == cpu["on"] and "optimization_barrier" in cpu["on"]
    assert "scan" in cpu["step"]  # the stored layout runs its layers under the scan, on any backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert step_jaxpr() == cpu["step"]
    gpu_default = sample_jaxpr()
    assert gpu_default == sample_jaxpr(decode_layout=False) != cpu["on"]
    assert "optimization_barrier" not in gpu_default


def _logprobs_fn(params, config, family, tokens, valid):
    return token_logprobs(params, config, family, tokens, valid, chunk=16)


_jit_logprobs = jax.jit(_logprobs_fn, static_argnums=(1, 2))  # module level: the 1-device reference compiles once


@pytest.mark.parametrize("mesh_shape", [(2, 4), (8, 1)])
def test_sharded_generate_and_token_logprobs_equal_one_device(qwen3, mesh_shape):
    _, model, path = qwen3
    assert jax.device_count() >= 8, (
        f"needs 8 devices, found {jax.device_count()}: tests/conftest.py simulates 8 on CPU (as in CI); "
        "on a 1-GPU machine run this file with JAX_PLATFORMS=cpu")
    mesh = make_mesh(mesh_shape, ("fsdp", "tensor"))
    sharded = load_hf(path, mesh=mesh)
    q_proj = sharded.params["layers"]["q_proj_dnh"]  # [L, D=32, N=4, H]
    assert q_proj.addressable_shards[0].data.shape == (2, 32 // mesh_shape[0], 4 // mesh_shape[1], 12)
    kwargs = dict(max_new_tokens=NEW, temperature=0.7, top_k=20, top_p=0.8, seed=4)
    one = sampling.generate(model, PROMPTS, **kwargs)
    many = sampling.generate(sharded, PROMPTS, **kwargs)
    assert many.tokens == one.tokens
    np.testing.assert_allclose(np.concatenate(many.logprobs), np.concatenate(one.logprobs), atol=1e-5)

    # token_logprobs on the batch, split over fsdp (8 rows), against one device.
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 320, size=(8, 24)).astype(np.int32)
    valid = np.arange(24)[None, :] >= rng.integers(0, 12, size=(8, 1))
    ref = _jit_logprobs(model.params, model.config, model.family, tokens, valid)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    with jax.set_mesh(mesh):
        got = _jit_logprobs(sharded.params, model.config, model.family, jax.device_put(tokens, rows), jax.device_put(valid, rows))
    assert got[0].sharding.spec[0] == "fsdp"
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_bad_arguments_name_the_argument(qwen3):
    _, model, _ = qwen3
    with pytest.raises(ValueError, match="top_p"):
        sampling.generate(model, PROMPTS, max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        sampling.generate(model, PROMPTS, max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampling.generate(model, PROMPTS, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"prompts\[1\]: empty"):
        sampling.generate(model, [[5], []], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompts\[0\]: token ids \[320\]"):
        sampling.generate(model, [[5, 320]], max_new_tokens=4)
    with pytest.raises(ValueError, match="model"):
        sampling.generate(object(), PROMPTS, max_new_tokens=4)


def test_greedy_equals_transformers_qwen35(qwen35):
    """The sampler only uses the family contract: the hybrid Qwen3.5 (gated DeltaNet + gated attention) decodes too."""
    hf, model = qwen35
    prompts = _prompts_for(model)
    eos = 2
    ref, _ = hf_greedy(hf, prompts, NEW, eos_id=eos)
    ours = sampling.generate(model, prompts, max_new_tokens=NEW, temperature=0.0, eos_ids=(eos,))
    assert ours.tokens == ref
    assert len({t for row in ref for t in row}) > 3, "degenerate reference: every row repeats one token"


def test_bench_generate_quick_runs_and_matches_transformers(launch_script):
    """launch/bench_generate.py --quick end to end (not timed: figures come from the script itself)."""
    bench = launch_script("bench_generate")
    out = bench.main(["--quick"])
    assert out["agree"] == 1.0  # greedy, f32 on both sides, hidden 256: every token equal
    assert out["ours_s"] > 0 and out["hf_s"] > 0 and out["floor_step_s"] > 0 and out["torch_floor_step_s"] > 0


@pytest.mark.parametrize("family_fixture", ["qwen3", "qwen35"])
def test_chunked_prefill_samples_what_one_prefill_does(request, family_fixture):
    """`prefill_chunk`: the prompt fed to the cache in chunks (a scan of `forward`s) gives the same tokens and
    log-probs as one prefill of the whole prompt; left padding makes whole chunks of padding in some rows, and a
    prompt of 8 tokens inside a 32-wide batch starts mid-chunk."""
    model = request.getfixturevalue(family_fixture)[1]
    fam, cfg = model.family, model.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in (32, 8, 19, 27)]
    prompt_bp, mask_bp = left_pad(prompts, pad_id=0)
    assert prompt_bp.shape[1] == 32
    prompt_bp, mask_bp = jnp.asarray(prompt_bp, jnp.int32), jnp.asarray(mask_bp, bool)
    knobs = dict(max_new_tokens=NEW, temperature=0.7, top_k=20, eos_ids=(2,), decode_layout=False)
    run = {chunk: sampling._sample_jit(model.params, cfg, fam, prompt_bp, mask_bp, jax.random.key(1),
                                       prefill_chunk=chunk, **knobs)
           for chunk in (None, 8, 16)}
    for chunk in (8, 16):
        np.testing.assert_array_equal(np.asarray(run[chunk].tokens), np.asarray(run[None].tokens), err_msg=str(chunk))
        np.testing.assert_allclose(np.asarray(run[chunk].logprobs), np.asarray(run[None].logprobs), atol=1e-4)
    assert len(set(np.asarray(run[None].tokens).ravel().tolist())) > 3  # not one repeated token
    with pytest.raises(ValueError, match="prefill_chunk: 12 does not divide the prompt width 32"):
        sampling._sample_jit(model.params, cfg, fam, prompt_bp, mask_bp, jax.random.key(1), prefill_chunk=12, **knobs)
