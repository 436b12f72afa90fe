"""Qwen3.5 (hybrid Gated DeltaNet + gated attention): params, cache and cached forward.

The config and presets live in ``qwen35_config``, the HF name table in
``qwen35_hf``; both are re-exported here, so this module is the whole
``family.ModelFamily``.

Matches transformers' ``models/qwen3_5/modeling_qwen3_5.py`` (text model):
pre-norm decoder whose token mixer is, per ``layer_types``, either

* ``linear_attention`` — Gated DeltaNet: ``in_proj_qkv`` → causal depthwise
  conv (+SiLU) → split [q | k | v]; β = σ(b), g = −exp(A_log)·softplus(a +
  dt_bias); the gated delta rule (``gated_deltanet``) with L2-normalised q, k;
  gated RMSNorm ``w · norm(o) · silu(z)``; ``out_proj``; or
* ``full_attention`` — GQA whose ``q_proj`` yields query and an output gate
  per head, (1 + w) RMSNorm on q and k, RoPE on the first
  ``partial_rotary_factor`` of each head, output × σ(gate).

then a SwiGLU MLP. Every RMSNorm except the gated one is the (1 + w) kind.
Implements ``family.ModelFamily``.

Layer heterogeneity compiles flat: ``layer_types`` is split into its
shortest repeating pattern (3 × linear + 1 × full for the released models),
``lax.scan`` runs over the R repeats with the pattern unrolled in the body,
and the remaining ``num_layers − R·P`` layers (a pattern need not divide the
depth) run after it. Params and cache therefore have two parts:
``blocks[j]`` (pattern position j, every leaf stacked over the R repeats:
HF layer ``r·P + j`` is slice r) and ``tail[i]`` (unstacked).

Einsum letters: B batch, T length, S cache slots, D model, F MLP width,
V vocab; attention N query heads, K KV heads, H head dim; linear attention
C conv channels (2·J·E + M·U), J key heads, M value heads, E key dim,
U value dim, W conv kernel.

Padding: padded tokens are skipped by the conv, get β = 0 and g = 0 (the
delta-rule state is left exactly as it was), and are masked as attention keys.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from wmrl_jax.models import gated_deltanet as gdn
from wmrl_jax.models import layers as L
from wmrl_jax.models.attention import causal_attention
from wmrl_jax.models.family import Cache, Params, remat_layer
from wmrl_jax.models.qwen35_config import (  # noqa: F401 - the family contract and the presets, re-exported
    CAUSAL_LM,
    CONDITIONAL_GENERATION,
    FULL,
    LINEAR,
    MODEL_TYPES,
    PRESETS,
    QWEN35_4B,
    QWEN35_9B,
    Config,
    config_from_hf,
    config_to_hf,
)
from wmrl_jax.models.qwen35_hf import hf_ignore, hf_table  # noqa: F401 - family contract, re-exported
from wmrl_jax.models.sharding import constrain

# --------------------------------------------------------------------------- params


def _mlp_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    d, f = c.hidden_size, c.intermediate_size
    return {"mlp_norm_d": (d,), "gate_proj_df": (d, f), "up_proj_df": (d, f), "down_proj_fd": (f, d)}


def _layer_shapes(c: Config, kind: str) -> dict[str, tuple[int, ...]]:
    d = c.hidden_size
    if kind == FULL:
        n, k, h = c.num_heads, c.num_kv_heads, c.head_dim
        mixer = {
            "attn_norm_d": (d,),
            # [..., 0, :] is the query, [..., 1, :] the output gate (HF's per-head chunk of q_proj).
            "q_gate_proj_dnxh": (d, n, 2, h),
            "k_proj_dkh": (d, k, h),
            "v_proj_dkh": (d, k, h),
            "q_norm_h": (h,),
            "k_norm_h": (h,),
            "o_proj_nhd": (n, h, d),
        }
    else:
        m, u = c.linear_num_value_heads, c.linear_value_head_dim
        mixer = {
            "attn_norm_d": (d,),
            "qkv_proj_dc": (d, c.conv_dim),
            "z_proj_dmu": (d, m, u),
            "b_proj_dm": (d, m),
            "a_proj_dm": (d, m),
            "conv_wc": (c.linear_conv_kernel, c.conv_dim),
            "dt_bias_m": (m,),
            "a_log_m": (m,),
            "out_norm_u": (u,),
            "out_proj_mud": (m, u, d),
        }
    return {**mixer, **_mlp_shapes(c)}


_AXES = {
    "attn_norm_d": ("norm",),
    "q_gate_proj_dnxh": ("embed", "heads", None, "head_dim"),
    "k_proj_dkh": ("embed", "kv_heads", "head_dim"),
    "v_proj_dkh": ("embed", "kv_heads", "head_dim"),
    "q_norm_h": ("norm",),
    "k_norm_h": ("norm",),
    "o_proj_nhd": ("heads", "head_dim", "embed"),
    "qkv_proj_dc": ("embed", "conv_channels"),
    "z_proj_dmu": ("embed", "value_heads", "value_dim"),
    "b_proj_dm": ("embed", "value_heads"),
    "a_proj_dm": ("embed", "value_heads"),
    "conv_wc": ("conv_kernel", "conv_channels"),
    "dt_bias_m": ("value_heads",),
    "a_log_m": ("value_heads",),
    "out_norm_u": ("norm",),
    "out_proj_mud": ("value_heads", "value_dim", "embed"),
    "mlp_norm_d": ("norm",),
    "gate_proj_df": ("embed", "mlp"),
    "up_proj_df": ("embed", "mlp"),
    "down_proj_fd": ("mlp", "embed"),
}


def _layers_tree(c: Config, leaf) -> dict:
    """{"blocks": {j: {name: leaf(name, shape, stacked=True)}}, "tail": {i: {... stacked=False}}}.

    "tail" is left out when the pattern divides the depth, as in a checkpoint loaded by `load_hf`
    (whose tree has only the tensors the checkpoint holds): params, axes and loads agree.
    """
    tree = {"blocks": {
        str(j): {n: leaf(n, s, True) for n, s in _layer_shapes(c, kind).items()} for j, kind in enumerate(c.pattern)
    }}
    if c.tail_types:
        tree["tail"] = {
            str(i): {n: leaf(n, s, False) for n, s in _layer_shapes(c, kind).items()}
            for i, kind in enumerate(c.tail_types)
        }
    return tree


def param_axes(config: Config) -> dict:
    axes = {
        "embed_vd": ("vocab", "embed"),
        "final_norm_d": ("norm",),
        **_layers_tree(config, lambda name, shape, stacked: (("layers",) if stacked else ()) + _AXES[name]),
    }
    if not config.tie_word_embeddings:
        axes["lm_head_dv"] = ("embed", "vocab")
    return axes


def init_params(config: Config, rng: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random init as transformers does it: N(0, initializer_range) matrices, (1 + w) norms at 0,
    the gated norm at 1, dt_bias = 1, A = exp(A_log) ~ U(0.01, 16)."""
    c = config
    counter = iter(range(1 << 30))

    def leaf(name, shape, stacked):
        shape = ((c.num_repeats,) if stacked else ()) + shape
        key = jax.random.fold_in(rng, next(counter))
        if name == "out_norm_u" or name == "dt_bias_m":
            return jnp.ones(shape, dtype)
        if name.endswith("norm_d") or name.endswith("norm_h"):
            return jnp.zeros(shape, dtype)
        if name == "a_log_m":
            return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)
        return (c.initializer_range * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    params = {
        "embed_vd": leaf("embed_vd", (c.vocab_size, c.hidden_size), False),
        "final_norm_d": leaf("final_norm_d", (c.hidden_size,), False),
        **_layers_tree(c, leaf),
    }
    if not c.tie_word_embeddings:
        params["lm_head_dv"] = leaf("lm_head_dv", (c.hidden_size, c.vocab_size), False)
    return params


# --------------------------------------------------------------------------- cache


def _layer_cache_shapes(c: Config, kind: str, batch: int, max_len: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape, is_f32_state)."""
    if kind == FULL:
        kv = (batch, c.num_kv_heads, max_len, c.head_dim)  # head-major: decode reads it without a transpose
        return {"k": (kv, False), "v": (kv, False)}
    m, e, u = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    return {"conv": ((batch, c.linear_conv_kernel - 1, c.conv_dim), False), "state": ((batch, m, e, u), True)}


_CACHE_AXES = {
    "k": ("batch", "kv_heads", "cache_length", "head_dim"),
    "v": ("batch", "kv_heads", "cache_length", "head_dim"),
    "conv": ("batch", "conv_kernel", "conv_channels"),
    "state": ("batch", "value_heads", "key_dim", "value_dim"),
}


def _cache_tree(c: Config, leaf) -> dict:
    return {
        "blocks": {str(j): {n: leaf(n, True) for n in _layer_cache_shapes(c, kind, 1, 1)} for j, kind in enumerate(c.pattern)},
        "tail": {str(i): {n: leaf(n, False) for n in _layer_cache_shapes(c, kind, 1, 1)} for i, kind in enumerate(c.tail_types)},
    }


def init_cache(config: Config, batch: int, max_len: int, dtype: Any = jnp.float32) -> Cache:
    """KV for attention layers (``dtype``), conv state (``dtype``) + f32 delta-rule state for linear layers."""
    c = config
    kinds = {"blocks": dict(enumerate(c.pattern)), "tail": dict(enumerate(c.tail_types))}

    def zeros(part, pos, name):
        shape, f32 = _layer_cache_shapes(c, kinds[part][int(pos)], batch, max_len)[name]
        lead = (c.num_repeats,) if part == "blocks" else ()
        return jnp.zeros(lead + shape, jnp.float32 if f32 else dtype)

    layers = {
        part: {pos: {name: zeros(part, pos, name) for name in names} for pos, names in tree.items()}
        for part, tree in _cache_tree(c, lambda n, s: None).items()
    }
    return {"index": jnp.zeros((), jnp.int32), "valid": jnp.zeros((batch, max_len), bool), **layers}


def cache_axes(config: Config) -> dict:
    tree = _cache_tree(config, lambda name, stacked: (("layers",) if stacked else ()) + _CACHE_AXES[name])
    return {"index": (), "valid": ("batch", "cache_length"), **tree}


# --------------------------------------------------------------------------- forward


# How many leading dims each projection weight contracts (`layers.fuse_projections`).
_PROJ_IN = {
    "qkv_proj_dc": 1, "z_proj_dmu": 1, "b_proj_dm": 1, "a_proj_dm": 1, "out_proj_mud": 2, "q_gate_proj_dnxh": 1,
    "k_proj_dkh": 1, "v_proj_dkh": 1, "o_proj_nhd": 2, "gate_proj_df": 1, "up_proj_df": 1, "down_proj_fd": 1,
}  # fmt: skip


def _linear_attention(lp: dict, c: Config, h_btd: jax.Array, valid: jax.Array, cache: dict | None):
    """Gated DeltaNet token mixer. h: normed input [B, T, D]; returns ([B, T, D], new layer cache)."""
    b, t, _ = h_btd.shape
    j, e = c.linear_num_key_heads, c.linear_key_head_dim
    m, u = c.linear_num_value_heads, c.linear_value_head_dim
    if "in_proj_dx" in lp:  # decode layout: q|k|v, z, b and a stacked, one product
        x_btx = L.project("btd,dx->btx", h_btd, lp["in_proj_dx"])
        mixed_btc, z_btx, b_btm, a_btm = jnp.split(x_btx, np.cumsum([c.conv_dim, m * u, m]), axis=-1)
        z_btmu = z_btx.reshape(b, t, m, u)
    else:
        mixed_btc = L.project("btd,dc->btc", h_btd, lp["qkv_proj_dc"])
        z_btmu = L.project("btd,dmu->btmu", h_btd, lp["z_proj_dmu"])
        b_btm = L.project("btd,dm->btm", h_btd, lp["b_proj_dm"])
        a_btm = L.project("btd,dm->btm", h_btd, lp["a_proj_dm"])
    b_btm, a_btm = b_btm.astype(jnp.float32), a_btm.astype(jnp.float32)
    conv_state = None if cache is None else cache["conv"]
    mixed_btc, new_conv = gdn.causal_conv1d(mixed_btc, lp["conv_wc"], conv_state, valid)
    q_btje = mixed_btc[..., : c.key_dim].reshape(b, t, j, e)
    k_btje = mixed_btc[..., c.key_dim : 2 * c.key_dim].reshape(b, t, j, e)
    v_btmu = mixed_btc[..., 2 * c.key_dim :].reshape(b, t, m, u)
    keep = valid[..., None].astype(jnp.float32)
    # β = 0 and g = 0 on padding: the state is neither written nor decayed there.
    beta_btm = jax.nn.sigmoid(b_btm) * keep
    a_log = lp["a_log_m"].astype(jnp.float32)
    g_btm = -jnp.exp(a_log) * jax.nn.softplus(a_btm + lp["dt_bias_m"].astype(jnp.float32)) * keep
    state = None if cache is None else cache["state"]
    if cache is not None and t == 1:
        o_btmu, new_state = gdn.recurrent_gated_delta_rule(q_btje, k_btje, v_btmu, g_btm, beta_btm, state)
    else:
        o_btmu, new_state = gdn.chunk_gated_delta_rule(
            q_btje, k_btje, v_btmu, g_btm, beta_btm, state, chunk_size=c.chunk_size
        )
    o_btmu = constrain(o_btmu, ("batch", "length", "value_heads", "value_dim"))
    # Gated RMSNorm: plain w (initialised to 1), not (1 + w); the gate is applied in f32.
    o_btmu = L.rms_norm(o_btmu.astype(jnp.float32), lp["out_norm_u"], c.rms_norm_eps) * jax.nn.silu(
        z_btmu.astype(jnp.float32)
    )
    out_btd = L.project("btmu,mud->btd", o_btmu.astype(h_btd.dtype), lp["out_proj_mud"])
    new_cache = None if cache is None else {"conv": new_conv.astype(cache["conv"].dtype), "state": new_state}
    return out_btd, new_cache


def _full_attention(lp: dict, c: Config, h_btd: jax.Array, ctx: dict, cache: dict | None):
    """Gated GQA token mixer. h: normed input [B, T, D]; returns ([B, T, D], new layer cache)."""
    b, t, _ = h_btd.shape
    n, k, h = c.num_heads, c.num_kv_heads, c.head_dim
    if "qkv_gate_proj_dx" in lp:  # decode layout: q|gate, k and v stacked, one product
        x_btx = L.project("btd,dx->btx", h_btd, lp["qkv_gate_proj_dx"])
        qg_btx, k_btx, v_btx = jnp.split(x_btx, np.cumsum([n * 2 * h, k * h]), axis=-1)
        qg_btnxh, k_btkh, v_btkh = qg_btx.reshape(b, t, n, 2, h), k_btx.reshape(b, t, k, h), v_btx.reshape(b, t, k, h)
    else:
        qg_btnxh = L.project("btd,dnxh->btnxh", h_btd, lp["q_gate_proj_dnxh"])
        k_btkh = L.project("btd,dkh->btkh", h_btd, lp["k_proj_dkh"])
        v_btkh = L.project("btd,dkh->btkh", h_btd, lp["v_proj_dkh"])
    q_btnh, gate_btnh = qg_btnxh[..., 0, :], qg_btnxh[..., 1, :]
    norm = lambda x, w: L.rms_norm(x, w, c.rms_norm_eps, offset=1.0)
    q_btnh = L.apply_rope(norm(q_btnh, lp["q_norm_h"]), ctx["positions"], c.rope_theta, c.rotary_dim)
    k_btkh = L.apply_rope(norm(k_btkh, lp["k_norm_h"]), ctx["positions"], c.rope_theta, c.rotary_dim)
    q_btnh = constrain(q_btnh, ("batch", "length", "heads", "head_dim"))
    scale = c.head_dim**-0.5
    if cache is None:
        new_cache = None
        keys, values, key_valid = k_btkh.swapaxes(1, 2), v_btkh.swapaxes(1, 2), ctx["valid"]
    else:
        keys = L.write_kv(cache["k"], k_btkh, ctx["index"])
        values = L.write_kv(cache["v"], v_btkh, ctx["index"])
        new_cache, key_valid = {"k": keys, "v": values}, ctx["cache_valid"]
    if q_btnh.shape[1] == 1:  # a decode step: one score row per head, nothing to block
        attn_btnh = L.gqa_attention(q_btnh, keys, values, ctx["mask"], scale, kv_layout="bksh")
    else:
        # cuDNN's flash attention on a GPU where it applies (no cache), else blocked (models.attention).
        attn_btnh = causal_attention(q_btnh, keys, values, key_valid, scale, q_offset=ctx["index"])
    attn_btnh = attn_btnh * jax.nn.sigmoid(gate_btnh.astype(jnp.float32)).astype(attn_btnh.dtype)
    return L.project("btnh,nhd->btd", attn_btnh, lp["o_proj_nhd"]), new_cache


def _decoder_layer(kind: str, lp: dict, c: Config, x_btd: jax.Array, ctx: dict, cache: dict | None):
    h_btd = L.rms_norm(x_btd, lp["attn_norm_d"], c.rms_norm_eps, offset=1.0)
    if kind == FULL:
        mixed_btd, new_cache = _full_attention(lp, c, h_btd, ctx, cache)
    else:
        mixed_btd, new_cache = _linear_attention(lp, c, h_btd, ctx["valid"], cache)
    x_btd = constrain(x_btd + mixed_btd, ("batch", "length", "embed"))
    h_btd = L.rms_norm(x_btd, lp["mlp_norm_d"], c.rms_norm_eps, offset=1.0)
    x_btd = x_btd + L.mlp(h_btd, lp)
    return constrain(x_btd, ("batch", "length", "embed")), new_cache


# The decode layout's fused projections: each group reads one input, so one product serves it.
_FUSED = {
    "in_proj_dx": ("qkv_proj_dc", "z_proj_dmu", "b_proj_dm", "a_proj_dm"),  # Gated DeltaNet
    "qkv_gate_proj_dx": ("q_gate_proj_dnxh", "k_proj_dkh", "v_proj_dkh"),  # gated attention
    "gate_up_proj_dx": ("gate_proj_df", "up_proj_df"),  # SwiGLU (`layers.mlp`)
}


def decode_layout(config: Config, params: Params, cache: Cache | None, *, fuse_matmuls: bool = True):
    """(params, cache) in the layout a CPU decode loop reads fastest; `forward` takes both layouts.

    The family hook of `family.py`. "blocks" becomes a tuple over the R
    repeats (each ``{pattern position: layer}``, unstacked), and so does the
    cache's, so `forward` unrolls the repeats: each reads its own weights and
    its own state buffers, which the decode loop updates in place. Under the
    scan, XLA:CPU copies every slice of a stacked weight on each trip of the
    sampler's while loop (a scan's dynamic slice cannot be hoisted out of
    it): 108 MB of weight copies per token for the benchmark model. The
    sampler does this once per call, after the prefill; it holds one more
    copy of the weights while it runs (GPU/TPU XLA reads slices in place, so
    the sampler uses this layout on CPU only).

    fuse_matmuls: also stack the projections that read the same input
    (``_FUSED``) and store every projection and the LM head output dims first
    (``layers.fuse_projections``, ``layers.seal_decode_params``), which a
    one-token step of few rows multiplies as a row reduction
    (``layers.project``). Measured on the benchmark model (8 rows, 2 x (3
    linear + 1 full)): 37 ms a step with the scan, 28 ms unstacked, 19 ms
    with the weights output dims first; on a later day 25.6 ms before and
    18.7 ms after the stacked row reductions (runs an hour apart on a
    machine whose speed varies by ±20%). Leave it off under a mesh: a fused
    output axis would mix differently sharded heads.
    """
    c = config
    prepare = (lambda layer: L.fuse_projections(layer, _FUSED, _PROJ_IN)) if fuse_matmuls else dict
    blocks = tuple(
        {pos: prepare({name: w[r] for name, w in layer.items()}) for pos, layer in params["blocks"].items()}
        for r in range(c.num_repeats)
    )
    params = {**params, "blocks": blocks}
    if "tail" in params:  # none when the pattern divides the depth
        params["tail"] = {pos: prepare(layer) for pos, layer in params["tail"].items()}
    params = L.seal_decode_params(params, tied=c.tie_word_embeddings, head=fuse_matmuls)
    if cache is not None:
        per_repeat = lambda r: {pos: {n: leaf[r] for n, leaf in layer.items()} for pos, layer in cache["blocks"].items()}
        cache = {**cache, "blocks": tuple(per_repeat(r) for r in range(c.num_repeats))}
    return params, cache


def forward(
    params: Params,
    config: Config,
    tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    cache: Cache | None = None,
    *,
    remat: str | None = None,
    embeds: jax.Array | None = None,
) -> tuple[jax.Array, Cache | None]:
    """Final-normed hidden states [B, T, D] (param dtype) and the updated cache (see family.py).

    embeds: optional [B, T, D] input vectors used instead of the token
    embeddings (`layers.embed_inputs`); tokens then only give the shape.
    Params and cache are either stacked (the stored layout; the repeats run
    under `lax.scan`) or per-repeat (`decode_layout`; the repeats unrolled).
    remat: None, or a `family.REMAT_POLICIES` name: each repeat of the
    pattern (the scan body) and each tail layer runs under `jax.checkpoint`
    (the backward keeps only the [B, T, D] residual between them).
    """
    c = config
    ctx = L.attention_context(tokens, positions, valid, cache)
    x_btd = constrain(L.embed_inputs(params["embed_vd"], tokens, embeds), ("batch", "length", "embed"))

    def block(x_btd, inputs):
        block_params, block_cache = inputs
        new_block_cache = {}
        for j, kind in enumerate(c.pattern):
            layer_cache = None if block_cache is None else block_cache[str(j)]
            x_btd, new_block_cache[str(j)] = _decoder_layer(kind, block_params[str(j)], c, x_btd, ctx, layer_cache)
        return x_btd, (None if block_cache is None else new_block_cache)

    per_repeat = isinstance(params["blocks"], (tuple, list))
    if cache is not None and isinstance(cache["blocks"], (tuple, list)) != per_repeat:
        raise ValueError("params and cache: one is in `decode_layout` (blocks a tuple over repeats), the other is not")
    if per_repeat:  # the decode layout: repeats unrolled
        new_blocks = []
        for r, block_params in enumerate(params["blocks"]):
            x_btd, new_block = remat_layer(block, remat)(
                x_btd, (block_params, None if cache is None else cache["blocks"][r]))
            new_blocks.append(new_block)
        new_blocks = None if cache is None else tuple(new_blocks)
    else:
        blocks_and_cache = (params["blocks"], None if cache is None else cache["blocks"])
        x_btd, new_blocks = jax.lax.scan(remat_layer(block, remat, prevent_cse=False), x_btd, blocks_and_cache)
    new_tail = {}
    for i, kind in enumerate(c.tail_types):
        layer_cache = None if cache is None else cache["tail"][str(i)]
        layer = remat_layer(lambda x, lp, layer_cache, kind=kind: _decoder_layer(kind, lp, c, x, ctx, layer_cache),
                            remat)
        x_btd, new_tail[str(i)] = layer(x_btd, params["tail"][str(i)], layer_cache)
    hidden_btd = L.rms_norm(x_btd, params["final_norm_d"], c.rms_norm_eps, offset=1.0)
    if cache is None:
        return hidden_btd, None
    new_cache = {
        "index": cache["index"] + tokens.shape[1],
        "valid": ctx["cache_valid"],
        "blocks": new_blocks,
        "tail": new_tail,
    }
    return hidden_btd, new_cache


def unembed(params: Params, config: Config, hidden: jax.Array) -> jax.Array:
    """float32[B, T, V] logits of final-normed hidden [B, T, D] (tied head = embedding transposed)."""
    logits = L.mask_padded_vocab(L.unembed(hidden, params, config.tie_word_embeddings), config.token_count)
    return constrain(logits, ("batch", "length", "vocab"))


def num_params(config: Config) -> int:
    """Parameter count of the text model (what ``init_params`` allocates), without materialising it."""
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0), jnp.bfloat16))
    return sum(int(x.size) for x in jax.tree.leaves(shapes))
