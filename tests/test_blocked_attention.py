"""Blocked (online-softmax) causal attention vs the naive full-score version and a numpy softmax.

The naive reference is ``layers.gqa_attention`` with ``layers.attention_mask`` (the whole
[B, K, G, T, S] score tensor), checked itself against a float64 numpy softmax on one case.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wmrl_jax.models import layers
from wmrl_jax.models.blocked_attention import blocked_causal_attention


def _qkv(seed, b, t, s, n, kv, h):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k = rng.normal(size=(b, kv, s, h)).astype(np.float32)
    v = rng.normal(size=(b, kv, s, h)).astype(np.float32)
    return q, k, v


def _naive(q, k, v, valid_k, offset, scale):
    valid_q = np.ones(q.shape[:2], bool)
    mask = layers.attention_mask(jnp.asarray(valid_q), jnp.asarray(valid_k), q_offset=offset)
    return np.asarray(layers.gqa_attention(q, k, v, mask, scale, kv_layout="bksh"))


def _numpy(q, k, v, valid_k, offset, scale):
    b, t, n, h = q.shape
    g = n // k.shape[1]
    out = np.zeros(q.shape)
    for bi in range(b):
        for ni in range(n):
            scores = q[bi, :, ni].astype(np.float64) @ k[bi, ni // g].T.astype(np.float64) * scale
            visible = (np.arange(k.shape[2])[None, :] <= offset + np.arange(t)[:, None]) & valid_k[bi][None, :]
            scores = np.where(visible, scores, -np.inf)
            with np.errstate(invalid="ignore"):  # rows with no visible key are NaN here and not compared
                probs = np.exp(scores - scores.max(-1, keepdims=True))
            out[bi, :, ni] = (probs / probs.sum(-1, keepdims=True)) @ v[bi, ni // g]
    return out


@pytest.mark.parametrize(
    "t,s,offset,block_q,block_k",
    [
        (37, 37, 0, 8, 16),  # no cache: neither length a multiple of a block
        (37, 37, 0, 64, 64),  # blocks larger than the sequence (clipped)
        (21, 40, 0, 8, 8),  # cache prefill into a longer cache (slots past T invalid)
        (6, 40, 12, 4, 8),  # a later chunk: queries start at slot 12, earlier slots cached
    ],
)
@pytest.mark.parametrize("traced_offset", [False, True])
def test_blocked_equals_naive(t, s, offset, block_q, block_k, traced_offset):
    q, k, v = _qkv(t + s, b=2, t=t, s=s, n=4, kv=2, h=8)
    valid = np.zeros((2, s), bool)
    valid[:, : offset + t] = True
    valid[1, :5] = False  # left padding in row 1
    valid[0, offset + 2] = False  # a hole
    off = jnp.int32(offset) if traced_offset else offset
    fn = jax.jit(
        lambda q, k, v, valid, off: blocked_causal_attention(
            q, k, v, valid, 0.3, q_offset=off, block_q=block_q, block_k=block_k
        ),
        static_argnums=() if traced_offset else (4,),
    )
    out = np.asarray(fn(q, k, v, valid, off))
    ref = _naive(q, k, v, valid, offset, 0.3)
    seen = np.array([[valid[b, : offset + i + 1].any() for i in range(t)] for b in range(2)])  # rows with a visible key
    np.testing.assert_allclose(out[seen], ref[seen], atol=2e-6, rtol=1e-5)
    assert np.isfinite(out).all()


def test_naive_reference_equals_numpy_softmax():
    q, k, v = _qkv(0, b=2, t=9, s=9, n=4, kv=1, h=4)
    valid = np.ones((2, 9), bool)
    valid[1, :3] = False
    out = np.asarray(blocked_causal_attention(q, k, v, valid, 0.5, block_q=4, block_k=2))
    ref = _numpy(q, k, v, valid, 0, 0.5)
    np.testing.assert_allclose(out[1, 3:], ref[1, 3:], atol=1e-5)
    np.testing.assert_allclose(out[0], ref[0], atol=1e-5)
    np.testing.assert_allclose(_naive(q, k, v, valid, 0, 0.5)[0], ref[0], atol=1e-5)


def test_bad_shapes_name_the_tensor():
    q, k, v = _qkv(1, b=1, t=4, s=4, n=3, kv=2, h=4)
    with pytest.raises(ValueError, match="multiple of 2 KV heads"):
        blocked_causal_attention(q, k, v, np.ones((1, 4), bool), 1.0)
    q, k, v = _qkv(1, b=1, t=4, s=4, n=4, kv=2, h=4)
    with pytest.raises(ValueError, match="valid_bs"):
        blocked_causal_attention(q, k, v, np.ones((1, 5), bool), 1.0)
    with pytest.raises(ValueError, match="k/v"):
        blocked_causal_attention(q, k[..., :3], v, np.ones((1, 4), bool), 1.0)
