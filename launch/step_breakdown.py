"""Where a training step's time goes: each phase's wall seconds beside its FLOPs at this CPU's matmul rate.

    python launch/step_breakdown.py                          # tiny_cpu, 6 steps, shared prompts vs not
    python launch/step_breakdown.py --steps=3 --sides=ours   # quicker, no peer
    python launch/step_breakdown.py --config.rollout.group_size=8

Runs `launch/train.py`'s loop (configs/tiny_cpu.py, no held-out evaluation)
for --steps steps in a fresh workdir per side and reads the loop's own
per-step timers (TensorBoard `time/*`): the reshard of the trained weights
into the sampler's layout, agent sampling, scoring (the world model and the
sandbox's real runs of the anchor groups, concurrent: the scoring's wall time
is their union), the GRPO update, and the rest of the step (corrections,
logging, checkpoints) as overhead. The first step compiles every program and
is left out; the rest are averaged.

Sides: "peer" is the update with every rollout written out whole
(`optim.share_prompt='never'`, the loop before prompt sharing); "ours" the
default. Beside the seconds, each phase's model FLOPs (`train.plan.
analytic_flops`: 2N a token forward, the update's policy forward + backward
+ layer-remat recomputation and the reference's forward; sampling's prefill
and decode as upper bounds) and the seconds those FLOPs take at this CPU's
measured float32 matmul rate: a phase far above its floor is bound by
something else (decode: one token at a time; the sandbox: the programs' own
CPU time). Writes step_breakdown.json and step_breakdown.png under --out.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys

from absl import app, flags, logging
from ml_collections import config_flags

import bench_common  # noqa: F401  (quiets absl/JAX INFO logs)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_STEPS = flags.DEFINE_integer("steps", 6, "Training steps a side (the first compiles and is left out).")
_SIDES = flags.DEFINE_list("sides", ["peer", "ours"], "peer: optim.share_prompt='never'; ours: the config's.")
_WORK = flags.DEFINE_string("work", "/tmp/wmrl/step_breakdown", "Workdirs, one a side (emptied first).")
_OUT = flags.DEFINE_string("out", "results/step_breakdown", "step_breakdown.json and step_breakdown.png.")


def _base_config():
    from configs import tiny_cpu

    c = tiny_cpu.get_config()
    c.eval_attempts = 0
    return c


_CONFIG = config_flags.DEFINE_config_dict("config", _base_config(), "configs/tiny_cpu.py without the held-out "
                                          "evaluation; --config.x=y overrides any field.")
PHASES = ("reshard", "sample", "score", "update", "overhead")


def phase_seconds(scalars: dict, first: int = 2) -> dict:
    """Mean seconds per phase over steps >= `first`, from the loop's `time/*` scalars (see the docstring)."""
    import numpy as np

    def mean(tag):
        values = [v for step, v in scalars.get(f"time/{tag}", []) if step >= first]
        if not values:
            raise ValueError(f"time/{tag}: no step >= {first} logged; expected a run of at least {first} steps")
        return float(np.mean(values))

    wm, sandbox, overlap = mean("wm_s"), mean("sandbox_s"), mean("overlap_s")
    out = {"reshard": mean("reshard_s"), "sample": mean("sample_s"), "score": wm + sandbox - overlap,
           "update": mean("update_s"), "step": mean("step_s"), "wm": wm, "sandbox": sandbox}
    out["overhead"] = out["step"] - sum(out[p] for p in PHASES if p != "overhead")
    return out


def main(argv):
    del argv
    import jax
    import numpy as np

    from bench_update import matmul_gflops
    from wmrl_jax import agent, chat
    from wmrl_jax.train import loop, plan
    from wmrl_jax.train.config import agent_config, model_folder, shares_prompt
    from wmrl_jax.train.metrics import read_scalars
    from wmrl_jax.train.run import load_tasks

    logging.set_verbosity(logging.WARNING)
    unknown = set(_SIDES.value) - {"peer", "ours"}
    if unknown or not _SIDES.value:
        raise app.UsageError(f"--sides: {_SIDES.value}, expected some of peer, ours")
    if _STEPS.value < 2:
        raise app.UsageError(f"--steps: {_STEPS.value}, expected >= 2 (the first step compiles and is left out)")
    rate = matmul_gflops()
    lm = chat.load_chat_model(model_folder(_CONFIG.value))
    results = {}
    for side in _SIDES.value:
        config = _CONFIG.value.copy_and_resolve_references()
        config.steps = config.optim.total_steps = _STEPS.value
        if side == "peer":
            config.optim.share_prompt = "never"
        work = pathlib.Path(_WORK.value) / side
        shutil.rmtree(work, ignore_errors=True)
        config.workdir = str(work)
        print(f"== {side}: {config.steps} steps, optim.share_prompt={config.optim.share_prompt!r} -> {work}")
        loop.train(config)
        times = phase_seconds(read_scalars(work / "tb"))
        # FLOPs of the step's programs, at the shapes this run had.
        acfg = agent_config(config)
        prompt = max(len(lm.prompt_ids(agent.initial_messages(t, acfg))) for t in load_tasks(config, "train"))
        wm_prompt = plan.estimated_prompt_tokens(config, 3.0)[1]
        shapes = plan.shapes_of(config, prompt, wm_prompt, 1, share_prompt=shares_prompt(config, jax.device_count()))
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(lm.model.params) if x.ndim >= 2)
        flops = plan.analytic_flops(config, lm.model.config, n, shapes)
        remat = 1.0 + (0.25 if config.optim.remat not in ("none", None, False) else 0.0)   # + one policy forward of 4
        gflop = {"sample": (flops["agent prefill"] + flops["agent decode"]) / 1e9,
                 "score": flops["world model"] / 1e9, "update": remat * flops["train"] / 1e9}
        results[side] = {"seconds": times, "gflop": gflop, "floor_s": {k: v / rate for k, v in gflop.items()},
                         "update_tokens": shapes.train_tokens}
    print(f"\nthis CPU's float32 matmul rate: {rate:.1f} GFLOP/s ({os.cpu_count()} cores); mean of steps 2-"
          f"{_STEPS.value}, seconds")
    print(f"{'phase':<10}" + "".join(f"{side + ' s':>10}{'GFLOP':>8}{'floor s':>9}" for side in results))
    for phase in (*PHASES, "step"):
        row = f"{phase:<10}"
        for r in results.values():
            g = r["gflop"].get(phase)
            row += f"{r['seconds'][phase]:>10.2f}" + (f"{g:>8.1f}{r['floor_s'][phase]:>9.2f}" if g else " " * 17)
        print(row)
    if {"peer", "ours"} <= set(results):
        p, o = results["peer"]["seconds"], results["ours"]["seconds"]
        print(f"\nours vs peer: update {p['update'] / o['update']:.2f}x faster, step {p['step'] / o['step']:.2f}x "
              f"({results['peer']['update_tokens']:,} -> {results['ours']['update_tokens']:,} update token slots)")
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_breakdown.json").write_text(json.dumps({"matmul_gflops": rate, "steps": _STEPS.value,
                                                         "sides": results}, indent=1) + "\n")
    plot(results, out / "step_breakdown.png")
    print(f"wrote {out / 'step_breakdown.json'} and {out / 'step_breakdown.png'}")


def plot(results: dict, path) -> None:
    """Stacked bars of a step's phases per side, the matmul floor of each FLOP-counted phase marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    colors = dict(zip(PHASES, ("tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:brown")))
    for i, (side, r) in enumerate(results.items()):
        bottom = 0.0
        for phase in PHASES:
            s = r["seconds"][phase]
            ax.bar(i, s, bottom=bottom, color=colors[phase], label=phase if i == 0 else None, width=0.5)
            floor = r["floor_s"].get(phase)
            if floor:
                ax.plot([i - 0.25, i + 0.25], [bottom + floor] * 2, color="black", lw=1)
            bottom += s
    ax.set_xticks(range(len(results)), [f"{side}" for side in results])
    ax.set_ylabel("seconds a step")
    ax.set_title("Step breakdown (black ticks: each phase's FLOPs at the matmul rate)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    app.run(main)
