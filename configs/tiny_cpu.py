"""The embedded default: the shipped micro-world model on the embedded task suite, on CPU.

    python launch/train.py --config=configs/tiny_cpu.py

Cost: ~4-6 min on 2 CPU cores (356 s with a micro-world build beside it; held-out avg@4 64.75 % -> 61.13 %,
one of 16 programs after training a runtime error; docs/results.md):
12 steps of 4 tasks x 4 rollouts with a 4.0M-parameter
Qwen3.5-style model, 1 group a step run for real in 2 sandboxes, avg@4 on the 4 held-out tasks
before and after. Every WMRL mechanism runs: real anchors, world-model rewards,
isotonic refits, the inverse-variance weight, checkpoints. Ablation arms:
--config.rewards.mode=real|wm_only|naive_mix|debias_only|denoise_only.
"""

from configs import base
from wmrl_jax.micro_world import MicroWorldConfig


def get_config():
    micro = MicroWorldConfig()   # the prompt caps and sampling the micro-world model was trained with
    c = base.get_base_config()
    c.model_path = ""            # the shipped micro-world checkpoint
    c.model_preset = "micro"
    c.dtype = "float32"          # CPU: bf16 is emulated and slower
    c.data_dir = ""              # the embedded suite (12 train, 4 test tasks)
    c.benchmark = "embedded"
    c.eval_attempts = 4          # avg@4: half the paper's 8 attempts keeps the two evaluations ~2 minutes
    c.workdir = "/tmp/wmrl/tiny_cpu"
    c.steps = 12                 # enough for several isotonic refits and the anchor weight to switch on

    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 1, 1
    c.rollout.groups_per_step = 4   # 4 tasks x 4 rollouts: 16 sequences of ~1k tokens a step
    c.rollout.group_size = 4
    c.agent.update(base.agent_fields(micro.agent))
    c.world_model.update(base.world_model_fields(micro.world_model))

    # 1 of 4 groups runs for real (the paper's 25 %), so 4 (WM, real) pairs a step: the debiaser and the
    # inverse-variance weight must start within a few steps, not after the paper's 200 pairs / 32 groups.
    c.rewards.min_anchors = 1
    c.rewards.min_pairs = 16
    c.rewards.refit_every = 8
    c.rewards.warmup = 4
    c.rewards.half_life = 8.0

    c.sandbox.workers = 2        # the 2 cores
    c.sandbox.timeout_s = micro.agent.timeout_s   # what the micro-world's prompts tell the agent
    c.sandbox.memory_mb = 2048   # the embedded tasks are small tabular data sets
    c.sandbox.cpus = 1

    # A 4M-parameter model moves measurably in 12 steps only at a much higher rate than 1e-6 (tuned
    # for 4-9B): Adam steps each weight by ~lr, so 2e-5 x 12 is ~1 % of a typical 0.02 weight. Not higher
    # (measured on the first micro-world): at 5e-5 the 12 steps raised the probability that it starts a
    # boilerplate line with a line number ("19 | X_test = ..." -- its world model's code listing format)
    # from 0.055 to 0.91 on star98_math, and held-out avg@4 fell 0.53 -> 0.31; at 2e-5 it went 0.53 -> 0.55
    # (kl_coef 0.2 at 5e-5: 0.34). The shipped micro-world's listing puts line numbers in trailing comments,
    # where no line of the agent's starts; at 2e-5 its held-out avg@4 went 0.499 -> 0.568, 16/16 valid.
    c.optim.learning_rate = 2e-5
    c.optim.warmup_steps = 2
    c.optim.micro_batches = 1    # 16 x ~1k tokens of a 256-wide model fit in memory at once
    c.optim.param_dtype = "float32"
    c.checkpoint.every = 4
    c.checkpoint.max_to_keep = 2
    return c
