"""The world model: the frozen backbone, prompted to predict what running a solution would give.

WMRL replaces most sandbox executions by this prediction (docs/design.md,
"The agent and the world model"). It has two stages, as in the paper:

1. A deterministic gate. No code block, empty code, or code that fails
   `compile()` is scored at once (malformed / syntax_err) -- the same rule the
   real sandbox applies before it launches anything, so both sources agree on
   these cases and no model call is spent on them.
2. The frozen LLM reads the task overview, the data inventory and the
   line-numbered code, and answers in a fixed format::

       STATUS: valid
       ERROR: none
       QUALITY: mid
       FEEDBACK: Execution successful; the submission is valid ...

   status in {syntax_err, runtime_err, ran_no_sub, valid}; ERROR names the
   exception type (and line) of a failing run; QUALITY in {low, fair, mid,
   high} for a valid one; FEEDBACK is the synthetic message the agent reads
   next turn. The reward goes through the real grader's ladder (0.0 / 0.1 /
   0.2 / 0.5 + 0.5 * position), with a documented position per bucket.

An answer that cannot be parsed is *ungraded*: reward None, excluded from the
advantages downstream -- never 0, which would be a confident "syntax error".
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Sequence

import numpy as np

from wmrl_jax import sampling
from wmrl_jax.agent import _cap, data_inventory, target_columns, task_overview
from wmrl_jax.chat import ChatModel

STATUSES = ("syntax_err", "runtime_err", "ran_no_sub", "valid")   # what the model may answer
BUCKETS = ("low", "fair", "mid", "high")
# Each quality bucket stands for a quarter of the leaderboard; its reward uses the quarter's midpoint.
BUCKET_EDGES = (0.25, 0.5, 0.75)
DEFAULT_BUCKET_POSITIONS = (("low", 0.125), ("fair", 0.375), ("mid", 0.625), ("high", 0.875))


@dataclasses.dataclass(frozen=True)
class WorldModelConfig:
    """How the world model is prompted and sampled. Defaults: the paper's (docs/design.md)."""

    overview_chars: int = 4000     # task overview shown to the world model
    inventory_chars: int = 4000    # data inventory, capped (paper: ~4000 chars)
    code_chars: int = 8000         # line-numbered solution, capped (paper: ~8000 chars)
    max_new_tokens: int = 1024     # paper: WM max 1024 tokens
    temperature: float = 0.7       # paper: WM sampling T = 0.7, top-p 0.8, top-k 20
    top_p: float = 0.8
    top_k: int = 20
    num_samples: int = 1           # K answers per solution, rewards averaged (status: the most common)
    # bucket -> leaderboard position in [0, 1] used on the reward ladder (0.5 + 0.5 * position).
    bucket_positions: tuple[tuple[str, float], ...] = DEFAULT_BUCKET_POSITIONS

    def __post_init__(self):
        for name in ("overview_chars", "inventory_chars", "code_chars", "max_new_tokens", "num_samples"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"WorldModelConfig.{name}: got {value!r}, expected an int >= 1")
        sampling.check_sampling_args(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                     top_p=self.top_p, top_k=self.top_k)
        names = [b for b, _ in self.bucket_positions]
        if sorted(names) != sorted(BUCKETS) or not all(0.0 <= p <= 1.0 for _, p in self.bucket_positions):
            raise ValueError(f"WorldModelConfig.bucket_positions: got {self.bucket_positions!r}, expected each of "
                             f"{BUCKETS} once with a position in [0, 1]")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The world model's verdict on one solution.

    status: "malformed" / "syntax_err" from the gate, else the model's status; None when unparseable.
    bucket: quality bucket of a valid prediction, else None.
    reward: on the real grader's ladder, averaged over the K samples that parsed; None = ungraded.
    feedback: the synthetic execution feedback the agent reads next.
    raw_text: the model's answer(s) ("" when the gate decided).
    gated: True when the deterministic gate decided without calling the model.
    """

    status: str | None
    bucket: str | None
    reward: float | None
    feedback: str
    raw_text: str
    error_type: str | None = None
    gated: bool = False

    def __repr__(self) -> str:
        reward = "None" if self.reward is None else f"{self.reward:.3f}"
        return (f"Prediction(status={self.status!r}, bucket={self.bucket!r}, reward={reward}, "
                f"error_type={self.error_type!r}, gated={self.gated})")


# --------------------------------------------------------------------------- answer format

def quality_bucket(position: float) -> str:
    """The bucket of a leaderboard position score in [0, 1] (quarters: low, fair, mid, high)."""
    return BUCKETS[int(np.searchsorted(BUCKET_EDGES, position, side="right"))]


def ladder_reward(status: str, bucket: str | None, config: WorldModelConfig) -> float | None:
    """The real grader's reward ladder applied to a predicted status (and bucket)."""
    from sandbox.grading import ladder_reward as real_ladder

    position = dict(config.bucket_positions)[bucket] if status == "valid" else None
    return real_ladder(status, position)


def default_feedback(status: str, error: str | None = None, bucket: str | None = None) -> str:
    """The synthetic feedback line for an outcome (also what the micro-world learns to write)."""
    if status == "syntax_err":
        return f"Execution failed: code syntax validation failed ({error or 'SyntaxError'})."
    if status == "runtime_err":
        return f"Execution failed: {error or 'the program raised an error'}."
    if status == "ran_no_sub":
        return f"Execution successful, but the submission is invalid ({error or 'no valid submission file'})."
    where = {"low": "near the bottom", "fair": "in the lower half", "mid": "in the upper half",
             "high": "near the top"}.get(bucket or "", "somewhere")
    return f"Execution successful. Submission valid; it ranks {where} of the leaderboard."


def format_answer(status: str, *, error: str | None = None, bucket: str | None = None,
                  feedback: str | None = None) -> str:
    """The answer text for an outcome, in the format `parse_answer` reads."""
    if status not in STATUSES:
        raise ValueError(f"status: got {status!r}, expected one of {STATUSES}")
    if (status == "valid") != (bucket is not None) or (bucket is not None and bucket not in BUCKETS):
        raise ValueError(f"bucket: got {bucket!r} for status {status!r}; expected one of {BUCKETS} exactly "
                         f"when status is 'valid'")
    feedback = default_feedback(status, error, bucket) if feedback is None else feedback
    return (f"STATUS: {status}\nERROR: {error or 'none'}\nQUALITY: {bucket or 'none'}\n"
            f"FEEDBACK: {' '.join(feedback.split())}")


_FIELD = re.compile(r"^\s*(STATUS|ERROR|QUALITY|FEEDBACK)\s*:[ \t]*(.*?)\s*$", re.M | re.I)


def parse_answer(text: str) -> tuple[str, str | None, str | None, str] | None:
    """(status, error, bucket, feedback) from a world-model answer, or None when unusable.

    Usable means: a STATUS line with a known status and, for "valid", a
    QUALITY line with a known bucket. A truncated answer that still has these
    is used (its feedback is rebuilt from them when missing); garbage is None.
    """
    if not isinstance(text, str):
        return None
    fields = {}
    for key, value in _FIELD.findall(text):
        fields.setdefault(key.upper(), value)
    status = fields.get("STATUS", "").strip().lower()
    if status not in STATUSES:
        return None
    error = fields.get("ERROR", "").strip() or None
    error = None if error is None or error.lower() == "none" else error
    bucket = fields.get("QUALITY", "").strip().lower() or None
    if status == "valid":
        if bucket not in BUCKETS:
            return None
    else:
        bucket = None
    feedback = fields.get("FEEDBACK", "").strip() or default_feedback(status, error, bucket)
    return status, error, bucket, feedback


# --------------------------------------------------------------------------- prompt

def gate(text: str | None) -> tuple[str, str, str] | None:
    """(status, error type, feedback) when the deterministic gate decides, else None (ask the model).

    The real sandbox's own checks before it launches (`sandbox.runner.check_before_launch`):
    no code (or empty code) is "malformed", code that does not `compile()` is
    "syntax_err", with the feedback text the sandbox would return.
    """
    from sandbox.runner import check_before_launch

    _, refusal = check_before_launch(text)
    if refusal is None:
        return None
    return refusal.status, refusal.error_type, refusal.feedback()


def numbered(code: str) -> str:
    """Code as the world model reads it: every line unchanged, its 1-based number in a trailing comment.

    Errors are reported by line, so the model needs the numbers; but the
    world model and the agent are one backbone, and a listing whose lines
    *start* with numbers (``19 | X_test = ...``) taught the agent to start its
    own code lines that way once RL moved the shared weights (P("19") at a
    boilerplate line rose from 0.055 to 0.91 in 12 GRPO steps: a syntax error
    in every program). Lines here start exactly as the agent writes them, and
    the number is a comment: drifting into it still runs.
    """
    lines = code.rstrip("\n").split("\n")
    return "\n".join(f"{line}  # {i}" if line.strip() else f"# {i}" for i, line in enumerate(lines, 1))


def column_inventory(task, max_chars: int = 4000) -> str:
    """The public files as the world model reads them: one line a file, every column with its dtype.

    Checks of data references (a misspelt column, a string column fed to an
    estimator, NaN left in) need every column name, its type and whether it
    has gaps, not value ranges; a column list fits many more columns into the
    cap than the agent's inventory (`agent.data_inventory`). Files without
    an `info/inventory.json` fall back to the agent's listing (file sizes and
    CSV headers).
    """
    import json
    import pathlib

    path = pathlib.Path(task.root) / "info" / "inventory.json"
    if not path.is_file():
        return data_inventory(task, max_chars)
    lines = []
    targets = target_columns(task)
    if targets is not None:
        lines.append(f"Target columns (in train.csv, not in test.csv): {targets!r}")
    files = json.loads(path.read_text())
    listed: dict[str, list[str]] = {}
    # train.csv first: it has every column; a file whose columns are a subset of a listed one says only
    # which are missing (test.csv: train.csv's without the targets), which keeps the cap for names.
    for name in sorted(files, key=lambda n: n != "train.csv"):
        info = files[name]
        names = [c["name"] for c in info["columns"]]
        parent = next((p for p, cols in listed.items() if set(names) <= set(cols)), None)
        if parent is not None:
            missing = [c for c in listed[parent] if c not in names]
            if len(missing) <= len(names):
                lines.append(f"{name}: {info['rows']} rows; the columns of {parent}"
                             + (f" except {', '.join(missing)}" if missing else ""))
            else:
                lines.append(f"{name}: {info['rows']} rows; {', '.join(names)} (as in {parent})")
        else:
            cols = []
            for c in info["columns"]:
                kind = "str" if "values" in c or c["dtype"] in ("str", "object") else c["dtype"]
                cols.append(f"{c['name']} ({kind}{', missing' if c.get('missing') else ''})")
            lines.append(f"{name}: {info['rows']} rows; {', '.join(cols)}")
        listed[name] = names
    return _cap("\n".join(lines), max_chars)


WM_SYSTEM_PROMPT = (
    "You are a world model of a code-execution sandbox. Given a Kaggle-style task and a Python solution, predict "
    "what running the solution gives, without running it. Answer in exactly this format:\n"
    "STATUS: syntax_err | runtime_err | ran_no_sub | valid\n"
    "ERROR: the error type of a failed run, or none\n"
    "QUALITY: low | fair | mid | high (the leaderboard quarter of a valid submission), or none\n"
    "FEEDBACK: the execution feedback the author would read")


def messages(task, code: str, config: WorldModelConfig) -> list[dict]:
    """System + user messages asking for a prediction of `code` on `task`."""
    user = (f"# Task\n{task_overview(task, config.overview_chars)}\n\n"
            f"# Data\n{column_inventory(task, config.inventory_chars)}\n\n"
            f"# Solution\n{_cap(numbered(code), config.code_chars)}")
    return [{"role": "system", "content": WM_SYSTEM_PROMPT}, {"role": "user", "content": user}]


# --------------------------------------------------------------------------- predict

def _combine(answers: Sequence[str], config: WorldModelConfig) -> Prediction:
    parsed = [p for p in map(parse_answer, answers) if p is not None]
    raw = "\n---\n".join(answers)
    if not parsed:
        return Prediction(status=None, bucket=None, reward=None, feedback="", raw_text=raw)
    rewards = [ladder_reward(s, b, config) for s, _, b, _ in parsed]
    status = Counter(s for s, *_ in parsed).most_common(1)[0][0]
    first = next(p for p in parsed if p[0] == status)
    _, error, bucket, feedback = first
    return Prediction(status=status, bucket=bucket, reward=float(np.mean(rewards)), feedback=feedback,
                      raw_text=raw, error_type=error)


def predict(model: ChatModel, tasks: Sequence, codes: Sequence[str | None], *, config: WorldModelConfig,
            seed: int = 0, params=None) -> list[Prediction]:
    """Predicts the outcome of `codes[i]` on `tasks[i]`; one `Prediction` per solution.

    Solutions the gate decides never reach the model; the rest (x K samples)
    go through one batched `sampling.generate` call. `params` overrides the
    model's own (e.g. a frozen copy shared with the reference policy).
    """
    if len(tasks) != len(codes):
        raise ValueError(f"tasks and codes: {len(tasks)} tasks for {len(codes)} solutions, expected equal lengths")
    if not codes:
        raise ValueError("codes: empty batch, expected at least one solution")
    out: list[Prediction | None] = [None] * len(codes)
    ask, prompts = [], []
    for i, (task, code) in enumerate(zip(tasks, codes)):
        decided = gate(code)
        if decided is not None:
            status, error, feedback = decided
            reward = ladder_reward(status, None, config)
            out[i] = Prediction(status=status, bucket=None, reward=reward, feedback=feedback, raw_text="",
                                error_type=error, gated=True)
            continue
        ask.append(i)
        prompts.append(model.prompt_ids(messages(task, code, config)))
    if ask:
        lm = model.model if params is None else dataclasses.replace(model.model, params=params)
        result = sampling.generate(
            lm, [p for p in prompts for _ in range(config.num_samples)], max_new_tokens=config.max_new_tokens,
            temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, eos_ids=model.eos_ids,
            pad_id=model.pad_id, seed=seed)
        texts = [model.decode(t) for t in result.tokens]
        k = config.num_samples
        for j, i in enumerate(ask):
            out[i] = _combine(texts[j * k:(j + 1) * k], config)
    return out


__all__ = ["BUCKETS", "DEFAULT_BUCKET_POSITIONS", "Prediction", "STATUSES", "WM_SYSTEM_PROMPT", "WorldModelConfig",
           "column_inventory", "default_feedback", "format_answer", "gate", "ladder_reward", "messages", "numbered", "parse_answer",
           "predict", "quality_bucket"]
