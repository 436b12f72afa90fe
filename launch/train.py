"""Trains a research agent with WMRL (or one of the paper's ablation arms).

    python launch/train.py --config=configs/tiny_cpu.py                 # embedded default, <= 15 min on 2 CPU cores
    python launch/train.py --config=configs/tiny_cpu.py --config.rewards.mode=real --config.workdir=/tmp/real
    python launch/train.py --config=configs/mle_dojo_9b.py --config.model_path=/ckpt/Qwen3.5-9B \
        --config.data_dir=/data/mle-dojo --config.workdir=/runs/9b

Starting the same command again resumes from the newest good checkpoint in
`workdir`. TensorBoard: `tensorboard --logdir WORKDIR/tb`. The loop itself is
`wmrl_jax.train.loop.train`.
"""

from __future__ import annotations

import os
import sys

from absl import app, logging
from ml_collections import config_flags

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs)

# Runnable as `python launch/train.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file (with --config.x=y overrides).")


def main(argv):
    del argv
    from wmrl_jax.train import loop

    logging.set_verbosity(logging.WARNING)   # Orbax reports every save at INFO through absl
    if _CONFIG.value is None:
        raise app.UsageError("--config: required, e.g. --config=configs/tiny_cpu.py")
    summary = loop.train(_CONFIG.value)
    print(summary)


if __name__ == "__main__":
    app.run(main)
