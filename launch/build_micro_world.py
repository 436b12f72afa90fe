"""Builds the embedded micro-world: a tiny Qwen3.5 base model trained on the embedded suite (train split).

    python launch/build_micro_world.py                      # into wmrl_jax/assets/micro_world (what ships)
    python launch/build_micro_world.py --out /tmp/mw --steps 3

About 8-9 minutes on 2 CPU cores; deterministic for a given seed and code
(build_log.json records every step's loss; the shipped weights predate a
rounding-level change to the attention backward, so a rebuild matches their
log for three steps, then drifts -- see `wmrl_jax.micro_world`, which also
says what the model learns from).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs)

# Runnable as `python launch/build_micro_world.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from wmrl_jax import micro_world  # noqa: E402

_OUT = flags.DEFINE_string("out", str(micro_world.shipped_path()), "Checkpoint folder to write.")
_STEPS = flags.DEFINE_integer("steps", None, "Training steps (default: the config's epoch budget).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the corpus order, tokenizer sample, init and batches.")


def main(argv):
    del argv
    import dataclasses

    config = dataclasses.replace(micro_world.MicroWorldConfig(), seed=_SEED.value)
    log = micro_world.build(_OUT.value, config, steps=_STEPS.value)
    print(f"micro-world: {log['parameters'] / 1e6:.2f}M parameters, {log['steps']} steps of "
          f"{log['batch_size']} x {log['width']} tokens, reply loss {log['reply_nll'][0]:.3f} -> "
          f"{log['reply_nll'][-1]:.3f}, {log['seconds']:.0f} s -> {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
