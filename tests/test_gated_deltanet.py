"""The gated delta rule and causal conv vs transformers' pure-PyTorch Qwen3.5 fallbacks.

Reference: ``transformers.models.qwen3_5.modeling_qwen3_5`` — ``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn`` / ``causal_conv1d_update`` — plus a
by-hand recurrence in numpy for the padding semantics.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from wmrl_jax.models import gated_deltanet as gdn


def _inputs(seed, b=2, t=37, h_k=2, h_v=4, d_k=8, d_v=6, with_state=True):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h_k, d_k)).astype(np.float32)
    k = rng.normal(size=(b, t, h_k, d_k)).astype(np.float32)
    v = rng.normal(size=(b, t, h_v, d_v)).astype(np.float32)
    # Realistic decays: -exp(A_log) * softplus(a + dt_bias), some strong, some ~0.
    g = (-np.exp(rng.uniform(-3, 1.5, size=(1, 1, h_v))) * np.log1p(np.exp(rng.normal(size=(b, t, h_v))))).astype(
        np.float32
    )
    beta = (1 / (1 + np.exp(-rng.normal(size=(b, t, h_v))))).astype(np.float32)
    s0 = rng.normal(size=(b, h_v, d_k, d_v)).astype(np.float32) if with_state else None
    return q, k, v, g, beta, s0


def _torch(fn, q, k, v, g, beta, s0, **kw):
    t = lambda x: None if x is None else torch.from_numpy(x)
    out, state = fn(
        t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=t(s0), output_final_state=True,
        use_qk_l2norm_in_kernel=True, **kw,
    )
    return out.numpy(), state.numpy()


@pytest.mark.parametrize("t,chunk,h_k,h_v", [(37, 16, 2, 4), (64, 16, 3, 3), (5, 16, 1, 2), (37, 12, 2, 4), (9, 1, 1, 2)])
def test_chunked_equals_recurrent_f32(t, chunk, h_k, h_v):
    q, k, v, g, beta, s0 = _inputs(t, t=t, h_k=h_k, h_v=h_v)
    o_c, s_c = gdn.chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk)
    o_r, s_r = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o_c, o_r, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s_c, s_r, atol=1e-5, rtol=1e-5)


def test_chunked_matches_transformers():
    q, k, v, g, beta, s0 = _inputs(1, t=37)
    ref_o, ref_s = _torch(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, s0, chunk_size=16)
    o, s = gdn.chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=16)
    np.testing.assert_allclose(o, ref_o, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s, ref_s, atol=1e-5, rtol=1e-5)


def test_recurrent_matches_transformers():
    q, k, v, g, beta, s0 = _inputs(2, t=37)
    ref_o, ref_s = _torch(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, s0)
    o, s = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o, ref_o, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s, ref_s, atol=1e-5, rtol=1e-5)


def test_zero_beta_and_g_leave_state_untouched():
    """The padding mechanism the model uses: β = 0, g = 0 at a token means S is unchanged there."""
    q, k, v, g, beta, s0 = _inputs(3, t=37)
    keep = np.ones((2, 37), bool)
    keep[0, 3:9] = False
    keep[1, :11] = False
    g_m, beta_m = g * keep[..., None], beta * keep[..., None]
    _, s_masked = gdn.chunk_gated_delta_rule(q, k, v, g_m, beta_m, s0, chunk_size=16)
    for row in range(2):
        idx = np.flatnonzero(keep[row])
        sub = lambda x: x[row : row + 1, idx]
        _, s_ref = gdn.recurrent_gated_delta_rule(sub(q), sub(k), sub(v), sub(g), sub(beta), s0[row : row + 1])
        np.testing.assert_allclose(s_masked[row : row + 1], s_ref, atol=1e-5, rtol=1e-5)


def test_chunked_gradients_are_finite():
    q, k, v, g, beta, s0 = _inputs(4, t=19)
    loss = lambda *a: jnp.sum(gdn.chunk_gated_delta_rule(*a, chunk_size=8)[0] ** 2)
    grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in grads)
    assert all(float(jnp.abs(x).max()) > 0 for x in grads)


def _hf_conv_weight(weight_kc):
    return torch.from_numpy(np.ascontiguousarray(weight_kc.T))  # [C, K] (the squeezed [C, 1, K])


def test_conv_matches_transformers_prefill_and_update():
    rng = np.random.default_rng(5)
    b, t, c, kern = 2, 11, 6, 4
    x = rng.normal(size=(b, t, c)).astype(np.float32)
    w = rng.normal(size=(kern, c)).astype(np.float32)
    ref = hf.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), _hf_conv_weight(w), None, activation="silu")
    y, state = gdn.causal_conv1d(x, w)
    np.testing.assert_allclose(y, ref.transpose(1, 2).numpy(), atol=1e-6)
    np.testing.assert_allclose(state, x[:, -(kern - 1) :], atol=0)

    x1 = rng.normal(size=(b, 1, c)).astype(np.float32)
    hf_state = torch.from_numpy(np.ascontiguousarray(np.swapaxes(np.asarray(state), 1, 2)))
    ref1 = hf.causal_conv1d_update(torch.from_numpy(x1).transpose(1, 2), hf_state, _hf_conv_weight(w), None, "silu")
    y1, state1 = gdn.causal_conv1d(x1, w, state)
    np.testing.assert_allclose(y1, ref1.transpose(1, 2).numpy(), atol=1e-6)
    np.testing.assert_allclose(state1, np.swapaxes(hf_state.numpy(), 1, 2), atol=0)


def test_conv_skips_padding_anywhere():
    """Padded tokens (left, middle, and a single-token step) are skipped exactly: compare with the valid subsequence."""
    rng = np.random.default_rng(6)
    b, t, c, kern = 3, 9, 5, 4
    x = rng.normal(size=(b, t, c)).astype(np.float32)
    w = rng.normal(size=(kern, c)).astype(np.float32)
    s0 = rng.normal(size=(b, kern - 1, c)).astype(np.float32)
    valid = np.ones((b, t), bool)
    valid[0, :4] = False  # left padding
    valid[1, [2, 3, 7]] = False  # holes
    y, state = gdn.causal_conv1d(x, w, s0, valid)
    for row in range(b):
        idx = np.flatnonzero(valid[row])
        y_ref, s_ref = gdn.causal_conv1d(x[row : row + 1, idx], w, s0[row : row + 1])
        np.testing.assert_allclose(np.asarray(y)[row, idx], y_ref[0], atol=1e-6)
        np.testing.assert_allclose(np.asarray(y)[row, ~valid[row]], 0.0)
        np.testing.assert_allclose(state[row], s_ref[0], atol=0)
    _, held = gdn.causal_conv1d(x[:, :1], w, s0, np.zeros((b, 1), bool))
    np.testing.assert_allclose(held, s0, atol=0)


def test_bad_shapes_name_the_tensor():
    q, k, v, g, beta, s0 = _inputs(7, t=4, h_k=3, h_v=4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdn.chunk_gated_delta_rule(q, k, v, g, beta)
    q, k, v, g, beta, s0 = _inputs(7, t=4)
    with pytest.raises(ValueError, match="initial_state"):
        gdn.recurrent_gated_delta_rule(q, k, v, g, beta, s0[:, :1])
    with pytest.raises(ValueError, match="conv weight"):
        gdn.causal_conv1d(np.zeros((1, 3, 5), np.float32), np.zeros((4, 6), np.float32))


@pytest.mark.parametrize("size", [1, 6, 16, 17])  # the Neumann product needs 2^m >= size factors
def test_unit_lower_triangular_inverse_matches_numpy(size):
    a = np.random.default_rng(size).normal(size=(3, size, size)).astype(np.float32) * 0.4
    unit = np.tril(a.astype(np.float64), -1) + np.eye(size)
    np.testing.assert_allclose(gdn.unit_lower_triangular_inverse(a), np.linalg.inv(unit), atol=1e-5, rtol=1e-5)
