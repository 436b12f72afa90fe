"""What a training run is, independent of how a step runs: its arms, seeds, tasks, cost counters and checkpoint.

The training loop (`train.loop`), the config checks (`train.config`), the
held-out evaluation (`evaluate.load_policy` restores a run's checkpoint), the
comparison (`compare`) and the planner (`train.plan`) all read these facts from
here, so each is written once:

* `MODES` -- the paper's arms as switches of one loop (`Arm`);
* `seed_for`, `SeedStream`, `eval_seed` -- every random stream of a run,
  derived from (run seed, step, stream), so a resumed run draws the same;
* `load_tasks`, `TaskCursor` -- which tasks a step trains on;
* `Counters` -- the run's cumulative cost, checkpointed with it;
* `checkpoint_tree` / `abstract_checkpoint_tree` -- what a checkpoint holds;
* `batch_width` -- the run's one [B, T] update width;
* `make_sandbox_pool` -- the pool a run's `config.sandbox` asks for.
"""

from __future__ import annotations

import dataclasses
import enum
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import sandbox
from sandbox import suite
from wmrl_jax import corrections
from wmrl_jax.train import update


# --------------------------------------------------------------------------- arms

class Arm(NamedTuple):
    """One of the paper's reward arms: which switches of the shared loop it turns on."""

    world_model: bool    # the world model is asked (feedback between turns, rewards of non-anchor groups)
    real_groups: str     # which groups run for real: "all", "none" or "some" (the anchor schedule picks)
    debias: bool         # online isotonic debiasing of world-model rewards
    denoise: bool        # inverse-variance weight on the anchor groups


MODES = {
    "real": Arm(False, "all", False, False),          # every group executed: the expensive baseline
    "wm_only": Arm(True, "none", False, False),       # the simulator alone: no anchors, no corrections
    "naive_mix": Arm(True, "some", False, False),     # anchors real, the rest raw world model
    "debias_only": Arm(True, "some", True, False),
    "denoise_only": Arm(True, "some", False, True),
    "wmrl": Arm(True, "some", True, True),            # both corrections
}


# --------------------------------------------------------------------------- seeds

def seed_for(*parts: int) -> int:
    """A 31-bit seed derived from integers (stable across runs and processes)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] >> 1)


class SeedStream(enum.IntEnum):
    """The random streams of one step: `seed_for(run seed, step, stream)` (`step_seed`).

    The values are part of a run's identity: changing one changes every
    run's numbers (and breaks exact resume of a run started before).
    """

    ANCHORS = 1        # which groups run for real this step
    WM_FEEDBACK = 2    # world-model predictions shown to the agent between turns
    ROLLOUTS = 3       # the policy's sampling
    WM_SCORING = 4     # world-model rewards of the final programs


# The held-out evaluation's stream: `seed_for(run seed, HELD_OUT)`, no step. Far above any step count, so
# it never meets the task cursor's `seed_for(run seed, epoch)`. Before and after training use the same
# seed: both policies meet the same sampling noise.
HELD_OUT = 1 << 20


def step_seed(seed: int, step: int, stream: SeedStream) -> int:
    """The seed of `stream` at `step` of the run seeded `seed`."""
    return seed_for(seed, step, stream)


def eval_seed(seed: int) -> int:
    """The held-out evaluation's sampling seed for the run seeded `seed` (`launch/eval.py`'s default too)."""
    return seed_for(seed, HELD_OUT)


# --------------------------------------------------------------------------- tasks

def load_tasks(config, split: str) -> list:
    """The tasks of `split` for `config.benchmark`, loaded (and so validated) before any compute."""
    root = config.data_dir or None
    if config.benchmark == "embedded":
        paths = suite.list_tasks(split, root)
    else:
        base = pathlib.Path(config.data_dir)
        if not base.is_dir():
            raise FileNotFoundError(f"data_dir {base}: not a folder (expected one task folder per competition)")
        split_dir = base / split if (base / split).is_dir() else base
        paths = sorted(p for p in split_dir.iterdir() if p.is_dir())
    if not paths:
        raise ValueError(f"data_dir {config.data_dir or '(embedded suite)'}: no tasks for split {split!r}")
    return [sandbox.load_task(p) for p in paths]


class TaskCursor:
    """Draws tasks epoch by epoch in a seeded order; `position` (tasks drawn so far) is all its state."""

    def __init__(self, n_tasks: int, seed: int, position: int = 0):
        self.n, self.seed, self.position = n_tasks, seed, position

    def take(self, count: int) -> list[int]:
        out = []
        for p in range(self.position, self.position + count):
            epoch, offset = divmod(p, self.n)
            out.append(int(np.random.default_rng(seed_for(self.seed, epoch)).permutation(self.n)[offset]))
        self.position += count
        return out


# --------------------------------------------------------------------------- cost

@dataclasses.dataclass
class Counters:
    """Cumulative cost of the run (checkpointed with it)."""

    real_executions: int = 0
    sandbox_cpu_s: float = 0.0
    wm_predictions: int = 0
    tokens_generated: int = 0
    ungraded_real: int = 0
    ungraded_wm: int = 0
    rollouts: int = 0
    compute_cpu_s: float = 0.0   # this process's CPU time in steps: the "accelerator" on CPU (sandboxes excluded)


# --------------------------------------------------------------------------- checkpoint

def correction_state(rewards, arm: Arm):
    """The correction state of `config.rewards` for `arm` (its debias / denoise switches)."""
    return corrections.init_correction_state(
        cap=rewards.cap, bins=rewards.bins, min_pairs=rewards.min_pairs, refit_every=rewards.refit_every,
        half_life=rewards.half_life, warmup=rewards.warmup, w_max=rewards.w_max,
        target_weight=rewards.target_weight, debias=arm.debias, denoise=arm.denoise)


def checkpoint_tree(train_state, correction, rng) -> dict:
    """The arrays a checkpoint holds: train state (params, optimizer), correction state, the base PRNG key data."""
    return {"train": train_state, "corrections": correction, "rng": rng}


def abstract_checkpoint_tree(config, params) -> Any:
    """`checkpoint_tree`'s shapes and dtypes for a run of `config` on base `params` (nothing allocated).

    What `Checkpointer.latest` restores into when only the checkpoint is wanted
    (`evaluate.load_policy`). The correction flags do not change shapes, so
    every arm's checkpoint has this structure.
    """
    optimizer = update.make_optimizer(config.optim)
    return jax.eval_shape(lambda p: checkpoint_tree(
        update.init_train_state(jax.tree.map(jnp.copy, p), optimizer, param_dtype=config.optim.param_dtype),
        correction_state(config.rewards, MODES["wmrl"]),
        jax.random.key_data(jax.random.key(0))), params)


# --------------------------------------------------------------------------- shapes and pools

def batch_width(config, prompt_tokens: int) -> int:
    """A fixed [B, T] width for the whole run (one compiled update): the longest possible episode, in 256s."""
    a = config.agent
    longest = prompt_tokens + a.max_turns * a.max_new_tokens + (a.max_turns - 1) * (a.observation_max_tokens + 64)
    return -(-longest // 256) * 256


def shared_prompt_widths(config, prompt_tokens: int) -> tuple[int, int]:
    """(P, T) of the update's batch when a group's rows share their prompt (`optim.share_prompt`), in 32s.

    P holds the longest prompt; T the longest continuation: per turn the reply
    (max_new_tokens, + the end-of-turn token the agent closes a cut reply
    with), and between turns the observation and its template (64). Fixed
    for the run: one compiled update.
    """
    a = config.agent
    longest = a.max_turns * (a.max_new_tokens + 1) + (a.max_turns - 1) * (a.observation_max_tokens + 64)
    return -(-prompt_tokens // 32) * 32, -(-longest // 32) * 32


def make_sandbox_pool(config):
    """The sandbox pool `config.sandbox` asks for (backend "local" or "ray"), on this process."""
    s = config.sandbox
    return sandbox.make_pool(s.get("backend", "local"), ray_address=s.get("ray_address", ""), workers=s.workers,
                             timeout_s=s.timeout_s, memory_mb=s.memory_mb, cpus=s.cpus)


__all__ = ["Arm", "Counters", "HELD_OUT", "MODES", "SeedStream", "TaskCursor", "abstract_checkpoint_tree",
           "batch_width", "checkpoint_tree", "correction_state", "eval_seed", "load_tasks", "make_sandbox_pool",
           "seed_for", "shared_prompt_widths", "step_seed"]
