"""Tokenizer of a checkpoint folder, through transformers (chat template included)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path):
    """`transformers.AutoTokenizer` of an HF folder; it must carry a chat template.

    The agent and world-model prompts are built with `apply_chat_template`,
    so a folder without one is an error here rather than a silently
    differently formatted prompt later.
    """
    import transformers

    path = Path(path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"{path}: no tokenizer.json / tokenizer_config.json (expected an HF tokenizer folder)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{path}: the tokenizer has no chat_template (expected chat_template.jinja or one in tokenizer_config.json)")
    return tokenizer
