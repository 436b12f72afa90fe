"""Qwen3.5 HF state-dict names <-> our param tree: the table ``hf_io`` loads and saves with (data, not code paths).

Our stacked leaves hold one pattern position over the R scanned repeats, so
slice r of ``blocks[j]`` is HF layer ``r·P + j``: each stacked entry lists
those ids in ``HfTensor.layer_ids``. Split from ``qwen35``, which re-exports
``hf_table`` and ``hf_ignore`` (the family contract).
"""

from __future__ import annotations

from typing import Callable

from wmrl_jax.models.family import HfTensor
from wmrl_jax.models.qwen35_config import FULL, HF_PREFIX, Config

def _layer_entries(c: Config, kind: str, key: Callable[[str], str], path: tuple[str, ...], ids) -> list[HfTensor]:
    """HfTensors of one layer (``ids``: the HF layer of each stacked slice, or None for an unstacked
    tail layer); ``key(suffix)`` is the HF key, or key template with ``{layer}``, of ``...layers.N.<suffix>``."""
    d, f = c.hidden_size, c.intermediate_size
    stacked = ids is not None

    def lin(suffix, name, in_dims, out_dims):
        return HfTensor.linear(key(suffix), path + (name,), in_dims, out_dims, stacked, ids)

    def same(suffix, name, shape):
        return HfTensor.same(key(suffix), path + (name,), shape, stacked, ids)

    entries = [
        same("input_layernorm.weight", "attn_norm_d", (d,)),
        same("post_attention_layernorm.weight", "mlp_norm_d", (d,)),
        lin("mlp.gate_proj.weight", "gate_proj_df", (d,), (f,)),
        lin("mlp.up_proj.weight", "up_proj_df", (d,), (f,)),
        lin("mlp.down_proj.weight", "down_proj_fd", (f,), (d,)),
    ]
    if kind == FULL:
        n, k, h = c.num_heads, c.num_kv_heads, c.head_dim
        return entries + [
            lin("self_attn.q_proj.weight", "q_gate_proj_dnxh", (d,), (n, 2, h)),
            lin("self_attn.k_proj.weight", "k_proj_dkh", (d,), (k, h)),
            lin("self_attn.v_proj.weight", "v_proj_dkh", (d,), (k, h)),
            same("self_attn.q_norm.weight", "q_norm_h", (h,)),
            same("self_attn.k_norm.weight", "k_norm_h", (h,)),
            lin("self_attn.o_proj.weight", "o_proj_nhd", (n, h), (d,)),
        ]
    m, u, ch, w = c.linear_num_value_heads, c.linear_value_head_dim, c.conv_dim, c.linear_conv_kernel
    return entries + [
        lin("linear_attn.in_proj_qkv.weight", "qkv_proj_dc", (d,), (ch,)),
        lin("linear_attn.in_proj_z.weight", "z_proj_dmu", (d,), (m, u)),
        lin("linear_attn.in_proj_b.weight", "b_proj_dm", (d,), (m,)),
        lin("linear_attn.in_proj_a.weight", "a_proj_dm", (d,), (m,)),
        # nn.Conv1d depthwise weight [C, 1, W] -> [W, C]
        HfTensor(key("linear_attn.conv1d.weight"), path + ("conv_wc",), (ch, 1, w), (ch, w), (1, 0), stacked, ids),
        same("linear_attn.dt_bias", "dt_bias_m", (m,)),
        same("linear_attn.A_log", "a_log_m", (m,)),
        same("linear_attn.norm.weight", "out_norm_u", (u,)),
        lin("linear_attn.out_proj.weight", "out_proj_mud", (m, u), (d,)),
    ]


def hf_table(config: Config) -> list[HfTensor]:
    """HF state-dict keys <-> params, for ``Qwen3_5ForCausalLM`` (``model.layers.*``) or
    ``Qwen3_5ForConditionalGeneration`` (``model.language_model.layers.*``), per ``config.hf_layout``."""
    c = config
    prefix = HF_PREFIX[c.hf_layout]
    period = len(c.pattern)
    table = [
        HfTensor.same(prefix + "embed_tokens.weight", ("embed_vd",), (c.vocab_size, c.hidden_size)),
        HfTensor.same(prefix + "norm.weight", ("final_norm_d",), (c.hidden_size,)),
    ]
    template = lambda suffix: prefix + "layers.{layer}." + suffix
    for j, kind in enumerate(c.pattern):
        ids = tuple(r * period + j for r in range(c.num_repeats))  # slice r of blocks[j] is HF layer r·P + j
        table += _layer_entries(c, kind, template, ("blocks", str(j)), ids)
    for i, kind in enumerate(c.tail_types):
        layer = c.num_repeats * period + i
        table += _layer_entries(c, kind, lambda s, n=layer: f"{prefix}layers.{n}.{s}", ("tail", str(i)), None)
    if not c.tie_word_embeddings:
        table.append(HfTensor.linear("lm_head.weight", ("lm_head_dv",), (c.hidden_size,), (c.vocab_size,)))
    return table


def hf_ignore(config: Config) -> tuple[str, ...]:
    """Keys skipped on load (hf_io prints a one-line notice): the vision tower, the MTP head, a tied head."""
    ignore = (r"^model\.visual\.", r"^mtp\.")
    return ignore + ((r"^lm_head\.weight$",) if config.tie_word_embeddings else ())
