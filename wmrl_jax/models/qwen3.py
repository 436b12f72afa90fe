"""Qwen3 (dense): config, params, forward with KV cache, and its HF checkpoint table.

Matches transformers' `models/qwen3/modeling_qwen3.py`: pre-norm decoder,
GQA attention with per-head RMSNorm on q and k (before RoPE), SwiGLU MLP,
final RMSNorm, tied or untied LM head. Implements `family.ModelFamily`.

Params (leading L = layers axis on everything under "layers"):
  embed_vd [V, D], final_norm_d [D], lm_head_dv [D, V] (untied only),
  layers: attn_norm_d [L, D], q_proj_dnh [L, D, N, H], k_proj_dkh / v_proj_dkh
  [L, D, K, H], q_norm_h / k_norm_h [L, H], o_proj_nhd [L, N, H, D],
  mlp_norm_d [L, D], gate_proj_df / up_proj_df [L, D, F], down_proj_fd [L, F, D].

The Qwen2 family (`qwen2.py`) is this layout without q/k norms and with
biases on q, k, v (q_bias_nh [L, N, H], k_bias_kh / v_bias_kh [L, K, H]):
its Config subclasses this one and flips the two class-level switches
`QK_NORM` and `QKV_BIAS`; every function here reads them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from wmrl_jax.models import layers as L
from wmrl_jax.models.family import Cache, HfTensor, Params, remat_layer
from wmrl_jax.models.sharding import constrain

MODEL_TYPES = ("qwen3",)


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40_960
    initializer_range: float = 0.02
    # Token ids are carried only so that save_hf writes them back.
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Ids >= token_count are embedding padding (rows past the tokenizer's vocabulary, e.g. a vocabulary
    # padded to a multiple of 64): their logits are masked so they are never sampled or given mass.
    # None: every id is a token. Not an HF field: `chat.load_chat_model` sets it from the tokenizer.
    token_count: int | None = None

    # The layout, fixed per family (not per checkpoint): Qwen3 normalises q and k per head and has no
    # attention biases; `qwen2.Qwen2Config` sets both the other way.
    QK_NORM: ClassVar[bool] = True
    QKV_BIAS: ClassVar[bool] = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )


def config_from_hf(hf: dict) -> Config:
    """Config from a transformers `Qwen3Config.to_dict()`; unsupported options raise."""
    if hf.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"config model_type={hf.get('model_type')!r}, expected one of {MODEL_TYPES}")
    if hf.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act={hf['hidden_act']!r}: only 'silu' is implemented")
    if hf.get("attention_bias", False):
        raise NotImplementedError("attention_bias=True: Qwen3 checkpoints have no attention biases; not implemented")
    if hf.get("use_sliding_window", False):
        raise NotImplementedError("use_sliding_window=True: sliding-window attention is not implemented")
    return dense_config_from_hf(Config, hf, "Qwen3", max_positions=40_960)


def dense_config_from_hf(config_class: type, hf: dict, name: str, *, max_positions: int):
    """`config_class` (this Config or a subclass: Qwen2's) from an HF config dict, its options already checked."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    theta, rotary_dim = L.rope_settings(hf.get("rope_parameters"), head_dim, rope_theta=hf.get("rope_theta"))
    if rotary_dim != head_dim:
        raise NotImplementedError(f"{name} rotates the whole head; partial_rotary_factor != 1 is not supported")
    eos = hf.get("eos_token_id")
    return config_class(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", max_positions),
        initializer_range=hf.get("initializer_range", 0.02),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=hf.get("pad_token_id"),
    )


def config_to_hf(config: Config) -> dict:
    """kwargs for `transformers.Qwen3Config` (model_type included)."""
    eos = config.eos_token_id
    return dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        hidden_act="silu",
        attention_bias=False,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(eos) if isinstance(eos, tuple) else eos,
        pad_token_id=config.pad_token_id,
    )


def _layer_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    d, n, k, h, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    shapes = {
        "attn_norm_d": (d,),
        "q_proj_dnh": (d, n, h),
        "k_proj_dkh": (d, k, h),
        "v_proj_dkh": (d, k, h),
        "q_norm_h": (h,),
        "k_norm_h": (h,),
        "q_bias_nh": (n, h),
        "k_bias_kh": (k, h),
        "v_bias_kh": (k, h),
        "o_proj_nhd": (n, h, d),
        "mlp_norm_d": (d,),
        "gate_proj_df": (d, f),
        "up_proj_df": (d, f),
        "down_proj_fd": (f, d),
    }
    return {name: s for name, s in shapes.items() if _has_leaf(c, name)}


def _has_leaf(c: Config, name: str) -> bool:
    """Whether a layer weight exists in this family's layout (q/k norms: Qwen3; q/k/v biases: Qwen2)."""
    if name in ("q_norm_h", "k_norm_h"):
        return c.QK_NORM
    if name in ("q_bias_nh", "k_bias_kh", "v_bias_kh"):
        return c.QKV_BIAS
    return True


def param_axes(config: Config) -> dict:
    axes = {
        "embed_vd": ("vocab", "embed"),
        "final_norm_d": ("norm",),
        "layers": {
            "attn_norm_d": ("layers", "norm"),
            "q_proj_dnh": ("layers", "embed", "heads", "head_dim"),
            "k_proj_dkh": ("layers", "embed", "kv_heads", "head_dim"),
            "v_proj_dkh": ("layers", "embed", "kv_heads", "head_dim"),
            "q_norm_h": ("layers", "norm"),
            "k_norm_h": ("layers", "norm"),
            "q_bias_nh": ("layers", "heads", "head_dim"),
            "k_bias_kh": ("layers", "kv_heads", "head_dim"),
            "v_bias_kh": ("layers", "kv_heads", "head_dim"),
            "o_proj_nhd": ("layers", "heads", "head_dim", "embed"),
            "mlp_norm_d": ("layers", "norm"),
            "gate_proj_df": ("layers", "embed", "mlp"),
            "up_proj_df": ("layers", "embed", "mlp"),
            "down_proj_fd": ("layers", "mlp", "embed"),
        },
    }
    axes["layers"] = {name: a for name, a in axes["layers"].items() if _has_leaf(config, name)}
    if not config.tie_word_embeddings:
        axes["lm_head_dv"] = ("embed", "vocab")
    return axes


def init_params(config: Config, rng: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random init as transformers does it: N(0, initializer_range) matrices, unit norms, zero biases.

    All matrices are slices of ONE normal draw: each `jax.random` call is its
    own RNG program, and a dozen of them cost ~10x the compile time on CPU.
    """
    c = config
    shapes = {"embed_vd": (c.vocab_size, c.hidden_size)}
    shapes.update({("layers", k): (c.num_layers,) + s for k, s in _layer_shapes(c).items() if _is_matrix(k)})
    if not c.tie_word_embeddings:
        shapes["lm_head_dv"] = (c.hidden_size, c.vocab_size)
    sizes = [math.prod(s) for s in shapes.values()]
    flat = c.initializer_range * jax.random.normal(rng, (sum(sizes),), jnp.float32)
    params: Params = {"final_norm_d": jnp.ones((c.hidden_size,), dtype), "layers": {}}
    for (name, shape), start, size in zip(shapes.items(), np.cumsum([0] + sizes), sizes):
        value = flat[start : start + size].reshape(shape).astype(dtype)
        if isinstance(name, tuple):
            params["layers"][name[1]] = value
        else:
            params[name] = value
    for name, shape in _layer_shapes(c).items():
        if not _is_matrix(name):
            fill = jnp.ones if "norm" in name else jnp.zeros
            params["layers"][name] = fill((c.num_layers,) + shape, dtype)
    return params


def _is_matrix(name: str) -> bool:
    return "norm" not in name and "bias" not in name


def hf_table(config: Config) -> list[HfTensor]:
    """HF `Qwen3ForCausalLM` (or `Qwen2ForCausalLM`: `qwen2.py`) state-dict keys <-> params."""
    c = config
    d, n, k, h, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    p = "model.layers.{layer}."
    lin, same = HfTensor.linear, HfTensor.same
    table = [
        same("model.embed_tokens.weight", ("embed_vd",), (c.vocab_size, d)),
        same("model.norm.weight", ("final_norm_d",), (d,)),
        same(p + "input_layernorm.weight", ("layers", "attn_norm_d"), (d,), True),
        lin(p + "self_attn.q_proj.weight", ("layers", "q_proj_dnh"), (d,), (n, h), True),
        lin(p + "self_attn.k_proj.weight", ("layers", "k_proj_dkh"), (d,), (k, h), True),
        lin(p + "self_attn.v_proj.weight", ("layers", "v_proj_dkh"), (d,), (k, h), True),
        same(p + "self_attn.q_norm.weight", ("layers", "q_norm_h"), (h,), True),
        same(p + "self_attn.k_norm.weight", ("layers", "k_norm_h"), (h,), True),
        _bias(p + "self_attn.q_proj.bias", ("layers", "q_bias_nh"), (n, h)),
        _bias(p + "self_attn.k_proj.bias", ("layers", "k_bias_kh"), (k, h)),
        _bias(p + "self_attn.v_proj.bias", ("layers", "v_bias_kh"), (k, h)),
        lin(p + "self_attn.o_proj.weight", ("layers", "o_proj_nhd"), (n, h), (d,), True),
        same(p + "post_attention_layernorm.weight", ("layers", "mlp_norm_d"), (d,), True),
        lin(p + "mlp.gate_proj.weight", ("layers", "gate_proj_df"), (d,), (f,), True),
        lin(p + "mlp.up_proj.weight", ("layers", "up_proj_df"), (d,), (f,), True),
        lin(p + "mlp.down_proj.weight", ("layers", "down_proj_fd"), (f,), (d,), True),
    ]
    table = [entry for entry in table if _has_leaf(c, entry.path[-1])]
    if not c.tie_word_embeddings:
        table.append(lin("lm_head.weight", ("lm_head_dv",), (d,), (c.vocab_size,)))
    return table


def _bias(key: str, path: tuple[str, ...], heads: tuple[int, int]) -> HfTensor:
    """An `nn.Linear` bias [heads · head_dim] stored per head, [heads, head_dim], stacked on layers."""
    return HfTensor(key, path, (math.prod(heads),), heads, (0, 1), stacked=True)


def hf_ignore(config: Config) -> tuple[str, ...]:
    # Some tied checkpoints still store the (identical) head; the embedding is the source of truth.
    return (r"^lm_head\.weight$",) if config.tie_word_embeddings else ()


def init_cache(config: Config, batch: int, max_len: int, dtype: Any = jnp.float32) -> Cache:
    # Head-major, read in place by decode attention (layers.gqa_attention's
    # "bkhs" layout): keys transposed [L, B, K, H, S], values [L, B, K, S, H].
    c = config
    return {
        "index": jnp.zeros((), jnp.int32),
        "valid": jnp.zeros((batch, max_len), bool),
        "k": jnp.zeros((c.num_layers, batch, c.num_kv_heads, c.head_dim, max_len), dtype),
        "v": jnp.zeros((c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim), dtype),
    }


def cache_axes(config: Config) -> dict:
    return {
        "index": (),
        "valid": ("batch", "cache_length"),
        "k": ("layers", "batch", "kv_heads", "head_dim", "cache_length"),
        "v": ("layers", "batch", "kv_heads", "cache_length", "head_dim"),
    }


# The decode layout's fused projections (each group reads one input) and how
# many leading dims each stored projection contracts (`layers.fuse_projections`).
_FUSED = {
    "qkv_proj_dx": ("q_proj_dnh", "k_proj_dkh", "v_proj_dkh"),
    "gate_up_proj_dx": ("gate_proj_df", "up_proj_df"),
    "o_proj_xd": ("o_proj_nhd",),  # a group of one: flattened to the [N·H, D] that `forward` multiplies
}
_PROJ_IN = {"q_proj_dnh": 1, "k_proj_dkh": 1, "v_proj_dkh": 1, "o_proj_nhd": 2, "gate_proj_df": 1, "up_proj_df": 1,
            "down_proj_fd": 1}  # fmt: skip


def decode_layout(config: Config, params: Params, cache: Cache | None, *, fuse_matmuls: bool = True):
    """(params, cache) in the layout a CPU decode loop reads fastest; `forward` takes both layouts.

    The family hook of `family.py`. A layer scan slices each layer's weights
    and KV cache out of the [L, ...] stacks, and XLA:CPU copies those slices:
    per decode step, the whole model's weights plus the whole cache. Here
    "layers" becomes a tuple of per-layer dicts and the cache's "k"/"v"
    tuples of per-layer buffers (keys [B, K, H, S], values [B, K, S, H]), so
    the unrolled layers read their own buffers and the decode loop updates
    each cache in place. The sampler does this once per call, after the
    prefill (one more copy of the weights while it runs). With the
    transposed-key attention and the fused matmuls below, a batch-32 decode
    step of the bench_generate model went from 96 to ~70 ms on 2 CPU cores.

    fuse_matmuls: also concatenate q|k|v into `qkv_proj_dx` [D, (N + 2K)·H]
    and gate|up into `gate_up_proj_dx` [D, 2F] (three and two matmuls become
    one each), and store every projection and the LM head output dims first
    (`layers.fuse_projections`, `layers.seal_decode_params`), which a one-token
    step of few rows multiplies as a row reduction (`layers.project`): at
    batch 32, 27.1 -> 19.6 ms for the bench_generate model's 8 layers of
    weights. Leave it off under a mesh: the fused output axis would mix
    differently sharded heads.
    """
    c = config
    layers = []
    for i in range(c.num_layers):
        lp = {name: value[i] for name, value in params["layers"].items()}
        layers.append(L.fuse_projections(lp, _FUSED, _PROJ_IN) if fuse_matmuls else lp)
    params = L.seal_decode_params({**params, "layers": tuple(layers)}, tied=c.tie_word_embeddings, head=fuse_matmuls)
    if cache is not None:
        cache = {**cache, **{kv: tuple(cache[kv][i] for i in range(c.num_layers)) for kv in ("k", "v")}}
    return params, cache


def _project_qkv(h_btd: jax.Array, lp: Params, c: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, T, N, H], k and v [B, T, K, H] from separate or fused (`decode_layout`) projections, biases added."""
    if "qkv_proj_dx" not in lp:
        q, k_, v = (
            jnp.einsum("btd,dnh->btnh", h_btd, lp["q_proj_dnh"]),
            jnp.einsum("btd,dkh->btkh", h_btd, lp["k_proj_dkh"]),
            jnp.einsum("btd,dkh->btkh", h_btd, lp["v_proj_dkh"]),
        )
    else:
        n, k, h = c.num_heads, c.num_kv_heads, c.head_dim
        qkv_btx = L.project("btd,dx->btx", h_btd, lp["qkv_proj_dx"])
        q, k_, v = jnp.split(qkv_btx, [n * h, (n + k) * h], axis=-1)
        batch, length = h_btd.shape[:2]
        q, k_, v = q.reshape(batch, length, n, h), k_.reshape(batch, length, k, h), v.reshape(batch, length, k, h)
    if c.QKV_BIAS:
        q, k_, v = q + lp["q_bias_nh"], k_ + lp["k_bias_kh"], v + lp["v_bias_kh"]
    return q, k_, v


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
    Params and cache are either stacked (the stored layout; layers run under
    `lax.scan`) or per-layer (`decode_layout`; layers unrolled). remat: None,
    or a `family.REMAT_POLICIES` name: each layer runs under `jax.checkpoint`
    (the backward keeps only the [B, T, D] residual between layers).
    """
    c = config
    ctx = L.attention_context(tokens, positions, valid, cache)
    x_btd = constrain(L.embed_inputs(params["embed_vd"], tokens, embeds), ("batch", "length", "embed"))
    scale = c.head_dim**-0.5

    def block(x_btd, lp, attend):
        """One decoder layer; attend(q, k, v) -> (out [B, T, N, H], kv state) owns the KV handling."""
        h_btd = L.rms_norm(x_btd, lp["attn_norm_d"], c.rms_norm_eps)
        q_btnh, k_btkh, v_btkh = _project_qkv(h_btd, lp, c)
        if c.QK_NORM:
            q_btnh = L.rms_norm(q_btnh, lp["q_norm_h"], c.rms_norm_eps)
            k_btkh = L.rms_norm(k_btkh, lp["k_norm_h"], c.rms_norm_eps)
        q_btnh = L.apply_rope(q_btnh, positions, c.rope_theta, c.head_dim)
        k_btkh = L.apply_rope(k_btkh, positions, c.rope_theta, c.head_dim)
        q_btnh = constrain(q_btnh, ("batch", "length", "heads", "head_dim"))
        attn_btnh, kv_state = attend(q_btnh, k_btkh, v_btkh)
        # As one [B·T, N·H] x [N·H, D] matmul: contracting (n, h) as two dims
        # made XLA:CPU transpose the weight at every step.
        o_xd = lp["o_proj_xd"] if "o_proj_xd" in lp else lp["o_proj_nhd"].reshape(-1, c.hidden_size)
        x_btd = x_btd + L.project("btx,xd->btd", attn_btnh.reshape(*attn_btnh.shape[:2], -1), o_xd)
        x_btd = constrain(x_btd, ("batch", "length", "embed"))
        h_btd = L.rms_norm(x_btd, lp["mlp_norm_d"], c.rms_norm_eps)
        x_btd = x_btd + L.mlp(h_btd, lp)
        return constrain(x_btd, ("batch", "length", "embed")), kv_state

    def fresh_attend(q, k, v):
        return L.gqa_attention(q, k, v, ctx["mask"], scale), None

    def cached_attend(k_cache_bkhs, v_cache_bksh):
        def attend(q, k, v):
            k_bkhs = L.write_kv(k_cache_bkhs, k, ctx["index"], layout="bkhs")
            v_bksh = L.write_kv(v_cache_bksh, v, ctx["index"], layout="bksh")
            out = L.gqa_attention(q, k_bkhs, v_bksh, ctx["mask"], scale, kv_layout="bkhs")
            return out, (k_bkhs, v_bksh)

        return attend

    def finish(x_btd, k, v):
        hidden_btd = L.rms_norm(x_btd, params["final_norm_d"], c.rms_norm_eps)
        if cache is None:
            return hidden_btd, None
        return hidden_btd, {"index": ctx["index"] + tokens.shape[1], "valid": ctx["cache_valid"], "k": k, "v": v}

    if isinstance(params["layers"], (tuple, list)):  # per-layer layout: unrolled
        keys, values = [], []
        for i, lp in enumerate(params["layers"]):
            attend = fresh_attend if cache is None else cached_attend(cache["k"][i], cache["v"][i])
            x_btd, kv = remat_layer(lambda x, lp, attend=attend: block(x, lp, attend), remat)(x_btd, lp)
            if cache is not None:
                keys.append(kv[0])
                values.append(kv[1])
        return finish(x_btd, tuple(keys), tuple(values))

    if cache is None:
        layer = remat_layer(lambda x, lp: block(x, lp, fresh_attend), remat, prevent_cse=False)
        x_btd, _ = jax.lax.scan(layer, x_btd, params["layers"])
        return finish(x_btd, None, None)

    def cached_layer(carry, inputs):
        # The stacked cache is carried (updated in place), not scanned over.
        x_btd, k_lbkhs, v_lbksh = carry
        lp, index_l = inputs

        def attend(q, k, v):
            k_stack = L.write_layer_kv(k_lbkhs, k, index_l, ctx["index"], layout="bkhs")
            v_stack = L.write_layer_kv(v_lbksh, v, index_l, ctx["index"], layout="bksh")
            keys = jax.lax.dynamic_index_in_dim(k_stack, index_l, 0, keepdims=False)
            values = jax.lax.dynamic_index_in_dim(v_stack, index_l, 0, keepdims=False)
            return L.gqa_attention(q, keys, values, ctx["mask"], scale, kv_layout="bkhs"), (k_stack, v_stack)

        x_btd, (k_lbkhs, v_lbksh) = block(x_btd, lp, attend)
        return (x_btd, k_lbkhs, v_lbksh), None

    layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
    (x_btd, k_lbkhs, v_lbksh), _ = jax.lax.scan(
        remat_layer(cached_layer, remat, prevent_cse=False), (x_btd, cache["k"], cache["v"]),
        (params["layers"], layer_ids)
    )
    return finish(x_btd, k_lbkhs, v_lbksh)


def unembed(params: Params, config: Config, hidden: jax.Array) -> jax.Array:
    """float32[B, T, V] logits of final-normed hidden [B, T, D] (tied head = embedding transposed)."""
    logits = L.mask_padded_vocab(L.unembed(hidden, params, config.tie_word_embeddings), config.token_count)
    return constrain(logits, ("batch", "length", "vocab"))
