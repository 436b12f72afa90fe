"""The paper's WMRL hyper-parameters, shared by every config (docs/design.md, "Paper hyper-parameters").

Not a run on its own: `configs/mle_dojo_9b.py` and the others build on
`get_base_config()` and set the model, the benchmark and the batch layout.
Fields read by `wmrl_jax.train.loop.train`; checked by
`wmrl_jax.train.config.validate` before any compute.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from wmrl_jax.agent import AgentConfig
from wmrl_jax.world_model import WorldModelConfig

# The paper's agent and world-model prompt caps and sampling are the dataclasses' defaults
# (<= 4 turns, 4096 new tokens a turn, observations <= 1024 tokens; WM T=0.7, top-p 0.8, top-k 20, <= 1024 tokens).
_AGENT_FIELDS = ("max_turns", "max_new_tokens", "observation_max_tokens", "overview_chars", "inventory_chars",
                 "temperature", "top_p", "top_k")
_WORLD_MODEL_FIELDS = ("overview_chars", "inventory_chars", "code_chars", "max_new_tokens", "temperature", "top_p",
                       "top_k", "num_samples", "design", "listing", "inventory", "readout")


def agent_fields(agent: AgentConfig) -> dict:
    return {k: getattr(agent, k) for k in _AGENT_FIELDS}


def world_model_fields(world_model: WorldModelConfig) -> dict:
    return {k: getattr(world_model, k) for k in _WORLD_MODEL_FIELDS}


def get_base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model_path = ""             # HF checkpoint folder; '' = the shipped micro-world
    c.model_preset = "micro"      # 'micro' | 'qwen3.5-4b' | 'qwen3.5-9b' (the parameter-count check)
    c.dtype = "bfloat16"
    c.attention = "auto"          # 'auto' (cuDNN flash attention on a GPU where it applies, else blocked) | 'blocked' | 'cudnn' | 'xla'
    c.data_dir = ""               # task root; '' = the embedded suite
    c.benchmark = "embedded"      # 'embedded' | 'mle_dojo' | 'dsbench'
    c.train_split = "train"
    c.eval_split = "test"
    c.eval_attempts = 8           # the paper's avg@8 on held-out tasks, before and after training
    c.eval_every = 0              # > 0: also every this many steps, a learning curve (<workdir>/curve.jsonl)
    c.eval_train_tasks = False    # the curve's points also score the policy on the train tasks
    c.eval_sampling_seed = -1     # the evaluations' sampling seed; -1: derived from `seed` (run.eval_seed)
    c.workdir = "/tmp/wmrl"
    c.seed = 0
    c.steps = 3200                # paper: 3200 GRPO steps

    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # -1: the rest of the devices
    c.rollout = ml_collections.ConfigDict(dict(
        groups_per_step=8,        # paper: 8 tasks x 8 rollouts
        group_size=8,
        # Where generation (agent and world model) reads its weights (wmrl_jax/train/rollout.py): "rollout" = a
        # bf16 copy resharded from the masters once a step, whole inside groups of `tensor` devices
        # (tensor-parallel within a group, 1 = replicated) with the batch's rows over the groups; the frozen
        # copy lives there. "train" = the training mesh (every layer's weights all-gathered for every token).
        layout="rollout",
        tensor=1,                 # launch/plan.py chooses it for a config (the paper configs set its choice)
    ))
    c.agent = ml_collections.ConfigDict(agent_fields(AgentConfig()))
    c.world_model = ml_collections.ConfigDict(world_model_fields(WorldModelConfig()))

    c.rewards = ml_collections.ConfigDict(dict(
        mode="wmrl",              # 'real' | 'wm_only' | 'naive_mix' | 'debias_only' | 'denoise_only' | 'wmrl'
        anchor_fraction=0.25,     # paper: 2 of 8 groups a step run for real
        min_anchors=2,
        cap=5000,                 # debiaser: FIFO of the newest (WM, real) pairs -- the "recent window"
        bins=10,                  # isotonic map over 10 equal-width bins of [0, 1]
        min_pairs=200,            # no map before 200 pairs (identity until then)
        refit_every=64,           # refit after 64 new pairs
        half_life=64.0,           # EWMA of the anchor-group disagreement, in groups
        warmup=32,                # groups observed before the inverse-variance constant is fixed
        w_max=4.0,                # anchor weight clipped to [1, 4]
        target_weight=2.0,        # the weight at the warm-up disagreement level
    ))
    c.sandbox = ml_collections.ConfigDict(dict(
        workers=16,               # concurrent sandboxes: 16 anchor rollouts a step (2 groups x 8) run at once
        timeout_s=600.0,          # paper: sandbox cap 600 s
        memory_mb=16384,          # Kaggle-sized tabular data in pandas
        cpus=4,
        backend="local",          # 'local': sandboxes on this machine; 'ray': Ray tasks on a cluster's CPU nodes
        ray_address="",           # backend 'ray': '' = RAY_ADDRESS or a new local Ray, 'auto' = the cluster this
                                  # machine joined (`ray start`), or 'host:6379' / 'ray://host:10001'
    ))
    c.optim = ml_collections.ConfigDict(dict(
        learning_rate=1e-6,       # paper
        warmup_steps=0,           # not stated in the paper; verl (its trainer) defaults to none
        total_steps=c.get_ref("steps"),   # follows --config.steps
        weight_decay=0.01,        # not stated; torch AdamW's / verl's default
        b1=0.9,
        b2=0.999,
        grad_clip=1.0,            # global-norm clip, verl's default
        kl_coef=0.04,             # paper: k3 KL to the frozen reference
        entropy_coef=0.002,       # paper
        clip_eps=0.2,             # PPO clip (inactive on-policy: one update per batch, ratio 1)
        micro_batches=1,
        remat="full",             # layer remat: "full" (recompute each layer), "dots" (keep matmul outputs), "none"
        share_prompt="auto",      # a group's prompt runs once in the update, not once per rollout ("auto" where
                                  # micro-batches and data shards hold whole groups, "always", "never")
        param_dtype="float32",    # float32 master weights: a 1e-6 Adam step is below bf16's resolution
    ))
    c.checkpoint = ml_collections.ConfigDict(dict(every=50, max_to_keep=3))
    c.log = ml_collections.ConfigDict(dict(every=1, text_samples=2))
    return c


def get_paper_config(preset: str, benchmark: str) -> ml_collections.ConfigDict:
    """The paper's run of `preset` ('qwen3.5-4b' | 'qwen3.5-9b') on `benchmark` ('mle_dojo' | 'dsbench'), 8 GPUs."""
    c = get_base_config()
    size = preset.split("-")[-1].upper()
    c.model_path = f"/path/to/Qwen3.5-{size}"          # placeholder: --config.model_path=... (validate refuses it)
    c.model_preset = preset
    c.dtype = "bfloat16"
    c.benchmark = benchmark
    c.data_dir = f"/path/to/{benchmark.replace('_', '-')}"  # placeholder: --config.data_dir=...
    c.workdir = f"/tmp/wmrl/{benchmark}_{size.lower()}"
    # f32 master weights + Adam moments are 12 bytes a parameter (108 GB for 9B, 48 GB for 4B), more than
    # one 80 GB A100 holds next to activations, so they are sharded over fsdp x tensor = 8 GPUs. 64 sequences
    # of up to 4 turns x (4096 reply + 1024 observation) tokens + a ~3k-token prompt: ~23k tokens each. At
    # fsdp 8 (one sequence a GPU at a time) the update's activations do not fit next to the state
    # (`launch/plan.py`: 86 GiB a device for 4B, 112 GiB for 9B); the tensor axis shards them by heads and
    # MLP columns, so the planner's fitting layouts are the defaults: one sequence per fsdp shard at a time
    # (micro-batches of 64 / micro = fsdp sequences). More GPUs add data-parallel replicas (data=-1).
    fsdp, tensor = {"4B": (4, 2), "9B": (2, 4)}[size]
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, fsdp, tensor
    c.optim.micro_batches = 64 // fsdp   # 4B: 16, 9B: 32
    c.rollout.tensor = 4                 # launch/plan.py's choice for both sizes on 8 devices (docs/scaling.md)
    return c
