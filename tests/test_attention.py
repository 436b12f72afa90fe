"""models.attention: which kernel runs where, and that the library kernels compute what blocked attention does.

On CPU: "auto" falls back to the blocked kernel and "cudnn" refuses with the
reason; `jax.nn.dot_product_attention(implementation="xla")` equals the
blocked attention (f32, grouped-query, causal, left padding) on every query
row that has a real token, forward and gradients. On a GPU
(launch/device_check.sh) the same comparison runs against cuDNN in bf16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wmrl_jax.models import attention
from wmrl_jax.models.blocked_attention import blocked_causal_attention

GPU = jax.default_backend() == "gpu"


def _inputs(dtype, b=3, t=96, n=8, kv=2, h=64, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k1, (b, t, n, h), jnp.float32).astype(dtype)
    k = jax.random.normal(k2, (b, kv, t, h), jnp.float32).astype(dtype)
    v = jax.random.normal(k3, (b, kv, t, h), jnp.float32).astype(dtype)
    pads = np.array([0, 17, 60][:b])                    # left padding of each row
    valid = np.arange(t)[None, :] >= pads[:, None]
    return q, k, v, jnp.asarray(valid), h**-0.5


def _compare(kernel, dtype, atol):
    q, k, v, valid, scale = _inputs(dtype)
    real = np.asarray(valid)[:, :, None, None]           # query rows with a real token

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(jnp.where(valid[:, :, None, None], out.astype(jnp.float32), 0.0) ** 2), out

    def blocked(q, k, v):
        return blocked_causal_attention(q, k, v, valid, scale, block_q=32, block_k=32)

    def library(q, k, v):
        return attention.causal_attention(q, k, v, valid, scale, implementation=kernel)

    (_, want), grads_want = jax.value_and_grad(lambda *a: loss(blocked, *a), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (_, got), grads_got = jax.value_and_grad(lambda *a: loss(library, *a), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert got.dtype == q.dtype and got.shape == q.shape
    np.testing.assert_allclose(np.where(real, np.asarray(got, np.float32), 0),
                               np.where(real, np.asarray(want, np.float32), 0), atol=atol, rtol=atol)
    for g, w, name in zip(grads_got, grads_want, "qkv"):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if name == "q":
            g, w = np.where(real, g, 0), np.where(real, w, 0)
        scale_ = max(1.0, np.abs(w).max())
        np.testing.assert_allclose(g / scale_, w / scale_, atol=atol, err_msg=f"d{name}")


# The library kernels this backend has, each against the blocked attention: XLA's everywhere (f32), cuDNN's
# on a GPU (bf16; launch/device_check.sh runs this file there). A kernel the backend lacks has no case here.
LIBRARY_KERNELS = [("xla", jnp.float32, 2e-5)] + ([("cudnn", jnp.bfloat16, 3e-2)] if GPU else [])


@pytest.mark.parametrize("kernel,dtype,atol", LIBRARY_KERNELS, ids=[k for k, *_ in LIBRARY_KERNELS])
def test_library_kernel_equals_blocked(kernel, dtype, atol):
    if kernel == "cudnn":
        assert attention.selected(*_inputs(dtype)[:2], 0, "auto") == "cudnn"
    _compare(kernel, dtype, atol)


def test_auto_follows_the_backend_and_cudnn_off_gpu_says_why():
    q, k, _, _, _ = _inputs(jnp.bfloat16)
    if GPU:
        assert attention.selected(q, k, 0, "auto") == "cudnn"
        return
    assert attention.selected(q, k, 0, "auto") == "blocked"
    with pytest.raises(ValueError, match="'cudnn' does not apply: backend 'cpu', cuDNN needs a GPU"):
        attention.selected(q, k, 0, "cudnn")


def test_selection_rules_and_bad_names():
    q, k, _, _, _ = _inputs(jnp.float32, t=32)
    # A prefill into a cache (traced offset) or more keys than queries: cuDNN's is_causal cannot express it.
    assert "prefill into a cache" in attention.cudnn_unsupported(q, k, jnp.int32(4))
    assert "is_causal aligns them" in attention.cudnn_unsupported(q[:, :16], k, 0)
    assert "bf16 / fp16" in attention.cudnn_unsupported(q, k, 0)
    assert attention.selected(q, k, jnp.int32(4), "auto") == "blocked"
    with pytest.raises(ValueError, match="'xla': expected queries and keys starting at slot 0"):
        attention.selected(q, k, 3, "xla")
    with pytest.raises(ValueError, match=r"config.attention: 'flash', expected one of \('auto', 'blocked'"):
        attention.set_implementation("flash")
    assert attention.get_implementation() == "auto"
    with pytest.raises(ValueError, match="implementation: 'flash'"):
        attention.selected(q, k, 0, "flash")


def test_the_model_uses_the_selected_kernel():
    """qwen35's full-attention layers go through models.attention: forcing 'xla' gives the same logits (f32)."""
    from wmrl_jax import micro_world
    from wmrl_jax.models import load_hf

    model = load_hf(micro_world.shipped_path())
    tokens = np.array([[0, 0, 5, 17, 33, 200], [8, 9, 250, 3, 4, 5]], np.int32)
    valid = tokens != 0
    want = np.asarray(model.logits(tokens, valid))
    try:
        attention.set_implementation("xla")
        got = np.asarray(jax.jit(lambda p: model.family.unembed(p, model.config, model.family.forward(
            p, model.config, tokens, jnp.asarray(np.maximum(np.cumsum(valid, 1) - 1, 0)), jnp.asarray(valid))[0]))(
            model.params))
    finally:
        attention.set_implementation("auto")
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4)
