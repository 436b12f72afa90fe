"""Qwen2 / Qwen2.5 (dense): Qwen3's layout without q/k norms, with biases on the q, k, v projections.

Matches transformers' `models/qwen2/modeling_qwen2.py` (`Qwen2Attention`:
q/k/v `nn.Linear(bias=True)`, o_proj without bias, no per-head norms; the
rest as Qwen3: pre-norm RMSNorm, RoPE, GQA, SwiGLU, final norm, tied or
untied head). Qwen2.5-0.5B, MiniVLA-1B's backbone, is this family with a
tied head. Sliding-window attention (off in every Qwen2.5 checkpoint:
`use_sliding_window=false`) is refused.

The code is Qwen3's (`qwen3.py`): `Qwen2Config` subclasses its Config and
flips the class-level switches `QK_NORM` and `QKV_BIAS`, so forward, cache,
decode layout and the HF table are one implementation. Params: Qwen3's
minus q_norm_h / k_norm_h, plus q_bias_nh [L, N, H], k_bias_kh / v_bias_kh
[L, K, H]. Implements `family.ModelFamily`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from wmrl_jax.models import qwen3
from wmrl_jax.models.qwen3 import (  # noqa: F401 - the family contract, shared with Qwen3
    cache_axes,
    decode_layout,
    forward,
    hf_ignore,
    hf_table,
    init_cache,
    init_params,
    param_axes,
    unembed,
)

MODEL_TYPES = ("qwen2",)


@dataclasses.dataclass(frozen=True)
class Qwen2Config(qwen3.Config):
    """Qwen3's Config fields (same meaning); the layout switches set for Qwen2."""

    QK_NORM: ClassVar[bool] = False
    QKV_BIAS: ClassVar[bool] = True


Config = Qwen2Config  # the family contract's name


def config_from_hf(hf: dict) -> Qwen2Config:
    """Config from a transformers `Qwen2Config.to_dict()`; unsupported options raise."""
    if hf.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"config model_type={hf.get('model_type')!r}, expected one of {MODEL_TYPES}")
    if hf.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act={hf['hidden_act']!r}: only 'silu' is implemented")
    sliding = [t for t in hf.get("layer_types") or () if t != "full_attention"]
    if hf.get("use_sliding_window", False) or sliding:
        raise NotImplementedError(
            f"use_sliding_window={hf.get('use_sliding_window')}, layer_types with {len(sliding)} sliding layer(s): "
            "sliding-window attention is not implemented (expected every layer 'full_attention')"
        )
    # transformers' Qwen2Attention: head_dim = config.head_dim if set, else hidden_size // heads (as Qwen3).
    return qwen3.dense_config_from_hf(Qwen2Config, hf, "Qwen2", max_positions=32_768)


def config_to_hf(config: Qwen2Config) -> dict:
    """kwargs for `transformers.Qwen2Config` (model_type included)."""
    hf = qwen3.config_to_hf(config)
    del hf["attention_bias"]  # not a Qwen2Config field: its q/k/v always have biases
    hf.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False)
    if config.head_dim == config.hidden_size // config.num_heads:
        del hf["head_dim"]  # the usual case: leave it derived, as Qwen2.5's own config.json does
    return hf
