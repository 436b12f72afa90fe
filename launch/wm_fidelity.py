"""World-model fidelity on the embedded suite: predictions vs real sandbox outcomes, train and held-out tasks.

    python launch/wm_fidelity.py                          # shipped micro-world, 16 sampled + 16 logged per task
    python launch/wm_fidelity.py --samples_per_task=64 --logged_per_task=0 --out=outputs/wm_fidelity

Samples solutions from the base model with the agent prompt, runs them through
the real sandbox and through the world model, and adds solutions from the
suite's execution log (their real outcome is the log's sandbox run; pass
--rerun_logged to execute them again). Prints status accuracy, the confusion
matrix, Spearman(world-model reward, real reward), bias per quality bucket and
the cost gap (predictions/s vs executions/s); writes report.json and
wm_fidelity.png under --out.
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
_SAMPLES = flags.DEFINE_integer("samples_per_task", 16, "Solutions sampled from the model per task.")
_LOGGED = flags.DEFINE_integer("logged_per_task", 16, "Solutions taken from the suite's execution log per task.")
_RERUN = flags.DEFINE_bool("rerun_logged", False, "Execute logged solutions again instead of using the log.")
_WORKERS = flags.DEFINE_integer("workers", 2, "Concurrent sandboxes.")
_SPLITS = flags.DEFINE_list("splits", ["train", "test"], "Suite splits to evaluate.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of sampling and of the logged-solution subsample.")
_OUT = flags.DEFINE_string("out", "outputs/wm_fidelity", "Folder for report.json and wm_fidelity.png.")


def main(argv):
    del argv
    import numpy as np

    import sandbox
    from sandbox import suite
    from wmrl_jax import chat, fidelity, micro_world

    mw = micro_world.MicroWorldConfig()
    lm = chat.load_chat_model(_CHECKPOINT.value or micro_world.shipped_path())
    print(lm)
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
    to_run = [s for s in samples if s.origin == "sampled" or _RERUN.value]
    with sandbox.SandboxPool(workers=_WORKERS.value, timeout_s=mw.agent.timeout_s, cache=False) as pool:
        real_s = fidelity.run_real(pool, to_run, tasks) if to_run else float("nan")
        stats = pool.stats()
    # The logged solutions go first: they compile the world model's sampler, so the timed pass over the
    # executed ones measures predictions, not compilation.
    timed = to_run or samples
    rest = [s for s in samples if all(s is not t for t in timed)]
    if rest:
        fidelity.run_world_model(lm, rest, tasks, config=mw.world_model, seed=_SEED.value + 1)
    else:
        fidelity.run_world_model(lm, timed[:1], tasks, config=mw.world_model, seed=_SEED.value + 1)
    wm_s = fidelity.run_world_model(lm, timed, tasks, config=mw.world_model, seed=_SEED.value)
    # The baseline: mean real reward of the program's estimator class over the train tasks' logged runs.
    table = fidelity.lookup_table(suite.execution_log("train"))
    report = {
        "checkpoint": str(lm.path), "samples_per_task": _SAMPLES.value, "logged_per_task": _LOGGED.value,
        "splits": {split: fidelity.summarize([s for s in samples if s.split == split], table)
                   for split in _SPLITS.value},
        "policy_spread": {split: fidelity.policy_spread([s for s in samples if s.split == split])
                          for split in _SPLITS.value},
        "by_origin": {f"{split}/{origin}": fidelity.summarize([s for s in samples if s.split == split
                                                               and s.origin == origin], table)
                      for split in _SPLITS.value for origin in ("sampled", "logged")
                      if any(s.split == split and s.origin == origin for s in samples)},
        "cost": {"real_executions": len(to_run), "real_seconds": real_s, "wm_seconds": wm_s,
                 "real_executions_per_s": len(to_run) / real_s if to_run else float("nan"),
                 "wm_predictions_per_s": len(timed) / wm_s,
                 "speedup": (len(timed) / wm_s) / (len(to_run) / real_s) if to_run else float("nan"),
                 "sandbox_cpu_s": stats["cpu_s"], "workers": _WORKERS.value},
    }
    print(fidelity.format_report(report))
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    fidelity.plot(report, samples, out / "wm_fidelity.png")
    print(f"wrote {out / 'report.json'} and {out / 'wm_fidelity.png'}")


if __name__ == "__main__":
    app.run(main)
