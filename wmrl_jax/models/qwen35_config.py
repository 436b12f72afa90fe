"""Qwen3.5 config: the ``Config`` dataclass, HF ``config.json`` dicts <-> Config, and the released presets.

Split from ``qwen35`` (which re-exports every public name here): the config
is what the HF name table (``qwen35_hf``), the params and the forward all
read, and the presets are config values only.
"""

from __future__ import annotations

import dataclasses
import json

from wmrl_jax.models import layers as L

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LINEAR, FULL = "linear_attention", "full_attention"
CAUSAL_LM, CONDITIONAL_GENERATION = "causal_lm", "conditional_generation"
HF_PREFIX = {CAUSAL_LM: "model.", CONDITIONAL_GENERATION: "model.language_model."}


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
    # Ids >= token_count are embedding padding (rows past the tokenizer's vocabulary, e.g. a vocabulary
    # padded to a multiple of 64): their logits are masked so they are never sampled or given mass.
    # None: every id is a token. Not an HF field: `chat.load_chat_model` sets it from the tokenizer.
    token_count: int | None = None

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
        if self.hf_layout not in HF_PREFIX:
            raise ValueError(f"hf_layout={self.hf_layout!r}, expected one of {sorted(HF_PREFIX)}")
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
