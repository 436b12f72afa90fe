"""How good is the world model? Its predictions against real sandbox outcomes on the same solutions.

WMRL's premise is a simulator that is *useful but biased*: its rewards rank
solutions roughly as reality does (so GRPO's within-group comparison learns
something), yet they are off in systematic ways that only real anchors reveal.
This module measures exactly that, per split (train tasks, which the world
model learned from, and held-out tasks, which it never saw):

* status accuracy and the confusion matrix (real status x predicted status);
* Spearman correlation of world-model reward vs real reward;
* mean bias (world-model reward - real reward) per real quality bucket;
* the cost gap: world-model predictions per second vs real executions per
  second on the same solutions.

`launch/wm_fidelity.py` runs it and saves the figures as JSON and PNG.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Sequence

import numpy as np

from wmrl_jax import agent, world_model
from wmrl_jax.chat import ChatModel

REAL_STATUSES = ("malformed", "syntax_err", "runtime_err", "ran_no_sub", "valid")
PREDICTED = (*REAL_STATUSES, "ungraded")


@dataclasses.dataclass
class Sample:
    """One solution with both verdicts. origin: "sampled" (the base model wrote it) or "logged" (the suite's log)."""

    split: str
    task: str
    origin: str
    code: str | None
    real_status: str
    real_reward: float | None
    real_position: float | None
    wm: world_model.Prediction | None = None
    real_error_type: str | None = None


def sample_solutions(lm: ChatModel, tasks: Sequence, per_task: int, *, config: agent.AgentConfig,
                     seed: int = 0) -> list[list[str | None]]:
    """`per_task` single-turn solutions per task from the model with the agent prompt (None: no code block)."""
    config = dataclasses.replace(config, max_turns=1)
    episodes = agent.run_episodes(lm, tasks, per_task, config=config, seed=seed)
    return [[e.solution for e in episodes[b * per_task:(b + 1) * per_task]] for b in range(len(tasks))]


def run_real(pool, samples: list[Sample], tasks: dict) -> float:
    """Executes each sample's code in the sandbox pool (in place); returns elapsed seconds."""
    start = time.perf_counter()
    futures = [pool.submit(tasks[s.task], s.code if s.code is not None else "") for s in samples]
    for s, fut in zip(samples, futures):
        result = fut.result()
        s.real_status, s.real_reward, s.real_position = result.status, result.reward, result.position_score
        s.real_error_type = result.error_type
    return time.perf_counter() - start


def run_world_model(lm: ChatModel, samples: list[Sample], tasks: dict, *, config: world_model.WorldModelConfig,
                    seed: int = 0, batch: int = 64) -> float:
    """Predicts each sample's outcome (in place), `batch` solutions per sampler call; returns elapsed seconds."""
    start = time.perf_counter()
    for lo in range(0, len(samples), batch):
        chunk = samples[lo:lo + batch]
        preds = world_model.predict(lm, [tasks[s.task] for s in chunk], [s.code for s in chunk], config=config,
                                    seed=seed + lo)
        for s, p in zip(chunk, preds):
            s.wm = p
    return time.perf_counter() - start


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan when either side is constant."""
    from scipy import stats

    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(stats.spearmanr(x, y).statistic)


# --------------------------------------------------------------------------- baselines and the policy's spread

_MODEL_LINE = re.compile(r"^model\s*=\s*(.+)$", re.M)
_WRAPPERS = {"make_pipeline", "StandardScaler", "MultiOutputRegressor", "Pipeline", "MinMaxScaler"}


def model_line(code: str | None) -> str | None:
    """The program's ``model = ...`` expression (the estimator and its settings), or None."""
    m = _MODEL_LINE.search(code or "")
    return " ".join(m.group(1).split()) if m else None


def estimator_class(code: str | None) -> str | None:
    """The estimator class a program fits (``Ridge`` for ``make_pipeline(StandardScaler(), linear_model.Ridge())``)."""
    line = model_line(code)
    if line is None:
        return None
    names = [n for n in re.findall(r"(\w+)\s*\(", line) if n not in _WRAPPERS]
    return names[0] if names else None


def lookup_table(entries: Sequence[dict]) -> dict:
    """The baseline a world model must beat: mean real reward per estimator class, over `entries` (train runs).

    ``{"by_class": {class: mean reward}, "default": mean over all}``; a
    program whose class the table has not seen gets the default. It reads the
    estimator and nothing else: it cannot tell a misspelt column from a good one.
    """
    rewards: dict[str, list[float]] = {}
    everything = []
    for e in entries:
        if e.get("reward") is None:
            continue
        everything.append(e["reward"])
        cls = estimator_class(e.get("code"))
        if cls is not None:
            rewards.setdefault(cls, []).append(e["reward"])
    return {"by_class": {c: float(np.mean(r)) for c, r in sorted(rewards.items())},
            "default": float(np.mean(everything)) if everything else float("nan")}


def table_reward(table: dict, code: str | None) -> float:
    return table["by_class"].get(estimator_class(code), table["default"])


def policy_spread(samples: Sequence[Sample], group_size: int = 4) -> dict:
    """How different a group's rollouts are: GRPO learns nothing from a group of identical programs.

    Sampled solutions of each task, in sampling order, cut into groups of
    `group_size` (as the loop's groups are drawn). Per group: the number of
    distinct estimator classes, of distinct model lines (class + settings),
    and the population standard deviation of the real rewards; means over
    groups, and the share of groups whose real rewards are all equal. Also
    each task's real valid rate over all its sampled programs.
    """
    by_task: dict[str, list[Sample]] = {}
    for s in samples:
        if s.origin == "sampled":
            by_task.setdefault(s.task, []).append(s)
    classes, lines, sds, flat = [], [], [], []
    for rows in by_task.values():
        for lo in range(0, len(rows) - group_size + 1, group_size):
            group = rows[lo:lo + group_size]
            classes.append(len({estimator_class(s.code) for s in group}))
            lines.append(len({model_line(s.code) for s in group}))
            rewards = [s.real_reward for s in group if s.real_reward is not None]
            if len(rewards) == group_size:
                sds.append(float(np.std(rewards)))
                flat.append(float(np.ptp(rewards) == 0))
    if not classes:
        return {}
    valid_rate = {task: float(np.mean([s.real_status == "valid" for s in rows])) for task, rows in by_task.items()}
    return {"groups": len(classes), "group_size": group_size, "distinct_estimators": float(np.mean(classes)),
            "valid_rate_by_task": valid_rate,
            "distinct_model_lines": float(np.mean(lines)),
            "reward_sd": float(np.mean(sds)) if sds else float("nan"),
            "identical_reward_groups": float(np.mean(flat)) if flat else float("nan")}


def summarize(samples: Sequence[Sample], table: dict | None = None) -> dict:
    """The figures of one split: counts, status accuracy, confusion matrix, Spearman, bias per bucket."""
    known = [s for s in samples if s.real_status in REAL_STATUSES]
    confusion = np.zeros((len(REAL_STATUSES), len(PREDICTED)), int)
    for s in known:
        pred = s.wm.status if s.wm is not None and s.wm.status is not None else "ungraded"
        confusion[REAL_STATUSES.index(s.real_status), PREDICTED.index(pred)] += 1
    asked = [s for s in known if s.wm is not None and not s.wm.gated]
    graded = [s for s in known if s.wm is not None and s.wm.reward is not None and s.real_reward is not None]
    real = np.array([s.real_reward for s in graded], float)
    wm = np.array([s.wm.reward for s in graded], float)
    bias = {}
    for bucket in world_model.BUCKETS:
        rows = [s for s in graded if s.real_status == "valid" and world_model.quality_bucket(s.real_position) == bucket]
        if rows:
            bias[bucket] = {"n": len(rows), "mean_bias": float(np.mean([s.wm.reward - s.real_reward for s in rows]))}
    # Detection rates over what the model decides (gate cases excluded: the gate is exact by construction).
    failing = [s for s in asked if s.real_status in ("runtime_err", "ran_no_sub")]
    valid = [s for s in asked if s.real_status == "valid"]
    runtime = [s for s in failing if s.real_status == "runtime_err"]
    detection = {
        "failing_predicted_failing": float(np.mean([s.wm.status not in ("valid", None) for s in failing]))
        if failing else float("nan"),
        "valid_predicted_valid": float(np.mean([s.wm.status == "valid" for s in valid])) if valid else float("nan"),
        "runtime_error_type_accuracy": float(np.mean([s.wm.status == "runtime_err" and s.wm.error_type is not None
                                                      and s.wm.error_type.split(":")[0].split(" ")[0]
                                                      == (s.real_error_type or "") for s in runtime]))
        if runtime else float("nan"),
        "failing": len(failing), "valid": len(valid), "runtime_err": len(runtime),
    }
    failed = [s for s in graded if s.real_status != "valid"]
    if failed:
        bias["failed runs"] = {"n": len(failed), "mean_bias": float(np.mean([s.wm.reward - s.real_reward
                                                                             for s in failed]))}
    return {
        "solutions": len(samples), "real_unknown": len(samples) - len(known),
        "real_valid_rate": float(np.mean([s.real_status == "valid" for s in known])) if known else float("nan"),
        "status_accuracy": float(np.mean([s.wm is not None and s.wm.status == s.real_status for s in known]))
        if known else float("nan"),
        "status_accuracy_model_only": float(np.mean([s.wm.status == s.real_status for s in asked]))
        if asked else float("nan"),
        "ungraded": int(sum(s.wm is None or s.wm.reward is None for s in known)),
        "spearman": spearman(wm, real),
        "table_spearman": spearman([table_reward(table, s.code) for s in graded], real) if table else float("nan"),
        **detection,
        "mean_bias": float(np.mean(wm - real)) if graded else float("nan"),
        "bias_by_real_bucket": bias,
        "confusion": {"rows (real)": list(REAL_STATUSES), "columns (predicted)": list(PREDICTED),
                      "counts": confusion.tolist()},
    }


def format_report(report: dict) -> str:
    """A plain-text table of `evaluate`'s report."""
    lines = []
    for split, figs in report["splits"].items():
        lines.append(f"== {split} tasks: {figs['solutions']} solutions (real valid rate "
                     f"{figs['real_valid_rate']:.2f}) ==")
        lines.append(f"status accuracy {figs['status_accuracy']:.3f} (model-decided only "
                     f"{figs['status_accuracy_model_only']:.3f}), ungraded {figs['ungraded']}, "
                     f"Spearman(wm, real) {figs['spearman']:.3f} (estimator lookup table "
                     f"{figs.get('table_spearman', float('nan')):.3f}), mean bias {figs['mean_bias']:+.3f}")
        lines.append(f"failing runs predicted failing {figs['failing_predicted_failing']:.2f} (n={figs['failing']}), "
                     f"valid runs predicted valid {figs['valid_predicted_valid']:.2f} (n={figs['valid']}), "
                     f"runtime error type right {figs['runtime_error_type_accuracy']:.2f} (n={figs['runtime_err']})")
        for bucket, b in figs["bias_by_real_bucket"].items():
            lines.append(f"  bias on real '{bucket}': {b['mean_bias']:+.3f} (n={b['n']})")
        conf = figs["confusion"]
        lines.append("  real \\ predicted " + " ".join(f"{c[:10]:>10}" for c in conf["columns (predicted)"]))
        for name, row in zip(conf["rows (real)"], conf["counts"]):
            lines.append(f"  {name:>16} " + " ".join(f"{v:>10d}" for v in row))
    for key, figs in report.get("by_origin", {}).items():
        lines.append(f"  {key:>14}: {figs['solutions']:>4} solutions, Spearman(wm, real) {figs['spearman']:.3f} "
                     f"(lookup table {figs.get('table_spearman', float('nan')):.3f}), failing predicted failing "
                     f"{figs['failing_predicted_failing']:.2f} (n={figs['failing']}), valid predicted valid "
                     f"{figs['valid_predicted_valid']:.2f} (n={figs['valid']})")
    for split, spread in report.get("policy_spread", {}).items():
        if spread:
            lines.append(f"policy spread on {split} tasks ({spread['groups']} groups of {spread['group_size']} "
                         f"sampled programs): {spread['distinct_estimators']:.2f} distinct estimators, "
                         f"{spread['distinct_model_lines']:.2f} distinct model lines, real-reward sd "
                         f"{spread['reward_sd']:.3f}, groups with identical rewards "
                         f"{spread['identical_reward_groups']:.0%}")
            rates = spread.get("valid_rate_by_task", {})
            if rates:
                lines.append(f"  sampled programs valid, by task: " + ", ".join(f"{t} {v:.0%}" for t, v in rates.items())
                             + f" (lowest {min(rates.values()):.0%})")
    cost = report["cost"]
    lines.append(f"cost: {cost['wm_predictions_per_s']:.2f} world-model predictions/s vs "
                 f"{cost['real_executions_per_s']:.2f} real executions/s ({cost['speedup']:.1f}x), "
                 f"sandbox CPU {cost['sandbox_cpu_s']:.0f} s for {cost['real_executions']} runs")
    return "\n".join(lines)


def plot(report: dict, samples: Sequence[Sample], path) -> None:
    """Confusion matrices, WM vs real reward scatter and bias per bucket, one row per split, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(report["splits"])
    fig, axes = plt.subplots(len(splits), 3, figsize=(15, 4.5 * len(splits)), squeeze=False)
    for row, split in enumerate(splits):
        figs = report["splits"][split]
        conf = np.array(figs["confusion"]["counts"])
        ax = axes[row, 0]
        ax.imshow(conf, cmap="Blues")
        ax.set_xticks(range(len(PREDICTED)), PREDICTED, rotation=45, ha="right")
        ax.set_yticks(range(len(REAL_STATUSES)), REAL_STATUSES)
        for (i, j), v in np.ndenumerate(conf):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=8)
        ax.set_title(f"{split}: status (accuracy {figs['status_accuracy']:.2f})")
        ax.set_xlabel("predicted")
        ax.set_ylabel("real")
        ax = axes[row, 1]
        for origin, marker in (("sampled", "o"), ("logged", "x")):
            pts = [(s.real_reward, s.wm.reward) for s in samples if s.split == split and s.origin == origin
                   and s.wm is not None and s.wm.reward is not None and s.real_reward is not None]
            if pts:
                x, y = np.array(pts).T
                jitter = np.random.default_rng(0).normal(0, 0.01, size=(2, len(x)))
                ax.scatter(x + jitter[0], y + jitter[1], s=12, alpha=0.5, marker=marker, label=origin)
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_xlabel("real reward")
        ax.set_ylabel("world-model reward")
        ax.set_title(f"{split}: Spearman {figs['spearman']:.2f}")
        ax.legend()
        ax = axes[row, 2]
        names = list(figs["bias_by_real_bucket"])
        ax.bar(names, [figs["bias_by_real_bucket"][n]["mean_bias"] for n in names])
        ax.axhline(0, color="k", lw=0.8)
        ax.set_ylabel("mean (wm - real) reward")
        ax.set_title(f"{split}: bias by real outcome")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["PREDICTED", "REAL_STATUSES", "Sample", "estimator_class", "format_report", "lookup_table", "model_line",
           "plot", "policy_spread", "run_real", "run_world_model", "sample_solutions", "spearman", "summarize",
           "table_reward"]
