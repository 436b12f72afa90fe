"""token_logprobs: values against transformers, values and gradients against the
naive full-logits computation, proof that no [B, T, V] array exists in the
forward or the backward program, and layer remat (`remat=`): the same values
and gradients, and a backward that XLA compiles into far fewer temporary bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers_hf import build_tiny_qwen3, hf_logits, tiny_qwen3_config
from wmrl_jax.logprobs import logprob_and_entropy, token_logprobs
from wmrl_jax.models import init, load_hf, qwen3, qwen35
from wmrl_jax.models.layers import positions_from_valid

B, T, CHUNK, TEMPERATURE = 3, 21, 8, 0.8  # T not a multiple of CHUNK: the padded tail must be dropped


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tied-embedding tiny Qwen3 (the head's gradient reaches the embedding twice) + a left-padded batch."""
    path = tmp_path_factory.mktemp("qwen3_logprobs")
    hf = build_tiny_qwen3(tiny_qwen3_config(tie_word_embeddings=True), seed=5)
    hf.save_pretrained(path)
    model = load_hf(path)
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, 320, size=(B, T)).astype(np.int32)
    valid = np.arange(T)[None, :] >= np.array([[0], [4], [9]])
    tokens = np.where(valid, tokens, 0)
    mask = valid & (rng.random((B, T)) < 0.7)
    return hf, model, tokens, valid, mask


def naive(params, config, family, tokens, valid, mask):
    """The f32[B, T, V] way: full logits, log_softmax, gather; shifted so logp[:, t] scores tokens[:, t]."""
    hidden, _ = family.forward(params, config, tokens, positions_from_valid(valid), valid)
    logp_btv = jax.nn.log_softmax(family.unembed(params, config, hidden).astype(jnp.float32) / TEMPERATURE)
    logp = jnp.take_along_axis(logp_btv[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)[:, :-1]
    scored = valid[:, 1:] & valid[:, :-1] & mask[:, 1:]
    pad = ((0, 0), (1, 0))
    return jnp.pad(jnp.where(scored, logp, 0.0), pad), jnp.pad(jnp.where(scored, entropy, 0.0), pad)


def chunked(params, config, family, tokens, valid, mask):
    return token_logprobs(params, config, family, tokens, valid, mask, temperature=TEMPERATURE, chunk=CHUNK)


def surrogate(fn, model):
    """A GRPO-like scalar of (logp, entropy), returning them as aux."""
    weights = jnp.linspace(-1.0, 1.0, B)[:, None]

    def loss(params, tokens, valid, mask):
        logp, entropy = fn(params, model.config, model.family, tokens, valid, mask)
        return jnp.sum(weights * logp) + 0.1 * jnp.sum(entropy), (logp, entropy)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def test_values_and_grads_equal_naive_and_transformers(setup):
    hf, model, tokens, valid, mask = setup
    (_, (logp, entropy)), grads = surrogate(chunked, model)(model.params, tokens, valid, mask)
    (_, (ref_logp, ref_entropy)), ref_grads = surrogate(naive, model)(model.params, tokens, valid, mask)
    np.testing.assert_allclose(np.asarray(logp), np.asarray(ref_logp), atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy), np.asarray(ref_entropy), atol=1e-5)
    flat, ref_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)
    for (path, g), r in zip(flat, ref_flat):
        scale = float(np.abs(np.asarray(r)).max())
        assert scale > 0, f"no gradient reached {jax.tree_util.keystr(path)}"
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5 * max(1.0, scale), err_msg=jax.tree_util.keystr(path))

    # Independent source: transformers' logits of the same left-padded batch.
    z = hf_logits(hf, tokens, valid.astype(np.int64)).astype(np.float64) / TEMPERATURE
    z = z - z.max(-1, keepdims=True)
    hf_logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = np.take_along_axis(hf_logp[:, :-1], tokens[:, 1:, None].astype(np.int64), axis=-1)[..., 0]
    scored = valid[:, 1:] & valid[:, :-1] & mask[:, 1:]
    np.testing.assert_allclose(np.asarray(logp)[:, 1:], np.where(scored, want, 0.0), atol=1e-4)
    want_entropy = -(np.exp(hf_logp) * hf_logp).sum(-1)[:, :-1]
    np.testing.assert_allclose(np.asarray(entropy)[:, 1:], np.where(scored, want_entropy, 0.0), atol=1e-4)
    assert (np.asarray(logp)[:, 0] == 0).all() and (np.asarray(logp)[~mask] == 0).all()


def _shapes_in(jaxpr, found):
    """Every intermediate shape of a (closed) jaxpr, sub-jaxprs (scan, remat, pjit, cond) included."""
    for eqn in jaxpr.eqns:
        found.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _shapes_in(inner, found)
    return found


def test_no_full_logits_in_forward_or_backward(setup):
    _, model, tokens, valid, mask = setup
    vocab = model.config.vocab_size

    def full_logit_shapes(fn):
        closed = jax.make_jaxpr(surrogate(fn, model))(model.params, tokens, valid, mask)
        return {s for s in _shapes_in(closed.jaxpr, set()) if s and s[-1] == vocab and int(np.prod(s)) >= B * T * vocab}

    assert full_logit_shapes(naive), "the checker must see the naive version's [B, T, V]"
    assert full_logit_shapes(chunked) == set()


def test_logprob_and_entropy_by_hand():
    logits = jnp.asarray([[1.0, 2.0, 0.5], [0.0, 0.0, 0.0]])
    logp, entropy = jax.jit(logprob_and_entropy)(logits, jnp.asarray([1, 2]))
    p = np.exp([1.0, 2.0, 0.5]) / np.exp([1.0, 2.0, 0.5]).sum()
    np.testing.assert_allclose(np.asarray(logp), [np.log(p[1]), -np.log(3.0)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(entropy), [-(p * np.log(p)).sum(), np.log(3.0)], rtol=1e-6)


def test_bad_arguments(setup):
    _, model, tokens, valid, mask = setup
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model.params, model.config, model.family, tokens, valid, temperature=0.0)
    with pytest.raises(ValueError, match="chunk"):
        token_logprobs(model.params, model.config, model.family, tokens, valid, chunk=0)
    with pytest.raises(AssertionError):
        token_logprobs(model.params, model.config, model.family, tokens, valid[:, :-1])


def _remat_config(name, layers, hidden, chunk_size, first=qwen35.LINEAR):
    """A qwen3 or a qwen35 model config; qwen35 alternates linear and full attention layers, `first` first."""
    if name == "qwen3":
        return qwen3.Config(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                            num_heads=4, num_kv_heads=2, head_dim=hidden // 4)
    kinds = (first, qwen35.FULL if first == qwen35.LINEAR else qwen35.LINEAR)
    return qwen35.Config(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=4,
                         num_kv_heads=2, head_dim=hidden // 4, layer_types=tuple(kinds[i % 2] for i in range(layers)),
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=hidden // 4,
                         linear_value_head_dim=hidden // 4, chunk_size=chunk_size)


def _remat_loss(model, remat, layout="stacked"):
    """A GRPO-like scalar of token_logprobs with layer remat `remat`, of stacked params.

    layout "unrolled" runs the forward on `decode_layout(params)` (per-layer
    weights, the layers unrolled), built inside the loss: the gradient is
    still w.r.t. the stacked params, comparable with the stacked run's.
    """

    def loss(params, tokens, valid):
        if layout == "unrolled":
            params, _ = model.family.decode_layout(model.config, params, None, fuse_matmuls=False)
        logp, entropy = token_logprobs(params, model.config, model.family, tokens, valid, remat=remat)
        weights = jnp.linspace(-1.0, 1.0, tokens.shape[0])[:, None]
        return jnp.sum(weights * logp) + 0.1 * jnp.sum(entropy)

    return loss


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_layer_remat_gives_the_same_values_and_gradients(name):
    """Without remat vs "full" (stacked params, the training path) and "dots" (per-layer params, unrolled).

    qwen35 (full, linear, full): the pattern scanned once plus one tail layer, so every remat site runs.
    The training step's gradient with each policy is checked in tests/test_train_update.py too.
    """
    model = init(_remat_config(name, 3, 32, 8, first=qwen35.FULL), jax.random.key(3))
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 128, size=(B, T)).astype(np.int32)
    valid = np.arange(T)[None, :] >= np.array([[0], [4], [9]])
    if name == "qwen35":
        assert model.config.num_repeats == 1 and model.config.tail_types == (qwen35.FULL,)
    runs = {(layout, remat): jax.jit(jax.value_and_grad(_remat_loss(model, remat, layout)))(model.params, tokens, valid)
            for layout, remat in (("stacked", None), ("stacked", "full"), ("unrolled", "dots"))}
    value, grads = runs["stacked", None]
    for key in (("stacked", "full"), ("unrolled", "dots")):
        np.testing.assert_allclose(float(runs[key][0]), float(value), rtol=1e-6, err_msg=str(key))
        for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(runs[key][1]), jax.tree.leaves(grads)):
            scale = float(np.abs(np.asarray(r)).max())
            assert scale > 0, f"no gradient reached {jax.tree_util.keystr(path)}"
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5 * scale,
                                       err_msg=f"{key} {jax.tree_util.keystr(path)}")
    with pytest.raises(ValueError, match=r"remat: 'some', expected None or one of \['dots', 'full'\]"):
        _remat_loss(model, "some")(model.params, tokens, valid)


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_layer_remat_shrinks_the_backward_temporaries(name):
    """XLA's own count of the compiled gradient's temporary bytes, remat off vs on, 8 layers, [2, 256] tokens.

    Without remat the backward keeps every layer's activations (attention
    scores, MLP hiddens, ...): ~64 MiB (qwen3) and ~110 MiB (qwen35) here on
    CPU; with "full" only the [B, T, D] residual between layers plus one
    layer's recomputation: ~11 and ~25 MiB; "dots" keeps the weight matmuls'
    outputs too (~18 MiB, qwen3).
    """
    model = init(_remat_config(name, 8, 64, 64), jax.random.key(0))
    tokens = jnp.zeros((2, 256), jnp.int32)
    valid = jnp.ones((2, 256), bool)
    policies = (None, "full", "dots") if name == "qwen3" else (None, "full")
    temp = {}
    for remat in policies:
        compiled = jax.jit(jax.grad(_remat_loss(model, remat))).lower(model.params, tokens, valid).compile()
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
    print(f"{name}, 8 layers, hidden 64, B=2, T=256, temp bytes of the gradient: "
          + ", ".join(f"remat={r}: {v / 2**20:.1f} MiB" for r, v in temp.items()))
    assert temp["full"] < 0.4 * temp[None], temp
    if "dots" in temp:
        assert temp["full"] < temp["dots"] < 0.5 * temp[None], temp


def _grouped_rows(rng, groups, k, prompt_width, width, vocab):
    """G left-padded prompts and G*K right-padded continuations, and the same rows concatenated, left-padded."""
    prompt_lens = rng.integers(3, prompt_width + 1, size=groups)
    prompt_lens[0] = prompt_width
    cont_lens = rng.integers(1, width + 1, size=groups * k)
    cont_lens[-1] = width
    prompts = np.zeros((groups, prompt_width), np.int32)
    prompt_valid = np.arange(prompt_width)[None, :] >= (prompt_width - prompt_lens)[:, None]
    prompts[prompt_valid] = rng.integers(3, vocab, size=int(prompt_valid.sum()))
    cont_valid = np.arange(width)[None, :] < cont_lens[:, None]
    cont = np.where(cont_valid, rng.integers(3, vocab, size=(groups * k, width)), 0).astype(np.int32)
    mask = cont_valid & (rng.random(cont.shape) < 0.7)
    full_width = prompt_width + width
    full = np.zeros((groups * k, full_width), np.int32)
    full_valid = np.zeros(full.shape, bool)
    full_mask = np.zeros(full.shape, bool)
    for b in range(groups * k):
        row = np.concatenate([prompts[b // k][prompt_valid[b // k]], cont[b][cont_valid[b]]])
        full[b, full_width - len(row):], full_valid[b, full_width - len(row):] = row, True
        full_mask[b, full_width - cont_lens[b]:] = mask[b, :cont_lens[b]]
    return (prompts, prompt_valid, cont, cont_valid, mask), (full, full_valid, full_mask, cont_lens)


@pytest.mark.parametrize("name,remat", [("qwen3", None), ("qwen35", "full"), ("qwen35", None)])
def test_prefix_logprobs_equal_token_logprobs_of_the_whole_rows(name, remat):
    """Prompts run once per group (the GRPO update's prefix sharing): the same log-probs, entropies and
    gradients as `token_logprobs` of every row written out whole. qwen35 (linear, full, linear) with a
    chunk size below the prompt: the continuation starts from the prompt's delta-rule and conv states."""
    from wmrl_jax.logprobs import prefix_logprobs

    model = init(_remat_config(name, 3, 32, 4), jax.random.key(7))
    groups, k = 3, 2
    (prompts, prompt_valid, cont, cont_valid, mask), (full, full_valid, full_mask, lens) = _grouped_rows(
        np.random.default_rng(2), groups, k, 9, 7, 128)
    weights = jnp.linspace(-1.0, 1.0, groups * k)[:, None]

    def shared(params):
        logp, entropy = prefix_logprobs(params, model.config, model.family, prompts, prompt_valid, cont, cont_valid,
                                        mask, group_size=k, temperature=TEMPERATURE, chunk=CHUNK, remat=remat)
        return jnp.sum(weights * logp) + 0.1 * jnp.sum(entropy), (logp, entropy)

    def whole(params):
        logp, entropy = token_logprobs(params, model.config, model.family, full, full_valid, full_mask,
                                       temperature=TEMPERATURE, chunk=CHUNK)
        return jnp.sum(weights * logp) + 0.1 * jnp.sum(entropy), (logp, entropy)

    (value, (logp, entropy)), grads = jax.jit(jax.value_and_grad(shared, has_aux=True))(model.params)
    (ref_value, (ref_logp, ref_entropy)), ref_grads = jax.jit(jax.value_and_grad(whole, has_aux=True))(model.params)
    width = cont.shape[1]
    for b, n in enumerate(lens):   # the continuation's columns of the whole row
        np.testing.assert_allclose(np.asarray(logp[b, :n]), np.asarray(ref_logp[b, -n:]), atol=2e-5)
        np.testing.assert_allclose(np.asarray(entropy[b, :n]), np.asarray(ref_entropy[b, -n:]), atol=2e-5)
        assert not np.asarray(logp[b, n:width]).any()
    assert np.count_nonzero(np.asarray(logp)) == mask.sum() > 0
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        scale = float(np.abs(np.asarray(r)).max())
        assert scale > 0, f"no gradient reached {jax.tree_util.keystr(path)}"
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_prefix_logprobs_bad_arguments():
    from wmrl_jax.logprobs import prefix_logprobs

    model = init(_remat_config("qwen3", 1, 32, 4), jax.random.key(0))
    prompts, tokens = jnp.ones((2, 5), jnp.int32), jnp.ones((6, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"group_size: 2 with 2 prompts and 6 rows; expected an int K >= 1 with "
                                         r"rows = prompts x K"):
        prefix_logprobs(model.params, model.config, model.family, prompts, prompts > 0, tokens, tokens > 0,
                        group_size=2)
