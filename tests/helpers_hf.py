"""Shared test helpers: tiny random HF models and a tiny tokenizer, saved in HF format.

Nothing is downloaded: models are built from a config with transformers and
random weights (norm weights too, so a forgotten norm shows up in parity
tests), the tokenizer is trained in-process with the `tokenizers` library on
a few sentences. Other families' tests (Qwen3.5) and the sampler tests import
these.

    cfg = tiny_qwen3_config(tie_word_embeddings=True)
    path = save_tiny_qwen3(tmp_path / "m", cfg, seed=0)   # model + tokenizer
    tokens, mask = left_pad([[5, 6, 7], [8, 9]], pad_id=0)
    ref = hf_logits(path_or_model, tokens, mask)         # float32[B, T, V]
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

# Vocabulary of the tiny tokenizer; tiny models use the same size so that
# sampled ids always decode.
TINY_VOCAB = 320
# ChatML, as Qwen's checkpoints and the shipped micro-world write it.
from wmrl_jax.micro_world import CHAT_TEMPLATE, SPECIAL_TOKENS  # noqa: E402
_CORPUS = [
    "def train(model, data): return model.fit(data)",
    "import numpy as np\nimport pandas as pd\nscore = 0.5 + 0.5 * position",
    "The world model predicts the score of the solution before it runs.",
    "submission.csv written; validation accuracy 0.87",
    "Traceback (most recent call last): ValueError: bad input",
]


def tiny_qwen3_config(**overrides):
    """A tiny `transformers.Qwen3Config` with the awkward choices parity must survive.

    GQA 4:2, head_dim (12) != hidden / heads (8), rope_theta and eps away from
    their defaults. Any field can be overridden.
    """
    import transformers

    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
    )
    kwargs.update(overrides)
    return transformers.Qwen3Config(**kwargs)


def masked_max_err(a, b, mask) -> float:
    """The largest |a - b| over the positions `mask` marks (a [..., V] pair of logits, a [...] mask)."""
    return float(np.max(np.abs(a - b) * np.asarray(mask)[..., None]))


def randomize_norms(model, seed: int = 0, *, scale: float = 0.3, center: float = 1.0) -> None:
    """Sets every parameter whose name contains "norm" to center + scale * N(0, 1), in place.

    Random inits leave RMSNorm weights at 1 (or 0 for (1 + w) norms), which
    hides a norm applied twice or not at all; parity tests must not.
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(center + scale * torch.randn(param.shape, generator=gen, dtype=param.dtype))


def build_tiny_qwen3(config=None, *, seed: int = 0):
    """A random `Qwen3ForCausalLM` in f32 eval mode, norms randomized, eager attention."""
    import transformers

    return build_tiny_lm(transformers.Qwen3ForCausalLM, config if config is not None else tiny_qwen3_config(), seed=seed)


def build_tiny_lm(model_class, config, *, seed: int = 0):
    """A random `model_class(config)` (an HF causal LM) in f32 eval mode, weights 0.15·N(0, 1) (biases
    too), norms randomized, eager attention."""
    import torch

    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    # initializer_range 0.02 gives near-uniform logits; larger weights make
    # parity errors visible instead of drowned in tiny numbers.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
    randomize_norms(model, seed)
    return model


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer (TINY_VOCAB ids, ChatML specials 0..2) with a chat template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def save_tiny_tokenizer(path) -> Path:
    path = Path(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def save_tiny_qwen3(path, config=None, *, seed: int = 0, max_shard_size=None, tokenizer: bool = True) -> Path:
    """Builds a tiny random Qwen3 and `save_pretrained`s it (+ the tiny tokenizer) to `path`.

    `max_shard_size` (e.g. "20KB") forces a sharded checkpoint with a
    `model.safetensors.index.json`.
    """
    path = Path(path)
    model = build_tiny_qwen3(config, seed=seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        save_tiny_tokenizer(path)
    return path


def left_pad(prompts, pad_id: int = 0):
    """Left-pads lists of ids: returns (int64[B, T] tokens, int64[B, T] attention mask)."""
    width = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        if prompt:
            tokens[row, width - len(prompt) :] = prompt
            mask[row, width - len(prompt) :] = 1
    return tokens, mask


def hf_positions(mask) -> np.ndarray:
    """position_ids as HF generate computes them for a left-padded batch: cumsum(mask) - 1, pads at 1."""
    mask = np.asarray(mask)
    pos = np.cumsum(mask, axis=-1) - 1
    return np.where(mask == 0, 1, pos)


def hf_logits(model_or_path, tokens, mask=None) -> np.ndarray:
    """float32[B, T, V] logits of a transformers causal LM (a model or a saved folder).

    With a mask, position_ids are those HF generate uses for left padding.
    """
    import torch
    import transformers

    model = model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_or_path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.as_tensor(np.asarray(mask), dtype=torch.long)
        kwargs["position_ids"] = torch.as_tensor(hf_positions(mask), dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=tokens, **kwargs).logits.float().numpy()


def tiny_vla_config(tokenizer, image_size: int = 16, cameras=("agentview", "wrist")):
    """A VLA config small enough for CPU tests: a 2-layer Qwen2 backbone, a 1-layer ViT of 8-pixel patches."""
    from wmrl_jax.models import qwen2
    from wmrl_jax.vla import model as vla
    from wmrl_jax.vla import sft, vision

    backbone = qwen2.Qwen2Config(vocab_size=sft.vocab_size_for(tokenizer), hidden_size=32, intermediate_size=48,
                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=5000.0,
                                 initializer_range=0.1)
    vis = vision.VisionConfig(image_size=image_size, patch_size=8, width=16, num_layers=1, num_heads=2, mlp_size=32,
                              initializer_range=0.1)
    return vla.Config(backbone=backbone, vision=vis, cameras=tuple(cameras), initializer_range=0.1)
