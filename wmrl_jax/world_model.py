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

That is the *holistic* design (`WorldModelConfig.design = "holistic"`, the
default): one question, one answer. The paper also describes a *decomposed*
design (`design = "decomposed"`): stage 2 becomes seven focused checks
(`CHECKS`) and a quality rubric, asked in parallel on the same task, data and
listing, each with its own system prompt, and their verdicts are combined by
precedence on the same ladder (see `combine_checks`). Why both: a single
answer must trace every failure mode at once, and a small model tends to stop
at the first plausible one; a focused question is easier, but seven of them
must all stay quiet on a working program, so false alarms add up. Which one
predicts real outcomes better is measured, not assumed (`launch/wm_fidelity.py
--designs=holistic,decomposed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import re
from collections import Counter
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from wmrl_jax import sampling
from wmrl_jax.models.layers import positions_from_valid
from wmrl_jax.agent import SANDBOX_PACKAGES, cap_text, data_inventory, target_columns, task_overview
from wmrl_jax.chat import ChatModel, load_chat_model

STATUSES = ("syntax_err", "runtime_err", "ran_no_sub", "valid")   # what the model may answer
BUCKETS = ("low", "fair", "mid", "high")
# Each quality bucket stands for a quarter of the leaderboard; its reward uses the quarter's midpoint.
BUCKET_EDGES = (0.25, 0.5, 0.75)
DEFAULT_BUCKET_POSITIONS = (("low", 0.125), ("fair", 0.375), ("mid", 0.625), ("high", 0.875))
DESIGNS = ("holistic", "decomposed")
# The decomposed design's focused checks, in the order they are asked (and break ties in confidence).
RUNTIME_CHECKS = ("imports_and_names", "api_calls", "data_references", "shapes_and_types", "compute_budget",
                  "other_runtime")
CHECKS = (*RUNTIME_CHECKS, "submission")
RUBRIC = "quality"   # the decomposed design's quality question, asked alongside the checks
VERDICTS = ("pass", "fail")


LISTINGS = ("prefix", "comment")
READOUTS = ("sample", "expected")
INVENTORIES = ("agent", "columns")


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
    # "holistic": one answer per solution; "decomposed": len(CHECKS) checks + the rubric per solution.
    design: str = "holistic"
    # How the code is listed (`numbered`): "prefix" (``19 | X_test = ...``, what the shipped micro-world
    # was trained on) or "comment" (``X_test = ...  # 19``: lines start as the agent writes them).
    listing: str = "prefix"
    # The data section (`data_inventory`): "agent" (the agent's inventory, value ranges) or "columns"
    # (`column_inventory`: every column with its dtype and gaps, one line a file).
    inventory: str = "agent"
    # How an answer becomes a reward: "sample" (K sampled answers, parsed, rewards averaged: the paper's) or
    # "expected" (one teacher-forced forward reads the model's probability of each status and bucket -- of each
    # check's verdict in the decomposed design -- and the reward is their expectation on the ladder; no
    # decoding, no sampling noise, generic feedback). See `expected_predictions`.
    readout: str = "sample"

    def __post_init__(self):
        if self.design not in DESIGNS:
            raise ValueError(f"WorldModelConfig.design: got {self.design!r}, expected one of {DESIGNS}")
        if self.listing not in LISTINGS:
            raise ValueError(f"WorldModelConfig.listing: got {self.listing!r}, expected one of {LISTINGS}")
        if self.readout not in READOUTS:
            raise ValueError(f"WorldModelConfig.readout: got {self.readout!r}, expected one of {READOUTS}")
        if self.inventory not in INVENTORIES:
            raise ValueError(f"WorldModelConfig.inventory: got {self.inventory!r}, expected one of {INVENTORIES}")
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
    checks: decomposed design only: (name, verdict, confidence, error) per check in `CHECKS` order, from
      the sample whose outcome the prediction reports (verdict etc. None where that check did not parse).
    """

    status: str | None
    bucket: str | None
    reward: float | None
    feedback: str
    raw_text: str
    error_type: str | None = None
    gated: bool = False
    checks: tuple | None = None

    def __repr__(self) -> str:
        reward = "None" if self.reward is None else f"{self.reward:.3f}"
        failed = "" if self.checks is None else f", failed={tuple(c[0] for c in self.checks if c[1] == 'fail')}"
        return (f"Prediction(status={self.status!r}, bucket={self.bucket!r}, reward={reward}, "
                f"error_type={self.error_type!r}, gated={self.gated}{failed})")


# --------------------------------------------------------------------------- answer format

FOLDER = "world_model"   # an agent checkpoint's own world model, when it ships one (`checkpoint_path`)


def checkpoint_path(path) -> pathlib.Path:
    """Where the world model of the agent checkpoint folder `path` lives.

    Its ``world_model/`` subfolder when it has one -- the micro-world's: the
    agent's backbone, copied after their shared schedule and trained further on
    the execution corpus, because a model of a few million parameters cannot
    hold both skills in one set of weights (docs/results.md) -- else `path`
    itself: the agent's own base weights, frozen, as in the paper.
    """
    path = pathlib.Path(path)
    own = path / FOLDER
    return own if (own / "config.json").is_file() else path


def load(path, *, dtype="float32", mesh=None, base: ChatModel | None = None) -> ChatModel:
    """The world model of the agent checkpoint `path` (`checkpoint_path`), as a ChatModel.

    `base`: the agent checkpoint already loaded; returned as is when the world
    model is the agent's own weights (one frozen copy, not two).
    """
    where = checkpoint_path(path)
    if base is not None and where == pathlib.Path(path):
        return base
    return load_chat_model(where, dtype=dtype, mesh=mesh)


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


def _first_fields(pattern: re.Pattern, text: str) -> dict[str, str]:
    """KEY -> value of the first ``KEY: value`` line `pattern` finds for each key (keys upper-cased)."""
    fields: dict[str, str] = {}
    for key, value in pattern.findall(text):
        fields.setdefault(key.upper(), value)
    return fields


def parse_answer(text: str) -> tuple[str, str | None, str | None, str] | None:
    """(status, error, bucket, feedback) from a world-model answer, or None when unusable.

    Usable means: a STATUS line with a known status and, for "valid", a
    QUALITY line with a known bucket. A truncated answer that still has these
    is used (its feedback is rebuilt from them when missing); garbage is None.
    """
    if not isinstance(text, str):
        return None
    fields = _first_fields(_FIELD, text)
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


def numbered(code: str, listing: str = "prefix") -> str:
    """Code with 1-based line numbers, as the world model reads it (errors are reported by line).

    "prefix": ``19 | X_test = ...``. "comment": ``X_test = ...  # 19`` --
    every line starts exactly as the agent writes it, and drifting into the
    format still runs. The world model and the agent are one backbone: with
    the prefix listing, 12 GRPO steps at lr 5e-5 raised the micro-world
    agent's P("19") at the start of a boilerplate line from 0.055 to 0.91 (a
    syntax error in every program). The shipped micro-world was trained on
    the prefix form, so that stays the default until a build on "comment"
    ships.
    """
    if listing not in LISTINGS:
        raise ValueError(f"listing: got {listing!r}, expected one of {LISTINGS}")
    lines = code.rstrip("\n").split("\n")
    if listing == "comment":
        return "\n".join(f"{line}  # {i}" if line.strip() else f"# {i}" for i, line in enumerate(lines, 1))
    width = len(str(len(lines)))
    return "\n".join(f"{i:>{width}} | {line}" for i, line in enumerate(lines, 1))


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
    return cap_text("\n".join(lines), max_chars)


WM_SYSTEM_PROMPT = (
    "You are a world model of a code-execution sandbox. Given a Kaggle-style task and a Python solution, predict "
    "what running the solution gives, without running it. Answer in exactly this format:\n"
    "STATUS: syntax_err | runtime_err | ran_no_sub | valid\n"
    "ERROR: the error type of a failed run, or none\n"
    "QUALITY: low | fair | mid | high (the leaderboard quarter of a valid submission), or none\n"
    "FEEDBACK: the execution feedback the author would read")


_INVENTORY = {"agent": data_inventory, "columns": column_inventory}


def _case(task, code: str, config: WorldModelConfig) -> str:
    """The user message both designs ask about: task overview, data inventory, numbered listing (each capped).

    The listing is fenced as the agent fences its program: the world model and the agent share a backbone, and
    an unfenced listing ending the message taught an agent to end its own program as a listing ends (a
    trailing ``# 28``, then end of turn with the fence still open: no program, issue #26)."""
    return (f"# Task\n{task_overview(task, config.overview_chars)}\n\n"
            f"# Data\n{_INVENTORY[config.inventory](task, config.inventory_chars)}\n\n"
            f"# Solution\n```python\n{cap_text(numbered(code, config.listing), config.code_chars)}\n```")


def messages(task, code: str, config: WorldModelConfig) -> list[dict]:
    """System + user messages asking for a prediction of `code` on `task`."""
    return [{"role": "system", "content": WM_SYSTEM_PROMPT}, {"role": "user", "content": _case(task, code, config)}]


# --------------------------------------------------------------------------- decomposed design: prompts

@functools.lru_cache(maxsize=None)
def installed_versions() -> str:
    """The sandbox's packages with their versions, e.g. "numpy 2.4.6, pandas 3.1.1, ...".

    The sandbox runs solutions with this interpreter's packages (`sandbox.isolation`), so these are the
    versions whose APIs the api_calls check must judge against.
    """
    from importlib import metadata

    def version(name):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            return name
    return ", ".join(version(n) for n in SANDBOX_PACKAGES)


# What each check looks for; every check shares the preamble and the answer format of `check_system_prompt`.
_CHECK_FOCUS = {
    "imports_and_names": (
        "imports and names. Fail when a module that is not installed is imported, a name is imported from a "
        "module that does not define it (ImportError, ModuleNotFoundError), a name is used but never defined or "
        "imported (NameError), or a local is read before it is assigned (UnboundLocalError)."),
    "api_calls": (
        "API calls, for the installed versions: {versions}. Fail when a function, method, attribute or "
        "keyword argument does not exist in that version (e.g. DataFrame.append, removed in pandas 2), or a "
        "method is called on an object of the wrong type (AttributeError, TypeError)."),
    "data_references": (
        "files and columns, against the data inventory. Fail when a file that is not listed is opened "
        "(FileNotFoundError), a column is misspelt or absent from the file it is read from, a column is read "
        "after it was dropped, the target is dropped before it is read or is kept as a feature and then looked "
        "up in test.csv, which lacks it (KeyError)."),
    "shapes_and_types": (
        "shapes, dtypes and labels. Fail when a string column or NaN reaches an estimator that rejects them, "
        "class labels are predicted where probabilities are needed (or the reverse), arrays of different lengths "
        "are combined, or a 2-D target reaches a single-output estimator (ValueError)."),
    "compute_budget": (
        "the compute budget. Fail when fitting or predicting cannot finish within the sandbox's time limit or "
        "memory for the data's size (the inventory's rows and columns) and this estimator and search (a "
        "timeout, MemoryError)."),
    "other_runtime": (
        "any other runtime error, not one of imports and names, API calls, data references, shapes and types "
        "or the compute budget: e.g. NotFittedError, IndexError, ZeroDivisionError, a failing assert."),
    "submission": (
        "the submission, assuming the program runs to its end. Fail when it writes no CSV to the path in "
        "os.environ['SUBMISSION_PATH'], or the file lacks the columns of sample_submission.csv or has a row "
        "count other than test.csv's; ERROR then names what is wrong (e.g. 'missing column Species')."),
}

_CHECK_PREAMBLE = (
    "You are one focused check of a world model of a code-execution sandbox. Given a Kaggle-style task, its data "
    "inventory and a Python solution (each line's number in a trailing comment), judge one aspect of running the "
    "solution, without running it: {focus}\nJudge only this aspect; answer fail only for a specific line that "
    "certainly fails. Answer in exactly this format:\n"
    "VERDICT: pass | fail\n"
    "CONFIDENCE: 0.0-1.0 (how sure you are of the verdict)\n"
    "ERROR: the exception type and line of a fail (e.g. KeyError line 12), or none\n"
    "FEEDBACK: the execution feedback the author would read, or none")

QUALITY_SYSTEM_PROMPT = (
    "You are the quality rubric of a world model of a code-execution sandbox. Given a Kaggle-style task, its data "
    "inventory and a Python solution, assume it runs and writes a valid submission, and judge where its score "
    "would rank on the task's leaderboard, by quarter: low (bottom quarter), fair, mid, high (top quarter). "
    "Weigh whether the estimator suits the data, how features and missing values are handled, and whether the "
    "predictions have the form the metric needs. Answer in exactly this format:\n"
    "QUALITY: low | fair | mid | high")


def check_system_prompt(check: str) -> str:
    """The system prompt of one decomposed check (a name in `CHECKS`) or of the rubric (`RUBRIC`)."""
    if check == RUBRIC:
        return QUALITY_SYSTEM_PROMPT
    if check not in CHECKS:
        raise ValueError(f"check: got {check!r}, expected one of {(*CHECKS, RUBRIC)}")
    return _CHECK_PREAMBLE.format(focus=_CHECK_FOCUS[check].format(versions=installed_versions()))


def check_messages(task, code: str, config: WorldModelConfig, check: str) -> list[dict]:
    """System + user messages of one decomposed check (or the rubric); the user message is the holistic one."""
    return [{"role": "system", "content": check_system_prompt(check)},
            {"role": "user", "content": _case(task, code, config)}]


# --------------------------------------------------------------------------- decomposed design: answers

def format_check_answer(verdict: str, confidence: float, error: str | None = None,
                        feedback: str | None = None) -> str:
    """A check's answer text, in the format `parse_check_answer` reads.

    Confidence is written with two decimals; a None (or empty) error or feedback is written "none".
    """
    if verdict not in VERDICTS:
        raise ValueError(f"verdict: got {verdict!r}, expected one of {VERDICTS}")
    if not 0.0 <= float(confidence) <= 1.0:
        raise ValueError(f"confidence: got {confidence!r}, expected a number in [0, 1]")
    feedback = "none" if not feedback else " ".join(feedback.split())
    return f"VERDICT: {verdict}\nCONFIDENCE: {float(confidence):.2f}\nERROR: {error or 'none'}\nFEEDBACK: {feedback}"


_CHECK_FIELD = re.compile(r"^\s*(VERDICT|CONFIDENCE|ERROR|FEEDBACK)\s*:[ \t]*(.*?)\s*$", re.M | re.I)


def parse_check_answer(text: str) -> tuple[str, float, str | None, str | None] | None:
    """(verdict, confidence, error, feedback) from a check's answer, or None when unusable.

    Usable means: a VERDICT line reading pass or fail and a CONFIDENCE line
    holding a number in [0, 1] (the first of each counts). ERROR and FEEDBACK
    are optional; missing or "none" gives None.
    """
    if not isinstance(text, str):
        return None
    fields = _first_fields(_CHECK_FIELD, text)
    verdict = fields.get("VERDICT", "").strip().lower()
    try:
        confidence = float(fields.get("CONFIDENCE", ""))
    except ValueError:
        return None
    if verdict not in VERDICTS or not 0.0 <= confidence <= 1.0:
        return None
    error, feedback = (None if fields.get(k, "").strip().lower() in ("", "none") else fields[k].strip()
                       for k in ("ERROR", "FEEDBACK"))
    return verdict, confidence, error, feedback


def format_quality_answer(bucket: str) -> str:
    """The rubric's answer text, in the format `parse_quality_answer` reads."""
    if bucket not in BUCKETS:
        raise ValueError(f"bucket: got {bucket!r}, expected one of {BUCKETS}")
    return f"QUALITY: {bucket}"


_QUALITY = re.compile(r"^\s*QUALITY\s*:[ \t]*(\w+)", re.M | re.I)


def parse_quality_answer(text: str) -> str | None:
    """The bucket of the rubric's first QUALITY line, or None when there is none or it names no bucket."""
    m = _QUALITY.search(text) if isinstance(text, str) else None
    bucket = m.group(1).lower() if m else None
    return bucket if bucket in BUCKETS else None


def combine_checks(answers: Sequence[str], quality: str, config: WorldModelConfig) -> Prediction:
    """The decomposed design's outcome for ONE sample: `answers` (one per check, `CHECKS` order) + the rubric's.

    Precedence, on the grader's ladder (the gate, 0.0, is decided before any check is asked):
      1. any runtime check (`RUNTIME_CHECKS`) answers fail -> runtime_err (0.1); its error and feedback are
         those of the failing runtime check with the highest confidence (ties: the first in `CHECKS`);
      2. else the submission check answers fail -> ran_no_sub (0.2), with its error and feedback;
      3. else valid: 0.5 + 0.5 * the position of the rubric's bucket (`config.bucket_positions`).
    A check whose answer does not parse abstains: it neither fails nor vouches (so the remaining checks
    decide). Ungraded (status and reward None, never 0): every check's answer unparseable, or the
    outcome is valid but the rubric names no bucket.
    """
    if len(answers) != len(CHECKS):
        raise ValueError(f"answers: got {len(answers)}, expected one per check ({len(CHECKS)})")
    parsed = dict(zip(CHECKS, map(parse_check_answer, answers)))
    checks = tuple((name, *(p[:3] if p else (None, None, None))) for name, p in parsed.items())
    raw = "\n---\n".join(f"[{name}]\n{text}" for name, text in zip((*CHECKS, RUBRIC), (*answers, quality)))
    ungraded = Prediction(status=None, bucket=None, reward=None, feedback="", raw_text=raw, checks=checks)
    if all(p is None for p in parsed.values()):
        return ungraded
    runtime = [(name, parsed[name]) for name in RUNTIME_CHECKS if parsed[name] and parsed[name][0] == "fail"]
    bucket = None
    if runtime:
        name, (_, _, error, feedback) = max(runtime, key=lambda r: r[1][1])   # max keeps the first of ties
        status = "runtime_err"
    elif parsed["submission"] and parsed["submission"][0] == "fail":
        status, (_, _, error, feedback) = "ran_no_sub", parsed["submission"]
    else:
        status, error, feedback, bucket = "valid", None, None, parse_quality_answer(quality)
        if bucket is None:
            return ungraded
    return Prediction(status=status, bucket=bucket, reward=ladder_reward(status, bucket, config),
                      feedback=feedback or default_feedback(status, error, bucket), raw_text=raw,
                      error_type=error, checks=checks)


# --------------------------------------------------------------------------- the expected readout

def _branch(model: ChatModel, answers: Sequence[str]) -> tuple[list[int], list[int]]:
    """The ids `answers` share before they first differ, and each answer's id at that point.

    The expected readout reads one next-token distribution there; that needs each answer to start its
    own branch with a distinct token (true of the micro-world's and Qwen's tokenizers for the statuses,
    buckets and verdicts), else ValueError.
    """
    ids = [model.encode(a) for a in answers]
    n = 0
    while all(len(i) > n for i in ids) and len({i[n] for i in ids}) == 1:
        n += 1
    branch = [i[n] if len(i) > n else None for i in ids]
    if None in branch or len(set(branch)) != len(branch):
        raise ValueError(f"WorldModelConfig.readout='expected': this tokenizer gives the answers {answers!r} no "
                         f"single token at which all of them differ (ids {ids}); expected distinct first tokens, "
                         f"or use readout='sample'")
    return ids[0][:n], branch


def _answer_branches(model: ChatModel, design: str) -> list[tuple[list[int], tuple[tuple[list[int], list[int]], ...]]]:
    """Per question of `design`: (the answer ids fed after the prompt, ((prefix, branch ids) per read)).

    Holistic: one sequence reaching ``QUALITY:`` of a valid answer, read where the status starts and
    where the bucket starts. Decomposed: per check, ``VERDICT:`` (pass / fail); the rubric, ``QUALITY:``.
    """
    if design == "holistic":
        status = _branch(model, [format_answer(s, bucket="low" if s == "valid" else None) for s in STATUSES])
        bucket = _branch(model, [format_answer("valid", bucket=b) for b in BUCKETS])
        valid_ids = status[0] + [status[1][STATUSES.index("valid")]]
        if bucket[0][:len(valid_ids)] != valid_ids:
            raise ValueError("WorldModelConfig.readout='expected': the valid answer's ids do not start with the "
                             "status branch's; use readout='sample'")
        return [(bucket[0], (status, bucket))]
    verdict = _branch(model, [format_check_answer(v, 0.5) for v in VERDICTS])
    quality = _branch(model, [format_quality_answer(b) for b in BUCKETS])
    return [(verdict[0], (verdict,))] * len(CHECKS) + [(quality[0], (quality,))]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _log_softmax_at(params, config, family, tokens, valid, where):
    """log softmax of the next-token logits at positions `where` [B, R] of left-padded `tokens` [B, T]."""
    hidden, _ = family.forward(params, config, tokens, positions_from_valid(valid), valid, None)
    picked = jnp.take_along_axis(hidden, where[:, :, None], axis=1)
    return jax.nn.log_softmax(family.unembed(params, config, picked).astype(jnp.float32), axis=-1)


def _read_distributions(lm, seqs: Sequence[list[int]], reads: Sequence[Sequence[int]]) -> np.ndarray:
    """float32[n, R, V]: the next-token log-probs after position reads[i][r] of seqs[i] (one forward pass)."""
    num, width = len(seqs), sampling.bucket_size(max(len(s) for s in seqs), 16)
    batch = sampling.bucket_size(num, 1)
    tokens = np.zeros((batch, width), np.int32)
    valid = np.zeros((batch, width), bool)
    where = np.full((batch, len(reads[0])), width - 1, np.int32)
    for row, (ids, at) in enumerate(zip(seqs, reads)):
        tokens[row, width - len(ids):] = ids
        valid[row, width - len(ids):] = True
        where[row] = np.asarray(at) + width - len(ids)
    valid[num:, -1] = True   # padding rows: one dummy token so attention is never empty
    mesh = getattr(lm, "mesh", None)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        out = _log_softmax_at(lm.params, lm.config, lm.family, tokens, valid, where)
    return np.asarray(jax.device_get(out))[:num]


def _probs(logp_row: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """The distribution over `ids` alone (renormalised: mass on other tokens would not parse, as in `_vote`)."""
    x = logp_row[np.asarray(ids)]
    x = np.exp(x - x.max())
    return x / x.sum()


def _expected_valid_reward(p_bucket: np.ndarray, config: WorldModelConfig) -> float:
    """A valid run's reward on the ladder, in expectation over P(bucket)."""
    return float(sum(p * ladder_reward("valid", b, config) for p, b in zip(p_bucket, BUCKETS)))


def _expected_holistic(p_status: np.ndarray, p_bucket: np.ndarray, config: WorldModelConfig) -> Prediction:
    rewards = [_expected_valid_reward(p_bucket, config) if s == "valid" else ladder_reward(s, None, config)
               for s in STATUSES]
    status = STATUSES[int(np.argmax(p_status))]
    bucket = BUCKETS[int(np.argmax(p_bucket))] if status == "valid" else None
    raw = ("P(status): " + ", ".join(f"{s} {p:.3f}" for s, p in zip(STATUSES, p_status))
           + "; P(quality | valid): " + ", ".join(f"{b} {p:.3f}" for b, p in zip(BUCKETS, p_bucket)))
    return Prediction(status=status, bucket=bucket, reward=float(np.dot(p_status, rewards)),
                      feedback=default_feedback(status, None, bucket), raw_text=raw)


def _expected_decomposed(p_fail: np.ndarray, p_bucket: np.ndarray, config: WorldModelConfig) -> Prediction:
    """The precedence of `combine_checks` on probabilities, the checks taken as independent."""
    p_runtime = 1.0 - float(np.prod(1.0 - p_fail[:len(RUNTIME_CHECKS)]))
    p_no_sub = (1.0 - p_runtime) * float(p_fail[len(RUNTIME_CHECKS)])
    p_valid = 1.0 - p_runtime - p_no_sub
    reward = (p_runtime * ladder_reward("runtime_err", None, config)
              + p_no_sub * ladder_reward("ran_no_sub", None, config)
              + p_valid * _expected_valid_reward(p_bucket, config))
    status = ("runtime_err", "ran_no_sub", "valid")[int(np.argmax([p_runtime, p_no_sub, p_valid]))]
    bucket = BUCKETS[int(np.argmax(p_bucket))] if status == "valid" else None
    checks = tuple((name, "fail" if p > 0.5 else "pass", float(max(p, 1.0 - p)), None)
                   for name, p in zip(CHECKS, p_fail))
    raw = ("P(fail): " + ", ".join(f"{n} {p:.3f}" for n, p in zip(CHECKS, p_fail))
           + "; P(quality): " + ", ".join(f"{b} {p:.3f}" for b, p in zip(BUCKETS, p_bucket)))
    return Prediction(status=status, bucket=bucket, reward=reward, feedback=default_feedback(status, None, bucket),
                      raw_text=raw, checks=checks)


def expected_predictions(model: ChatModel, prompts: Sequence[list[int]], config: WorldModelConfig,
                         params=None) -> list[Prediction]:
    """Predictions from the model's answer distribution, for `prompts` (question-major per solution).

    For each question the answer is fed up to where its outcomes branch and the next-token distribution
    is read there (`_answer_branches`): P(status) and P(bucket | valid) for the holistic design, P(fail) of
    each check and P(bucket) of the rubric for the decomposed one (the checks' precedence then applied
    to probabilities, the checks taken as independent). The reward is the expectation on the ladder;
    status and bucket are the most probable; the feedback is `default_feedback`'s (no error text is
    decoded). The model's own distribution (temperature 1, no top-k / top-p): the reward ranks what the
    model believes rather than one draw from it, which is what the isotonic map and GRPO's within-group
    comparison consume.
    """
    questions = _answer_branches(model, config.design)
    q = len(questions)
    seqs, reads = [], []
    for j, prompt in enumerate(prompts):
        fed, branches = questions[j % q]
        seqs.append(list(prompt) + fed)
        at = [len(prompt) + len(prefix) - 1 for prefix, _ in branches]
        reads.append(at + [at[-1]] * (2 - len(at)))   # every row reads two positions (one shape per call)
    lm = model.model if params is None else dataclasses.replace(model.model, params=params)
    logp = _read_distributions(lm, seqs, reads)
    out = []
    for i in range(len(prompts) // q):
        rows = logp[i * q:(i + 1) * q]
        if config.design == "holistic":
            (_, status_ids), (_, bucket_ids) = questions[0][1]
            out.append(_expected_holistic(_probs(rows[0, 0], status_ids), _probs(rows[0, 1], bucket_ids), config))
        else:
            verdict_ids, quality_ids = questions[0][1][0][1], questions[-1][1][0][1]
            p_fail = np.array([_probs(rows[c, 0], verdict_ids)[VERDICTS.index("fail")] for c in range(len(CHECKS))])
            out.append(_expected_decomposed(p_fail, _probs(rows[-1, 0], quality_ids), config))
    return out


# --------------------------------------------------------------------------- predict

def _vote(samples: Sequence[Prediction], raw: str) -> Prediction:
    """K sampled outcomes of one solution as one prediction.

    The reward is the mean over the graded samples (None when none is); the status is the most common
    among them, and the error, bucket, feedback and checks are those of the first sample with it.
    """
    graded = [p for p in samples if p.reward is not None]
    if not graded:
        return Prediction(status=None, bucket=None, reward=None, feedback="", raw_text=raw,
                          checks=samples[0].checks if samples else None)
    status = Counter(p.status for p in graded).most_common(1)[0][0]
    first = next(p for p in graded if p.status == status)
    return dataclasses.replace(first, reward=float(np.mean([p.reward for p in graded])), raw_text=raw)


def _combine(answers: Sequence[str], config: WorldModelConfig) -> Prediction:
    """The holistic design's prediction from its K answers."""
    samples = [Prediction(status=s, bucket=b, reward=ladder_reward(s, b, config), feedback=f, raw_text="",
                          error_type=e) for s, e, b, f in filter(None, map(parse_answer, answers))]
    return _vote(samples, "\n---\n".join(answers))


def _combine_decomposed(answers: Sequence[Sequence[str]], config: WorldModelConfig) -> Prediction:
    """The decomposed design's prediction from answers[sample] = the checks' answers + the rubric's."""
    samples = [combine_checks(a[:len(CHECKS)], a[len(CHECKS)], config) for a in answers]
    return _vote(samples, "\n=====\n".join(p.raw_text for p in samples))


def predict(model: ChatModel, tasks: Sequence, codes: Sequence[str | None], *, config: WorldModelConfig,
            seed: int = 0, params=None) -> list[Prediction]:
    """Predicts the outcome of `codes[i]` on `tasks[i]`; one `Prediction` per solution.

    Solutions the gate decides never reach the model. The rest go through ONE
    batched `sampling.generate` call: K (`config.num_samples`) samples of the
    holistic prompt per solution (the K share one prefill of the prompt), or,
    for the decomposed design, K samples of each check's prompt and of the
    rubric's (the checks run in parallel);
    sample k of a decomposed prediction combines the k-th answer of every
    check. `params` overrides the model's own (e.g. a frozen copy shared with
    the reference policy).
    """
    if len(tasks) != len(codes):
        raise ValueError(f"tasks and codes: {len(tasks)} tasks for {len(codes)} solutions, expected equal lengths")
    if not codes:
        raise ValueError("codes: empty batch, expected at least one solution")
    out: list[Prediction | None] = [None] * len(codes)
    questions = (None,) if config.design == "holistic" else (*CHECKS, RUBRIC)
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
        prompts += [model.prompt_ids(messages(task, code, config) if q is None else
                                     check_messages(task, code, config, q)) for q in questions]
    if ask and config.readout == "expected":
        for i, p in zip(ask, expected_predictions(model, prompts, config, params)):
            out[i] = p
    elif ask:
        lm = model.model if params is None else dataclasses.replace(model.model, params=params)
        # K samples of each prompt, rows prompt-major; each prompt is prefilled once for its K samples.
        result = sampling.generate(
            lm, prompts, num_samples=config.num_samples, max_new_tokens=config.max_new_tokens,
            temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, eos_ids=model.eos_ids,
            pad_id=model.pad_id, seed=seed)
        texts = [model.decode(t) for t in result.tokens]
        k, q = config.num_samples, len(questions)
        for j, i in enumerate(ask):
            mine = texts[j * q * k:(j + 1) * q * k]            # [question][sample], flattened
            if config.design == "holistic":
                out[i] = _combine(mine, config)
            else:
                out[i] = _combine_decomposed([mine[s::k] for s in range(k)], config)
    return out


__all__ = ["BUCKETS", "CHECKS", "DEFAULT_BUCKET_POSITIONS", "DESIGNS", "FOLDER", "INVENTORIES", "LISTINGS",
           "Prediction", "QUALITY_SYSTEM_PROMPT", "READOUTS", "RUBRIC", "RUNTIME_CHECKS", "STATUSES", "VERDICTS",
           "WM_SYSTEM_PROMPT", "WorldModelConfig", "check_messages", "check_system_prompt", "checkpoint_path",
           "column_inventory", "combine_checks", "default_feedback", "expected_predictions", "format_answer",
           "format_check_answer", "format_quality_answer", "gate", "installed_versions", "ladder_reward", "load",
           "messages", "numbered", "parse_answer", "parse_check_answer", "parse_quality_answer", "predict",
           "quality_bucket"]
