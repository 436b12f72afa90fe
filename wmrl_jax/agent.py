"""The research agent: its prompts, the multi-turn protocol, and episodes as training data.

An episode is one attempt at one task. The agent reads a system prompt that
describes the sandbox (where the data is, where the submission goes, what is
installed, the time limit) and a user turn with the task overview and the data
inventory, then writes a short plan and one fenced Python program. For up to
`max_turns` turns it reads feedback on that program and may write a better
one; the last fenced Python block of the final turn is the solution.

Where the feedback comes from is the caller's choice, per rollout: the real
sandbox for anchor groups, the world model's synthetic feedback otherwise
(`run_episodes(..., feedback=...)`). That is the whole point of WMRL: the
protocol is the same, only the source of the observation changes.

For GRPO an episode is a token sequence with a loss mask that covers the
agent's own tokens only -- never the prompt, never an observation -- and the
sampling log-probs of those tokens. Every turn of a batch (B tasks x G
rollouts) is one call of the jitted sampler.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Callable, Sequence

import numpy as np

from wmrl_jax import sampling
from wmrl_jax.chat import ChatModel

# What the sandbox offers a solution (sandbox/isolation.py runs it; the suite's
# reference solutions use exactly these).
SANDBOX_PACKAGES = ("numpy", "pandas", "scikit-learn", "scipy", "statsmodels")
DATA_FILES = "train.csv, test.csv, sample_submission.csv"


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """How the agent is prompted and sampled. Defaults: the paper's settings (docs/design.md)."""

    max_turns: int = 4                  # paper: <= 4 agent turns
    max_new_tokens: int = 4096          # paper: 4096 new tokens per turn
    observation_max_tokens: int = 1024  # paper: observations capped at 1024 tokens
    overview_chars: int = 4000          # task overview shown to the agent
    inventory_chars: int = 4000         # data inventory shown to the agent
    temperature: float = 1.0            # GRPO samples from the policy itself
    top_p: float = 1.0
    top_k: int = 0
    timeout_s: float = 600.0            # paper: sandbox cap 600 s (stated in the prompt)
    # Turn k+1 continues turn k's sampler cache (prefilling only the observation and the next header) instead
    # of re-prefilling the whole conversation; same tokens and log-probs up to float rounding (docs/design.md,
    # "Multi-turn cache reuse"). The cache is held on the device while the feedback is computed.
    reuse_cache: bool = True

    def __post_init__(self):
        for name in ("max_turns", "max_new_tokens", "observation_max_tokens", "overview_chars", "inventory_chars"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"AgentConfig.{name}: got {value!r}, expected an int >= 1")
        sampling.check_sampling_args(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                     top_p=self.top_p, top_k=self.top_k)


# --------------------------------------------------------------------------- what the agent reads

def cap_text(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` at a line boundary where possible, marked when cut."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    cut = cut if cut > max_chars // 2 else max_chars
    return text[:cut].rstrip() + "\n[... truncated]"


def _info_dir(task) -> pathlib.Path | None:
    info = pathlib.Path(task.root) / "info"
    if task.layout == "mle-dojo" and not info.is_dir():
        raise FileNotFoundError(
            f"task {task.name}: no info/ folder in {task.root} (expected the MLE-Dojo layout: info/description.txt, "
            f"info/*_leaderboard.csv)")
    return info if info.is_dir() else None


def task_overview(task, max_chars: int = 4000) -> str:
    """The task's description (MLE-Dojo `info/description.txt`), without a data inventory, capped."""
    info = _info_dir(task)
    text = task.description
    if info is not None and (info / "description.txt").is_file():
        text = (info / "description.txt").read_text(encoding="utf-8")
    text = text.split("\nData inventory\n", 1)[0]
    if not text.strip():
        raise ValueError(f"task {task.name}: empty description (expected info/description.txt with the task text)")
    return cap_text(text, max_chars)


def _render_inventory(inv: dict) -> str:
    lines = []
    for name, info in inv.items():
        lines.append(f"{name}: {info['rows']} rows x {len(info['columns'])} columns")
        for c in info["columns"]:
            extra = (f"range [{c['min']:.6g}, {c['max']:.6g}]" if "min" in c
                     else "values " + ", ".join(map(str, c.get("values", []))))
            miss = f", {c['missing']} missing" if c.get("missing") else ""
            lines.append(f"  - {c['name']} ({c['dtype']}{miss}): {extra}")
    return "\n".join(lines)


def _list_files(folder: pathlib.Path) -> str:
    lines = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        line = f"{path.relative_to(folder)}: {path.stat().st_size} bytes"
        if path.suffix == ".csv":
            with open(path, encoding="utf-8", errors="replace") as f:
                header = f.readline().strip()
            line += f"; columns: {header}"
        lines.append(line)
    return "\n".join(lines)


def _csv_header(path: pathlib.Path) -> list[str]:
    import csv

    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        return next(csv.reader(f), [])


def target_columns(task) -> list[str] | None:
    """Columns of train.csv that test.csv lacks -- what a solution must predict; None without both files."""
    public = pathlib.Path(task.public_dir)
    if not ((public / "train.csv").is_file() and (public / "test.csv").is_file()):
        return None
    test = set(_csv_header(public / "test.csv"))
    return [c for c in _csv_header(public / "train.csv") if c not in test]


def data_inventory(task, max_chars: int = 4000) -> str:
    """What the public data holds: `info/inventory.json` when the task has one, else the files and CSV headers.

    It opens with the target columns (those of train.csv missing from
    test.csv), written as a Python list: the one fact every solution must get
    right, stated where no cap cuts it and in the form code uses.
    """
    info = _info_dir(task)
    if info is not None and (info / "inventory.json").is_file():
        text = _render_inventory(json.loads((info / "inventory.json").read_text()))
    else:
        text = _list_files(pathlib.Path(task.public_dir))
    targets = target_columns(task)
    if targets is not None:
        text = f"Target columns (in train.csv, not in test.csv): {targets!r}\n{text}"
    return cap_text(text, max_chars)


def system_prompt(config: AgentConfig) -> str:
    return (
        "You are a machine learning research agent. You solve a Kaggle-style competition by writing one Python "
        "program.\n"
        f"The program runs offline in a sandbox with {', '.join(SANDBOX_PACKAGES)}; time limit {config.timeout_s:g} s. "
        f"Read the data from the folder in the environment variable DATA_DIR ({DATA_FILES}). Write your predictions "
        "for test.csv as CSV to the path in the environment variable SUBMISSION_PATH, in the format of "
        "sample_submission.csv.\n"
        "Answer with a one-line plan and one ```python block. You will see how the program ran and may improve it; "
        "your last program is your solution.")


def task_type_line(category: str, metric: str = "") -> str:
    """The user turn's last line: ``Task type: regression; metric: r2.``"""
    return f"Task type: {category}" + (f"; metric: {metric}." if metric else ".")


def initial_messages(task, config: AgentConfig) -> list[dict]:
    """System + user messages that start an episode on `task`.

    The user turn ends with the task type and metric when the task folder
    states them (`info/task.json`): the last thing read before answering, and
    what decides between a classifier and a regressor and what a submission
    row holds.
    """
    user = (f"# Task\n{task_overview(task, config.overview_chars)}\n\n"
            f"# Data\n{data_inventory(task, config.inventory_chars)}")
    if task.category and task.category != "uncategorized":
        user += f"\n\n{task_type_line(task.category, task.metric)}"
    return [{"role": "system", "content": system_prompt(config)}, {"role": "user", "content": user}]


def observation_message(feedback: str) -> dict:
    """The user turn that shows the agent how its program ran."""
    return {"role": "user", "content": f"{feedback.strip()}\n\nImprove the program if you can, as one ```python block."}


# --------------------------------------------------------------------------- episodes

@dataclasses.dataclass
class Episode:
    """One rollout: the whole token sequence and what GRPO needs of it.

    tokens: int32[T] prompt, then per turn the agent's reply and (between turns) the observation.
    loss_mask: bool[T], True exactly on the agent's sampled tokens.
    logprobs: float32[T], the sampling log-prob of each agent token (0 elsewhere).
    prompt_len: number of prompt tokens (tokens[:prompt_len]).
    replies: the agent's text per turn; solution: the final turn's program (None when it wrote none).
    observations: the feedback shown after each non-final turn.
    truncated: per turn, whether the reply ran out of `max_new_tokens` before its end-of-turn token.
    """

    task_index: int
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    prompt_len: int
    replies: list[str]
    solution: str | None
    observations: list[str]
    truncated: list[bool]

    def __repr__(self) -> str:
        return (f"Episode(task_index={self.task_index}, tokens={len(self.tokens)}, agent_tokens="
                f"{int(self.loss_mask.sum())}, turns={len(self.replies)}, solution="
                f"{'None' if self.solution is None else f'{len(self.solution)} chars'})")


# feedback(rows, solutions) -> observation text per row; rows are indices into the episode batch.
FeedbackFn = Callable[[Sequence[int], Sequence[str | None]], Sequence[str]]


def extract_solution(reply: str) -> str | None:
    """The last fenced Python block of a reply (else the last fenced block), or None."""
    from sandbox.runner import extract_code   # one extraction rule for the agent, the sandbox and the world model

    if "```" not in reply:
        return None
    return extract_code(reply)


def run_episodes(lm: ChatModel, tasks: Sequence, group_size: int, *, config: AgentConfig,
                 feedback: FeedbackFn | None = None, seed: int = 0, params=None) -> list[Episode]:
    """Runs `group_size` episodes on each task; returns B * G episodes, task-major (group b = rows b*G..b*G+G-1).

    Each turn is one `sampling.generate` call over every row. Between turns
    `feedback(rows, solutions)` gives each row's observation (capped at
    `config.observation_max_tokens` tokens); it is not called after the final
    turn, nor when `max_turns` is 1. With `config.reuse_cache` each later turn
    continues the previous turn's cache: only the tokens added since (the
    reply's last token, the observation, the next assistant header) are
    prefilled. `params` overrides `lm.model.params` (e.g. the policy being
    trained, while `lm` carries the tokenizer).
    """
    if not tasks:
        raise ValueError("tasks: empty batch, expected at least one task")
    if not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size: got {group_size!r}, expected an int >= 1")
    if config.max_turns > 1 and feedback is None:
        raise ValueError(f"feedback: None, but max_turns={config.max_turns} needs feedback between turns")
    model = lm.model if params is None else dataclasses.replace(lm.model, params=params)
    rows = [(b, g) for b in range(len(tasks)) for g in range(group_size)]
    messages = [initial_messages(tasks[b], config) for b, _ in rows]
    first = [lm.prompt_ids(m) for m in messages]
    tokens = [list(p) for p in first]
    mask = [[False] * len(p) for p in first]
    logps = [[0.0] * len(p) for p in first]
    replies = [[] for _ in rows]
    observations = [[] for _ in rows]
    truncated = [[] for _ in rows]
    cache = None   # the previous turn's sampler cache (config.reuse_cache)
    for turn in range(config.max_turns):
        out = sampling.generate(
            model, tokens, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            top_p=config.top_p, top_k=config.top_k, eos_ids=lm.eos_ids, pad_id=lm.pad_id,
            seed=int(np.random.SeedSequence([seed, turn]).generate_state(1)[0]),
            cache=cache, return_cache=config.reuse_cache and turn < config.max_turns - 1)
        cache = out.cache
        for i in range(len(rows)):
            new = out.tokens[i]
            tokens[i] += new
            mask[i] += [True] * len(new)
            logps[i] += out.logprobs[i].tolist()
            truncated[i].append(not bool(out.finished[i]))
            if not out.finished[i]:  # close the turn so the template stays well formed; not the agent's token
                tokens[i].append(lm.eos_ids[0])
                mask[i].append(False)
                logps[i].append(0.0)
            text = lm.decode(new)
            replies[i].append(text)
        if turn == config.max_turns - 1:
            break
        solutions = [extract_solution(r[-1]) for r in replies]
        shown = list(feedback(list(range(len(rows))), solutions))
        if len(shown) != len(rows):
            raise ValueError(f"feedback returned {len(shown)} observations, expected {len(rows)}")
        for i, text in enumerate(shown):
            capped = lm.decode(lm.encode(text)[: config.observation_max_tokens])
            observations[i].append(capped)
            obs = observation_message(capped)
            ids = lm.continuation_ids(messages[i], replies[i][-1], [obs])
            messages[i] = [*messages[i], {"role": "assistant", "content": replies[i][-1]}, obs]
            tokens[i] += ids
            mask[i] += [False] * len(ids)
            logps[i] += [0.0] * len(ids)
    return [
        Episode(task_index=b, tokens=np.asarray(tokens[i], np.int32), loss_mask=np.asarray(mask[i], bool),
                logprobs=np.asarray(logps[i], np.float32), prompt_len=len(first[i]), replies=replies[i],
                solution=extract_solution(replies[i][-1]), observations=observations[i], truncated=truncated[i])
        for i, (b, _) in enumerate(rows)
    ]


__all__ = ["AgentConfig", "Episode", "FeedbackFn", "SANDBOX_PACKAGES", "cap_text", "data_inventory", "extract_solution",
           "initial_messages", "observation_message", "run_episodes", "system_prompt", "target_columns", "task_type_line",
           "task_overview"]
