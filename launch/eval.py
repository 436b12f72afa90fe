"""Held-out avg@k of a policy through the real sandbox (the paper's avg@8), with its cost.

    python launch/eval.py --checkpoint=/tmp/wmrl/tiny_cpu --tasks=test          # a training workdir
    python launch/eval.py --checkpoint=wmrl_jax/assets/micro_world --tasks=test  # any HF checkpoint folder
    python launch/eval.py --checkpoint=/ckpt/Qwen3.5-9B --data_dir=/data/mle-dojo --tasks=test \
        --config=configs/mle_dojo_9b.py --batch_tasks=2

`--checkpoint`: an HF checkpoint folder (config.json, *.safetensors, tokenizer),
or a training workdir (its exported policy `export/`, else its newest good
checkpoint). `--tasks`: a split of the task root (a bare name, `test` or
`train`; the embedded suite unless `--data_dir` names an MLE-Dojo-layout root),
or a path with a `/` to a folder of task folders or to one task folder. Each task gets `--attempts` episodes (default 8)
whose programs all run in the sandbox; the agent's prompts and sampling come
from `--config` (default: the embedded configs/tiny_cpu.py; a workdir's own
config.json when it has one). Writes `<out>/eval.json` and `<out>/eval.md`
(default out: `<checkpoint>/eval` for a workdir, else `outputs/eval`). The
logic is `wmrl_jax.evaluate`.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

import bench_common  # importing it quiets absl/JAX INFO logs; its parse_flags makes config typos one line

# Runnable as `python launch/eval.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "HF checkpoint folder or training workdir.")
_TASKS = flags.DEFINE_string("tasks", "test", "A split of the task root (a bare name: test, train), or a path (with a "
                             "'/') to a folder of task folders or to one task folder.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Task root in the MLE-Dojo layout (default: the config's; "
                                "'' = the embedded suite).")
_ATTEMPTS = flags.DEFINE_integer("attempts", 8, "Episodes per task (the paper's avg@8).")
_SEED = flags.DEFINE_integer("seed", None, "Sampling seed (default: the training loop's held-out evaluation seed).")
_OUT = flags.DEFINE_string("out", None, "Output folder for eval.json / eval.md.")
_BATCH_TASKS = flags.DEFINE_integer("batch_tasks", None, "Tasks sampled together (default: all at once).")
_SOURCE = flags.DEFINE_enum("source", "export", ["export", "checkpoint"],
                            "For a workdir: its exported policy (when there is one) or its newest checkpoint.")
_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file for the agent's prompts and "
                                          "sampling and the sandbox limits (default: configs/tiny_cpu.py).")


def resolve_tasks(spec: str, data_dir: str, benchmark: str) -> list:
    """The tasks `spec` names: a split of `data_dir` (embedded suite when empty), a folder of tasks, or one task."""
    import ml_collections

    import sandbox

    if "/" not in spec:   # a bare name is a split of the task root
        from wmrl_jax.train.run import load_tasks   # the training loop's rule: <data_dir>/<split>/, else <data_dir>/

        return load_tasks(ml_collections.ConfigDict(dict(data_dir=data_dir, benchmark=benchmark)), spec)
    path = pathlib.Path(spec)
    if not path.is_dir():
        raise FileNotFoundError(f"--tasks={spec}: not a folder (expected a split name such as 'test', a folder of "
                                f"task folders, or one task folder)")
    if any((path / marker).exists() for marker in ("data", "info")):
        return [sandbox.load_task(path)]
    folders = sorted(p for p in path.iterdir() if p.is_dir())
    if not folders:
        raise ValueError(f"--tasks={spec}: an empty folder (expected task folders, or one task folder)")
    return [sandbox.load_task(p) for p in folders]


def main(argv):
    del argv
    import ml_collections

    import sandbox
    from configs import tiny_cpu
    from wmrl_jax.evaluate import evaluate, load_policy, write_report
    from wmrl_jax.train.config import agent_config
    from wmrl_jax.train.run import eval_seed

    logging.set_verbosity(logging.WARNING)
    if not _CHECKPOINT.value:
        raise app.UsageError("--checkpoint: required (an HF checkpoint folder or a training workdir)")
    checkpoint = pathlib.Path(_CHECKPOINT.value)
    config = _CONFIG.value
    if config is None:
        own = checkpoint / "config.json"
        is_workdir = (checkpoint / "checkpoints").is_dir() or (checkpoint / "export").is_dir()
        config = (ml_collections.ConfigDict(json.loads(own.read_text())) if is_workdir and own.is_file()
                  else tiny_cpu.get_config())
    data_dir = config.data_dir if _DATA_DIR.value is None else _DATA_DIR.value
    benchmark = config.benchmark if not data_dir else (config.benchmark if config.benchmark != "embedded"
                                                       else "mle_dojo")
    if _ATTEMPTS.value < 1:
        raise app.UsageError(f"--attempts: {_ATTEMPTS.value}, expected >= 1")
    tasks = resolve_tasks(_TASKS.value, data_dir, benchmark)        # checked before the model loads
    policy = load_policy(checkpoint, dtype=config.dtype, prefer=_SOURCE.value)
    print(f"{policy}: avg@{_ATTEMPTS.value} on {len(tasks)} tasks ({', '.join(t.name for t in tasks)})")
    seed = _SEED.value if _SEED.value is not None else eval_seed(config.get("seed", 0))
    pool = sandbox.make_pool(config.sandbox.get("backend", "local"), ray_address=config.sandbox.get("ray_address", ""),
                             workers=config.sandbox.workers, timeout_s=config.sandbox.timeout_s,
                             memory_mb=config.sandbox.memory_mb, cpus=config.sandbox.cpus)
    try:
        result = evaluate(policy.lm, tasks, pool, config=agent_config(config), attempts=_ATTEMPTS.value, seed=seed,
                          params=policy.params, progress=True, batch_tasks=_BATCH_TASKS.value)
    finally:
        pool.close(wait=False, cancel_pending=True)
    is_workdir = not ((checkpoint / "config.json").is_file() and any(checkpoint.glob("*.safetensors")))
    default_out = checkpoint / "eval" if is_workdir else pathlib.Path("outputs/eval")
    out = pathlib.Path(_OUT.value) if _OUT.value else default_out
    json_path, md_path = write_report(result, out, title=f"{policy.source}: held-out avg@{_ATTEMPTS.value}",
                                      extra={"policy": policy.source, "tasks": _TASKS.value, "eval_seed": seed})
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    app.run(main, flags_parser=bench_common.parse_flags)
