"""Trains a research agent with WMRL (or one of the paper's ablation arms).

    python launch/train.py --config=configs/tiny_cpu.py                 # embedded default, <= 15 min on 2 CPU cores
    python launch/train.py --config=configs/tiny_cpu.py --config.rewards.mode=real --config.workdir=/tmp/real
    python launch/train.py --config=configs/mle_dojo_9b.py --config.model_path=/ckpt/Qwen3.5-9B \\
        --config.data_dir=/data/mle-dojo --config.workdir=/runs/9b

A first check of an install (one training step, no held-out evaluation, in a
fresh temporary workdir; about a minute on 2 CPU cores; what CI runs):

    python launch/train.py --config=configs/tiny_cpu.py --smoke

Starting the same command again resumes from the newest good checkpoint in
`workdir`. TensorBoard: `tensorboard --logdir WORKDIR/tb`. The loop itself is
`wmrl_jax.train.loop.train`.

Multi-host: start the same command once per host (or per accelerator), e.g.
two hosts of 8 GPUs:

    # host 0 (10.0.0.1)                                  # host 1
    python launch/train.py --config=... \\                 python launch/train.py --config=... \\
        --coordinator_address=10.0.0.1:1234 \\                --coordinator_address=10.0.0.1:1234 \\
        --num_processes=2 --process_id=0                     --num_processes=2 --process_id=1

or set WMRL_COORDINATOR_ADDRESS / WMRL_NUM_PROCESSES / WMRL_PROCESS_ID instead
of the flags. Under Slurm (`srun`) or Open MPI (`mpirun`) nothing is needed:
JAX reads the launcher's variables; on TPU pods and Kubernetes pass
`--distributed=on` to let JAX detect the cluster. `jax.devices()` then spans
every process and `config.mesh` is laid over all of them. `workdir` must be a
folder every host sees (a shared filesystem: Orbax writes each host's
shards there), and so must `data_dir`; process 0 alone runs the sandboxes
(or drives the Ray fleet, `--config.sandbox.backend=ray`) and writes logs
and the export (docs/design.md, "Multi-host training").
"""

from __future__ import annotations

import os
import sys
import tempfile

from absl import app, flags, logging
from ml_collections import config_flags

import bench_common  # importing it quiets absl/JAX INFO logs; its parse_flags makes config typos one line

# Runnable as `python launch/train.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file (with --config.x=y overrides).")
_SMOKE = flags.DEFINE_bool(
    "smoke", False, "Check the install: 1 training step, no held-out evaluation, in a fresh temporary workdir "
    "(so nothing is resumed; single-process runs only); overrides --config.steps/eval_attempts/workdir/"
    "optim.warmup_steps.")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", ["auto", "on", "off"],
    "Start jax.distributed? auto: when a coordinator address or more than one process is given (flags or "
    "WMRL_*/JAX_COORDINATOR_ADDRESS environment), or under Slurm srun / Open MPI mpirun with >1 task; "
    "on: always (JAX auto-detects TPU pods, Kubernetes, ...); off: never (a single-process run).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "HOST:PORT of process 0's coordination service, the same in every process (env WMRL_COORDINATOR_ADDRESS, "
    "or JAX_COORDINATOR_ADDRESS).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes in the run (env WMRL_NUM_PROCESSES).", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's id, 0 .. num_processes - 1; 0 writes logs and runs the sandboxes "
    "(env WMRL_PROCESS_ID).", lower_bound=0)


def main(argv):
    del argv
    from wmrl_jax.train import multihost

    # Before anything touches a device: jax.distributed must start first.
    multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, mode=_DISTRIBUTED.value)
    from wmrl_jax.train import loop
    from wmrl_jax.train.config import validate

    logging.set_verbosity(logging.WARNING)   # Orbax reports every save at INFO through absl
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config: required, e.g. --config=configs/tiny_cpu.py")
    if _SMOKE.value:
        config.steps = 1
        config.optim.warmup_steps = 0          # must not exceed the 1 step
        config.eval_attempts = 0               # the two held-out evaluations are most of a short run
        config.workdir = tempfile.mkdtemp(prefix="wmrl-smoke-")   # an old workdir would be resumed, not run
    try:
        validate(config)                       # loop.train validates too; here its message is the whole output
    except ValueError as exc:
        sys.exit(f"{os.path.basename(__file__)}: {exc}")
    if config.sandbox.get("backend", "local") == "local" and multihost.is_primary():
        from sandbox.isolation import warn_if_no_bwrap

        warn_if_no_bwrap()   # its one line before the model loads, not inside the first step's progress bar
    summary = loop.train(config)
    if multihost.is_primary():
        print(summary)


if __name__ == "__main__":
    app.run(main, flags_parser=bench_common.parse_flags)
