"""Tokenizer of a checkpoint folder, through transformers (chat template included)."""

from __future__ import annotations

import os
from pathlib import Path


def import_transformers():
    """`import transformers`, without its import-time advice that PyTorch is missing.

    We use transformers only for configs and tokenizers (JAX runs the model), so
    "PyTorch was not found. Models won't be available ..." is true and useless,
    and printed on every run. TRANSFORMERS_NO_ADVISORY_WARNINGS drops only
    transformers' advisory notices (`logger.warning_advice`); its warnings and
    errors still print. setdefault: a value the user set wins.
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    return transformers


def load_tokenizer(path):
    """`transformers.AutoTokenizer` of an HF folder; it must carry a chat template.

    The agent and world-model prompts are built with `apply_chat_template`,
    so a folder without one is an error here rather than a silently
    differently formatted prompt later.
    """
    transformers = import_transformers()

    path = Path(path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"{path}: no tokenizer.json / tokenizer_config.json (expected an HF tokenizer folder)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{path}: the tokenizer has no chat_template (expected chat_template.jinja or one in tokenizer_config.json)")
    return tokenizer
