"""The paper's table on our own runs: six reward arms x seeds, same step budget, held-out avg@k, cost.

`launch/compare.py` is the entry point; the logic is here so tests import it.

    spec = CompareSpec(out="results/compare", work="/tmp/wmrl/compare", seeds=(0, 1, 2), steps=4, attempts=8)
    report = run_compare(spec, config)     # trains, evaluates, writes the table and plots

Under `work/` (everything a rerun needs to skip finished work; checkpoints and
exported policies, so not for committing):

    spec.json                       what the comparison is (steps, attempts, the base config); a rerun must match
    base/seed<s>/eval.json, eval.md the untrained policy, evaluated once a seed with that seed's sampling seed
                                    (+ train_eval.json with curves on the train tasks): every arm of seed s
                                    starts from it and is evaluated with the same sampling seed, so the
                                    claims pair (arm, seed) with (base, seed) under common sampling noise
    runs/<arm>/seed<s>/             one training workdir (launch/train.py's layout: checkpoints/, tb/,
                                    export/, summary.json, pairs.jsonl) + eval.json / eval.md

Under `out/` (small, for reading and committing): table.md, compare.json (every
number behind the table and the plots, per run and per task), base_eval.md,
score_vs_cost.png, calibration.png, corrections.png.

A run is finished when its `summary.json` exists (the loop writes it last);
an unfinished one resumes from its newest checkpoint (the loop's own resume).
An evaluation is finished when its `eval.json` exists (written atomically).
So an interrupted comparison started again with the same command picks up
where it stopped, and once everything exists it only redraws the report.

Costs are the training runs' own (the paper's GPU-hours are training cost):
real executions, sandbox CPU-seconds (the executed programs' CPU time),
trainer CPU-seconds (the training process's CPU time: sampling, world model,
update -- the accelerator's work, on a CPU machine), wall time, world-model
predictions. The cost ratio is total CPU-seconds (sandbox + trainer) over the
`real` arm's mean.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import time
from typing import Sequence

import numpy as np

from wmrl_jax import chat
from wmrl_jax.evaluate import evaluate, to_markdown, write_report
from wmrl_jax.models import load_hf
from wmrl_jax.train import loop
from wmrl_jax.train.config import agent_config, model_folder, validate
from wmrl_jax.train.metrics import read_scalars
from wmrl_jax.train.run import MODES, eval_seed, load_tasks, make_sandbox_pool

ARMS = tuple(MODES)   # real, wm_only, naive_mix, debias_only, denoise_only, wmrl
# Each arm's switches, for the table's legend.
ARM_DESCRIPTIONS = {
    "real": "every group executed for real (GRPO, real env)",
    "wm_only": "world-model rewards only, no anchors, no corrections",
    "naive_mix": "anchors real, the rest raw world model",
    "debias_only": "naive mix + online isotonic debiasing",
    "denoise_only": "naive mix + inverse-variance anchor weight",
    "wmrl": "both corrections (WMRL)",
}
# Fields of the config the comparison sets itself (a run's identity), not part of the shared base.
_PER_RUN = ("workdir", "seed", "steps", "eval_attempts", "rewards.mode", "optim.total_steps", "eval_every",
            "eval_train_tasks", "eval_sampling_seed")


@dataclasses.dataclass(frozen=True)
class CompareSpec:
    """What to compare: `arms` x `seeds`, `steps` GRPO steps each, held-out avg@`attempts`, under `out`."""

    out: str
    work: str = ""          # runs and evaluations; "" = `out`
    arms: tuple = ARMS
    seeds: tuple = (0, 1, 2)
    steps: int = 5
    attempts: int = 8
    eval_tasks: tuple = ()   # names of held-out tasks to evaluate on; () = the whole eval split
    eval_every: int = 0      # > 0: learning curves, every run evaluated in the loop every this many steps
    eval_train_tasks: bool = False   # the curves' points also score the train tasks

    def __post_init__(self):
        unknown = [a for a in self.arms if a not in MODES]
        if unknown or not self.arms:
            raise ValueError(f"arms: {list(self.arms)}, expected a non-empty subset of {list(MODES)}")
        if len(set(self.arms)) != len(self.arms) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"arms {list(self.arms)} / seeds {list(self.seeds)}: expected no repeats")
        if not self.seeds or any(not isinstance(s, (int, np.integer)) or s < 0 for s in self.seeds):
            raise ValueError(f"seeds: {list(self.seeds)}, expected one or more ints >= 0")
        for name in ("steps", "attempts"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}: {v!r}, expected an int >= 1")
        if not isinstance(self.eval_every, (int, np.integer)) or self.eval_every < 0:
            raise ValueError(f"eval_every: {self.eval_every!r}, expected an int >= 0")
        if self.eval_every and self.eval_tasks:
            raise ValueError("eval_every with eval_tasks: the loop's curve evaluates the whole eval split; "
                             "expected one of them")

    def run_dir(self, arm: str, seed: int) -> pathlib.Path:
        return self.work_dir / "runs" / arm / f"seed{seed}"

    @property
    def work_dir(self) -> pathlib.Path:
        return pathlib.Path(self.work or self.out)


def run_config(base, spec: CompareSpec, arm: str, seed: int):
    """`base` with the run's identity set: arm, seed, step budget, workdir, the seed's evaluation sampling seed;
    no in-loop evaluation unless `spec.eval_every` (the learning curve)."""
    c = copy.deepcopy(base)
    c.rewards.mode = arm
    c.seed = int(seed)
    c.steps = int(spec.steps)
    if c.optim.total_steps != c.steps:   # a plain value, not the reference to `steps` base.py sets up
        c.optim.total_steps = c.steps
    c.workdir = str(spec.run_dir(arm, seed))
    c.eval_attempts = 0                  # evaluated here, once, with every arm of the seed on the same footing
    c.eval_sampling_seed = eval_seed(seed)   # the seed's base evaluation's: common sampling noise within a seed
    if spec.eval_every:                  # ... or in the loop, along the curve (step 0: the seed's base evaluation)
        c.eval_attempts, c.eval_every, c.eval_train_tasks = spec.attempts, spec.eval_every, spec.eval_train_tasks
    return c


def _shared_config_json(base) -> dict:
    """The base config without the per-run fields: what every run of one comparison must share."""
    d = json.loads(base.to_json_best_effort())
    for key in _PER_RUN:
        node = d
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.get(p, {})
        node.pop(leaf, None)
    return d


def _check_spec(spec: CompareSpec, base) -> None:
    """Writes spec.json on the first call; later calls must agree on steps, attempts and the base config."""
    work = spec.work_dir
    work.mkdir(parents=True, exist_ok=True)
    path = work / "spec.json"
    want = {"steps": spec.steps, "attempts": spec.attempts, "eval_tasks": list(spec.eval_tasks),
            "eval_every": spec.eval_every, "eval_train_tasks": spec.eval_train_tasks,
            "config": _shared_config_json(base)}
    if path.is_file():
        have = json.loads(path.read_text())
        have.setdefault("eval_tasks", [])
        have.setdefault("eval_every", 0)
        have.setdefault("eval_train_tasks", False)
        for key in ("steps", "attempts", "eval_tasks", "eval_every", "eval_train_tasks", "config"):
            if have.get(key) != want[key]:
                diff = key if key != "config" else "config: " + ", ".join(sorted(
                    _diff_keys(have.get("config", {}), want["config"]))[:8])
                raise ValueError(
                    f"{path}: this output folder holds a comparison with different settings ({diff}); "
                    f"expected the same --steps, --attempts, eval tasks and config overrides to resume it, "
                    f"or a new --work folder")
    path.write_text(json.dumps({**want, "arms": list(spec.arms), "seeds": list(spec.seeds)}, indent=1) + "\n")


def _diff_keys(a, b, prefix: str = "") -> list[str]:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [prefix.rstrip(".")] if a != b else []
    out = []
    for k in sorted(set(a) | set(b)):
        out += _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
    return out


# --------------------------------------------------------------------------- running

def _read_json(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None   # a torn file from a killed process: redo that piece


def _write_json(path: pathlib.Path, data: dict) -> None:
    """Atomically: a file a rerun finds is whole (a killed write leaves only `<name>.tmp`)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def run_finished(spec: CompareSpec, arm: str, seed: int) -> bool:
    summary = _read_json(spec.run_dir(arm, seed) / "summary.json")
    return summary is not None and summary.get("steps") == spec.steps and summary.get("mode") == arm


def eval_finished(path: pathlib.Path, attempts: int, stem: str = "eval") -> bool:
    data = _read_json(path / f"{stem}.json")
    return data is not None and data.get("attempts") == attempts


def base_dir(spec: CompareSpec, seed: int) -> pathlib.Path:
    """Where the untrained policy's evaluation with seed `seed`'s sampling seed lives."""
    return spec.work_dir / "base" / f"seed{seed}"


def run_compare(spec: CompareSpec, base, *, progress: bool = True, log=print) -> dict:
    """Trains and evaluates whatever is not finished yet, then writes the report; returns `compare.json`'s dict."""
    start = time.perf_counter()
    validate(run_config(base, spec, spec.arms[0], spec.seeds[0]))   # bad input: an error before any compute
    _check_spec(spec, base)
    out, work = pathlib.Path(spec.out), spec.work_dir
    out.mkdir(parents=True, exist_ok=True)
    probe = run_config(base, spec, spec.arms[0], spec.seeds[0])
    eval_tasks = load_tasks(probe, probe.eval_split)
    if spec.eval_tasks:
        unknown = sorted(set(spec.eval_tasks) - {t.name for t in eval_tasks})
        if unknown:
            raise ValueError(f"eval_tasks: {unknown} not in the {probe.eval_split!r} split; expected some of "
                             f"{[t.name for t in eval_tasks]}")
        eval_tasks = [t for t in eval_tasks if t.name in spec.eval_tasks]
    acfg = agent_config(probe)
    train_tasks = load_tasks(probe, probe.train_split) if spec.eval_every and spec.eval_train_tasks else []
    model = str(model_folder(probe))
    lm = pool = None
    trained = evaluated = 0

    def open_eval():
        nonlocal lm, pool
        if lm is None:
            lm = chat.load_chat_model(model, dtype=probe.dtype)
            pool = make_sandbox_pool(probe)

    def base_eval(seed: int) -> tuple[dict, dict | None]:
        """The untrained policy at seed `seed`'s sampling seed: held-out (and, for the curves, train tasks)."""
        nonlocal evaluated
        where, sampling = base_dir(spec, seed), eval_seed(seed)
        parts = [("eval", eval_tasks, "held-out")] + ([("train_eval", train_tasks, "train")] if train_tasks else [])
        for stem, tasks, which in parts:
            if not eval_finished(where, spec.attempts, stem):
                open_eval()
                log(f"evaluating the base policy, seed {seed}: avg@{spec.attempts} on {len(tasks)} {which} tasks")
                result = evaluate(lm, tasks, pool, config=acfg, attempts=spec.attempts, seed=sampling,
                                  progress=progress)
                write_report(result, where, stem=stem, extra={"policy": "base", "seed": seed, "eval_seed": sampling},
                             title=f"Base policy (untrained), seed {seed}, {which} avg@{spec.attempts}")
                evaluated += 1
        return (_read_json(where / "eval.json"), _read_json(where / "train_eval.json") if train_tasks else None)

    try:
        # Seed-major: a comparison cut short still has whole seeds across the arms.
        for seed in spec.seeds:
            held_out_before, train_before = base_eval(seed)
            for arm in spec.arms:
                run_dir = spec.run_dir(arm, seed)
                if not run_finished(spec, arm, seed):
                    if spec.eval_every and not (run_dir / loop.GIVEN_BEFORE).is_file():
                        # The curve's step 0 is the seed's base evaluation: the loop takes it instead of redoing it.
                        run_dir.mkdir(parents=True, exist_ok=True)
                        given = {"model": model, "eval_seed": eval_seed(seed), "held_out": held_out_before}
                        if train_before is not None:
                            given["train"] = train_before
                        _write_json(run_dir / loop.GIVEN_BEFORE, given)
                    log(f"training {arm} seed {seed} ({spec.steps} steps) -> {run_dir}")
                    loop.train(run_config(base, spec, arm, seed), progress=progress)
                    trained += 1
                summary = _read_json(run_dir / "summary.json") or {}
                after = summary.get("eval_after")
                if spec.eval_every and not eval_finished(run_dir, spec.attempts) and after is not None:
                    # The loop evaluated the final policy on the curve, with the seed's sampling seed: reuse it.
                    data = {**after, "policy": str(run_dir / "export"), "arm": arm, "seed": seed,
                            "eval_seed": eval_seed(seed)}
                    _write_json(run_dir / "eval.json", data)
                    (run_dir / "eval.md").write_text(to_markdown(data, f"{arm} seed {seed}, held-out "
                                                                      f"avg@{spec.attempts}"))
                if not eval_finished(run_dir, spec.attempts):
                    open_eval()
                    params = load_hf(run_dir / "export", dtype=probe.dtype).params
                    sampling_seed = eval_seed(seed)   # the seed's base's: the same sampling noise as its pair
                    log(f"evaluating {arm} seed {seed}: avg@{spec.attempts}")
                    result = evaluate(lm, eval_tasks, pool, config=acfg, attempts=spec.attempts, seed=sampling_seed,
                                      params=params, progress=progress)
                    write_report(result, run_dir, title=f"{arm} seed {seed}, held-out avg@{spec.attempts}",
                                 extra={"policy": str(run_dir / "export"), "arm": arm, "seed": seed,
                                        "eval_seed": sampling_seed})
                    evaluated += 1
    finally:
        if pool is not None:
            pool.close(wait=False, cancel_pending=True)
    report = write_report_files(spec)
    report["invocation"] = {"trained": trained, "evaluated": evaluated, "wall_s": time.perf_counter() - start,
                            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    previous = _read_json(out / "compare.json") or {}
    # Every invocation's record, oldest first: a report-only rerun keeps the wall time of the one that trained.
    report["invocations"] = [*previous.get("invocations", []), report["invocation"]]
    (out / "compare.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


# --------------------------------------------------------------------------- aggregating

def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def _mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    from wmrl_jax import stats

    v = [x for x in values if x is not None and np.isfinite(x)]
    return stats.bootstrap_mean_ci(v, level=level) if v else (float("nan"), float("nan"))


def collect(spec: CompareSpec) -> dict:
    """Per run: cost counters (summary.json) and held-out score (eval.json); per arm: mean and sd over seeds."""
    runs = []
    for arm in spec.arms:
        for seed in spec.seeds:
            d = spec.run_dir(arm, seed)
            summary, ev = _read_json(d / "summary.json"), _read_json(d / "eval.json")
            if summary is None or ev is None:
                continue
            c = summary["counters"]
            runs.append({"arm": arm, "seed": seed, "score": ev["score"], "valid_rate": ev["mean_valid_rate"],
                         "per_task": ev["per_task"], "real_executions": c["real_executions"],
                         "sandbox_cpu_s": c["sandbox_cpu_s"], "trainer_cpu_s": c.get("compute_cpu_s", float("nan")),
                         "wall_s": summary["seconds"], "wm_predictions": c["wm_predictions"],
                         "tokens_generated": c["tokens_generated"], "rollouts": c["rollouts"],
                         "ungraded_real": c["ungraded_real"], "ungraded_wm": c["ungraded_wm"],
                         "final": summary.get("final", {}), "eval_seconds": ev["seconds"],
                         "eval_sandbox_cpu_s": ev["sandbox_cpu_s"],
                         "curve": {str(k): v for k, v in loop.read_curve(d).items()},
                         "anchor_fidelity": anchor_fidelity(read_pairs(d), _group_size(d))})
    arms = {}
    for arm in spec.arms:
        rs = [r for r in runs if r["arm"] == arm]
        if not rs:
            continue
        arms[arm] = {"n": len(rs), "seeds": [r["seed"] for r in rs]}
        for key in ("score", "valid_rate", "real_executions", "sandbox_cpu_s", "trainer_cpu_s", "wall_s",
                    "wm_predictions", "tokens_generated"):
            m, s = _mean_sd([r[key] for r in rs])
            arms[arm][key], arms[arm][key + "_sd"] = m, s
        arms[arm]["total_cpu_s"] = arms[arm]["sandbox_cpu_s"] + arms[arm]["trainer_cpu_s"]
        fid = [r["anchor_fidelity"] for r in rs if r["anchor_fidelity"]["pairs"]]
        if fid:   # the world model on this arm's anchor rollouts: mean over the runs that have pairs
            arms[arm]["anchor_fidelity"] = {"runs": len(fid), "pairs": sum(f["pairs"] for f in fid), **{
                key: _mean_sd([f[key] for f in fid])[0]
                for key in ("spearman", "rmse", "within_group_spearman", "wm_flat_groups")}}
        for key in ("score", "sandbox_cpu_s"):   # the 95 % percentile bootstrap interval of the mean over seeds
            arms[arm][key + "_low"], arms[arm][key + "_high"] = _mean_ci([r[key] for r in rs])
    if "real" in arms:
        ref = arms["real"]
        for a in arms.values():
            a["cost_ratio"] = a["total_cpu_s"] / ref["total_cpu_s"] if ref["total_cpu_s"] > 0 else float("nan")
            a["sandbox_ratio"] = a["sandbox_cpu_s"] / ref["sandbox_cpu_s"] if ref["sandbox_cpu_s"] > 0 else float("nan")
    data = {"spec": dataclasses.asdict(spec), "base": collect_base(spec), "runs": runs, "arms": arms}
    data["claims"] = claims(data)
    data["curves"] = learning_curves(data)
    return data


def _group_size(run_dir: pathlib.Path) -> int | None:
    """The run's rollouts per group (its config.json), None when it kept no config."""
    config = _read_json(run_dir / "config.json")
    return None if config is None else int(config["rollout"]["group_size"])


def collect_base(spec: CompareSpec) -> dict | None:
    """The untrained policy's evaluations, one per seed (its sampling seed's): mean and sd of the score and valid
    rate over the seeds that have one, and each evaluation whole under `per_seed` (keyed by str(seed))."""
    per_seed = {}
    for seed in spec.seeds:
        ev = _read_json(base_dir(spec, seed) / "eval.json")
        if ev is not None:
            per_seed[str(seed)] = ev
    if not per_seed:
        return None
    score, score_sd = _mean_sd([e["score"] for e in per_seed.values()])
    valid, valid_sd = _mean_sd([e["mean_valid_rate"] for e in per_seed.values()])
    return {"n": len(per_seed), "seeds": [int(s) for s in per_seed], "score": score, "score_sd": score_sd,
            "valid_rate": valid, "valid_rate_sd": valid_sd, "per_seed": per_seed}


def learning_curves(data: dict, *, level: float = 0.95) -> dict:
    """Per arm and evaluated step, over the seeds whose curve has it: mean held-out (and train-task) avg@k, a
    bootstrap CI of that mean, and the paired change since step 0 (`stats.paired_bootstrap`)."""
    from wmrl_jax import stats

    out = {}
    for arm in data["arms"]:
        runs = [r for r in data["runs"] if r["arm"] == arm and r.get("curve")]
        steps = sorted({int(s) for r in runs for s in r["curve"]})
        rows = []
        for step in steps:
            row = {"step": step}
            for key in ("held_out", "train"):
                have = [r for r in runs if key in r["curve"].get(str(step), {}) and key in r["curve"].get("0", {})]
                if not have:
                    continue
                now = [r["curve"][str(step)][key] for r in have]
                low, high = stats.bootstrap_mean_ci(now, level=level)
                change = stats.paired_bootstrap(now, [r["curve"]["0"][key] for r in have], level=level)
                row[key] = {"n": len(have), "mean": float(np.mean(now)), "low": low, "high": high,
                            "change": dataclasses.asdict(change)}
            rows.append(row)
        if rows:
            out[arm] = rows
    return out


# The paper's claims as paired comparisons over seeds: (id, claim, arm a, arm b, metric, direction, paper).
# "base" is the untrained policy: seed s's evaluation of it (seed s's sampling seed, as every run of seed s).
CLAIMS = (
    ("0", "training learns: `real` beats the untrained policy", "real", "base", "score", "greater",
     "(the premise)"),
    ("1", "WMRL >= real-environment GRPO on held-out avg@k", "wmrl", "real", "score", "greater",
     "+1.2 to +3.1 points (4 cells)"),
    ("2a", "at a fraction of its sandbox CPU-s", "wmrl", "real", "sandbox_cpu_s", "less",
     "~1/3 of the GPU-hours"),
    ("2b", "at a fraction of its total CPU-s (sandbox + trainer)", "wmrl", "real", "total_cpu_s", "less",
     "286 vs 883 / 349 vs 1174 GPU-hours"),
    ("3", "both corrections beat the uncorrected mix", "wmrl", "naive_mix", "score", "greater",
     "+2.9 to +4.8 points"),
    ("3a", "debiasing alone helps", "debias_only", "naive_mix", "score", "greater", "helps"),
    ("3b", "denoising alone helps", "denoise_only", "naive_mix", "score", "greater", "helps"),
    ("4a", "world-model-only training falls below `real`", "real", "wm_only", "score", "greater",
     "WM-only 16.1 / 28.0 vs 18.8 / 31.2"),
    ("4b", "world-model-only training falls below WMRL", "wmrl", "wm_only", "score", "greater",
     "WM-only 16.1 / 28.0 vs 21.6 / 32.8"),
)


def claims(data: dict, *, level: float = 0.95, resamples: int = 10_000) -> list[dict]:
    """Each of `CLAIMS` whose two arms ran: the paired difference a - b over their common seeds (mean,
    percentile bootstrap CI, sign test; `wmrl_jax.stats`) and the verdict read off the interval."""
    from wmrl_jax import stats

    by_run = {(r["arm"], r["seed"]): r for r in data["runs"]}
    for r in data["runs"]:
        r.setdefault("total_cpu_s", r["sandbox_cpu_s"] + r["trainer_cpu_s"])
    for s, ev in ((data.get("base") or {}).get("per_seed") or {}).items():
        by_run["base", int(s)] = ev
    out = []
    for cid, text, a, b, metric, direction, paper in CLAIMS:
        seeds = sorted(s for arm, s in by_run if arm == a and (b, s) in by_run)
        if not seeds:
            continue
        xs = [by_run[a, s][metric] for s in seeds]
        ys = [by_run[b, s][metric] for s in seeds]
        if not all(np.isfinite(xs)) or not all(np.isfinite(ys)):
            continue
        p = stats.paired_bootstrap(xs, ys, level=level, resamples=resamples)
        out.append({"id": cid, "claim": text, "a": a, "b": b, "metric": metric, "direction": direction,
                    "paper": paper, "seeds": seeds, **dataclasses.asdict(p), "verdict": stats.verdict(p, direction)})
    return out


def format_claims(data: dict) -> str:
    """The claims table: paired difference with its CI and sign test, and the verdict."""
    rows = data.get("claims") or []
    if not rows:
        return ""
    k = data["spec"]["attempts"]
    lines = [f"| # | claim | difference (a - b) | {100 * rows[0]['level']:.0f} % CI | sign test | t-test | verdict | "
             f"paper |", "|---|---|---|---|---|---|---|---|"]
    for c in rows:
        scale, unit = (100.0, " pts") if c["metric"] == "score" else (1.0, " s")
        lines.append(f"| {c['id']} | {c['claim'].replace('avg@k', f'avg@{k}')} (`{c['a']}` - `{c['b']}`, "
                     f"n={c['n']}) | {scale * c['mean']:+.2f}{unit} | [{scale * c['low']:+.2f}, "
                     f"{scale * c['high']:+.2f}] | {c['positive']}+/{c['negative']}-, p={c['sign_p']:.3f} | "
                     f"p={c['t_p']:.3f} | **{c['verdict']}** | {c['paper']} |")
    return "\n".join(lines) + "\n"


def format_table(data: dict) -> str:
    """The Markdown table: one row per arm, mean ± sd over seeds (percent for scores)."""
    spec = data["spec"]
    k = spec["attempts"]
    lines = [f"| arm | held-out avg@{k} (%) | its 95 % CI | valid (%) | real executions | sandbox CPU-s | "
             f"trainer CPU-s | wall time (s) | WM predictions | cost ratio to `real` |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = data.get("base")
    if base is not None:
        low, high = _mean_ci([e["score"] for e in base["per_seed"].values()])
        lines.append(f"| base (untrained, n={base['n']}) | {100 * base['score']:.2f} ± {100 * base['score_sd']:.2f} | "
                     f"[{100 * low:.2f}, {100 * high:.2f}] | {100 * base['valid_rate']:.1f} ± {100 * base['valid_rate_sd']:.1f} | 0 | 0 | 0 | 0 | 0 | - |")
    for arm, a in data["arms"].items():
        ratio = a.get("cost_ratio", float("nan"))
        lines.append(
            f"| `{arm}` (n={a['n']}) | {100 * a['score']:.2f} ± {100 * a['score_sd']:.2f} | "
            f"[{100 * a['score_low']:.2f}, {100 * a['score_high']:.2f}] | "
            f"{100 * a['valid_rate']:.1f} ± {100 * a['valid_rate_sd']:.1f} | {a['real_executions']:.0f} | "
            f"{a['sandbox_cpu_s']:.0f} ± {a['sandbox_cpu_s_sd']:.0f} | {a['trainer_cpu_s']:.0f} ± "
            f"{a['trainer_cpu_s_sd']:.0f} | {a['wall_s']:.0f} ± {a['wall_s_sd']:.0f} | {a['wm_predictions']:.0f} | "
            f"{ratio:.2f} (sandbox {a.get('sandbox_ratio', float('nan')):.2f}) |")
    return "\n".join(lines) + "\n"


def format_report(data: dict) -> str:
    spec = data["spec"]
    k = spec["attempts"]
    text = [f"# Reward arms on the embedded suite: held-out avg@{k} and training cost", "",
            f"{len(spec['seeds'])} seeds ({', '.join(map(str, spec['seeds']))}) x {spec['steps']} GRPO steps per "
            f"arm; every final policy evaluated on the held-out tasks with {k} attempts each through the real "
            f"sandbox (avg@{k}: per task valid rate x mean best leaderboard position over valid attempts, "
            f"failures count 0; percent). Mean ± sd over seeds (sd with ddof=1), and the 95 % percentile bootstrap "
            f"interval of the mean over seeds. Every policy of seed s, the untrained one (base) included, is "
            f"evaluated with seed s's sampling seed, so the claims below pair them under common sampling noise. "
            f"Costs are the training runs': "
            f"sandbox CPU-s is the executed programs' CPU time, trainer CPU-s the training process's (sampling, "
            f"world model, GRPO update: the accelerator's work on this CPU machine); the cost ratio is "
            f"(sandbox + trainer) CPU-s over `real`'s (sandbox CPU-s alone in brackets).", "",
            format_table(data), ""]
    if data.get("claims"):
        text += ["The paper's claims, paired by seed (percentile bootstrap over seeds; exact two-sided sign test; "
                 "paired t-test, two-sided; reproduced when the interval lies on the claimed side of 0, not "
                 "reproduced when wholly on the other, else inconclusive):", "", format_claims(data), ""]
    fid = {arm: a["anchor_fidelity"] for arm, a in data["arms"].items() if "anchor_fidelity" in a}
    if fid:
        text += ["The world model on the anchor rollouts, in the runs (raw world-model reward vs the real one, "
                 "mean over the arm's runs; within-group: each anchor group's ranking, what GRPO's advantage "
                 "uses):", "",
                 "| arm | runs | pairs | Spearman, pooled | within-group Spearman | groups the WM scores alike (%) "
                 "| RMSE |", "|---|---|---|---|---|---|---|"]
        text += [f"| `{arm}` | {f['runs']} | {f['pairs']} | {f['spearman']:.3f} | {f['within_group_spearman']:.3f} | "
                 f"{100 * f['wm_flat_groups']:.0f} | {f['rmse']:.3f} |" for arm, f in fid.items()]
        text.append("")
    if data.get("curves"):
        text += [f"Learning curves (held-out avg@{k}, percent; mean over seeds, and the paired change since step 0 "
                 f"with its 95 % CI; `learning_curves.png`):", "",
                 "| arm | step | n | held-out | change since step 0 | train tasks | change |", "|---|---|---|---|---|---|---|"]
        for arm, rows in data["curves"].items():
            for r in rows:
                cells = []
                for key in ("held_out", "train"):
                    p = r.get(key)
                    cells += ["-", "-"] if p is None else [
                        f"{100 * p['mean']:.2f}", f"{100 * p['change']['mean']:+.2f} [{100 * p['change']['low']:+.2f}, "
                                                  f"{100 * p['change']['high']:+.2f}]"]
                n = (r.get("held_out") or r.get("train"))["n"]
                text.append(f"| `{arm}` | {r['step']} | {n} | " + " | ".join(cells) + " |")
        text.append("")
    text += ["| arm | what |", "|---|---|"]
    text += [f"| `{a}` | {ARM_DESCRIPTIONS[a]} |" for a in data["arms"]]
    text += ["", "Per run (held-out avg@%d, percent; base: the untrained policy with the seed's sampling seed):" % k,
             "", "| arm | " + " | ".join(f"seed {s}" for s in spec["seeds"]) + " |",
             "|---|" + "---|" * len(spec["seeds"])]
    if data.get("base") is not None:
        per = data["base"]["per_seed"]
        text.append("| base | " + " | ".join(f"{100 * per[str(s)]['score']:.2f}" if str(s) in per else "-"
                                            for s in spec["seeds"]) + " |")
    for arm in data["arms"]:
        by_seed = {r["seed"]: r["score"] for r in data["runs"] if r["arm"] == arm}
        text.append(f"| `{arm}` | " + " | ".join(f"{100 * by_seed[s]:.2f}" if s in by_seed else "-"
                                                  for s in spec["seeds"]) + " |")
    text += ["", "Per run, trainer CPU-s / wall s (a process's first run of a program pays its one-time XLA "
             "compilation: the update and the sampler in the first run, the world model in the first run that "
             "asks it; later runs read the persistent compilation cache):", "",
             "| arm | " + " | ".join(f"seed {s}" for s in spec["seeds"]) + " |", "|---|" + "---|" * len(spec["seeds"])]
    for arm in data["arms"]:
        by_seed = {r["seed"]: r for r in data["runs"] if r["arm"] == arm}
        text.append(f"| `{arm}` | " + " | ".join(
            f"{by_seed[s]['trainer_cpu_s']:.0f} / {by_seed[s]['wall_s']:.0f}" if s in by_seed else "-"
            for s in spec["seeds"]) + " |")
    return "\n".join(text) + "\n"


# --------------------------------------------------------------------------- plots

ARM_STYLES = {"debias_only": "--", "denoise_only": ":", "wmrl": "-"}
ARM_COLORS = {"real": "black", "wm_only": "tab:red", "naive_mix": "tab:orange", "debias_only": "tab:blue",
              "denoise_only": "tab:purple", "wmrl": "tab:green"}


def _plt():
    # Imported on use: matplotlib is heavy, needed only for the plots, and its backend must be chosen
    # before pyplot is imported.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_score_vs_cost(data: dict, path) -> None:
    """Held-out avg@k vs sandbox CPU-seconds of training: one dot per run, the arm's mean with its 95 % bootstrap
    interval (over seeds) on both axes as a cross."""
    plt = _plt()
    k = data["spec"]["attempts"]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for arm, a in data["arms"].items():
        rs = [r for r in data["runs"] if r["arm"] == arm]
        color = ARM_COLORS.get(arm)
        ax.scatter([r["sandbox_cpu_s"] for r in rs], [100 * r["score"] for r in rs], color=color, alpha=0.35, s=18)
        xerr = [[a["sandbox_cpu_s"] - a["sandbox_cpu_s_low"]], [a["sandbox_cpu_s_high"] - a["sandbox_cpu_s"]]]
        yerr = [[100 * (a["score"] - a["score_low"])], [100 * (a["score_high"] - a["score"])]]
        ax.errorbar(a["sandbox_cpu_s"], 100 * a["score"], xerr=xerr, yerr=yerr,
                    color=color, marker="o", capsize=3, label=f"{arm} (n={a['n']})")
    if data.get("base") is not None:
        ax.axhline(100 * data["base"]["score"], color="gray", ls="--", lw=1,
                   label=f"base (untrained, mean of {data['base']['n']})")
    ax.set_xlabel("sandbox CPU-seconds spent in training")
    ax.set_ylabel(f"held-out avg@{k} (leaderboard position, %)")
    ax.set_title(f"Score vs real-execution cost ({data['spec']['steps']} steps; mean, 95 % CI over seeds)",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_pairs(run_dir) -> dict[int, dict]:
    """pairs.jsonl of a run: step -> record (a step logged twice by a resumed run: the later line wins)."""
    path = pathlib.Path(run_dir) / "pairs.jsonl"
    records = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                records[int(r["step"])] = r
    return records


def anchor_fidelity(records: dict[int, dict], group_size: int | None = None) -> dict:
    """How the world model's reward agreed with the real one on a run's anchor rollouts (`read_pairs`).

    Pooled over every pair: Spearman and the raw reward's RMSE. Within each anchor group (consecutive
    `group_size` pairs of a step; None: a step's pairs are one group), the ranking GRPO's group-centred
    advantage uses: the mean Spearman over the groups where both rewards vary, and the share of groups
    whose world-model rewards are all equal (no advantage from the world model there). Numbers are nan
    where nothing qualifies."""
    from wmrl_jax.fidelity import spearman

    wm, real, within, flat, groups = [], [], [], 0, 0
    for r in records.values():
        x, y = list(r["wm"]), list(r["real"])
        wm += x
        real += y
        size = group_size or len(x)
        for lo in range(0, len(x), size):
            gx, gy = x[lo:lo + size], y[lo:lo + size]
            groups += 1
            flat += int(np.ptp(gx) == 0)
            rho = spearman(gx, gy)
            if np.isfinite(rho):
                within.append(rho)
    nan = float("nan")
    if not wm:
        return {"pairs": 0, "groups": 0, "spearman": nan, "rmse": nan, "within_group_spearman": nan,
                "within_group_n": 0, "wm_flat_groups": nan}
    error = np.asarray(wm, np.float64) - np.asarray(real, np.float64)
    return {"pairs": len(wm), "groups": groups, "spearman": spearman(wm, real),
            "rmse": float(np.sqrt(np.mean(error ** 2))),
            "within_group_spearman": float(np.mean(within)) if within else nan,
            "within_group_n": len(within), "wm_flat_groups": flat / groups}


def reliability(wm: np.ndarray, real: np.ndarray, bins: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per populated bin of `wm` (10 equal-width bins of [0, 1], the debiaser's): mean wm, mean real, count."""
    wm, real = np.asarray(wm, np.float64), np.asarray(real, np.float64)
    idx = np.clip(np.digitize(wm, np.linspace(0, 1, bins + 1)[1:-1]), 0, bins - 1)
    xs, ys, ns = [], [], []
    for b in range(bins):
        sel = idx == b
        if sel.any():
            xs.append(wm[sel].mean()), ys.append(real[sel].mean()), ns.append(int(sel.sum()))
    return np.asarray(xs), np.asarray(ys), np.asarray(ns)


def _prior_map(records: dict[int, dict], step: int):
    """The map in force when `step` began: the newest earlier record's map (identity before any); None when
    that record predates knot logging (the map cannot be rebuilt)."""
    earlier = [s for s in records if s < step]
    if not earlier:
        return lambda x: np.asarray(x, np.float64)
    r = records[max(earlier)]
    if not r.get("map_fitted"):
        return lambda x: np.asarray(x, np.float64)
    if "map_x" not in r:
        return None
    return lambda x: np.interp(np.asarray(x, np.float64), r["map_x"], r["map_y"])


def calibration_windows(records_by_run: Sequence[dict[int, dict]], steps: int) -> dict:
    """The first and last third of the steps (at least one step each), pairs pooled over the runs given.

    Per pair: the raw WM reward, the real reward, `calibrated` -- through the map in force right after its
    step's pushes (what the debiaser compared with the real reward; in sample: the map was fitted on these
    pairs too) -- and `calibrated_prior` -- through the map in force before the step (out of sample: what
    the non-anchor rollouts of that step got). `calibrated_prior` is None for a window where a run's log
    predates the map's knots.
    """
    width = max(1, steps // 3)
    windows = {"start": range(1, width + 1), "end": range(steps - width + 1, steps + 1)}
    out = {}
    for name, window in windows.items():
        wm, real, cal, prior, fitted = [], [], [], [], []
        for records in records_by_run:
            for s in window:
                r = records.get(s)
                if r is None:
                    continue
                wm += r["wm"]
                real += r["real"]
                cal += r["calibrated"]
                fitted.append(r["map_fitted"])
                f = _prior_map(records, s)
                if prior is not None and f is not None:
                    prior += np.asarray(f(r["wm"])).round(6).tolist()
                else:
                    prior = None
        out[name] = {"steps": [window.start, window.stop - 1], "wm": wm, "real": real, "calibrated": cal,
                     "calibrated_prior": prior, "map_fitted_steps": int(sum(fitted)), "step_records": len(fitted)}
    return out


def plot_calibration(windows: dict, path, *, title: str) -> None:
    """Reliability diagram: mean real reward per WM-reward bin -- raw, through the map before the step (out of
    sample, when logged) and through the map after it (in sample) -- at the start and the end."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.6), sharey=True)
    for ax, (name, w) in zip(axes, windows.items()):
        ax.plot([0, 1], [0, 1], color="gray", ls=":", lw=1, label="perfect calibration")
        wm, real = np.asarray(w["wm"], np.float64), np.asarray(w["real"], np.float64)
        if wm.size:
            ax.scatter(wm, real, color="tab:red", alpha=0.15, s=12)
            series = [(wm, "raw WM", "raw", "tab:red", "o")]
            if w.get("calibrated_prior") is not None:
                series.append((np.asarray(w["calibrated_prior"], np.float64), "calibrated, map before the step "
                               "(out of sample)", "out of sample", "tab:blue", "^"))
            series.append((np.asarray(w["calibrated"], np.float64), "calibrated, map after the step "
                           "(in sample)", "in sample", "tab:green", "s"))
            lines = [f"{wm.size} pairs; RMSE vs real:"]
            for x, label, short, color, marker in series:
                bx, by, bn = reliability(x, real)
                ax.plot(bx, by, color=color, marker=marker, label=label)
                for xx, yy, nn in zip(bx, by, bn):
                    ax.annotate(str(nn), (xx, yy), fontsize=7, xytext=(3, 3), textcoords="offset points", color=color)
                lines.append(f"  {short} {float(np.sqrt(np.mean((x - real) ** 2))):.3f}")
            lines.append(f"map fitted after {w['map_fitted_steps']}/{w['step_records']} step records")
            ax.text(0.02, 0.97, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=7)
        else:
            ax.text(0.5, 0.5, "no anchor pairs in this window", ha="center", transform=ax.transAxes)
        ax.set_title(f"{name}: step{'s' if w['steps'][0] != w['steps'][1] else ''} "
                     f"{w['steps'][0]}{'-' + str(w['steps'][1]) if w['steps'][0] != w['steps'][1] else ''}")
        ax.set_xlabel("world-model reward (raw or calibrated)")
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("real reward (sandbox)")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def correction_curves(spec: CompareSpec, arms=("debias_only", "denoise_only", "wmrl")) -> dict:
    """Per arm and seed: [(step, anchor weight)], [(step, bias reduction)] from the runs' TensorBoard scalars."""
    out = {}
    for arm in arms:
        if arm not in spec.arms:
            continue
        for seed in spec.seeds:
            tb = spec.run_dir(arm, seed) / "tb"
            if not tb.is_dir():
                continue
            scalars = read_scalars(tb)
            out.setdefault(arm, {})[seed] = {
                "anchor_weight": sorted(dict(scalars.get("wmrl/anchor_weight", [])).items()),
                "bias_reduction": sorted(dict(scalars.get("wmrl/bias_reduction", [])).items()),
                "calibrated": sorted(dict(scalars.get("wmrl/calibrated", [])).items())}
    return out


def plot_corrections(curves: dict, path) -> None:
    """Anchor weight and bias reduction over steps: one thin line per seed, the mean thick."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.0))
    for ax, key, label in ((axes[0], "anchor_weight", "inverse-variance anchor weight w"),
                           (axes[1], "bias_reduction", "bias reduction of the last refit")):
        # Drawn last arm first, each thinner than the one below it: arms that coincide (debias_only and wmrl
        # make the same refits when their anchor pairs agree) stay visible.
        for i, (arm, seeds) in enumerate(reversed(list(curves.items()))):
            color = ARM_COLORS.get(arm)
            series = [dict(v[key]) for v in seeds.values()]
            steps = sorted(set().union(*series)) if series else []
            style = ARM_STYLES.get(arm, "-")
            for s in series:
                ax.plot(list(s), list(s.values()), color=color, alpha=0.3, lw=1, ls=style)
            if steps:
                mean = [np.nanmean([s.get(t, np.nan) for s in series]) for t in steps]
                ax.plot(steps, mean, color=color, lw=4 - 1.2 * i, ls=style, marker="o", ms=6 - 1.5 * i,
                        label=f"{arm} (mean of {len(series)}; thin: seeds)")
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_learning_curves(data: dict, path) -> None:
    """Per arm against steps: left, the mean held-out (and train-task, dashed) avg@k over seeds; right, the
    paired change since step 0 with its 95 % bootstrap band (the seeds' base scores differ by more than the
    arms do, so the change is where the arms separate)."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.0, 4.5))
    k = data["spec"]["attempts"]
    for arm, rows in data["curves"].items():
        for key, style in (("held_out", "-"), ("train", "--")):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if not pts:
                continue
            x = [s for s, _ in pts]
            label = f"{arm}, {'held-out' if key == 'held_out' else 'train tasks'} (n={pts[-1][1]['n']})"
            left.plot(x, [100 * p["mean"] for _, p in pts], style, marker="o", ms=3, color=ARM_COLORS.get(arm),
                      label=label)
            right.plot(x, [100 * p["change"]["mean"] for _, p in pts], style, marker="o", ms=3,
                       color=ARM_COLORS.get(arm), label=label)
            right.fill_between(x, [100 * p["change"]["low"] for _, p in pts],
                               [100 * p["change"]["high"] for _, p in pts], color=ARM_COLORS.get(arm), alpha=0.08)
    left.set_ylabel(f"avg@{k} (%)")
    left.set_title("mean over seeds", fontsize=10)
    right.axhline(0.0, color="gray", lw=1)
    right.set_ylabel("change since step 0 (points)")
    right.set_title("paired change since step 0, 95 % bootstrap band", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("GRPO step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report_files(spec: CompareSpec) -> dict:
    """compare.json's data, table.md and the three PNGs under `spec.out` from whatever is finished."""
    out = pathlib.Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    data = collect(spec)
    (out / "table.md").write_text(format_report(data))
    files = {"table": str(out / "table.md")}
    if data["base"] is not None:
        (out / "base_eval.md").write_text("\n".join(
            to_markdown(ev, f"Base policy (untrained), held-out evaluation, seed {s} (sampling seed "
                            f"{ev.get('eval_seed', '?')})") for s, ev in data["base"]["per_seed"].items()))
        files["base_eval"] = str(out / "base_eval.md")
    if data["arms"]:
        plot_score_vs_cost(data, out / "score_vs_cost.png")
        files["score_vs_cost"] = str(out / "score_vs_cost.png")
    wmrl_seeds = [s for s in spec.seeds if "wmrl" in spec.arms and run_finished(spec, "wmrl", s)]
    if wmrl_seeds:
        windows = calibration_windows([read_pairs(spec.run_dir("wmrl", s)) for s in wmrl_seeds], spec.steps)
        plot_calibration(windows, out / "calibration.png",
                         title=f"WMRL runs (seeds {', '.join(map(str, wmrl_seeds))} pooled): world-model vs real "
                               f"reward of anchor rollouts, first and last third of {spec.steps} steps")
        data["calibration"] = {k: {kk: vv for kk, vv in v.items()} for k, v in windows.items()}
        files["calibration"] = str(out / "calibration.png")
    if data["curves"]:
        plot_learning_curves(data, out / "learning_curves.png")
        files["learning_curves"] = str(out / "learning_curves.png")
    curves = correction_curves(spec)
    if curves:
        plot_corrections(curves, out / "corrections.png")
        data["corrections"] = {a: {str(s): v for s, v in seeds.items()} for a, seeds in curves.items()}
        files["corrections"] = str(out / "corrections.png")
    data["files"] = files
    return data


__all__ = ["ARMS", "CompareSpec", "anchor_fidelity", "base_dir", "calibration_windows", "collect", "collect_base", "format_report", "format_table",
           "read_pairs", "reliability", "run_compare", "run_config", "run_finished", "write_report_files"]
