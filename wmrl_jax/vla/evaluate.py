"""The VLA policy in the simulator: a batched `policy_fn` for `simulator.run_episodes`, and success per task.

    fn = evaluate.policy_fn(policy, instructions, temperature=0.0, seed=0)   # policy: `sft.load_policy(...)`
    episodes = simulator.run_episodes(pool, fn, starts)
    table = evaluate.summarize(episodes)         # per task and overall: rate, 95 % Wilson interval, unknown

No simulator process or benchmark import: `summarize` reads the `Episode`
fields (task_id, init_state_index, status, steps, reason) and counts through
`simulator.episode.success_rate`, so the Episode contract holds: an episode
with status "unknown" (its simulator process crashed or hung) is excluded
from the rate and counted apart, never a failure.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from simulator.episode import success_rate
from wmrl_jax import stats
from wmrl_jax.vla import model as vla


def policy_fn(policy, instructions: Sequence[str], *, temperature: float = 0.0, seed: int = 0):
    """obs (SimPool's batch) -> float32 [n, 7] actions of `policy` (an `sft.Policy`).

    The `instructions` the rows may carry are tokenized once, left-padded to one width (one compile per batch
    size). Each call uses the key fold_in(key(seed), call index): a run is reproducible from its seed.
    """
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature}: expected >= 0 (0 = greedy)")
    instructions = list(dict.fromkeys(instructions))
    text, valid = vla.tokenize_instructions(policy.tokenizer, instructions)
    index = {s: i for i, s in enumerate(instructions)}
    base, calls = jax.random.key(seed), [0]

    def fn(obs):
        try:
            rows = [index[s] for s in obs["instruction"]]
        except KeyError as e:
            raise ValueError(f"policy_fn: instruction {e.args[0]!r} was not given when the policy was built "
                             f"(expected one of {instructions})") from None
        inputs = {cam: obs[cam] for cam in policy.config.cameras}
        inputs.update(text=text[rows], text_valid=valid[rows])
        key = jax.random.fold_in(base, calls[0])
        calls[0] += 1
        return np.asarray(vla.act(policy.params, policy.config, inputs, key, temperature))

    return fn


def _rate(episodes, level: float) -> dict:
    rate, known, unknown = success_rate(episodes)   # the Episode contract: unknown ones excluded, never failures
    wins = round(rate * known) if known else 0
    row = {"episodes": len(episodes), "known": known, "successes": wins, "unknown": unknown,
           "success_rate": rate, "ci_low": None, "ci_high": None}
    if known:
        row["ci_low"], row["ci_high"] = stats.wilson_interval(wins, known, level=level)
    steps = [e.steps for e in episodes if e.success]
    row["mean_steps_success"] = float(np.mean(steps)) if steps else None
    return row


def summarize(episodes, *, level: float = 0.95, instructions: dict | None = None) -> dict:
    """{"tasks": {task_id: row}, "overall": row, "level"}; row: episodes, known, successes, unknown,
    success_rate (None when nothing is known), ci_low / ci_high (Wilson, at `level`), mean_steps_success;
    per task also "states" and "unknown_reasons" (state -> reason)."""
    tasks = {}
    for t in sorted({e.task_id for e in episodes}):
        mine = [e for e in episodes if e.task_id == t]
        row = _rate(mine, level)
        row["states"] = sorted({e.init_state_index for e in mine})
        row["unknown_reasons"] = {str(e.init_state_index): e.reason for e in mine if e.status == "unknown"}
        if instructions and t in instructions:
            row["instruction"] = instructions[t]
        tasks[t] = row
    return {"level": level, "tasks": tasks, "overall": _rate(list(episodes), level)}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def markdown(summary: dict) -> str:
    """The summary as a table: one row per task and the overall row."""
    lvl = f"{100 * summary['level']:.0f} %"
    lines = [f"| task | successes / known | success rate | {lvl} interval (Wilson) | unknown | mean steps (success) |",
             "|---|---|---|---|---|---|"]
    rows = [(str(t), r) for t, r in summary["tasks"].items()] + [("all", summary["overall"])]
    for name, r in rows:
        ci = "-" if r["ci_low"] is None else f"[{_pct(r['ci_low'])}, {_pct(r['ci_high'])}]"
        steps = "-" if r["mean_steps_success"] is None else f"{r['mean_steps_success']:.0f}"
        label = f"{name}: {r['instruction']}" if r.get("instruction") else name
        lines.append(f"| {label} | {r['successes']} / {r['known']} | {_pct(r['success_rate'])} | {ci} | "
                     f"{r['unknown']} | {steps} |")
    return "\n".join(lines)
