"""Checks and conversions of a run config (the `get_config()` of `configs/*.py`).

`validate(config)` runs before any compute: every error names the field
(`config.rewards.mode`, ...), what it holds and what was expected, so a typo
in a 3200-step run fails in a second, not after an hour of sampling.
"""

from __future__ import annotations

import dataclasses

import math
import pathlib

import jax

from sandbox.backends import BACKENDS
from sandbox.ray_pool import import_ray   # Ray itself is imported only when called (an optional extra)
from wmrl_jax import micro_world
from wmrl_jax.agent import AgentConfig
from wmrl_jax.models.attention import IMPLEMENTATIONS
from wmrl_jax.train.rollout import rollout_mesh_shape
from wmrl_jax.train.run import MODES
from wmrl_jax.world_model import WorldModelConfig

MODEL_PRESETS = ("micro", "qwen3.5-4b", "qwen3.5-9b")
BENCHMARKS = ("embedded", "mle_dojo", "dsbench")
DTYPES = ("float32", "bfloat16")
MESH_AXES = ("data", "fsdp", "tensor")
REMAT_POLICIES = ("dots", "full")   # the keys of models.family.REMAT_POLICIES (tests/test_train_update.py checks)


def _fail(field: str, value, expected: str):
    raise ValueError(f"config.{field}: {value!r}, expected {expected}")


def _int(config, field: str, lowest: int) -> int:
    value = _get(config, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        _fail(field, value, f"an int >= {lowest}")
    return value


def _number(config, field: str, lowest: float, highest: float = math.inf, *, strict: bool = False) -> float:
    value = _get(config, field)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > lowest if strict else value >= lowest) and value <= highest
    if not ok:
        _fail(field, value, f"a number {'>' if strict else '>='} {lowest}" + (f" and <= {highest}" if highest < math.inf
                                                                            else ""))
    return float(value)


def _get(config, field: str):
    value = config
    for part in field.split("."):
        if part not in value:
            raise ValueError(f"config.{field}: missing (every configs/*.py builds on configs/base.py)")
        value = value[part]
    return value


def remat_policy(value) -> str | None:
    """`optim.remat` as a layer remat policy: "none" (or False) -> None, "full" (or True), "dots"."""
    if isinstance(value, bool):
        return "full" if value else None
    if value == "none":
        return None
    if value not in REMAT_POLICIES:
        _fail("optim.remat", value, f"'none', {', '.join(repr(p) for p in REMAT_POLICIES)} (or True / False)")
    return value


def resolve_mesh(mesh, device_count: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes for `device_count` devices; one axis may be -1 ("the rest of the devices")."""
    sizes = [mesh[k] for k in MESH_AXES]
    if sum(s == -1 for s in sizes) > 1 or any(not isinstance(s, int) or (s < 1 and s != -1) for s in sizes):
        _fail("mesh", dict(zip(MESH_AXES, sizes)), "positive sizes for data, fsdp, tensor, at most one of them -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if device_count % known:
            _fail("mesh", dict(zip(MESH_AXES, sizes)), f"sizes whose product divides the {device_count} devices")
        sizes[sizes.index(-1)] = device_count // known
    if math.prod(sizes) != device_count:
        _fail("mesh", dict(zip(MESH_AXES, sizes)), f"sizes whose product is the {device_count} devices")
    return tuple(sizes)


def _sandbox_backend(config) -> None:
    """sandbox.backend is a known backend; 'ray' needs Ray importable; an address only goes with 'ray'."""
    backend, address = _get(config, "sandbox.backend"), _get(config, "sandbox.ray_address")
    if backend not in BACKENDS:
        _fail("sandbox.backend", backend, f"one of {BACKENDS}")
    if not isinstance(address, str):
        _fail("sandbox.ray_address", address, "a string ('' = RAY_ADDRESS or a local Ray, 'auto', 'host:port')")
    if address and backend != "ray":
        _fail("sandbox.ray_address", address, f"'' with sandbox.backend {backend!r} (an address is for 'ray')")
    if backend == "ray":
        try:
            import_ray()
        except ImportError as exc:
            _fail("sandbox.backend", backend, f"Ray installed ({exc})")


def model_folder(config) -> pathlib.Path:
    """The run's checkpoint folder: `config.model_path`, or the shipped micro-world when it is ''."""
    return pathlib.Path(config.model_path) if config.model_path else micro_world.shipped_path()


def agent_config(config):
    """The `agent.AgentConfig` of a run config (the sandbox timeout is stated in the agent's prompt)."""
    # Every field the run config sets, as for the world model; the timeout is the sandbox's, not the agent's.
    a = config.agent
    fields = {f.name: a[f.name] for f in dataclasses.fields(AgentConfig) if f.name in a and f.name != "timeout_s"}
    return AgentConfig(**fields, timeout_s=float(config.sandbox.timeout_s))


def world_model_config(config):
    """The `world_model.WorldModelConfig` of a run config."""
    # Every field the run config sets (a field listed by hand here once dropped `readout` silently).
    w = config.world_model
    return WorldModelConfig(**{f.name: w[f.name] for f in dataclasses.fields(WorldModelConfig) if f.name in w})


def validate(config, *, device_count: int | None = None) -> None:
    """Raises ValueError naming the first field of `config` that cannot run.

    Checks: names (mode, preset, benchmark, dtype, sandbox backend), that model_path and
    data_dir are folders (an empty one means the shipped micro-world / the
    embedded suite and is only valid with them), counts and ranges, and that
    the batch of groups_per_step × group_size sequences splits into
    `optim.micro_batches` slices each divisible by the mesh's data × fsdp
    size (`device_count` defaults to `jax.device_count()`).
    """
    for field, names in (("rewards.mode", tuple(MODES)), ("model_preset", MODEL_PRESETS),
                         ("benchmark", BENCHMARKS), ("dtype", DTYPES)):
        if _get(config, field) not in names:
            _fail(field, _get(config, field), f"one of {names}")

    if config.model_path:
        model_path = pathlib.Path(config.model_path)
        if not (model_path / "config.json").is_file():
            _fail("model_path", config.model_path, "an HF checkpoint folder (with config.json)")
    elif config.model_preset != "micro":
        _fail("model_path", "", f"the {config.model_preset} checkpoint folder ('' means the shipped micro-world, "
                                f"model_preset 'micro')")
    else:
        if not (model_folder(config) / "config.json").is_file():
            _fail("model_path", "", f"a built micro-world at {model_folder(config)} "
                                    f"(python launch/build_micro_world.py), or an HF checkpoint folder")
    if config.data_dir:
        if not pathlib.Path(config.data_dir).is_dir():
            _fail("data_dir", config.data_dir, "an existing folder of tasks")
    elif config.benchmark != "embedded":
        _fail("data_dir", "", f"the {config.benchmark} task folder ('' means the embedded suite, benchmark "
                              f"'embedded')")
    for field in ("train_split", "workdir"):
        if not isinstance(_get(config, field), str) or not _get(config, field):
            _fail(field, _get(config, field), "a non-empty string")

    steps = _int(config, "steps", 1)
    _int(config, "eval_every", 0)
    _int(config, "eval_sampling_seed", -1)
    if not isinstance(config.get("eval_train_tasks", False), bool):
        _fail("eval_train_tasks", config.eval_train_tasks, "True or False")
    groups = _int(config, "rollout.groups_per_step", 1)
    group_size = _int(config, "rollout.group_size", 2)   # a group of 1 has no baseline: every advantage is 0
    for field in ("max_turns", "max_new_tokens", "observation_max_tokens", "overview_chars", "inventory_chars"):
        _int(config, f"agent.{field}", 1)
    for field in ("overview_chars", "inventory_chars", "code_chars", "max_new_tokens", "num_samples"):
        _int(config, f"world_model.{field}", 1)
    for part in ("agent", "world_model"):
        _number(config, f"{part}.temperature", 0.0, strict=True)
        _number(config, f"{part}.top_p", 0.0, 1.0, strict=True)
        _int(config, f"{part}.top_k", 0)

    _number(config, "rewards.anchor_fraction", 0.0, 1.0)
    min_anchors = _int(config, "rewards.min_anchors", 0)
    if min_anchors > groups:
        _fail("rewards.min_anchors", min_anchors, f"<= rollout.groups_per_step = {groups}")
    cap = _int(config, "rewards.cap", 1)
    _int(config, "rewards.bins", 2)
    min_pairs = _int(config, "rewards.min_pairs", 2)
    if min_pairs > cap:
        _fail("rewards.min_pairs", min_pairs, f"<= rewards.cap = {cap} (the buffer could never hold enough)")
    _int(config, "rewards.refit_every", 1)
    _number(config, "rewards.half_life", 0.0, strict=True)
    _int(config, "rewards.warmup", 1)
    w_max = _number(config, "rewards.w_max", 1.0)
    _number(config, "rewards.target_weight", 1.0, w_max)

    _int(config, "sandbox.workers", 1)
    _number(config, "sandbox.timeout_s", 0.0, strict=True)
    _int(config, "sandbox.memory_mb", 64)
    _int(config, "sandbox.cpus", 1)
    _sandbox_backend(config)

    _number(config, "optim.learning_rate", 0.0, strict=True)
    total = _int(config, "optim.total_steps", 1)
    if total < steps:
        _fail("optim.total_steps", total, f">= steps = {steps}")
    warmup = _int(config, "optim.warmup_steps", 0)
    if warmup > total:
        _fail("optim.warmup_steps", warmup, f"<= optim.total_steps = {total}")
    _number(config, "optim.weight_decay", 0.0)
    _number(config, "optim.b1", 0.0, 1.0)
    _number(config, "optim.b2", 0.0, 1.0)
    _number(config, "optim.grad_clip", 0.0, strict=True)
    for field in ("kl_coef", "entropy_coef", "clip_eps"):
        _number(config, f"optim.{field}", 0.0)
    micro = _int(config, "optim.micro_batches", 1)
    remat_policy(_get(config, "optim.remat"))
    _int(config, "checkpoint.every", 1)
    _int(config, "checkpoint.max_to_keep", 1)
    _int(config, "log.every", 1)
    _int(config, "log.text_samples", 0)

    if device_count is None:
        device_count = jax.device_count()
    data, fsdp, _ = resolve_mesh(config.mesh, device_count)
    rollout_mesh_shape(config.rollout, device_count)   # rollout.layout and rollout.tensor (train.rollout)
    if config.get("attention", "auto") not in IMPLEMENTATIONS:
        _fail("attention", config.attention, f"one of {IMPLEMENTATIONS}")
    batch = groups * group_size
    if batch % micro:
        _fail("optim.micro_batches", micro, f"a divisor of the batch of {groups} x {group_size} = {batch} sequences")
    if (batch // micro) % (data * fsdp):
        _fail("optim.micro_batches", micro, f"micro-batches of {batch} / {micro} = {batch // micro} sequences "
                                            f"divisible by the mesh's data x fsdp = {data} x {fsdp}")
    share = config.optim.get("share_prompt", "auto")
    if share not in SHARE_PROMPT:
        _fail("optim.share_prompt", share, f"one of {SHARE_PROMPT}")
    if share == "always" and not _whole_groups(groups, micro, data * fsdp):
        _fail("optim.share_prompt", share, f"'auto' or 'never': with it each micro-batch, and each of its data x fsdp "
                                           f"= {data * fsdp} shards, holds whole groups; groups_per_step / "
                                           f"micro_batches = {groups} / {micro} does not split so")


# optim.share_prompt: "auto" shares where micro-batches and data shards hold whole groups.
SHARE_PROMPT = ("auto", "always", "never")


def _whole_groups(groups: int, micro_batches: int, shards: int) -> bool:
    return groups % micro_batches == 0 and (groups // micro_batches) % shards == 0


def shares_prompt(config, device_count: int | None = None) -> bool:
    """Whether the update runs each group's prompt once (`optim.share_prompt`; "auto": when each
    micro-batch, and each data shard of it, can hold whole groups -- not the paper's 8 GPUs, whose
    32 micro-batches of 2 rows split every group of 8)."""
    share = config.optim.get("share_prompt", "auto")
    if share != "auto":
        return share == "always"
    if device_count is None:
        device_count = jax.device_count()
    data, fsdp, _ = resolve_mesh(config.mesh, device_count) if device_count > 1 else (1, 1, 1)
    return _whole_groups(config.rollout.groups_per_step, config.optim.micro_batches, data * fsdp)
