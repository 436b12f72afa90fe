"""Continues a micro-world's world-model stage: more steps, optionally on the agent's own train-task programs.

    python launch/wm_stage_probe.py --checkpoint=/tmp/mw.seed2 --out=/tmp/probe/ctl --steps=100 --renamed=0.25
    python launch/wm_stage_probe.py --checkpoint=/tmp/mw.seed2 --out=/tmp/probe/own --steps=100 --renamed=0.25 \
        --own_per_task=32
    python launch/wm_fidelity.py --readout=expected --splits=test --designs=holistic --checkpoint=/tmp/probe/own

A probe of the world-model recipe (issue #26) that costs one stage, not a
build: the checkpoint's world model (`<checkpoint>/world_model/`) trains on
for `--steps` steps of the build's outcome pool (`micro_world.outcome_examples`
and, with `--renamed`, the renamed copies a build with that
`outcome_stage_renamed` had), with the stage's loss and optimizer schedule at
`--learning_rate`. With `--own_per_task`, the checkpoint's agent first samples
that many programs per TRAIN task at its sampling settings; each runs in the
real sandbox and joins the pool (`--own_repeat` times) with its real outcome.
The agent's weights are copied as they are. The result is a checkpoint folder
for `launch/wm_fidelity.py`; `probe.json` records the settings and the losses.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import time

from absl import app, flags

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs)

# Runnable as `python launch/wm_stage_probe.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A micro-world folder with a world_model/ folder (a build's).")
_OUT = flags.DEFINE_string("out", None, "Folder to write: the agent copied, the continued world model in world_model/.")
_STEPS = flags.DEFINE_integer("steps", 100, "Stage steps to continue for.")
_LR = flags.DEFINE_float("learning_rate", 2e-4, "Peak rate of the continued stage (warm-up, cosine to 10 %).")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Outcome episodes a step (the build's outcome_stage_batch_size).")
_RENAMED = flags.DEFINE_float("renamed", 0.0, "The build's outcome_stage_renamed: renamed copies in the pool.")
_OWN = flags.DEFINE_integer("own_per_task", 0, "The agent's own programs per train task, executed, added to the pool.")
_OWN_REPEAT = flags.DEFINE_integer("own_repeat", 2, "Copies of each own program's episode in the pool.")
_SEED = flags.DEFINE_integer("seed", None, "The build's seed (default: its build log's): the renamed copies' names; "
                             "the continued stage's batch order is seed + 7, the own samples' 1234.")
_WORKERS = flags.DEFINE_integer("workers", 2, "Concurrent sandboxes for the own programs.")


def own_programs(agent, per_task: int, *, workers: int) -> list[dict]:
    """`per_task` programs of `agent` per train task, each with its real outcome (task, code, status, ...)."""
    import sandbox
    from sandbox import suite

    from configs import tiny_cpu
    from wmrl_jax import fidelity
    from wmrl_jax.train.config import agent_config

    config = tiny_cpu.get_config()
    tasks = [sandbox.load_task(p) for p in suite.list_tasks("train")]
    codes = fidelity.sample_solutions(agent, tasks, per_task, config=agent_config(config), seed=1234)
    with sandbox.SandboxPool(workers=workers, timeout_s=config.sandbox.timeout_s, memory_mb=config.sandbox.memory_mb,
                             cpus=1) as pool:
        runs = [(t.name, code, pool.submit(t, code)) for t, task_codes in zip(tasks, codes) for code in task_codes
                if code]
        return [{"task": name, "code": code, "status": r.status, "position_score": r.position_score,
                 "error_type": r.error_type} for name, code, r in ((n, c, f.result()) for n, c, f in runs)]


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm.auto import tqdm

    import sandbox
    from sandbox import suite
    from wmrl_jax import files, micro_world, world_model
    from wmrl_jax.chat import load_chat_model
    from wmrl_jax.models import qwen35, save_hf
    from wmrl_jax.models.family import Model

    if not _CHECKPOINT.value or not _OUT.value:
        raise app.UsageError("--checkpoint and --out are required")
    src, out = pathlib.Path(_CHECKPOINT.value), pathlib.Path(_OUT.value)
    log_path = src / micro_world.BUILD_LOG
    if not (src / world_model.FOLDER).is_dir() or not log_path.is_file():
        raise app.UsageError(f"--checkpoint={src}: expected a micro-world build folder with {micro_world.BUILD_LOG} "
                             f"and a {world_model.FOLDER}/ folder (a build with separate_world_model)")
    if _STEPS.value < 2 or not 0.0 <= _RENAMED.value <= 1.0 or _OWN.value < 0 or _OWN_REPEAT.value < 1:
        raise app.UsageError(f"--steps={_STEPS.value} (expected >= 2), --renamed={_RENAMED.value} (expected in "
                             f"[0, 1]), --own_per_task={_OWN.value} (>= 0), --own_repeat={_OWN_REPEAT.value} (>= 1)")
    seed = json.loads(log_path.read_text())["seed"] if _SEED.value is None else _SEED.value
    config = dataclasses.replace(micro_world.config_of(src), seed=seed, outcome_stage_renamed=_RENAMED.value)
    wm = load_chat_model(src / world_model.FOLDER)
    examples = micro_world.outcome_examples(config)
    if _RENAMED.value:
        examples += micro_world.renamed_outcome_examples(config, _RENAMED.value, seed=config.seed + 6)
    own, started = [], time.perf_counter()
    if _OWN.value:
        own = own_programs(load_chat_model(src), _OWN.value, workers=_WORKERS.value)
        tasks = {p.name: sandbox.load_task(p) for p in suite.list_tasks("train")}
        kept = [e for e in own if world_model.gate(e["code"]) is None and e["status"] in world_model.STATUSES]
        examples += _OWN_REPEAT.value * [micro_world._outcome_example(config, tasks[e["task"]], e["code"], e)
                                         for e in kept]
        print(f"own programs: {len(own)} in {time.perf_counter() - started:.0f} s, "
              f"{dict(collections.Counter(e['status'] for e in own))}")
    pool = micro_world.outcome_marks(micro_world.encode_examples(wm.tokenizer, examples), [k for *_, k in examples])
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), wm.model.params)
    optimizer = micro_world._stage_optimizer(_LR.value, _STEPS.value)
    opt_state = optimizer.init(params)
    step = micro_world.make_outcome_step(wm.model.config, optimizer, 0, micro_world.answer_tail(pool))
    losses, started = [], time.perf_counter()
    batches = micro_world.stage_batches(pool, batch_size=_BATCH.value, steps=_STEPS.value, pad_id=wm.pad_id,
                                        seed=seed + 7, multiple=config.outcome_pad_multiple)
    for batch in (bar := tqdm(batches, total=_STEPS.value, desc="world-model stage (continued)")):
        params, opt_state, loss = step(params, opt_state, *batch)
        losses.append(float(loss))
        bar.set_postfix(outcome_nll=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - started
    print(f"{len(pool)} episodes in the pool, {_STEPS.value} steps in {seconds:.0f} s, outcome NLL "
          f"{np.mean(losses[:10]):.3f} -> {np.mean(losses[-10:]):.3f} (first / last 10 steps)")
    staging = out.with_name(out.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(src, staging, ignore=shutil.ignore_patterns(world_model.FOLDER))
    shipped = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)   # as a build ships it
    save_hf(Model(config=wm.model.config, params=shipped, family=qwen35), staging / world_model.FOLDER,
            tokenizer=wm.tokenizer)
    (staging / "probe.json").write_text(json.dumps({
        "checkpoint": str(src), "seed": seed, "steps": _STEPS.value, "learning_rate": _LR.value,
        "batch_size": _BATCH.value, "renamed": _RENAMED.value, "own_per_task": _OWN.value,
        "own_repeat": _OWN_REPEAT.value, "own_statuses": dict(collections.Counter(e["status"] for e in own)),
        "pool": len(pool), "seconds": round(seconds, 1), "outcome_nll": losses}, indent=1) + "\n")
    files.swap_into_place(staging, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
