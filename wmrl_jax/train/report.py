"""What the training loop tells a person: the progress bar, TensorBoard scalars, pairs.jsonl, the summary.

Every field has one name and one meaning, here:

* `PROGRESS_FIELDS` -- the progress bar's fields (`progress_fields`), with a
  legend printed once when the bar starts (`progress_legend`);
* `step_scalars` -- the TensorBoard scalars of a step (tags `reward/...`,
  `wmrl/...`, `agent/...`, `cost/...`, `time/...`, `train/...`);
* `held_out_scalars` -- the held-out avg@k before (step 0) and after (the
  final step) training, as TensorBoard scalars;
* `RunSummary` -- the table printed at the end and saved in summary.json.

Held-out avg@k is shown as a percent everywhere (progress lines, summary,
TensorBoard, eval.md); the JSON files keep `score` as the fraction
`evaluate.EvalResult` computes (eval.json and summary.json alike).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np

from wmrl_jax import corrections
from wmrl_jax.fidelity import spearman
from wmrl_jax.train.rewards import Scores
from wmrl_jax.train.run import Counters

# progress-bar name -> (scalar it shows, format, meaning). Short names that read as words.
PROGRESS_FIELDS = {
    "real_reward": ("reward/real_mean", "{:.2f}", "mean reward of the rollouts run in the real sandbox"),
    "wm_reward": ("reward/wm_calibrated_mean", "{:.2f}",
                  "mean world-model reward of the other rollouts, after the calibration map"),
    "anchor_weight": ("wmrl/anchor_weight", "{:.2f}", "inverse-variance weight on the real groups (1 = off)"),
    "valid_rate": ("agent/valid_rate", "{:.2f}", "share of real runs that made a valid submission"),
    "s_per_step": ("time/step_s", "{:.0f}", "wall seconds of the step"),
}


def progress_legend() -> str:
    """One line per progress-bar field: what it shows."""
    return "progress fields: " + "; ".join(f"{name} = {meaning}" for name, (_, _, meaning) in PROGRESS_FIELDS.items())


def progress_fields(scalars: dict) -> dict:
    """The progress bar's postfix of a step's `step_scalars`."""
    return {name: fmt.format(scalars[tag]) for name, (tag, fmt, _) in PROGRESS_FIELDS.items()}


def percent(score: float) -> str:
    """A held-out avg@k (a fraction) as the paper prints it: percent, two decimals."""
    return f"{100 * score:.2f} %"


def held_out_scalars(result: dict) -> dict:
    """TensorBoard scalars of a held-out evaluation (`EvalResult.as_dict()`): avg@k in percent, valid rate."""
    return {"eval/held_out_avg_at_k_percent": 100 * result["score"],
            "eval/held_out_valid_rate": result["mean_valid_rate"]}


def step_scalars(scores: Scores, out, episodes, train_metrics: dict, counters: Counters, times: dict) -> dict:
    """TensorBoard scalars of one step: rewards, corrections, agent, cumulative cost, times, the update's metrics."""
    anchor_rows = scores.is_anchor[:, None] & np.ones_like(scores.real_graded)
    real = scores.real_rewards[scores.real_graded]
    raw = scores.wm_rewards[scores.wm_graded]
    calibrated = np.asarray(out.rewards)[np.asarray(out.graded) & ~anchor_rows]
    both = scores.real_graded & scores.wm_graded
    statuses = [getattr(r, "status", "unknown") for r in scores.real_results.values()]
    wm_status = [p.status for p in scores.wm_predictions]
    nan = float("nan")
    # What the world-model groups teach: their advantages, and the spread of their calibrated rewards within a
    # group (a flat calibration map or a blind world model gives every rollout of a group the same reward:
    # spread 0, advantages 0 -- the group teaches nothing).
    in_loss = np.asarray(out.graded) & np.asarray(out.used)[:, None]
    advantages = np.abs(np.asarray(out.advantages))
    rewards = np.asarray(out.rewards)
    wm_groups = [rewards[i][in_loss[i]] for i in np.flatnonzero(~scores.is_anchor & np.asarray(out.used))]
    scalars = {
        "reward/real_mean": float(real.mean()) if real.size else nan,
        "reward/wm_raw_mean": float(raw.mean()) if raw.size else nan,
        "reward/wm_calibrated_mean": float(calibrated.mean()) if calibrated.size else nan,
        "wmrl/anchor_fraction": float(out.anchor_fraction),
        "wmrl/calibrated": float(out.calibrated),
        "wmrl/bias_reduction": float(out.bias_reduction),
        "wmrl/anchor_weight": float(out.anchor_weight),
        "wmrl/disagreement": float(out.disagreement),
        "wmrl/pairs_in_buffer": float(out.pairs_in_buffer),
        "wmrl/spearman_wm_real": spearman(scores.wm_rewards[both], scores.real_rewards[both]),
        "advantage/anchor_abs_mean": float(advantages[in_loss & anchor_rows].mean())
        if (in_loss & anchor_rows).any() else nan,
        "advantage/world_model_abs_mean": float(advantages[in_loss & ~anchor_rows].mean())
        if (in_loss & ~anchor_rows).any() else nan,
        "wmrl/calibrated_group_sd": float(np.mean([g.std() for g in wm_groups])) if wm_groups else nan,
        "agent/valid_rate": statuses.count("valid") / len(statuses) if statuses else nan,
        "agent/wm_valid_rate": wm_status.count("valid") / len(wm_status) if wm_status else nan,
        "agent/has_solution": float(np.mean([e.solution is not None for e in episodes])),
        "agent/reply_tokens": float(np.mean([e.loss_mask.sum() for e in episodes])),
        "cost/real_executions": counters.real_executions,
        "cost/sandbox_cpu_s": counters.sandbox_cpu_s,
        "cost/wm_predictions": counters.wm_predictions,
        "cost/tokens_generated": counters.tokens_generated,
        "cost/ungraded_real": counters.ungraded_real,
        "cost/ungraded_wm": counters.ungraded_wm,
    }
    scalars.update({f"time/{k}": v for k, v in times.items()})
    scalars.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
    return scalars


def log_pairs(path: pathlib.Path, step: int, scores: Scores, corr) -> None:
    """Appends the step's anchor (WM, real) reward pairs, the WM rewards through the map in force after the
    step's pushes, and that map's knots, as one JSON line (for reliability diagrams; a resumed run may repeat
    a step: last wins)."""
    # The map as host arrays first: in a multi-process run the state is global (replicated) arrays, and
    # an op on them in process 0 alone would wait for the others.
    fitted = corrections.MonotoneMap(*(np.asarray(jax.device_get(x)) for x in corr.fitted))
    both = scores.real_graded & scores.wm_graded & scores.is_anchor[:, None]
    wm, real = scores.wm_rewards[both], scores.real_rewards[both]
    calibrated = np.asarray(corrections.apply_calibration(fitted, wm)) if wm.size else wm
    n = int(fitted.n_knots)
    record = {"step": step, "wm": wm.round(6).tolist(), "real": real.round(6).tolist(),
              "calibrated": np.asarray(calibrated, np.float64).round(6).tolist(), "map_fitted": bool(fitted.valid),
              "map_x": fitted.knots_x[:n].astype(np.float64).round(6).tolist(),
              "map_y": fitted.knots_y[:n].astype(np.float64).round(6).tolist()}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def rollout_text(episodes, scores: Scores, group_size: int, count: int) -> str:
    """`count` evenly spaced rollouts as Markdown: real and world-model outcome, then the program."""
    parts = []
    # Evenly spaced rollouts, by position (an Episode holds arrays: `list.index` would compare them).
    for idx in list(range(0, len(episodes), max(1, len(episodes) // max(1, count))))[:count]:
        e = episodes[idx]
        b, g = divmod(idx, group_size)
        real = scores.real_results.get((b, g))
        wm = scores.wm_predictions[idx] if scores.wm_predictions else None
        parts.append(f"**group {b} rollout {g}** real: {getattr(real, 'status', '-')} "
                     f"{getattr(real, 'reward', '-')}; world model: {getattr(wm, 'status', '-')} "
                     f"{getattr(wm, 'reward', '-')}\n\n```python\n{e.solution or '(no code)'}\n```")
    return "\n\n".join(parts)


@dataclasses.dataclass
class RunSummary:
    """What a run did and what it cost; `str()` is the table printed at the end (saved as summary.json's "table").

    final: the last step's `step_scalars` (+ "wmrl/n_fits"); eval_before / eval_after: the held-out
    evaluations' `EvalResult.as_dict()` (score a fraction), None when the run has none.
    """

    mode: str
    steps: int
    counters: Counters
    rollouts_per_step: int
    final: dict
    eval_before: dict | None
    eval_after: dict | None
    seconds: float
    export_path: str | None
    workdir: str

    def __str__(self) -> str:
        c = self.counters
        per_run = c.sandbox_cpu_s / max(1, c.real_executions)
        real_equiv = self.steps * self.rollouts_per_step
        nan = float("nan")
        fitted = self.final.get("wmrl/calibrated")
        rows = [
            ("mode", self.mode), ("steps", self.steps),
            ("real executions", f"{c.real_executions} (mode=real would run {real_equiv})"),
            ("sandbox CPU-seconds", f"{c.sandbox_cpu_s:.0f} (mode=real: ~{per_run * real_equiv:.0f} at "
                                    f"{per_run:.1f} s a run)"),
            ("trainer CPU-seconds", f"{c.compute_cpu_s:.0f} (sampling, world model, update)"),
            ("world-model predictions", c.wm_predictions), ("tokens generated", c.tokens_generated),
            ("ungraded rollouts (real / world model)", f"{c.ungraded_real} / {c.ungraded_wm}"),
            ("calibration map fitted", "-" if fitted is None else ("yes" if fitted else "no (identity)")),
            ("calibration refits", self.final.get("wmrl/n_fits", "-")),
            ("WM bias reduction", f"{self.final.get('wmrl/bias_reduction', nan):.3f} (share of the world model's "
                                  f"centred squared error vs real removed by the map)"),
            ("anchor weight", f"{self.final.get('wmrl/anchor_weight', nan):.3f} (inverse-variance weight on the "
                              f"real groups; 1 = off)"),
            ("world-model groups, last step",
             f"calibrated reward sd within a group {self.final.get('wmrl/calibrated_group_sd', nan):.4f}, mean "
             f"|advantage| {self.final.get('advantage/world_model_abs_mean', nan):.3f} (0: they teach nothing)"),
        ]
        if self.eval_before is not None and self.eval_after is not None:
            k = self.eval_after["attempts"]
            rows.append((f"held-out avg@{k} before -> after",
                         f"{percent(self.eval_before['score'])} -> {percent(self.eval_after['score'])}"))
        rows += [("wall time", f"{self.seconds:.0f} s"), ("workdir", self.workdir), ("exported policy", self.export_path)]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def to_json(self) -> str:
        """summary.json's text: the fields and the printed table."""
        return json.dumps({**dataclasses.asdict(self), "table": str(self)}, indent=1, default=str) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "RunSummary":
        d = json.loads(text)
        fields = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in fields}
        return cls(**{**d, "counters": Counters(**d["counters"])})


__all__ = ["PROGRESS_FIELDS", "RunSummary", "held_out_scalars", "log_pairs", "percent", "progress_fields",
           "progress_legend", "rollout_text", "step_scalars"]
