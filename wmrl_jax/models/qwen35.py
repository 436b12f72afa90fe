"""Qwen3.5 (hybrid Gated DeltaNet + gated attention): config, params, cached forward, HF table.

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

import dataclasses
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from wmrl_jax.models import gated_deltanet as gdn
from wmrl_jax.models import layers as L
from wmrl_jax.models.blocked_attention import blocked_causal_attention
from wmrl_jax.models.family import Cache, HfTensor, Params
from wmrl_jax.models.sharding import constrain

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LINEAR, FULL = "linear_attention", "full_attention"
CAUSAL_LM, CONDITIONAL_GENERATION = "causal_lm", "conditional_generation"
_PREFIX = {CAUSAL_LM: "model.", CONDITIONAL_GENERATION: "model.language_model."}


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel: int = 4
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262_144
    initializer_range: float = 0.02
    # Tokens per chunk of the chunked delta rule (ours, not HF's; FLA uses 64):
    # the intra-chunk terms are C² per chunk, the loop has T / C steps; 16 was
    # the fastest of 8-64 on CPU (see gated_deltanet.chunk_gated_delta_rule).
    chunk_size: int = 16
    # Which HF layout the checkpoint had; save_hf writes the same one back.
    hf_layout: str = CAUSAL_LM
    # Carried only so that save_hf writes them back (text-only positions make
    # multimodal RoPE the plain 1-D RoPE; the vision tower is not loaded).
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool | None = None
    vision_config_json: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        bad = sorted(set(self.layer_types) - {LINEAR, FULL})
        if bad or not self.layer_types:
            raise ValueError(f"layer_types: expected a non-empty list of {LINEAR!r} / {FULL!r}, got {bad or '[]'}")
        if self.hf_layout not in _PREFIX:
            raise ValueError(f"hf_layout={self.hf_layout!r}, expected one of {sorted(_PREFIX)}")
        L.rope_settings({"rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor}, self.head_dim)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def pattern(self) -> tuple[str, ...]:
        """The shortest P-prefix with layer_types[i] == layer_types[i % P] for every i."""
        types = self.layer_types
        period = next(p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types)))
        return types[:period]

    @property
    def num_repeats(self) -> int:
        return self.num_layers // len(self.pattern)

    @property
    def tail_types(self) -> tuple[str, ...]:
        return self.layer_types[self.num_repeats * len(self.pattern) :]


# --------------------------------------------------------------------------- HF config


def config_from_hf(hf: dict) -> Config:
    """Config from ``Qwen3_5TextConfig.to_dict()`` or a nested ``Qwen3_5Config.to_dict()`` (its ``text_config``)."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config model_type={model_type!r}, expected one of {MODEL_TYPES}")
    layout, text, vision = CAUSAL_LM, hf, None
    if "text_config" in hf:
        layout, text, vision = CONDITIONAL_GENERATION, dict(hf["text_config"]), hf.get("vision_config")
        if "tie_word_embeddings" in hf:  # the outer model ties (or not) the LM head
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    if text.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act={text['hidden_act']!r}: only 'silu' is implemented")
    if text.get("attention_bias", False):
        raise NotImplementedError("attention_bias=True: Qwen3.5 checkpoints have no attention biases; not implemented")
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    rope = dict(text.get("rope_parameters") or {})
    theta, rotary_dim = L.rope_settings(rope, head_dim, rope_theta=text.get("rope_theta"))
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = text.get("full_attention_interval", 4)
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(text["num_hidden_layers"])]
    if len(layer_types) != text["num_hidden_layers"]:
        raise ValueError(f"layer_types has {len(layer_types)} entries, num_hidden_layers={text['num_hidden_layers']}")
    eos = text.get("eos_token_id")
    section = rope.get("mrope_section")
    return Config(
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_heads=text["num_attention_heads"],
        num_kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
        head_dim=head_dim,
        layer_types=tuple(layer_types),
        linear_num_key_heads=text["linear_num_key_heads"],
        linear_num_value_heads=text["linear_num_value_heads"],
        linear_key_head_dim=text["linear_key_head_dim"],
        linear_value_head_dim=text["linear_value_head_dim"],
        linear_conv_kernel=text.get("linear_conv_kernel_dim", 4),
        rope_theta=theta,
        partial_rotary_factor=rotary_dim / head_dim,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        max_position_embeddings=text.get("max_position_embeddings", 262_144),
        initializer_range=text.get("initializer_range", 0.02),
        hf_layout=layout,
        mrope_section=tuple(section) if section is not None else None,
        mrope_interleaved=rope.get("mrope_interleaved"),
        vision_config_json=json.dumps(vision, sort_keys=True) if vision is not None else None,
        bos_token_id=text.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=text.get("pad_token_id"),
    )


def config_to_hf(config: Config) -> dict:
    """kwargs for ``transformers.AutoConfig.for_model`` (model_type included), in the checkpoint's layout."""
    c = config
    rope = {"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": c.partial_rotary_factor}
    if c.mrope_section is not None:
        rope["mrope_section"] = list(c.mrope_section)
    if c.mrope_interleaved is not None:
        rope["mrope_interleaved"] = c.mrope_interleaved
    eos = list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id
    text = dict(
        model_type="qwen3_5_text",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        layer_types=list(c.layer_types),
        linear_num_key_heads=c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads,
        linear_key_head_dim=c.linear_key_head_dim,
        linear_value_head_dim=c.linear_value_head_dim,
        linear_conv_kernel_dim=c.linear_conv_kernel,
        rope_parameters=rope,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position_embeddings,
        initializer_range=c.initializer_range,
        hidden_act="silu",
        attention_bias=False,
        bos_token_id=c.bos_token_id,
        eos_token_id=eos,
        pad_token_id=c.pad_token_id,
    )
    if c.hf_layout == CAUSAL_LM:
        return dict(text, architectures=["Qwen3_5ForCausalLM"])
    out = dict(
        model_type="qwen3_5",
        architectures=["Qwen3_5ForConditionalGeneration"],
        text_config=text,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    if c.vision_config_json is not None:
        out["vision_config"] = json.loads(c.vision_config_json)
    return out


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
    """{"blocks": {j: {name: leaf(name, shape, stacked=True)}}, "tail": {i: {... stacked=False}}}."""
    return {
        "blocks": {
            str(j): {n: leaf(n, s, True) for n, s in _layer_shapes(c, kind).items()} for j, kind in enumerate(c.pattern)
        },
        "tail": {
            str(i): {n: leaf(n, s, False) for n, s in _layer_shapes(c, kind).items()}
            for i, kind in enumerate(c.tail_types)
        },
    }


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


# --------------------------------------------------------------------------- HF table


class _LayerKey(str):
    """An HF key template whose ``.format(layer=r)`` names HF layer ``layer_ids[r]``.

    ``hf_io`` maps slice r of a stacked leaf to ``key.format(layer=r)``; our
    stacks hold every P-th layer (one pattern position), so r must be
    translated to the HF layer index r·P + j.
    """

    layer_ids: tuple[int, ...]

    def __new__(cls, template: str, layer_ids: tuple[int, ...]):
        obj = super().__new__(cls, template)
        obj.layer_ids = tuple(layer_ids)
        return obj

    def format(self, *args, **kwargs):  # noqa: A003 - mirrors str.format
        return str.format(self, layer=self.layer_ids[kwargs["layer"]])


def _layer_entries(c: Config, kind: str, key: Any, path: tuple[str, ...], stacked: bool) -> list[HfTensor]:
    """HfTensors of one layer; ``key(suffix)`` gives the HF key (template) of ``model.layers.{i}.<suffix>``."""
    d, f = c.hidden_size, c.intermediate_size
    lin, same = HfTensor.linear, HfTensor.same
    entries = [
        same(key("input_layernorm.weight"), path + ("attn_norm_d",), (d,), stacked),
        same(key("post_attention_layernorm.weight"), path + ("mlp_norm_d",), (d,), stacked),
        lin(key("mlp.gate_proj.weight"), path + ("gate_proj_df",), (d,), (f,), stacked),
        lin(key("mlp.up_proj.weight"), path + ("up_proj_df",), (d,), (f,), stacked),
        lin(key("mlp.down_proj.weight"), path + ("down_proj_fd",), (f,), (d,), stacked),
    ]
    if kind == FULL:
        n, k, h = c.num_heads, c.num_kv_heads, c.head_dim
        return entries + [
            lin(key("self_attn.q_proj.weight"), path + ("q_gate_proj_dnxh",), (d,), (n, 2, h), stacked),
            lin(key("self_attn.k_proj.weight"), path + ("k_proj_dkh",), (d,), (k, h), stacked),
            lin(key("self_attn.v_proj.weight"), path + ("v_proj_dkh",), (d,), (k, h), stacked),
            same(key("self_attn.q_norm.weight"), path + ("q_norm_h",), (h,), stacked),
            same(key("self_attn.k_norm.weight"), path + ("k_norm_h",), (h,), stacked),
            lin(key("self_attn.o_proj.weight"), path + ("o_proj_nhd",), (n, h), (d,), stacked),
        ]
    m, u, ch, w = c.linear_num_value_heads, c.linear_value_head_dim, c.conv_dim, c.linear_conv_kernel
    return entries + [
        lin(key("linear_attn.in_proj_qkv.weight"), path + ("qkv_proj_dc",), (d,), (ch,), stacked),
        lin(key("linear_attn.in_proj_z.weight"), path + ("z_proj_dmu",), (d,), (m, u), stacked),
        lin(key("linear_attn.in_proj_b.weight"), path + ("b_proj_dm",), (d,), (m,), stacked),
        lin(key("linear_attn.in_proj_a.weight"), path + ("a_proj_dm",), (d,), (m,), stacked),
        # nn.Conv1d depthwise weight [C, 1, W] -> [W, C]
        HfTensor(key("linear_attn.conv1d.weight"), path + ("conv_wc",), (ch, 1, w), (ch, w), (1, 0), stacked),
        same(key("linear_attn.dt_bias"), path + ("dt_bias_m",), (m,), stacked),
        same(key("linear_attn.A_log"), path + ("a_log_m",), (m,), stacked),
        same(key("linear_attn.norm.weight"), path + ("out_norm_u",), (u,), stacked),
        lin(key("linear_attn.out_proj.weight"), path + ("out_proj_mud",), (m, u), (d,), stacked),
    ]


def hf_table(config: Config) -> list[HfTensor]:
    """HF state-dict keys <-> params, for ``Qwen3_5ForCausalLM`` (``model.layers.*``) or
    ``Qwen3_5ForConditionalGeneration`` (``model.language_model.layers.*``), per ``config.hf_layout``."""
    c = config
    prefix = _PREFIX[c.hf_layout]
    period = len(c.pattern)
    table = [
        HfTensor.same(prefix + "embed_tokens.weight", ("embed_vd",), (c.vocab_size, c.hidden_size)),
        HfTensor.same(prefix + "norm.weight", ("final_norm_d",), (c.hidden_size,)),
    ]
    for j, kind in enumerate(c.pattern):
        ids = tuple(r * period + j for r in range(c.num_repeats))
        key = lambda suffix, ids=ids: _LayerKey(prefix + "layers.{layer}." + suffix, ids)
        table += _layer_entries(c, kind, key, ("blocks", str(j)), True)
    for i, kind in enumerate(c.tail_types):
        layer = c.num_repeats * period + i
        table += _layer_entries(c, kind, lambda s, n=layer: f"{prefix}layers.{n}.{s}", ("tail", str(i)), False)
    if not c.tie_word_embeddings:
        table.append(HfTensor.linear("lm_head.weight", ("lm_head_dv",), (c.hidden_size,), (c.vocab_size,)))
    return table


def hf_ignore(config: Config) -> tuple[str, ...]:
    """Keys skipped on load (hf_io prints a one-line notice): the vision tower, the MTP head, a tied head."""
    ignore = (r"^model\.visual\.", r"^mtp\.")
    return ignore + ((r"^lm_head\.weight$",) if config.tie_word_embeddings else ())


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


class _OutIn(NamedTuple):
    """A projection weight stored output dims first (``[*out, *in]``): see ``_decode_blocks``."""

    weight: jax.Array


# Input dims (leading, in the einsum name) of every projection weight.
_PROJ_IN = {
    "qkv_proj_dc": 1, "z_proj_dmu": 1, "b_proj_dm": 1, "a_proj_dm": 1, "out_proj_mud": 2, "q_gate_proj_dnxh": 1,
    "k_proj_dkh": 1, "v_proj_dkh": 1, "o_proj_nhd": 2, "gate_proj_df": 1, "up_proj_df": 1, "gate_up_proj_dxf": 1,
    "down_proj_fd": 1,
}


def _proj(spec: str, x: jax.Array, w: jax.Array | _OutIn) -> jax.Array:
    """``einsum(spec, x, w)`` for a projection whose contracted dims end x and start w.

    For an ``_OutIn`` weight the same product is taken as ``w[*out, *in] · xᵀ``
    and transposed back (the [B·T, ·] output is small at a decode step).
    """
    if not isinstance(w, _OutIn):
        return jnp.einsum(spec, x, w)
    x_dims, rest = spec.split(",")
    w_dims, out_dims = rest.split("->")
    n_in = sum(d in x_dims for d in w_dims)
    w_in, w_out, lead = w_dims[:n_in], w_dims[n_in:], x_dims[: len(x_dims) - n_in]
    y = jnp.einsum(f"{x_dims},{w_out}{w_in}->{w_out}{lead}", x, w.weight)
    return jnp.einsum(f"{w_out}{lead}->{out_dims}", y)


def _out_in(name: str, w: jax.Array) -> jax.Array | _OutIn:
    n_in = _PROJ_IN.get(name)
    if n_in is None:
        return w
    return _OutIn(jnp.transpose(w, tuple(range(n_in, w.ndim)) + tuple(range(n_in))))


def _mlp(lp: dict, h_btd: jax.Array) -> jax.Array:
    """SwiGLU MLP (``layers.swiglu``), through ``_proj`` so that decode-layout weights work too."""
    if "gate_up_proj_dxf" in lp:  # decode layout: gate and up stacked, one matmul
        gate_up_btxf = _proj("btd,dxf->btxf", h_btd, lp["gate_up_proj_dxf"])
        gate_btf, up_btf = gate_up_btxf[:, :, 0], gate_up_btxf[:, :, 1]
    else:
        gate_btf = _proj("btd,df->btf", h_btd, lp["gate_proj_df"])
        up_btf = _proj("btd,df->btf", h_btd, lp["up_proj_df"])
    return _proj("btf,fd->btd", jax.nn.silu(gate_btf) * up_btf, lp["down_proj_fd"])


def _linear_attention(lp: dict, c: Config, h_btd: jax.Array, valid: jax.Array, cache: dict | None):
    """Gated DeltaNet token mixer. h: normed input [B, T, D]; returns ([B, T, D], new layer cache)."""
    b, t, _ = h_btd.shape
    j, e = c.linear_num_key_heads, c.linear_key_head_dim
    m, u = c.linear_num_value_heads, c.linear_value_head_dim
    mixed_btc = _proj("btd,dc->btc", h_btd, lp["qkv_proj_dc"])
    z_btmu = _proj("btd,dmu->btmu", h_btd, lp["z_proj_dmu"])
    b_btm = _proj("btd,dm->btm", h_btd, lp["b_proj_dm"]).astype(jnp.float32)
    a_btm = _proj("btd,dm->btm", h_btd, lp["a_proj_dm"]).astype(jnp.float32)
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
    out_btd = _proj("btmu,mud->btd", o_btmu.astype(h_btd.dtype), lp["out_proj_mud"])
    new_cache = None if cache is None else {"conv": new_conv.astype(cache["conv"].dtype), "state": new_state}
    return out_btd, new_cache


def _full_attention(lp: dict, c: Config, h_btd: jax.Array, ctx: dict, cache: dict | None):
    """Gated GQA token mixer. h: normed input [B, T, D]; returns ([B, T, D], new layer cache)."""
    qg_btnxh = _proj("btd,dnxh->btnxh", h_btd, lp["q_gate_proj_dnxh"])
    q_btnh, gate_btnh = qg_btnxh[..., 0, :], qg_btnxh[..., 1, :]
    k_btkh = _proj("btd,dkh->btkh", h_btd, lp["k_proj_dkh"])
    v_btkh = _proj("btd,dkh->btkh", h_btd, lp["v_proj_dkh"])
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
        attn_btnh = blocked_causal_attention(q_btnh, keys, values, key_valid, scale, q_offset=ctx["index"])
    attn_btnh = attn_btnh * jax.nn.sigmoid(gate_btnh.astype(jnp.float32)).astype(attn_btnh.dtype)
    return _proj("btnh,nhd->btd", attn_btnh, lp["o_proj_nhd"]), new_cache


def _decoder_layer(kind: str, lp: dict, c: Config, x_btd: jax.Array, ctx: dict, cache: dict | None):
    h_btd = L.rms_norm(x_btd, lp["attn_norm_d"], c.rms_norm_eps, offset=1.0)
    if kind == FULL:
        mixed_btd, new_cache = _full_attention(lp, c, h_btd, ctx, cache)
    else:
        mixed_btd, new_cache = _linear_attention(lp, c, h_btd, ctx["valid"], cache)
    x_btd = constrain(x_btd + mixed_btd, ("batch", "length", "embed"))
    h_btd = L.rms_norm(x_btd, lp["mlp_norm_d"], c.rms_norm_eps, offset=1.0)
    x_btd = x_btd + _mlp(lp, h_btd)
    return constrain(x_btd, ("batch", "length", "embed")), new_cache


def _decode_blocks(block_params: dict, block_cache: dict, c: Config, x_btd: jax.Array, ctx: dict):
    """The scanned blocks of a one-token step on CPU, unrolled over the repeats (same result as the scan).

    A decode step runs inside the sampler's while loop, and XLA's CPU
    backend copies every slice of a stacked weight on each trip (a slice is
    "not worth hoisting" out of a loop on its own, and a scan's dynamic slice
    cannot be): 108 MB of weight copies per token for the benchmark model.
    Unrolled, each repeat's weights are static slices; behind an
    ``optimization_barrier`` (an identity) XLA hoists them out of the loop,
    so they are cut once per sampler call. They are cut output dims first
    (``_OutIn``): at M = B·T = 8 rows XLA's CPU matmul streams a ``[out, in]``
    left operand about twice as fast as it does an ``[in, out]`` right one.
    Measured on the benchmark model (8 rows, 2 x (3 linear + 1 full)): 37 ms
    a step with the scan, 28 ms with hoisted slices, 19 ms with them
    transposed. Cost: the hoisted copies hold one more copy of the block
    weights while the sampler runs (hence CPU only; GPU XLA feeds slices to
    its GEMMs in place). The recurrent state and KV slices are written back
    in place (``.at[r].set`` on the loop-carried cache).
    """
    new_cache = {pos: dict(layer) for pos, layer in block_cache.items()}
    for r in range(c.num_repeats):
        params_r = {}
        for pos, layer in block_params.items():
            layer_r = {name: w[r] for name, w in layer.items()}
            layer_r["gate_up_proj_dxf"] = jnp.stack([layer_r.pop("gate_proj_df"), layer_r.pop("up_proj_df")], axis=1)
            params_r[pos] = {name: _out_in(name, w) for name, w in layer_r.items()}
        params_r = jax.lax.optimization_barrier(params_r)
        for j, kind in enumerate(c.pattern):
            layer_cache = {name: leaf[r] for name, leaf in new_cache[str(j)].items()}
            x_btd, updated = _decoder_layer(kind, params_r[str(j)], c, x_btd, ctx, layer_cache)
            for name, leaf in updated.items():
                new_cache[str(j)][name] = new_cache[str(j)][name].at[r].set(leaf)
    return x_btd, new_cache


def forward(
    params: Params,
    config: Config,
    tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    cache: Cache | None = None,
) -> tuple[jax.Array, Cache | None]:
    """Final-normed hidden states [B, T, D] (param dtype) and the updated cache (see family.py)."""
    c = config
    ctx = L.attention_context(tokens, positions, valid, cache)
    x_btd = constrain(jnp.take(params["embed_vd"], tokens, axis=0), ("batch", "length", "embed"))

    def block(x_btd, inputs):
        block_params, block_cache = inputs
        new_block_cache = {}
        for j, kind in enumerate(c.pattern):
            layer_cache = None if block_cache is None else block_cache[str(j)]
            x_btd, new_block_cache[str(j)] = _decoder_layer(kind, block_params[str(j)], c, x_btd, ctx, layer_cache)
        return x_btd, (None if block_cache is None else new_block_cache)

    if cache is not None and tokens.shape[1] == 1 and jax.default_backend() == "cpu":
        x_btd, new_blocks = _decode_blocks(params["blocks"], cache["blocks"], c, x_btd, ctx)
    else:
        x_btd, new_blocks = jax.lax.scan(block, x_btd, (params["blocks"], None if cache is None else cache["blocks"]))
    new_tail = {}
    for i, kind in enumerate(c.tail_types):
        layer_cache = None if cache is None else cache["tail"][str(i)]
        x_btd, new_tail[str(i)] = _decoder_layer(kind, params["tail"][str(i)], c, x_btd, ctx, layer_cache)
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
    if config.tie_word_embeddings:
        logits = jnp.einsum("btd,vd->btv", hidden, params["embed_vd"], preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("btd,dv->btv", hidden, params["lm_head_dv"], preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "length", "vocab"))


# --------------------------------------------------------------------------- presets


def _released(**overrides) -> Config:
    """Shared values of the released Qwen3.5 dense text models (config.json ``text_config``)."""
    base = dict(
        vocab_size=248_320,
        num_heads=16,
        num_kv_heads=4,
        head_dim=256,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 8,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel=4,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        rms_norm_eps=1e-6,
        max_position_embeddings=262_144,
        hf_layout=CONDITIONAL_GENERATION,
        mrope_section=(11, 11, 10),
        mrope_interleaved=True,
        eos_token_id=248_044,
    )
    return Config(**{**base, **overrides})


# Source: huggingface.co/Qwen/Qwen3.5-4B config.json (text_config) and model card
# ("Hidden Dimension: 2560, 32 layers, 8 × (3 × Gated DeltaNet → FFN, 1 × Gated
# Attention → FFN), DeltaNet 32 V / 16 QK heads of 128, attention 16 Q / 4 KV
# heads of 256, rotary dim 64, FFN 9216, vocab 248320"); tied LM head.
QWEN35_4B = _released(hidden_size=2560, intermediate_size=9216, tie_word_embeddings=True)
# Source: huggingface.co/Qwen/Qwen3.5-9B config.json (text_config) and model card
# (hidden 4096, same layout and heads, FFN 12288); untied LM head.
QWEN35_9B = _released(hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
PRESETS = {"qwen3.5-4b": QWEN35_4B, "qwen3.5-9b": QWEN35_9B}


def num_params(config: Config) -> int:
    """Parameter count of the text model (what ``init_params`` allocates), without materialising it."""
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0), jnp.bfloat16))
    return sum(int(x.size) for x in jax.tree.leaves(shapes))
