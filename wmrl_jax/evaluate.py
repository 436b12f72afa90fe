"""avg@k of a policy on held-out tasks, through the real sandbox: the paper's score.

Each task gets `attempts` independent episodes (paper: 8). Every turn's
program runs in the real sandbox -- an evaluation never trusts the world
model -- and its feedback is what the agent reads next turn. Per task the
score is valid-rate x mean best position over valid attempts (an attempt's
best turn counts; failures count 0), averaged over tasks (docs/design.md,
"avg@8"); `sandbox.avg_at_k` computes it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from wmrl_jax import agent
from wmrl_jax.chat import ChatModel


@dataclasses.dataclass
class EvalResult:
    """avg@k and what it is made of.

    score: avg@k over tasks; per_task / valid_rate / per_category as `sandbox.AvgAtK`;
    results: task name -> attempts -> per-turn `sandbox.ExecutionResult`s;
    executions, sandbox_cpu_s, seconds: what the evaluation cost.
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

    def __repr__(self) -> str:
        tasks = ", ".join(f"{k}={v:.3f}" for k, v in self.per_task.items())
        return (f"EvalResult(avg@{self.attempts}={self.score:.4f}, valid_rate="
                f"{sum(self.valid_rate.values()) / max(1, len(self.valid_rate)):.2f}, tasks: {tasks})")

    def as_dict(self) -> dict:
        return {"score": self.score, "attempts": self.attempts, "per_task": self.per_task,
                "valid_rate": self.valid_rate, "per_category": self.per_category, "executions": self.executions,
                "sandbox_cpu_s": self.sandbox_cpu_s, "seconds": self.seconds}


def evaluate(lm: ChatModel, tasks: Sequence, pool, *, config: agent.AgentConfig, attempts: int = 8, seed: int = 0,
             params=None) -> EvalResult:
    """Runs `attempts` episodes per task with real feedback; returns avg@`attempts` and its parts.

    `pool` is a `sandbox.SandboxPool`; `params` overrides the model's (e.g. a
    policy being trained).
    """
    import sandbox

    if not tasks:
        raise ValueError("tasks: empty, expected at least one held-out task")
    start = time.perf_counter()
    cpu_before, runs_before = pool.stats()["cpu_s"], pool.stats()["executions"]
    rows = [b for b in range(len(tasks)) for _ in range(attempts)]
    turns: list[list] = [[] for _ in rows]

    def real_feedback(indices, solutions):
        results = pool.map([(tasks[rows[i]], code or "") for i, code in zip(indices, solutions)])
        for i, r in zip(indices, results):
            turns[i].append(r)
        return [r.feedback for r in results]

    episodes = agent.run_episodes(lm, tasks, attempts, config=config, feedback=real_feedback, seed=seed, params=params)
    real_feedback(list(range(len(rows))), [e.solution for e in episodes])   # the final turn's program
    by_task = {tasks[b].name: [turns[i] for i in range(len(rows)) if rows[i] == b] for b in range(len(tasks))}
    score = sandbox.avg_at_k(by_task, {t.name: t.category for t in tasks}, k=attempts)
    stats = pool.stats()
    return EvalResult(score=score.score, per_task=dict(score.per_task), valid_rate=dict(score.valid_rate),
                      per_category=dict(score.per_category), attempts=attempts, results=by_task,
                      executions=stats["executions"] - runs_before, sandbox_cpu_s=stats["cpu_s"] - cpu_before,
                      seconds=time.perf_counter() - start)


__all__ = ["EvalResult", "evaluate"]
