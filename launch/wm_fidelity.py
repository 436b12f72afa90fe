"""World-model fidelity on the embedded suite: predictions vs real sandbox outcomes, train and held-out tasks.

    python launch/wm_fidelity.py                          # shipped micro-world, 16 sampled + 16 logged per task
    python launch/wm_fidelity.py --samples_per_task=64 --logged_per_task=0 --out=outputs/wm_fidelity
    python launch/wm_fidelity.py --designs=holistic,decomposed   # both world-model designs, same solutions

Samples solutions from the base model with the agent prompt, runs them through
the real sandbox and through the world model, and adds solutions from the
suite's execution log (their real outcome is the log's sandbox run; pass
--rerun_logged to execute them again). Prints status accuracy, the confusion
matrix, Spearman(world-model reward, real reward), bias per quality bucket and
the cost gap (predictions/s vs executions/s); writes report.json and
wm_fidelity.png under --out.

With several --designs (`world_model.DESIGNS`), every design predicts the same
solutions (each into its own copies of them); the first design's figures fill
the report's usual keys, and each design's are under report["designs"][name]
(plot: wm_fidelity.png for the first, wm_fidelity_<name>.png for the others).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

from absl import app, flags

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs)

# Runnable as `python launch/wm_fidelity.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "HF checkpoint folder (default: the shipped micro-world).")
_WM_CHECKPOINT = flags.DEFINE_string(
    "world_model_checkpoint", None, "The world model's HF checkpoint folder (default: the checkpoint's own "
    "world_model/ folder if it has one, else the checkpoint itself: the agent's base weights).")
_SAMPLES = flags.DEFINE_integer("samples_per_task", 16, "Solutions sampled from the model per task.")
_LOGGED = flags.DEFINE_integer("logged_per_task", 16, "Solutions taken from the suite's execution log per task.")
_RERUN = flags.DEFINE_bool("rerun_logged", False, "Execute logged solutions again instead of using the log.")
_WORKERS = flags.DEFINE_integer("workers", 2, "Concurrent sandboxes.")
_SPLITS = flags.DEFINE_list("splits", ["train", "test"], "Suite splits to evaluate.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of sampling and of the logged-solution subsample.")
_OUT = flags.DEFINE_string("out", "outputs/wm_fidelity", "Folder for report.json and wm_fidelity.png.")
_DESIGNS = flags.DEFINE_list(
    "designs", ["holistic"], "World-model designs to compare on the same solutions (holistic, decomposed); the "
    "first fills the report's usual keys. Default holistic only: the shipped micro-world is trained to give the "
    "holistic answer, so the decomposed design's check and rubric prompts are new to it (try it with a prompted "
    "LLM via --checkpoint, or to measure how far the micro-world's training carries).")
_READOUT = flags.DEFINE_string(
    "readout", None, "How answers become rewards (world_model.READOUTS: sample, expected); default: the "
    "checkpoint's own world-model config.")


def main(argv):
    del argv
    import numpy as np

    import sandbox
    from sandbox import suite
    from wmrl_jax import chat, fidelity, micro_world, world_model

    mw = micro_world.config_of(_CHECKPOINT.value)   # the prompt format the checkpoint was trained on
    lm = chat.load_chat_model(_CHECKPOINT.value or micro_world.shipped_path())
    wm_lm = (chat.load_chat_model(_WM_CHECKPOINT.value) if _WM_CHECKPOINT.value
             else world_model.load(lm.path, base=lm))
    print(f"agent: {lm}\nworld model: {'the same weights' if wm_lm is lm else wm_lm}")
    rng = np.random.default_rng(_SEED.value)
    samples, tasks = [], {}
    for split in _SPLITS.value:
        split_tasks = [sandbox.load_task(p) for p in suite.list_tasks(split)]
        tasks.update({t.name: t for t in split_tasks})
        if _SAMPLES.value:
            codes = fidelity.sample_solutions(lm, split_tasks, _SAMPLES.value, config=mw.agent, seed=_SEED.value)
            samples += [fidelity.Sample(split, t.name, "sampled", c, "unknown", None, None)
                        for t, cs in zip(split_tasks, codes) for c in cs]
        log = suite.execution_log(split)
        targets = {row["name"]: row["targets"] for row in suite.manifest()["tasks"]}
        # Logged programs are shown in the agent's form, the form the world model reads in training and in
        # the loop (`normalise_solution` changes no behaviour, so the logged outcome still holds); the raw
        # reference form names its estimator in a docstring.
        log = [{**e, "code": micro_world.normalise_solution(e["code"], targets[e["task"]])} for e in log]
        for t in split_tasks:
            entries = [e for e in log if e["task"] == t.name]
            pick = rng.choice(len(entries), size=min(_LOGGED.value, len(entries)), replace=False)
            samples += [fidelity.Sample(split, t.name, "logged", entries[i]["code"], entries[i]["status"],
                                        entries[i]["reward"], entries[i]["position_score"],
                                        real_error_type=entries[i]["error_type"]) for i in sorted(pick)]
    unknown = [d for d in _DESIGNS.value if d not in world_model.DESIGNS]
    if unknown or not _DESIGNS.value:
        raise app.UsageError(f"--designs: got {_DESIGNS.value}, expected a non-empty list of {world_model.DESIGNS}")
    to_run = [s for s in samples if s.origin == "sampled" or _RERUN.value]
    with sandbox.SandboxPool(workers=_WORKERS.value, timeout_s=mw.agent.timeout_s, cache=False) as pool:
        real_s = fidelity.run_real(pool, to_run, tasks) if to_run else float("nan")
        stats = pool.stats()
    # The baseline: mean real reward of the program's estimator class over the train tasks' logged runs.
    table = fidelity.lookup_table(suite.execution_log("train"))
    timed_idx = [i for i, s in enumerate(samples) if s.origin == "sampled" or _RERUN.value] or list(range(len(samples)))
    rest_idx = sorted(set(range(len(samples))) - set(timed_idx))
    by_design = {}
    for design in _DESIGNS.value:
        config = dataclasses.replace(mw.world_model, design=design,
                                     readout=_READOUT.value or mw.world_model.readout)
        # The same number of prompts per sampler call for every design (the decomposed one asks 8 a solution).
        batch = max(1, 64 // (1 if design == "holistic" else len(world_model.CHECKS) + 1))
        mine = [dataclasses.replace(s, wm=None) for s in samples]
        timed, rest = [mine[i] for i in timed_idx], [mine[i] for i in rest_idx]
        # The logged solutions go first: they compile the world model's sampler, so the timed pass over the
        # executed ones measures predictions, not compilation.
        fidelity.run_world_model(wm_lm, rest or timed[:1], tasks, config=config, seed=_SEED.value + 1, batch=batch)
        wm_s = fidelity.run_world_model(wm_lm, timed, tasks, config=config, seed=_SEED.value, batch=batch)
        by_design[design] = mine, {
            "design": design,
            "splits": {split: fidelity.summarize([s for s in mine if s.split == split], table)
                       for split in _SPLITS.value},
            "by_origin": {f"{split}/{origin}": fidelity.summarize([s for s in mine if s.split == split
                                                                   and s.origin == origin], table)
                          for split in _SPLITS.value for origin in ("sampled", "logged")
                          if any(s.split == split and s.origin == origin for s in mine)},
            "cost": {"real_executions": len(to_run), "real_seconds": real_s, "wm_seconds": wm_s,
                     "real_executions_per_s": len(to_run) / real_s if to_run else float("nan"),
                     "wm_predictions_per_s": len(timed) / wm_s,
                     "speedup": (len(timed) / wm_s) / (len(to_run) / real_s) if to_run else float("nan"),
                     "sandbox_cpu_s": stats["cpu_s"], "workers": _WORKERS.value},
        }
    first = _DESIGNS.value[0]
    report = {
        "checkpoint": str(lm.path), "world_model_checkpoint": str(wm_lm.path), "samples_per_task": _SAMPLES.value, "logged_per_task": _LOGGED.value,
        **by_design[first][1],
        "policy_spread": {split: fidelity.policy_spread([s for s in samples if s.split == split])
                          for split in _SPLITS.value},
        "designs": {name: figs for name, (_, figs) in by_design.items()},
    }
    for name, (_, figs) in by_design.items():
        print(f"===== world-model design: {name} =====")
        print(fidelity.format_report(figs if name != first else report))
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    for name, (mine, figs) in by_design.items():
        png = out / ("wm_fidelity.png" if name == first else f"wm_fidelity_{name}.png")
        fidelity.plot(figs, mine, png)
        print(f"wrote {png}")
    print(f"wrote {out / 'report.json'}")


if __name__ == "__main__":
    app.run(main)
