"""The paper's table on the embedded suite: six reward arms x seeds, held-out avg@8, training cost.

    python launch/compare.py --out=results/compare --work=/tmp/wmrl/compare  # 6 arms x 5 seeds x 20 steps, the defaults
    python launch/compare.py --arms=real --eval_every=5 --eval_train_tasks --out=results/learning_curve_real
    python launch/compare.py --out=/tmp/cmp --work=/tmp/cmp --arms=real,wmrl --seeds=2 --steps=2 --attempts=2
    python launch/compare.py --config.rollout.group_size=8                    # any config field, as in train.py

Trains every (arm, seed) for `--steps` GRPO steps from the shipped micro-world
(`wmrl_jax.train.loop.train`, one workdir per run under `<work>/runs/`),
evaluates the untrained policy once a seed and every final policy on the
held-out tasks with `--attempts` attempts each through the real sandbox (every
policy of seed s with seed s's sampling seed, so the claims pair policies under
common sampling noise; with --eval_every the runs' curves start from that
evaluation instead of redoing it), then writes
`<out>/table.md` (avg@k mean ± sd, real executions, sandbox and trainer
CPU-seconds, wall time, WM predictions, cost ratio to `real`), `compare.json`
and three PNGs (score vs sandbox CPU-seconds; a reliability diagram of the WMRL
runs' WM vs real rewards, raw and calibrated, at the start and the end;
anchor weight and bias reduction over steps). Interrupted, the same command
picks up finished runs and evaluations. The logic is `wmrl_jax.compare`.

The default config is configs/tiny_cpu.py, whose correction thresholds are
scaled to a run of a few steps (one anchor group of 4 rollouts a step: the
paper's 200 pairs / 32 groups would never be reached, and debias_only,
denoise_only and wmrl would be the naive mix under other names).

The default budget (20 steps of 4 tasks x 4 rollouts at lr 2e-5, 5 seeds) is
the one at which training measurably learns: the second command above (the
`real` arm, held-out and train-task avg@8 every 5 steps; 94 min on 2 cores
with a micro-world build beside it) measured held-out avg@8 57.86 % untrained
-> 65.72 % after 20 steps, paired change +7.86 points, 95 % bootstrap CI
[+4.37, +11.35], 5 of 5 seeds up; after 10 steps +2.71 [+0.95, +4.79], after 5
+1.41 [-0.16, +2.99] (results/learning_curve_real/, docs/results.md). A
seed's held-out base score alone varies from 49.9 to 63.6 % with the sampling
seed (32 attempts), hence 5 paired seeds rather than 3. The six-arm table at
this budget (results/compare/, docs/results.md "The six arms at 20 steps, 5
seeds"): the 25 world-model runs took 8,052 s on 2 idle cores (266-348 s a
run with two curve points), a `real` run alone 433 s with its evaluation:
about 2 h 50 min in all.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs)

# Runnable as `python launch/compare.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_OUT = flags.DEFINE_string("out", "results/compare", "Report folder: table.md, compare.json, the PNGs (small).")
_WORK = flags.DEFINE_string("work", "/tmp/wmrl/compare", "Runs and evaluations (checkpoints, exported policies); "
                            "keep it to resume.")
_COMPILE_CACHE = flags.DEFINE_bool("compile_cache", True, "JAX's persistent compilation cache under <work>/jax_cache: "
                                   "every run compiles the same update, sampler and world model.")
_ARMS = flags.DEFINE_list("arms", ["real", "wm_only", "naive_mix", "debias_only", "denoise_only", "wmrl"],
                          "Reward arms (config.rewards.mode values).")
_SEEDS = flags.DEFINE_integer("seeds", 5, "Seeds 0..seeds-1 per arm (5: see the budget above).")
_STEPS = flags.DEFINE_integer("steps", 20, "GRPO steps per run (the same budget for every arm; 20: `real` beats the "
                              "untrained policy, CI excluding 0, see above).")
_ATTEMPTS = flags.DEFINE_integer("attempts", 8, "Held-out attempts per task (avg@k).")
_EVAL_TASKS = flags.DEFINE_list("eval_tasks", [], "Held-out tasks to evaluate on (default: the whole eval split).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 10, "> 0: learning curves, each run evaluated every this many "
                                   "steps in the loop (curve.jsonl; ~20 s a point on the held-out tasks), the report "
                                   "adds learning_curves.png; 0: the final policy only.")
_EVAL_TRAIN = flags.DEFINE_bool("eval_train_tasks", False, "The curves' points also score the train tasks.")


def short_run_config():
    """configs/tiny_cpu.py (whose correction thresholds start both corrections from step 1), saving every step."""
    from configs import tiny_cpu

    c = tiny_cpu.get_config()
    c.checkpoint.every = 1
    c.log.text_samples = 1
    return c


_CONFIG = config_flags.DEFINE_config_dict("config", short_run_config(), "Base config: configs/tiny_cpu.py, saving "
                                          "every step; --config.x=y overrides any field.")


def main(argv):
    del argv
    from wmrl_jax import compare

    logging.set_verbosity(logging.WARNING)   # Orbax reports every save at INFO through absl
    if _SEEDS.value < 1:
        raise app.UsageError(f"--seeds: {_SEEDS.value}, expected >= 1")
    config = _CONFIG.value
    if _COMPILE_CACHE.value:
        import jax

        jax.config.update("jax_compilation_cache_dir", os.path.join(_WORK.value, "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    spec = compare.CompareSpec(out=_OUT.value, work=_WORK.value, arms=tuple(_ARMS.value),
                               seeds=tuple(range(_SEEDS.value)),
                               steps=_STEPS.value, attempts=_ATTEMPTS.value,
                               eval_tasks=tuple(_EVAL_TASKS.value), eval_every=_EVAL_EVERY.value,
                               eval_train_tasks=_EVAL_TRAIN.value)
    start = time.perf_counter()
    report = compare.run_compare(spec, config)
    print(compare.format_report(report))
    for name, path in report["files"].items():
        print(f"{name}: {path}")
    inv = report["invocation"]
    print(f"this invocation: trained {inv['trained']} runs, evaluated {inv['evaluated']} policies, "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    app.run(main)
