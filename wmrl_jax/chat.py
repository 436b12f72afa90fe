"""A checkpoint that chats: model + tokenizer + chat template, as the agent and the world model use it.

WMRL's agent, frozen reference and world model are one backbone prompted
differently, so both prompts go through the checkpoint's *own* chat template
(`tokenizer.apply_chat_template`; ChatML for Qwen). A real Qwen3.5 folder and
the embedded micro-world load the same way:

    lm = load_chat_model("path/to/checkpoint")           # config.json, safetensors, tokenizer, template
    ids = lm.prompt_ids([{"role": "user", "content": "hi"}])
    out = sampling.generate(lm.model, [ids], eos_ids=lm.eos_ids, pad_id=lm.pad_id, ...)

Multi-turn episodes are built from token ids, never by re-tokenising text the
model wrote: `continuation_ids` renders what the template puts between the
end of one message and the next assistant turn and encodes only that, so an
agent's sampled tokens are kept exactly as sampled.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from wmrl_jax.models import load_hf, load_tokenizer


@dataclasses.dataclass
class ChatModel:
    """A `models.Model` and its tokenizer (with chat template).

    eos_ids: ids that end an assistant turn (the tokenizer's EOS, e.g.
      `<|im_end|>`, plus the config's `eos_token_id`s).
    pad_id: id used for padding (never attended to).
    """

    model: Any
    tokenizer: Any
    eos_ids: tuple[int, ...]
    pad_id: int
    path: Path | None = None

    def __repr__(self) -> str:
        config = self.model.config
        return (f"ChatModel({self.model.family.MODEL_TYPES[0]}, vocab={config.vocab_size}, "
                f"hidden={config.hidden_size}, layers={getattr(config, 'num_layers', '?')}, "
                f"eos_ids={self.eos_ids}, path={str(self.path) if self.path else None!r})")

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool) -> str:
        """The chat template's text for `messages` ([{"role", "content"}, ...])."""
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as it appears inside a rendered conversation (no added BOS/EOS)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """Ids of `messages` followed by the template's assistant header (what the model continues)."""
        if not messages:
            raise ValueError("messages: empty, expected at least one {'role', 'content'} message")
        return self.encode(self.render(messages, add_generation_prompt=True))

    def continuation_ids(self, messages: Sequence[dict], reply: str, new_messages: Sequence[dict]) -> list[int]:
        """Ids the template places after assistant `reply` up to the next assistant header.

        `messages` is the conversation before the reply. The result covers the
        reply's closing (e.g. ``"\\n"`` after `<|im_end|>`), the `new_messages`
        (e.g. the observation as a user turn) and the assistant header. The
        reply's own ids (its EOS included) are the caller's.
        """
        turn = [*messages, {"role": "assistant", "content": reply}]
        before = self.render(turn, add_generation_prompt=False)
        after = self.render([*turn, *new_messages], add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("chat template: rendering more messages changed the earlier text; "
                             "expected an append-only template (ChatML-like)")
        tail = after[len(before):]
        # The rendered reply ends with the template's end-of-turn text (e.g. "<|im_end|>\n"); the
        # reply's ids already hold the EOS token, so only what follows it is added.
        eos_text = self.tokenizer.decode([self.eos_ids[0]], skip_special_tokens=False)
        end = before.rfind(eos_text)
        if end >= 0:
            tail = before[end + len(eos_text):] + tail
        return self.encode(tail)


def load_chat_model(path, *, dtype: Any = "float32", mesh=None, model=None) -> ChatModel:
    """Loads an HF checkpoint folder (weights + tokenizer + chat template) as a `ChatModel`.

    `model` reuses already-loaded params (e.g. one frozen copy shared by the
    world model and the reference policy) instead of loading them again.
    Raises FileNotFoundError / ValueError naming what the folder lacks.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path}: not a folder (expected an HF checkpoint folder)")
    tokenizer = load_tokenizer(path)
    model = model if model is not None else load_hf(path, dtype=dtype, mesh=mesh)
    eos = []
    if tokenizer.eos_token_id is not None:
        eos.append(int(tokenizer.eos_token_id))
    cfg_eos = getattr(model.config, "eos_token_id", None)
    for e in (cfg_eos if isinstance(cfg_eos, (tuple, list)) else [cfg_eos]):
        if e is not None and int(e) not in eos:
            eos.append(int(e))
    if not eos:
        raise ValueError(f"checkpoint {path}: no EOS token (tokenizer.eos_token and config eos_token_id are unset)")
    pad = tokenizer.pad_token_id
    pad = int(pad) if pad is not None else eos[0]
    tokens = len(tokenizer)
    if tokens > model.config.vocab_size:
        raise ValueError(f"checkpoint {path}: the tokenizer has {tokens} tokens but the model's vocab_size is "
                         f"{model.config.vocab_size}; expected at most vocab_size tokens")
    if tokens < model.config.vocab_size and model.config.token_count != tokens:
        # Embedding rows past the tokenizer (vocabulary padding) are never sampled: their logits are masked.
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, token_count=tokens))
    return ChatModel(model=model, tokenizer=tokenizer, eos_ids=tuple(eos), pad_id=pad, path=path)


__all__ = ["ChatModel", "load_chat_model"]
