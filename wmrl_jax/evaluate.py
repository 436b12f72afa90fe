"""avg@k of a policy on held-out tasks, through the real sandbox: the paper's score.

Each task gets `attempts` independent episodes (paper: 8). Every turn's
program runs in the real sandbox -- an evaluation never trusts the world
model -- and its feedback is what the agent reads next turn. Per task the
score is valid-rate x mean best position over valid attempts (an attempt's
best turn counts; failures count 0), averaged over tasks (docs/design.md,
"avg@8"); `sandbox.avg_at_k` computes it.

    result = evaluate(lm, tasks, pool, config=agent_config, attempts=8)
    print(result)                       # EvalResult(avg@8=18.75 %, valid_rate=0.41, tasks: ...)
    write_report(result, "outputs/eval")  # eval.json + eval.md

`load_policy` opens what `launch/eval.py --checkpoint` accepts: an HF
checkpoint folder, or a training workdir (its exported policy, else the
newest good checkpoint's parameters).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from tqdm.auto import tqdm

import sandbox
from wmrl_jax import agent, chat
from wmrl_jax.chat import ChatModel
from wmrl_jax.train.checkpoint import Checkpointer
from wmrl_jax.train.config import model_folder
from wmrl_jax.train.run import abstract_checkpoint_tree


@dataclasses.dataclass
class EvalResult:
    """avg@k and what it is made of.

    score: avg@k over tasks, a fraction (stored so in eval.json and summary.json); every printed form
      (`repr`, eval.md, the training loop's lines) shows it x100, as the paper's percent;
    per_task / valid_rate / per_category as `sandbox.AvgAtK`; categories: task -> category;
    attempt_best: task -> per attempt, its best valid turn's position score (None: no valid turn);
    attempt_status: task -> per attempt, the status of each turn's run;
    results: task name -> attempts -> per-turn `sandbox.ExecutionResult`s (not in `as_dict`);
    cost: executions (sandbox runs; cached repeats of one program count once), sandbox_cpu_s (their
    CPU time), tokens_generated (the agent's sampled tokens), compute_cpu_s (this process's CPU time:
    sampling, i.e. the accelerator on a CPU machine), seconds (wall time).
    """

    score: float
    per_task: dict
    valid_rate: dict
    per_category: dict
    attempts: int
    results: dict
    executions: int
    sandbox_cpu_s: float
    seconds: float
    tokens_generated: int = 0
    compute_cpu_s: float = 0.0
    categories: dict = dataclasses.field(default_factory=dict)
    attempt_best: dict = dataclasses.field(default_factory=dict)
    attempt_status: dict = dataclasses.field(default_factory=dict)

    def __repr__(self) -> str:
        tasks = ", ".join(f"{k}={v:.3f}" for k, v in self.per_task.items())
        return (f"EvalResult(avg@{self.attempts}={100 * self.score:.2f} %, valid_rate={self.mean_valid_rate:.2f}, "
                f"tasks: {tasks})")

    @property
    def mean_valid_rate(self) -> float:
        return float(np.mean(list(self.valid_rate.values()))) if self.valid_rate else float("nan")

    def as_dict(self) -> dict:
        """Everything but the raw `results`, JSON-able."""
        return {"score": self.score, "attempts": self.attempts, "per_task": self.per_task,
                "valid_rate": self.valid_rate, "mean_valid_rate": self.mean_valid_rate,
                "per_category": self.per_category, "categories": self.categories,
                "attempt_best": self.attempt_best, "attempt_status": self.attempt_status,
                "executions": self.executions, "sandbox_cpu_s": self.sandbox_cpu_s,
                "tokens_generated": self.tokens_generated, "compute_cpu_s": self.compute_cpu_s,
                "seconds": self.seconds}


def _attempt_best(turns) -> float | None:
    valid = [t.position_score for t in turns if getattr(t, "status", None) == "valid" and t.position_score is not None]
    return float(max(valid)) if valid else None


def evaluate(lm: ChatModel, tasks: Sequence, pool, *, config: agent.AgentConfig, attempts: int = 8, seed: int = 0,
             params=None, progress: bool = False, batch_tasks: int | None = None) -> EvalResult:
    """Runs `attempts` episodes per task with real feedback; returns avg@`attempts` and its parts.

    `pool` is a `sandbox.SandboxPool`; `params` overrides the model's (e.g. a
    policy being trained). `batch_tasks` tasks are sampled together (one
    sampler call per turn over their `attempts` rows each; None: all tasks at
    once). `progress` shows a tqdm bar over the attempts as their final runs finish.
    """
    if not tasks:
        raise ValueError("tasks: empty, expected at least one held-out task")
    if not isinstance(attempts, (int, np.integer)) or attempts < 1:
        raise ValueError(f"attempts: got {attempts!r}, expected an int >= 1")
    if batch_tasks is not None and (not isinstance(batch_tasks, (int, np.integer)) or batch_tasks < 1):
        raise ValueError(f"batch_tasks: got {batch_tasks!r}, expected None or an int >= 1")
    start, cpu_start = time.perf_counter(), time.process_time()
    cpu_before, runs_before = pool.stats()["cpu_s"], pool.stats()["executions"]
    chunk = len(tasks) if batch_tasks is None else int(batch_tasks)
    bar = tqdm(total=len(tasks) * attempts, desc=f"avg@{attempts}", unit="attempt", disable=not progress)
    turns: dict[int, list] = {}     # global row -> per-turn results
    tokens = 0
    try:
        for c0 in range(0, len(tasks), chunk):
            part = list(tasks[c0:c0 + chunk])
            rows = [c0 * attempts + i for i in range(len(part) * attempts)]   # global rows of this chunk
            for r in rows:
                turns[r] = []

            def real_feedback(indices, solutions, rows=rows, part=part, final=False):
                futures = [pool.submit(part[i // attempts], code or "") for i, code in zip(indices, solutions)]
                if final:
                    for f in futures:
                        f.add_done_callback(lambda _: bar.update(1))
                results = [f.result() for f in futures]
                for i, r in zip(indices, results):
                    turns[rows[i]].append(r)
                return [r.feedback for r in results]

            # Seeds: one chunk of all tasks reproduces the unchunked run exactly.
            chunk_seed = seed if c0 == 0 else int(np.random.SeedSequence([seed, c0]).generate_state(1)[0])
            bar.set_postfix_str(f"sampling tasks {c0 + 1}-{c0 + len(part)}")
            episodes = agent.run_episodes(lm, part, attempts, config=config, feedback=real_feedback, seed=chunk_seed,
                                          params=params)
            tokens += int(sum(int(e.loss_mask.sum()) for e in episodes))
            bar.set_postfix_str(f"running tasks {c0 + 1}-{c0 + len(part)}")
            real_feedback(list(range(len(rows))), [e.solution for e in episodes], final=True)   # the final program
    finally:
        bar.close()
    by_task = {t.name: [turns[b * attempts + a] for a in range(attempts)] for b, t in enumerate(tasks)}
    categories = {t.name: t.category for t in tasks}
    score = sandbox.avg_at_k(by_task, categories, k=attempts)
    stats = pool.stats()
    return EvalResult(
        score=score.score, per_task=dict(score.per_task), valid_rate=dict(score.valid_rate),
        per_category=dict(score.per_category), attempts=attempts, results=by_task,
        executions=stats["executions"] - runs_before, sandbox_cpu_s=stats["cpu_s"] - cpu_before,
        seconds=time.perf_counter() - start, tokens_generated=tokens, compute_cpu_s=time.process_time() - cpu_start,
        categories=categories,
        attempt_best={k: [_attempt_best(a) for a in v] for k, v in by_task.items()},
        attempt_status={k: [[getattr(t, "status", "unknown") for t in a] for a in v] for k, v in by_task.items()})


# --------------------------------------------------------------------------- reports

def to_markdown(result: EvalResult | dict, title: str = "Held-out evaluation") -> str:
    """A Markdown report: avg@k, per category, per task (valid rate, mean best position, avg@k), cost."""
    d = result.as_dict() if isinstance(result, EvalResult) else result
    k = d["attempts"]
    lines = [f"# {title}", "", f"**avg@{k} = {100 * d['score']:.2f}** (leaderboard position, percent; "
             f"per task valid rate x mean best position over valid attempts, failures count 0; mean over "
             f"{len(d['per_task'])} tasks). Mean valid rate {100 * d['mean_valid_rate']:.1f} %.", "",
             "| category | avg@%d |" % k, "|---|---|"]
    lines += [f"| {c} | {100 * v:.2f} |" for c, v in d["per_category"].items()]
    lines += ["", f"| task | category | valid | mean best position (valid attempts) | avg@{k} |",
              "|---|---|---|---|---|"]
    for name, value in d["per_task"].items():
        best = [b for b in d.get("attempt_best", {}).get(name, []) if b is not None]
        mean_best = f"{100 * float(np.mean(best)):.1f}" if best else "-"
        n_valid = round(d["valid_rate"][name] * k)
        lines.append(f"| {name} | {d.get('categories', {}).get(name, '')} | {n_valid}/{k} | {mean_best} | "
                     f"{100 * value:.2f} |")
    lines += ["", "| cost | |", "|---|---|",
              f"| sandbox executions | {d['executions']} |",
              f"| sandbox CPU-seconds | {d['sandbox_cpu_s']:.1f} |",
              f"| generated tokens | {d.get('tokens_generated', 0)} |",
              f"| sampler CPU-seconds (this process) | {d.get('compute_cpu_s', 0.0):.1f} |",
              f"| wall time | {d['seconds']:.1f} s |"]
    return "\n".join(lines) + "\n"


def write_report(result: EvalResult, out_dir, *, title: str = "Held-out evaluation", extra: dict | None = None,
                 stem: str = "eval") -> tuple[pathlib.Path, pathlib.Path]:
    """Writes `<stem>.json` (as_dict + `extra`) and `<stem>.md` under `out_dir`; returns their paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {**result.as_dict(), **(extra or {})}
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(json_path)   # atomic: a finished report is whole (compare.py skips evaluations that have one)
    md_path.write_text(to_markdown(data, title))
    return json_path, md_path


# --------------------------------------------------------------------------- what to evaluate

@dataclasses.dataclass
class Policy:
    """A policy to evaluate: the chat model (tokenizer, base weights), the params to sample with, where from."""

    lm: ChatModel
    params: Any
    source: str
    step: int | None = None

    def __repr__(self) -> str:
        return f"Policy(source={self.source!r}, step={self.step})"


def _workdir_config(workdir: pathlib.Path):
    path = workdir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {workdir}: has checkpoints/ but no config.json (expected a training "
                                f"workdir written by launch/train.py)")
    return ml_collections.ConfigDict(json.loads(path.read_text()))


def load_policy(path, *, dtype: str = "float32", prefer: str = "export") -> Policy:
    """Opens `path`: an HF checkpoint folder (config.json + weights + tokenizer) or a training workdir.

    A workdir's exported policy (`export/`, written when the run finished) is
    used when present and `prefer="export"`; otherwise its newest good Orbax
    checkpoint's float32 master parameters, cast to `dtype`, on the base model
    named by its config.json. Raises FileNotFoundError / ValueError naming what
    is missing.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path}: does not exist (expected an HF checkpoint folder or a training "
                                f"workdir)")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path}: not a folder (expected an HF checkpoint folder or a training "
                                f"workdir)")
    if prefer not in ("export", "checkpoint"):
        raise ValueError(f"prefer: {prefer!r}, expected 'export' or 'checkpoint'")
    is_hf = (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    export = path / "export"
    if is_hf:
        lm = chat.load_chat_model(path, dtype=dtype)
        return Policy(lm, lm.model.params, f"HF folder {path}")
    if prefer == "export" and (export / "config.json").is_file():
        lm = chat.load_chat_model(export, dtype=dtype)
        return Policy(lm, lm.model.params, f"exported policy {export}")
    if not (path / "checkpoints").is_dir():
        raise FileNotFoundError(
            f"checkpoint {path}: neither an HF checkpoint folder (config.json + *.safetensors) nor a training workdir "
            f"(export/ or checkpoints/)")
    config = _workdir_config(path)
    lm = chat.load_chat_model(model_folder(config), dtype=dtype)
    like = abstract_checkpoint_tree(config, lm.model.params)
    ckpt = Checkpointer(path / "checkpoints", max_to_keep=max(1, int(config.checkpoint.max_to_keep)))
    try:
        restored = ckpt.latest(like)
    finally:
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"checkpoint {path}: checkpoints/ holds no complete checkpoint (and no export/)")
    step, tree, _ = restored
    params = jax.tree.map(lambda x: x.astype(dtype), tree["train"].params)
    return Policy(lm, params, f"workdir {path}, checkpoint step {step}", step)


__all__ = ["EvalResult", "Policy", "evaluate", "load_policy", "to_markdown", "write_report"]
