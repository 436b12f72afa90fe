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


def _naive_sum(q, k, v, valid_k, weights, scale):
    mask = layers.attention_mask(jnp.ones(q.shape[:2], bool), jnp.asarray(valid_k))
    return jnp.sum(layers.gqa_attention(q, k, v, mask, scale, kv_layout="bksh").astype(jnp.float32) * weights)


@pytest.mark.parametrize(
    "t,n,kv,block_q,block_k",
    [
        (37, 4, 2, 8, 16),  # GQA (2 query heads a KV head), neither length a multiple of a block
        (37, 4, 4, 64, 64),  # one block each way (clipped), one query head a KV head
        (40, 6, 2, 8, 8),  # square blocks that tile the sequence, 3 query heads a KV head
    ],
)
def test_gradients_equal_naive(t, n, kv, block_q, block_k):
    """The custom_vjp (recompute) backward: d/dq, d/dk, d/dv equal jax.grad of the full-score version."""
    b, h = 2, 8
    q, k, v = _qkv(t + n, b=b, t=t, s=t, n=n, kv=kv, h=h)
    valid = np.ones((b, t), bool)
    valid[1, :5] = False  # left padding in row 1
    valid[0, 3] = False  # a hole
    seen = np.array([[valid[bi, : i + 1].any() for i in range(t)] for bi in range(b)])
    weights = np.random.default_rng(t).normal(size=(b, t, n, h)).astype(np.float32)
    # A row with no visible key (row 1's padding) gets a finite average that differs between the two (they
    # average different key sets); no loss reads it, so it gets no cotangent here.
    weights *= seen[:, :, None, None]

    def blocked_sum(q, k, v):
        out = blocked_causal_attention(q, k, v, valid, 0.3, block_q=block_q, block_k=block_k)
        return jnp.sum(out * weights)

    value, grads = jax.jit(jax.value_and_grad(blocked_sum, argnums=(0, 1, 2)))(q, k, v)
    ref_value, ref_grads = jax.value_and_grad(_naive_sum, argnums=(0, 1, 2))(q, k, v, valid, weights, 0.3)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-4)
    for name, g, ref in zip("qkv", grads, ref_grads):
        assert g.shape == ref.shape and g.dtype == ref.dtype, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), atol=1e-5, rtol=1e-4, err_msg=f"d/d{name}")
    # Padded keys get no gradient: no query sees them.
    assert np.all(np.asarray(grads[1])[1, :, :5] == 0) and np.all(np.asarray(grads[2])[1, :, :5] == 0)


def test_gradients_bf16_and_masked_rows_finite():
    """bf16 inputs (the update's compute dtype) with a cotangent on every row, padded ones included: finite
    gradients in bf16, close to the same function's f32 gradients (which the test above ties to the naive one)."""
    q, k, v = _qkv(3, b=2, t=24, s=24, n=4, kv=2, h=8)
    valid = np.ones((2, 24), bool)
    valid[1, :6] = False  # rows 0..5 of sequence 1 see no key
    weights = np.random.default_rng(3).normal(size=q.shape).astype(np.float32)

    def loss(q, k, v):
        out = blocked_causal_attention(q, k, v, valid, 0.3, block_q=8, block_k=8)
        return jnp.sum(out.astype(jnp.float32) * weights)

    grads = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)))
    ref = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", grads, ref):
        assert g.dtype == jnp.bfloat16, name
        g = np.asarray(g, np.float32)
        assert np.isfinite(g).all(), name
        # bf16 inputs and bf16 p / ds in the block products: a few percent of the gradient's scale.
        np.testing.assert_allclose(g, np.asarray(r), atol=0.03 * np.abs(r).max(), err_msg=f"d/d{name}")


def test_backward_keeps_no_score_block_per_step():
    """The memory claim: the compiled gradient's temporaries stay near the forward's, far below the [T, T]
    f32 scores per head that jax.grad of the key-block loop kept."""
    b, t, n, kv, h = 1, 2048, 4, 2, 32
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32)
    k = jax.ShapeDtypeStruct((b, kv, t, h), jnp.float32)
    valid = jax.ShapeDtypeStruct((b, t), bool)
    grad = jax.jit(jax.grad(lambda q, k, v, valid: jnp.sum(
        blocked_causal_attention(q, k, v, valid, 0.1, block_q=128, block_k=128)), argnums=(0, 1, 2)))
    temps = grad.lower(q, k, k, valid).compile().memory_analysis().temp_size_in_bytes
    scores = b * n * t * t * 4 / 2   # the causal half of the f32 score matrix
    assert temps < scores / 4, f"gradient temporaries {temps / 2**20:.1f} MiB vs half scores {scores / 2**20:.1f} MiB"


def test_traced_offset_is_forward_only():
    """A traced q_offset (cache prefill) runs the forward; differentiating it is refused by JAX, not wrong."""
    q, k, v = _qkv(5, b=1, t=4, s=8, n=2, kv=1, h=4)
    valid = np.ones((1, 8), bool)
    out = jax.jit(lambda q, off: blocked_causal_attention(q, k, v, valid, 0.5, q_offset=off, block_q=2,
                                                          block_k=2))(q, jnp.int32(4))
    np.testing.assert_allclose(np.asarray(out), _naive(q, k, v, valid, 4, 0.5), atol=2e-6)
