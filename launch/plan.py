"""Will a run fit, and what will it cost? Compiles the run's real programs for a simulated mesh, allocates nothing.

    python launch/plan.py --config=configs/mle_dojo_9b.py --devices=8              # 80 GiB HBM, MFU 0.4
    python launch/plan.py --config=configs/mle_dojo_4b.py --devices=8 --hbm_gb=40 --mfu=0.35
    python launch/plan.py --config=configs/tiny_cpu.py --devices=2 --json=/tmp/plan.json

Lowers and compiles (AOT, abstract inputs with the loop's shardings) the
jitted GRPO update, the agent's sampler (longest turn) and the world model's
sampler for the config's model shapes, batch and mesh over `--devices`
simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count is
set here when it is not set), then prints per-device memory from XLA's memory
analysis by phase, FLOPs per step, whether it fits `--hbm_gb` ×
`--mem_fraction`, and, when it does not, re-plans with each knob that could
help (micro-batches, remat, mesh shape) until one fits. Last, the
accelerator-hours of `config.steps` steps at `--mfu` next to the paper's.
The library is `wmrl_jax.train.plan`.
"""

from __future__ import annotations

import os
import sys


def _devices_from_argv(argv) -> int:
    for i, arg in enumerate(argv):
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
        if arg == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
    return 8


# XLA reads its flags once, when JAX starts: set them before anything imports jax. The simulated device
# count; and, since these programs are compiled and never run, no LLVM optimisation of the machine code:
# the HLO passes and buffer assignment (what the memory analysis reports) are the same, compiling is ~2x
# faster (tiny config's update: 59 s -> 28 s under load, identical CompiledMemoryStats).
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += f" --xla_force_host_platform_device_count={_devices_from_argv(sys.argv)}"
for _flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
    if _flag.split("=")[0] not in _flags:
        _flags += " " + _flag
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the programs are compiled for CPU devices standing in for GPUs

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import bench_common  # noqa: E402,F401  (importing it quiets absl/JAX INFO logs)

# Runnable as `python launch/plan.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file (with --config.x=y overrides).")
_DEVICES = flags.DEFINE_integer("devices", 8, "Accelerators the run gets (simulated as CPU devices).")
_HBM = flags.DEFINE_float("hbm_gb", 80.0, "HBM per accelerator in GiB (an '80 GB' A100 has 80 GiB).")
_FRACTION = flags.DEFINE_float("mem_fraction", 0.75, "Share of HBM JAX may use: its GPU default 0.75, or what "
                                                     "XLA_PYTHON_CLIENT_MEM_FRACTION will be set to.")
_MFU = flags.DEFINE_float("mfu", 0.4, "Model-FLOPs utilisation assumed for the hours estimate.")
_PEAK = flags.DEFINE_float("peak_tflops", 312.0, "Dense bf16 peak per accelerator (A100: 312, H100 SXM: 989).")
_HBM_BW = flags.DEFINE_float("hbm_tbps", 2.04, "HBM bandwidth, TB/s (A100-80GB: 2.04), for the decode floor.")
_LINK = flags.DEFINE_float("link_gbps", 300.0, "Per-device all-gather bandwidth, GB/s (A100 NVLink: 300 each way).")
_PROMPT = flags.DEFINE_integer("prompt_tokens", None, "The agent's first prompt in tokens (default: estimated "
                                                     "from the config's character caps).")
_WM_PROMPT = flags.DEFINE_integer("wm_prompt_tokens", None, "The world model's prompt in tokens (default: "
                                                            "estimated likewise).")
_CPT = flags.DEFINE_float("chars_per_token", 3.0, "Characters a token for the prompt estimates.")
_PROGRAMS = flags.DEFINE_list("programs", ["train", "reshard", "sample", "wm"], "Programs to compile: train, "
                              "reshard, sample, wm.")
_KNOBS = flags.DEFINE_boolean("try_knobs", True, "When it does not fit, re-plan with each knob until one fits.")
_MAX_TRIES = flags.DEFINE_integer("max_tries", 3, "Knobs to try at most (each compiles again).")
_JSON = flags.DEFINE_string("json", None, "Also write every figure to this JSON file (hours_total, hours_ideal, "
                                          "fits, paper_hours, the bill by phase, ...).")
_LATENCY = flags.DEFINE_float("collective_us", 10.0, "Latency of one small collective, microseconds (a decode "
                                                     "step's all-reduces).")
_CHOOSE = flags.DEFINE_boolean("choose_rollout", True, "Plan with the rollout group size (rollout.tensor) whose "
                                                       "bill is lowest, instead of the config's.")


# What the memory figures assume of attention (the planner compiles for CPU devices: wmrl_jax.models.attention).
ATTENTION_NOTE = ("the hand-written blocked attention (wmrl_jax.models.blocked_attention; the planner compiles for CPU, "
                  "where the cuDNN kernel does not exist; on a GPU the prefill and the update use cuDNN's flash "
                  "attention where it applies, whose memory is of the same order: O(T) a row)")


def _gib(x: float) -> str:
    return f"{x / 2**30:8.2f}"


def _flops(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3e}"


def print_plan(p, hbm_bytes: float) -> None:
    from wmrl_jax.train.plan import GIB

    s = p.shapes
    print(f"\n== {p.label}: {p.devices} devices, mesh data {p.mesh['data']} x fsdp {p.mesh['fsdp']} x tensor "
          f"{p.mesh['tensor']}, micro_batches {p.micro_batches}, remat {p.remat}; {p.n_params:,} parameters")
    shared = f" after {s.groups} shared prompts [{s.groups}, {s.prompt_width}]" if s.prompt_width else ""
    print(f"update batch [{s.batch}, {s.train_width}]{shared} ({p.train_tokens:,} tokens); agent sampler {s.sample_rows} "
          f"rows x ({s.sample_prompt} prompt + {s.sample_new} new) tokens, the last of {s.turns} turns; world model "
          f"{s.wm_rows} rows x ({s.wm_prompt} + {s.wm_new}), {s.wm_calls} calls a step")
    print(f"prompts: the agent's first {s.prompt_tokens} tokens, the world model's {s.wm_prompt_raw} "
          f"({'given' if _PROMPT.value else f'estimated from the character caps at {_CPT.value} chars/token'})")
    print("per-device memory, GiB (XLA:CPU memory analysis of the partitioned programs):")
    print("  resident (all step; the policy copy while sampling)")
    for name, value in p.resident.items():
        print(f"    {name:44s}{_gib(value)}")
    print(f"  {'program':10s}{'arguments':>10s}{'outputs':>9s}{'aliased':>9s}{'temps':>9s}{'KV cache':>10s}"
          f"{'phase peak':>12s}{'compile s':>11s}")
    for name, prog in p.programs.items():
        cache = {"sample": p.kv_cache.get("agent"), "wm": p.kv_cache.get("world model")}.get(name)
        print(f"  {name:10s}{_gib(prog.arguments):>10s}{_gib(prog.outputs):>9s}{_gib(prog.aliased):>9s}"
              f"{_gib(prog.temporaries):>9s}{_gib(cache) if cache is not None else '':>10s}"
              f"{_gib(p.phases[name]):>12s}{prog.compile_s:>11.0f}")
    r = p.rollout
    if "mesh" in r:
        print(f"  generation (agent and world model) runs on {'the rollout layout' if r['layout'] == 'rollout' else 'the training mesh'}: "
              f"mesh {r['mesh']}")
    for name, prog in p.programs.items():
        if prog.decode_gathers is not None:
            g = prog.decode_gathers
            print(f"  {name}: all-gathers inside the compiled decode loop: {g['all_gathers']}, of which weights "
                  f"{g['weight_all_gathers']} ({g['weight_gather_bytes'] / 2**20:,.1f} MiB a token)")
    print(f"  memory figures assume attention by {ATTENTION_NOTE}")
    verdict = "FITS" if p.fits(hbm_bytes) else "DOES NOT FIT"
    worst = max(p.phases, key=p.phases.get)
    print(f"  peak {p.peak / GIB:.2f} GiB/device ({worst}) vs {hbm_bytes / GIB:.2f} GiB usable: {verdict}")


def print_flops(p, config, model_config) -> dict:
    from wmrl_jax.train.plan import analytic_flops

    a = analytic_flops(config, model_config, p.n_params, p.shapes)
    print("FLOPs per step:")
    if "train" in p.programs:
        prog = p.programs["train"]
        print(f"  update, matmuls counted on the jaxpr (global; backward, remat and head recompute included): "
              f"{_flops(prog.jaxpr_flops)}")
        print(f"  update, XLA cost_analysis (PER DEVICE, every loop body counted once): {_flops(prog.xla_flops)}"
              f" x {p.devices} devices = {_flops(None if prog.xla_flops is None else prog.xla_flops * p.devices)}")
    print(f"  update, analytic model FLOPs (policy 6N + reference 2N per token + attention): {_flops(a['train'])}"
          f"  [6N x tokens alone: {_flops(a['6N'])}, N = {a['n_matmul']:,} matmul weights]")
    print(f"  agent sampling, analytic, without multi-turn cache reuse (every turn re-prefilled, at its caps): prefill {_flops(a['agent prefill'])}, decode "
          f"{_flops(a['agent decode'])}; world model {_flops(a['world model'])}")
    return a


def bill_inputs(p, config):
    """(model costs, step workload, layout, hardware) of plan `p` for `train.bill`."""
    from wmrl_jax.train import bill as billlib
    from wmrl_jax.train.plan import model_of

    _, model_config, _ = model_of(config)
    m = billlib.ModelCosts.of(model_config, p.n_params)
    w = billlib.workload_of(config, p.shapes, p.mesh["data"] * p.mesh["fsdp"])
    lay = billlib.Layout(devices=p.devices, data=p.mesh["data"], fsdp=p.mesh["fsdp"], tensor=p.mesh["tensor"],
                         rollout=p.rollout.get("layout") == "rollout" and p.devices > 1,
                         rollout_tensor=p.rollout.get("tensor", 1))
    hw = billlib.Hardware(peak_tflops=_PEAK.value, mfu=_MFU.value, hbm_tbps=_HBM_BW.value, link_gbps=_LINK.value,
                          collective_us=_LATENCY.value)
    return m, w, lay, hw


def print_bill(p, config) -> dict:
    """The bill of `config.steps` steps on plan `p`'s layout, the ideal bill, the paper's budget; every assumption."""
    import dataclasses

    from wmrl_jax.train import bill as billlib
    from wmrl_jax.train.plan import PAPER_GPU_HOURS

    m, w, lay, hw = bill_inputs(p, config)
    steps = config.steps
    b = billlib.bill(m, w, lay, hw, steps)
    train_layout = billlib.bill(m, w, dataclasses.replace(lay, rollout=False), hw, steps)
    where = (f"rollout layout: {lay.gen_groups} groups of {lay.gen_tensor} (rollout.tensor={lay.rollout_tensor})"
             if lay.rollout else "generation on the training mesh (rollout.layout=train)")
    print(f"\nthe bill: accelerator-hours of {steps} steps, each phase max(FLOPs / (peak x MFU), bandwidth floor); "
          f"{where}")
    print("  assumptions: " + ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(hw).items())
          + f"; {p.devices} devices; tokens at the caps: {w.batch} sequences of a {w.prompt}-token prompt + "
            f"{w.turns} turns x {w.reply} generated + {w.turns - 1} x {w.observation} observation (+ template); "
            f"every row runs to its cap; multi-turn cache reuse (each prompt / observation token prefilled once); "
            f"the world model's {w.wm_samples} sample(s) share one prefill of its {w.wm_prompt}-token prompt, "
            f"{w.wm_calls} calls of {w.wm_rows} rows x {w.wm_new} tokens; N = {m.n_matmul:,} matmul weights; "
            f"bf16 weights and KV cache, f32 delta-rule state; the update is priced at its padded width "
            f"{w.train_width}")
    print(f"  {'phase':15s}{'hours':>9s}{'compute h':>11s}{'floor h':>10s}  bound      {'train layout h':>15s}")
    for k, v in b["phases"].items():
        print(f"  {k:15s}{v['hours']:9,.0f}{v['compute_hours']:11,.0f}{v['floor_hours']:10,.1f}  "
              f"{v['bound']:9s}  {train_layout['phases'][k]['hours']:15,.0f}")
    print(f"  {'total':15s}{b['hours_total']:9,.0f}{'':33s}{train_layout['hours_total']:15,.0f}")
    print(f"  ideal (same tokens once, 6N + 2N a trained token, 2N a sampled one, causal attention once, at the MFU, "
          f"no floors): {b['hours_ideal']:,.0f} (matmuls alone {b['hours_ideal_matmuls_only']:,.0f}); "
          f"ours / ideal = {b['ratio']:.2f}")
    paper = PAPER_GPU_HOURS.get(config.model_preset)
    budget = None
    if paper:
        budget = billlib.paper_budget(m, w, lay, hw, steps, paper["wmrl"])
        print(f"  the paper ({config.model_preset}, A100s): WMRL {paper['wmrl']} GPU-hours. The ideal bill reaches "
              f"that at {budget['scale']:.3f} x the caps' tokens ({budget['tokens_per_step']:,} trained tokens a step, "
              f"replies of {budget['reply_tokens']} tokens); our bill there: {budget['hours_total']:,.0f} "
              f"(ideal {budget['hours_ideal']:,.0f}, ratio {budget['ratio']:.2f}): "
              + ", ".join(f"{k} {v:,.0f}" for k, v in budget["phases"].items()))
    return {"bill": b, "train_layout_bill": train_layout, "paper_hours": paper["wmrl"] if paper else None,
            "paper_budget": budget, "assumptions": dataclasses.asdict(hw)}


def choose_rollout(config, devices: int):
    """Sets `config.rollout.tensor` to the group size with the cheapest bill (analytic; before compiling)."""
    import math

    import jax
    import jax.numpy as jnp

    from wmrl_jax.train import bill as billlib
    from wmrl_jax.train import plan as planlib
    from wmrl_jax.train.config import resolve_mesh, shares_prompt

    if config.rollout.get("layout", "rollout") != "rollout" or devices == 1:
        return None
    family, model_config, _ = planlib.model_of(config)
    shapes = jax.eval_shape(lambda: family.init_params(model_config, jax.random.key(0), jnp.dtype(config.dtype)))
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    data, fsdp, tensor = resolve_mesh(config.mesh, devices)
    est = planlib.estimated_prompt_tokens(config, _CPT.value)
    s = planlib.shapes_of(config, _PROMPT.value or est[0], _WM_PROMPT.value or est[1], data * fsdp,
                          share_prompt=shares_prompt(config, devices))
    m, w = billlib.ModelCosts.of(model_config, n), billlib.workload_of(config, s, data * fsdp)
    hw = billlib.Hardware(peak_tflops=_PEAK.value, mfu=_MFU.value, hbm_tbps=_HBM_BW.value, link_gbps=_LINK.value,
                          collective_us=_LATENCY.value)
    ranked = billlib.choose_rollout_tensor(m, w, billlib.Layout(devices, data, fsdp, tensor, True, 1), hw,
                                           config.steps)
    print("rollout layout, group size g -> bill (hours): " + ", ".join(f"g={g}: {h:,.0f}" for g, h in ranked))
    best = ranked[0][0]
    if best != config.rollout.tensor:
        print(f"  the planner chooses g={best} (config has rollout.tensor={config.rollout.tensor}; set "
              f"--config.rollout.tensor={best})")
    config.rollout.tensor = best
    return ranked


def try_knobs(config, first, hbm: float, kw: dict):
    """Re-plans with one knob after another (each on top of the last) until the plan fits: (final plan, tries).

    A knob that keeps the mesh recompiles only the programs that did not
    fit; the others' figures carry over (their inputs did not change).
    """
    from wmrl_jax.train import plan as planlib

    current, current_plan, tries = config, first, []
    print("\nknobs, tried in turn (each re-planned by compiling):")
    for _ in range(_MAX_TRIES.value):
        failing = {k for k, v in current_plan.phases.items() if v > hbm}
        candidates = planlib.knob_candidates(current, _DEVICES.value, failing)
        if not candidates:
            print("  no knob left that this code implements (see docs/scaling.md)")
            break
        what, variant, mesh_changed = candidates[0]
        programs = kw["programs"] if mesh_changed else tuple(failing)
        try:
            trial = planlib.plan(variant, _DEVICES.value, **{**kw, "programs": programs},
                                 label=f"{first.label} [{'; '.join([t['knob'] for t in tries] + [what])}]")
        except ValueError as e:
            print(f"  {what}: cannot plan ({e})")
            break
        if not mesh_changed:
            for name, prog in current_plan.programs.items():
                if name not in trial.programs:
                    trial.programs[name], trial.phases[name] = prog, current_plan.phases[name]
            trial.kv_cache = {**current_plan.kv_cache, **trial.kv_cache}
        print_plan(trial, hbm)
        tries.append({"knob": what, "plan": trial.as_dict(), "fits": trial.fits(hbm)})
        current, current_plan = variant, trial
        if trial.fits(hbm):
            print(f"  -> fits with: {'; '.join(t['knob'] for t in tries)}")
            return trial, tries
    else:
        print(f"  still does not fit after {_MAX_TRIES.value} knobs (--max_tries)")
    print("  what else would (no knob of this code): fewer tokens a sequence (agent.max_turns, "
          "agent.max_new_tokens); more devices; sampling fewer rows at a time; optimizer-state offload to host "
          "memory")
    return current_plan, tries


def main(argv):
    del argv
    import json
    import time

    from wmrl_jax.train import plan as planlib

    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config: required, e.g. --config=configs/mle_dojo_9b.py")
    hbm = _HBM.value * _FRACTION.value * planlib.GIB
    start = time.perf_counter()
    kw = dict(prompt_tokens=_PROMPT.value, wm_prompt_tokens=_WM_PROMPT.value, chars_per_token=_CPT.value,
              programs=tuple(_PROGRAMS.value))
    ranked = choose_rollout(config, _DEVICES.value) if _CHOOSE.value else None
    first = planlib.plan(config, _DEVICES.value, **kw)
    print_plan(first, hbm)
    _, model_config, source = planlib.model_of(config)
    a = print_flops(first, config, model_config)
    hours = print_bill(first, config)
    tries = []
    final = first
    if not first.fits(hbm) and _KNOBS.value:
        final, tries = try_knobs(config, first, hbm, kw)
    final_hours = hours
    if final is not first:
        print("\nthe bill on the final plan's mesh:")
        final_hours = print_bill(final, config)
    print(f"\nplanned in {time.perf_counter() - start:.0f} s (model from {source})")
    if _JSON.value:
        b = final_hours["bill"]
        out = {"config": config.to_dict(), "hbm_usable_bytes": hbm, "plan": first.as_dict(), "fits": first.fits(hbm),
               "flops": a, "hours": hours, "tries": tries, "final_fits": final.fits(hbm),
               "hours_total": b["hours_total"], "hours_ideal": b["hours_ideal"], "ratio": b["ratio"],
               "hours_by_phase": {k: v["hours"] for k, v in b["phases"].items()},
               "bill": b, "train_layout_bill": final_hours["train_layout_bill"],
               "paper_hours": final_hours["paper_hours"], "paper_budget": final_hours["paper_budget"],
               "assumptions": final_hours["assumptions"], "rollout_choice": ranked,
               "attention_kernel": ATTENTION_NOTE, "mfu": _MFU.value, "peak_tflops": _PEAK.value}
        with open(_JSON.value, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    app.run(main)
