r"""WMRL's theory, demonstrated on a bandit whose truth is known.

  python launch/bandit.py                       # 10 seeds, 200 steps, < 2 min on 2 CPU cores
  python launch/bandit.py --seeds=10 --out=outputs/bandit10.png

Trains a GRPO softmax policy with six reward pipelines (real-only, wm-only,
naive-mix, debias-only, denoise-only, wmrl) through `correct_step` and
`grpo_loss`, prints final true reward / regret / real executions (mean ± sd
over seeds) and saves true reward vs real executions as a PNG. The logic is in
`wmrl_jax/bandit.py` (see its docstring for the simulated world model).
"""

import dataclasses
import os
import sys
import time

from absl import app
from absl import flags

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs)

# Runnable as `python launch/bandit.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SEEDS = flags.DEFINE_integer("seeds", 10, "Number of seeds (0..seeds-1); the table reports mean ± sd.")
_STEPS = flags.DEFINE_integer("steps", None, "GRPO steps per run (default: BanditConfig.steps).")
_OUT = flags.DEFINE_string("out", "outputs/bandit.png", "Where to save the plot ('' to skip).")


def main(argv):
    del argv
    from wmrl_jax import bandit

    cfg = bandit.BanditConfig()
    if _STEPS.value is not None:
        cfg = dataclasses.replace(cfg, steps=_STEPS.value)
    if _SEEDS.value < 2:
        raise app.UsageError(f"--seeds: {_SEEDS.value}, expected >= 2 (the table reports a spread)")
    seeds = list(range(_SEEDS.value))
    start = time.perf_counter()
    results = bandit.run_all(seeds, cfg)
    table = bandit.summarize(results)
    print(bandit.format_table(table, len(seeds)))
    optimum = float(next(iter(results.values()))["optimum"].mean())
    print(f"optimum (mean over seeds of the best solution's true reward): {optimum:.3f}; "
          f"{cfg.steps} steps, {cfg.n_tasks} groups x {cfg.group_size}, "
          f"{cfg.anchors_per_step} anchor groups per step; {time.perf_counter() - start:.0f} s")
    if _OUT.value:
        os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
        bandit.plot(results, _OUT.value)
        print(f"saved {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
