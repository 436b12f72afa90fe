"""Plans a run before renting accelerators: per-device memory and FLOPs, by compiling the real programs.

`plan(config, devices)` builds abstract inputs (`jax.ShapeDtypeStruct`s with
the shardings the training loop gives them; no weight is allocated) and
lowers and compiles, for the config's model shapes, batch and mesh:

* the jitted GRPO update (`train.update.make_train_step`, exactly as
  `train.loop.start_run` builds it: float32 masters, bf16 compute, the config's
  micro-batches and remat, the frozen reference as the second argument, a
  batch [B, T] of the loop's fixed width `run.batch_width`);
* the agent's sampler (`sampling.sample`, the program `sampling.generate`
  jits) for the last, longest turn: B rows, the conversation so far bucketed
  to a power of two as `generate` does, `agent.max_new_tokens` new tokens
  into the KV cache -- with the policy's bf16 copy as its params;
* the world model's sampler (the same program over the frozen copy: one row
  per rollout × num_samples, the WM prompt, `world_model.max_new_tokens`).

From each compiled program it reads XLA's memory analysis (arguments,
outputs, aliased, temporaries; bytes per device) and cost analysis, and from
each traced program it counts matmul FLOPs on the jaxpr (`matmul_flops`).
The loop runs the three one after another on the same devices, with the
train state and the frozen copy resident throughout and (when masters are
float32) the policy's bf16 copy alive while the agent samples (the world
model's calls between turns included); the loop deletes it before the
update. The peak of a phase is what is resident in it plus that program's
own outputs and temporaries (`Plan.phases`).

What the two FLOP counts are (measured, `tests/test_plan.py`):

* XLA's `cost_analysis()["flops"]` is PER DEVICE (the SPMD-partitioned
  module) and counts the body of every loop ONCE: a `lax.scan` of length 4
  reports what one of length 1 does. The update scans over layers,
  micro-batches, log-prob chunks and delta-rule chunks, so it undercounts
  by orders of magnitude; it is printed for reference only.
* `matmul_flops(jaxpr)` counts every `dot_general` (2·m·n·k) of the traced,
  unpartitioned program (the backward and remat recomputation included),
  multiplying scan bodies by their length: the GLOBAL matmul FLOPs of one
  step. Elementwise work is left out (a few percent).

Memory caveats: the figures are XLA:CPU's buffer assignment of the same
partitioned program; XLA:GPU fuses differently, so its temporaries differ
(see docs/design.md, "Planning a run", for a measured comparison). Leave
headroom, and note that JAX on GPU takes 75 % of HBM unless
XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise (`mem_fraction`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pathlib
import re
import time
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from wmrl_jax import agent, sampling, world_model
from wmrl_jax.models import get_family, make_mesh, qwen35
from wmrl_jax.models.sharding import tree_shardings
from wmrl_jax.sampling import bucket_size
from wmrl_jax.train import rollout, update
from wmrl_jax.train.config import agent_config, model_folder, remat_policy, resolve_mesh, shares_prompt, world_model_config
from wmrl_jax.train.run import batch_width, shared_prompt_widths

GIB = 2**30  # HBM sizes as nvidia-smi counts them: an "80 GB" A100 holds 80 GiB

# The paper's cost figures (arXiv 2608.12564): GPU-hours of the whole 3200-step run on A100s.
PAPER_GPU_HOURS = {"qwen3.5-4b": {"wmrl": 286, "real": 883}, "qwen3.5-9b": {"wmrl": 349, "real": 1174}}
A100_BF16_TFLOPS = 312.0   # dense bf16 peak of the paper's accelerator
A100_HBM_TBPS = 2.04       # A100-80GB HBM2e bandwidth
POLICY_COPY = "policy copy, model dtype (sampling only)"


# --------------------------------------------------------------------------- counting


def _sub_jaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


@dataclasses.dataclass
class FlopCount:
    """Matmul FLOPs of a jaxpr; `while_loops`: loops of unknown trip count (their body counted once)."""

    flops: float = 0.0
    while_loops: int = 0


def matmul_flops(jaxpr) -> FlopCount:
    """Global matmul FLOPs of a (closed) jaxpr: 2·(lhs size)·(rhs free size) per dot_general.

    Scan bodies count `length` times, `cond` its costliest branch, a `while`
    (unknown trip count) its body once and is reported in `while_loops`;
    nested jits, `checkpoint`/remat, custom_jvp/vjp and shard_map bodies are
    entered. Convolutions count 2·(output size)·(kernel size / output features).
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = FlopCount()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            free = math.prod(d for i, d in enumerate(rhs) if i not in rhs_contract and i not in rhs_batch)
            out.flops += 2.0 * math.prod(lhs) * free
            continue
        if name == "conv_general_dilated":
            kernel = eqn.invars[1].aval.shape
            dn = eqn.params["dimension_numbers"]
            out_features = kernel[dn.rhs_spec[0]]
            out.flops += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(kernel) / out_features
            continue
        if name == "cond":
            counts = [matmul_flops(b) for b in eqn.params["branches"]]
            worst = max(counts, key=lambda c: c.flops)
            out.flops += worst.flops
            out.while_loops += worst.while_loops
            continue
        if name == "while":
            body = matmul_flops(eqn.params["body_jaxpr"])
            out.flops += body.flops
            out.while_loops += 1 + body.while_loops
            continue
        times = eqn.params["length"] if name == "scan" else 1
        for sub in (s for v in eqn.params.values() for s in _sub_jaxprs(v)):
            inner = matmul_flops(sub)
            out.flops += times * inner.flops
            out.while_loops += inner.while_loops
    return out


def _hlo_computations(text: str) -> tuple[dict, str]:
    """{computation name: its instruction lines} of an HLO module's text, and the ENTRY computation's name."""
    comps, entry, name = {}, None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if head:
            name = head.group(2)
            comps[name] = []
            if head.group(1):
                entry = name
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    return comps, entry


def _called(line: str) -> list[str]:
    names = re.findall(r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)", line)
    for group in re.findall(r"(?:called_computations|branch_computations)=\{([^}]*)\}", line):
        names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return names


def decode_loop_all_gathers(hlo_text: str, weight_shapes) -> dict:
    """All-gathers inside the decode loop of a compiled sampler's optimised HLO (`compiled.as_text()`).

    The decode loop is the top-level `while` of unknown trip count (the
    prefill's layer scans have a known one); every computation its body and
    condition call is searched. An all-gather is counted as a weight gather
    when its result has the shape of a weight (one layer's slice of a stacked
    parameter, or a whole one), possibly still split along some dims -- the
    activations' gathers (e.g. the logits over a vocabulary split by the
    tensor axis, for top-k) are counted apart. Returns {"loops", "all_gathers",
    "weight_all_gathers", "weight_gather_bytes"}.
    """
    comps, entry = _hlo_computations(hlo_text)
    shapes = set()
    for shape in weight_shapes:
        shapes.add(tuple(shape))
        if len(shape) > 1:
            shapes.add(tuple(shape[1:]))

    def weight_like(dims):
        return any(len(dims) == len(w) and all(d <= x and x % d == 0 for d, x in zip(dims, w)) and
                   math.prod(dims) * 4 >= math.prod(w) for w in shapes)

    loops = [ln for ln in comps.get(entry, []) if " while(" in ln and "known_trip_count" not in ln]
    seen, todo = set(), [n for ln in loops for n in _called(ln)]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for ln in comps[name]:
            todo += _called(ln)
    out = {"loops": len(loops), "all_gathers": 0, "weight_all_gathers": 0, "weight_gather_bytes": 0}
    sizes = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1, "u32": 4}
    for name in seen:
        for ln in comps[name]:
            m = re.search(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", ln)
            if not m:
                continue
            out["all_gathers"] += 1
            dims = tuple(int(d) for d in m.group(2).split(",") if d)
            if weight_like(dims):
                out["weight_all_gathers"] += 1
                out["weight_gather_bytes"] += math.prod(dims) * sizes.get(m.group(1), 4)
    return out


def device_bytes(tree) -> int:
    """Bytes ONE device holds of a tree of ShapeDtypeStructs/arrays (their shardings' shard shapes)."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def _abstract(shapes, shardings=None):
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


# --------------------------------------------------------------------------- the run's shapes


def model_of(config):
    """(family, model config, where it came from) for `config.model_preset` / `config.model_path`.

    The Qwen3.5 presets need no checkpoint (their shapes are `qwen35.PRESETS`);
    'micro' reads the shipped micro-world's (or `model_path`'s) config.json.
    """
    if config.model_preset in qwen35.PRESETS:
        return qwen35, qwen35.PRESETS[config.model_preset], f"qwen35.PRESETS[{config.model_preset!r}]"
    if config.model_preset != "micro":
        raise ValueError(f"config.model_preset: {config.model_preset!r}, expected 'micro' or one of "
                         f"{sorted(qwen35.PRESETS)}")
    folder = model_folder(config)
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config.model_path: {folder} has no config.json (an HF checkpoint folder expected)")
    hf = json.loads(path.read_text())
    family = get_family(hf.get("model_type"))
    return family, family.config_from_hf(hf), str(path)


def estimated_prompt_tokens(config, chars_per_token: float) -> tuple[int, int]:
    """(agent's first prompt, world model's prompt) in tokens, from the prompts' character caps.

    Each is its system prompt plus the capped task overview, data inventory
    (and, for the world model, the solution), at `chars_per_token`, plus 64
    tokens of chat template: an upper estimate for text at the caps. The loop
    itself measures the real prompts with the tokenizer.
    """
    a, w = config.agent, config.world_model
    first = len(agent.system_prompt(agent_config(config))) + a.overview_chars + a.inventory_chars
    wm = len(world_model.WM_SYSTEM_PROMPT) + w.overview_chars + w.inventory_chars + w.code_chars
    return math.ceil(first / chars_per_token) + 64, math.ceil(wm / chars_per_token) + 64


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The token shapes the loop's three programs see (see `shapes_of`)."""

    batch: int                 # B = groups_per_step × group_size sequences
    train_width: int           # T of the update's [B, T] batch (loop.batch_width; shared prompts: what follows them)
    prompt_tokens: int         # the agent's first prompt
    sample_rows: int           # rows of the agent's generate call (B bucketed as generate does)
    sample_prompt: int         # the last turn's prompt, bucketed to a power of two
    sample_new: int            # agent.max_new_tokens
    turns: int
    turn_prompts: tuple        # every turn's bucketed prompt width (for FLOPs)
    wm_rows: int
    wm_prompt: int             # bucketed
    wm_prompt_raw: int         # before bucketing
    wm_new: int
    wm_calls: int              # world-model generate calls a step (between turns and the final scoring)
    groups: int = 0            # G prompts of the update's batch when a group shares its prompt (optim.share_prompt)
    prompt_width: int = 0      # P of those [G, P] prompts (0: not shared)

    @property
    def train_tokens(self) -> int:
        """Token slots the update's backbone runs over (padding included)."""
        return self.groups * self.prompt_width + self.batch * self.train_width


def shapes_of(config, prompt_tokens: int, wm_prompt_tokens: int, batch_shards: int, share_prompt: bool = False) -> Shapes:
    """share_prompt: the update's batch as the loop makes it with `train.config.shares_prompt` true."""
    a, w = config.agent, config.world_model
    batch = config.rollout.groups_per_step * config.rollout.group_size
    # A turn adds the reply (max_new_tokens, + an EOS when cut), the observation and its template (batch_width's 64).
    raw = [prompt_tokens + t * (a.max_new_tokens + a.observation_max_tokens + 64) for t in range(a.max_turns)]
    buckets = tuple(bucket_size(n, 16) for n in raw)
    rows = bucket_size(batch, 1, batch_shards)
    # World-model calls a step: between turns (feedback for the non-anchor rows), then once over every
    # rollout to score it; each call's rows are bucketed by `generate` (48 of 64 rows -> 64).
    calls = a.max_turns if config.rewards.mode != "real" else 0
    wm_rows = bucket_size(batch * w.num_samples, 1, batch_shards)
    groups, (prompt_width, train_width) = 0, (0, batch_width(config, prompt_tokens))
    if share_prompt:
        groups, (prompt_width, train_width) = config.rollout.groups_per_step, shared_prompt_widths(config, prompt_tokens)
    return Shapes(batch=batch, train_width=train_width, groups=groups, prompt_width=prompt_width,
                  prompt_tokens=prompt_tokens,
                  sample_rows=rows, sample_prompt=buckets[-1], sample_new=a.max_new_tokens, turns=a.max_turns,
                  turn_prompts=buckets, wm_rows=wm_rows, wm_prompt=bucket_size(wm_prompt_tokens, 16),
                  wm_prompt_raw=wm_prompt_tokens, wm_new=w.max_new_tokens, wm_calls=calls)


# --------------------------------------------------------------------------- compiling


@dataclasses.dataclass
class Program:
    """One compiled program: XLA's memory analysis (bytes per device) and the FLOP counts."""

    name: str
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    xla_flops: float | None       # cost_analysis: per device, loop bodies once
    jaxpr_flops: float            # matmul_flops: global, scans × length
    while_loops: int
    lower_s: float
    compile_s: float
    decode_gathers: dict | None = None   # a sampler's `decode_loop_all_gathers`


    @property
    def peak(self) -> int:
        """Arguments + outputs (less what aliases a donated argument) + temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    def __repr__(self) -> str:
        return (f"Program({self.name}: args {self.arguments / GIB:.2f} GiB, out {self.outputs / GIB:.2f}, "
                f"temp {self.temporaries / GIB:.2f}, compiled in {self.compile_s:.0f} s)")


def _compile(name: str, traced, weight_shapes=None) -> Program:
    t0 = time.perf_counter()
    lowered = traced.lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    count = matmul_flops(traced.jaxpr)
    gathers = None if weight_shapes is None else decode_loop_all_gathers(compiled.as_text(), weight_shapes)
    return Program(decode_gathers=gathers, name=name, arguments=int(mem.argument_size_in_bytes), outputs=int(mem.output_size_in_bytes),
                   aliased=int(mem.alias_size_in_bytes), temporaries=int(mem.temp_size_in_bytes),
                   xla_flops=None if not cost or "flops" not in cost else float(cost["flops"]),
                   jaxpr_flops=count.flops, while_loops=count.while_loops, lower_s=t1 - t0, compile_s=t2 - t1)


def _mesh_for(config, devices: int):
    if devices == 1:
        return None   # as the loop: one device runs without a mesh
    if jax.device_count() < devices:
        raise ValueError(f"--devices={devices}: JAX sees {jax.device_count()} devices; set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} before importing jax")
    return make_mesh(resolve_mesh(config.mesh, devices), devices=jax.devices()[:devices])


def _param_shapes(family, model_config, dtype, mesh):
    shapes = jax.eval_shape(lambda: family.init_params(model_config, jax.random.key(0), jnp.dtype(dtype)))
    if mesh is None:
        return _abstract(shapes)
    return _abstract(shapes, tree_shardings(mesh, family.param_axes(model_config), shapes))


def abstract_state(config, family, model_config, mesh):
    """(optimizer, TrainState of ShapeDtypeStructs, frozen params) as the loop lays them out.

    The state holds `optim.param_dtype` masters and the optimizer's moments,
    sharded by `update.train_state_shardings`; the frozen reference (which
    is the world model's copy) is in `config.dtype`, sharded like the params.
    """
    optimizer = update.make_optimizer(config.optim)
    ref = _param_shapes(family, model_config, config.dtype, mesh)
    masters = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(config.optim.param_dtype)), ref)
    state = jax.eval_shape(lambda p: update.TrainState(step=jnp.zeros((), jnp.int32), params=p,
                                                       opt_state=optimizer.init(p)), masters)
    if mesh is not None:
        state = _abstract(state, update.train_state_shardings(mesh, family.param_axes(model_config), optimizer,
                                                              masters))
    return optimizer, state, ref


def compile_train(config, family, model_config, mesh, shapes: Shapes, optimizer, state, ref) -> Program:
    """The loop's jitted GRPO update (`update.make_train_step`, built as `loop.train` builds it), compiled."""
    b, t, g, p = shapes.batch, shapes.train_width, shapes.groups, shapes.prompt_width
    batch = update.Batch(tokens=jax.ShapeDtypeStruct((b, t), jnp.int32), valid=jax.ShapeDtypeStruct((b, t), bool),
                         loss_mask=jax.ShapeDtypeStruct((b, t), bool),
                         advantages=jax.ShapeDtypeStruct((b,), jnp.float32),
                         weights=jax.ShapeDtypeStruct((b,), jnp.float32),
                         prompt_tokens=jax.ShapeDtypeStruct((g, p), jnp.int32) if p else None,
                         prompt_valid=jax.ShapeDtypeStruct((g, p), bool) if p else None)
    step = update.make_train_step(family, model_config, optimizer, kl_coef=config.optim.kl_coef,
                                  entropy_coef=config.optim.entropy_coef, clip_eps=config.optim.clip_eps,
                                  micro_batches=config.optim.micro_batches, remat=config.optim.remat, mesh=mesh,
                                  temperature=agent_config(config).temperature, compute_dtype=config.dtype)
    traced = step.trace(state, ref, batch)
    return _context(mesh, lambda: _compile("train", traced))


def _context(mesh, fn):
    if mesh is None:
        return fn()
    with jax.set_mesh(mesh):
        return fn()


def compile_sampler(name, config, family, model_config, mesh, params, rows: int, prompt: int, new: int, *,
                    temperature: float, top_p: float, top_k: int):
    """(Program, KV-cache bytes per device) of `sampling.sample` as `generate` jits it, on GPU/TPU settings.

    `decode_layout=False`: the accelerator path (the CPU-only decode layout
    would hold a second copy of the weights, `sampling.sample`). `mesh` is
    the mesh generation runs on (the rollout layout's, or the training one),
    `params` laid out on it. The Program's `decode_gathers` counts the
    all-gathers inside the compiled decode loop.
    """
    tokens = jax.ShapeDtypeStruct((rows, prompt), jnp.int32)
    valid = jax.ShapeDtypeStruct((rows, prompt), bool)
    active = jax.ShapeDtypeStruct((rows,), bool)
    if mesh is not None:
        axes = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
        row_sharding = NamedSharding(mesh, PartitionSpec(axes))
        tokens, valid, active = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=row_sharding)
                                 for x in (tokens, valid, active))
    key = jax.eval_shape(lambda: jax.random.key(0))
    eos = np.zeros((1,), np.int32)

    def trace():
        # `_sample_jit` is the jitted program `sampling.generate` calls.
        return sampling._sample_jit.trace(params, model_config, family, tokens, valid, key, active=active,
                                          max_new_tokens=new, temperature=temperature, top_p=top_p, top_k=top_k,
                                          eos_ids=eos, pad_id=0, mesh=mesh, decode_layout=False)

    traced = _context(mesh, trace)
    weights = [x.shape for x in jax.tree.leaves(params)]
    program = _context(mesh, lambda: _compile(name, traced, weights))
    dtype = sampling._default_cache_dtype(params)
    cache = jax.eval_shape(lambda: family.init_cache(model_config, rows, prompt + new, dtype))
    if mesh is not None:
        cache = _abstract(cache, sampling._cache_sharding(family, model_config, mesh, cache))
    return program, device_bytes(cache)


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass
class Plan:
    """Per-device memory of each phase of a step, the programs behind it, and FLOPs per step."""

    label: str
    devices: int
    mesh: dict
    micro_batches: int
    remat: bool
    n_params: int
    shapes: Shapes
    resident: dict          # what stays in HBM (all step, or, the policy copy, while sampling): name -> bytes
    kv_cache: dict          # "agent" / "world model": cache bytes per device (inside that sampler's temporaries)
    programs: dict          # name -> Program
    phases: dict            # name -> peak bytes per device
    train_tokens: int
    rollout: dict = dataclasses.field(default_factory=dict)   # layout, tensor, mesh sizes of generation

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    def fits(self, hbm_bytes: float) -> bool:
        return self.peak <= hbm_bytes

    def __repr__(self) -> str:
        return (f"Plan({self.label}: {self.devices} devices, mesh {self.mesh}, micro_batches={self.micro_batches}, "
                f"remat={self.remat}, peak {self.peak / GIB:.1f} GiB/device)")

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["programs"] = {k: {**dataclasses.asdict(v), "peak": v.peak} for k, v in self.programs.items()}
        d["peak"] = self.peak
        return d


def plan(config, devices: int, *, prompt_tokens: int | None = None, wm_prompt_tokens: int | None = None,
         chars_per_token: float = 3.0, programs=("train", "reshard", "sample", "wm"), label: str = "") -> Plan:
    """Compiles the loop's programs for `config` on `devices` devices and adds up each phase's peak memory.

    `programs`: which of "train", "reshard" (masters -> the rollout layout,
    `train.rollout.Resharder`; only with `rollout.layout` "rollout" on
    several devices), "sample" (the agent's sampler), "wm" (the world model's
    sampler) to compile; a phase left out is not in `phases`.
    """
    unknown = set(programs) - {"train", "reshard", "sample", "wm"}
    if unknown:
        raise ValueError(f"programs: unknown {sorted(unknown)}, expected some of train, reshard, sample, wm")
    family, model_config, _ = model_of(config)
    mesh = _mesh_for(config, devices)
    sizes = dict(zip(("data", "fsdp", "tensor"), resolve_mesh(config.mesh, devices)))
    est_prompt, est_wm = estimated_prompt_tokens(config, chars_per_token)
    shards = 1 if mesh is None else sizes["data"] * sizes["fsdp"]
    shapes = shapes_of(config, prompt_tokens or est_prompt, wm_prompt_tokens or est_wm, shards,
                       share_prompt=shares_prompt(config, devices))
    micro = config.optim.micro_batches
    if shapes.batch % micro or (shapes.batch // micro) % shards:
        raise ValueError(f"config.optim.micro_batches: {micro}, expected micro-batches of {shapes.batch} / {micro} "
                         f"sequences divisible by the mesh's data x fsdp = {shards}")
    optimizer, state, ref = abstract_state(config, family, model_config, mesh)
    # Generation's mesh: the rollout layout's (train.rollout), where the frozen copy lives, or the training one.
    gen_mesh = mesh
    rollout_info = {"layout": config.rollout.get("layout", "rollout"), "tensor": config.rollout.get("tensor", 1)}
    if mesh is not None:
        rmesh = rollout.rollout_mesh(config.rollout, jax.devices()[:devices])
        if rmesh is not None:
            gen_mesh = rmesh
            ref = _abstract(ref, rollout.rollout_shardings(rmesh, family, model_config, ref))
        rollout_info["mesh"] = dict(gen_mesh.shape)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(ref))
    resident = {"params (masters)": device_bytes(state.params), "optimizer state": device_bytes(state.opt_state),
                "frozen reference = world model": device_bytes(ref)}
    out: dict[str, Program] = {}
    kv = {}
    if "train" in programs:
        out["train"] = compile_train(config, family, model_config, mesh, shapes, optimizer, state, ref)
    resharded = gen_mesh is not mesh
    policy = ref if config.optim.param_dtype == config.dtype and not resharded else None
    if policy is None:
        # The loop samples with the masters resharded into generation's layout in the model's dtype
        # (`loop.generation_params`): a second copy, alive while the agent samples (and the world model answers
        # between turns); deleted before the update.
        policy = ref if resharded else _param_shapes(family, model_config, config.dtype, mesh)
        resident[POLICY_COPY] = device_bytes(policy)
    if resharded and "reshard" in programs:
        resharder = rollout.Resharder(family, model_config, gen_mesh, jnp.dtype(config.dtype))
        out["reshard"] = _context(mesh, lambda: _compile("reshard", resharder.trace(state.params)))
    if "sample" in programs:
        a = agent_config(config)
        out["sample"], kv["agent"] = compile_sampler("sample", config, family, model_config, gen_mesh, policy,
                                                     shapes.sample_rows, shapes.sample_prompt, shapes.sample_new,
                                                     temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    if "wm" in programs and shapes.wm_calls:
        w = world_model_config(config)
        out["wm"], kv["world model"] = compile_sampler("wm", config, family, model_config, gen_mesh, ref,
                                                       shapes.wm_rows, shapes.wm_prompt, shapes.wm_new,
                                                       temperature=w.temperature, top_p=w.top_p, top_k=w.top_k)
    everything = sum(resident.values())
    phases = {}
    if "train" in out:
        p = out["train"]
        # Its arguments are the state, the frozen copy and the batch; the policy copy is gone (loop.train).
        phases["train"] = p.peak
    if "reshard" in out:
        p = out["reshard"]
        # Its argument is the masters (resident); its output is the policy copy.
        phases["reshard"] = everything - resident[POLICY_COPY] + p.outputs + p.temporaries
    for name in ("sample", "wm"):
        if name in out:
            p = out[name]
            params_in = device_bytes(policy if name == "sample" else ref)
            # Its arguments are params already counted as resident, and a few [rows, prompt] arrays.
            phases[name] = everything + (p.arguments - params_in) + p.outputs - p.aliased + p.temporaries
    return Plan(label=label or config.model_preset, devices=devices, mesh=sizes, micro_batches=micro,
                remat=remat_policy(config.optim.remat) is not None, n_params=n_params, shapes=shapes, resident=resident, kv_cache=kv,
                programs=out, phases=phases, train_tokens=shapes.train_tokens, rollout=rollout_info)


# --------------------------------------------------------------------------- analytic FLOPs and hours


def analytic_flops(config, model_config, n_params: int, shapes: Shapes) -> dict:
    """Model FLOPs of one step (no remat recomputation), by phase: 2·N per token forward, 6·N forward+backward.

    N counts the matmul weights (the embedding table only when it is also
    the LM head); full-attention layers add 2·T²·heads·head_dim per forward
    of a causal sequence of T (QKᵀ and PV, half the square). Sampling counts
    every turn's prefill of the whole conversation (`generate` has no prefix
    cache across turns; widths bucketed as it does) and max_new_tokens
    decode steps a turn over the B rows (an upper bound: rows stop at EOS).
    """
    c = model_config
    n = n_params
    if not getattr(c, "tie_word_embeddings", True):
        n -= c.vocab_size * c.hidden_size   # the embedding lookup is no matmul
    layer_types = getattr(c, "layer_types", None)
    full_layers = sum(t == "full_attention" for t in layer_types) if layer_types else c.num_layers
    per_attn = 2.0 * c.num_heads * c.head_dim * full_layers   # × T² for a causal forward

    def forward(tokens_per_seq, seqs):
        return seqs * (2.0 * n * tokens_per_seq + per_attn * tokens_per_seq**2)

    s = shapes
    if s.prompt_width:   # each group's prompt once; the continuations attend to it as well as to themselves
        one = forward(s.prompt_width, s.groups) + s.batch * (2.0 * n * s.train_width + per_attn * (
            s.train_width**2 + 2 * s.prompt_width * s.train_width))
    else:
        one = forward(s.train_width, s.batch)
    train = 3 * one + one   # policy fwd+bwd, reference fwd
    prefill = sum(forward(p, s.sample_rows) for p in s.turn_prompts)
    # A decode step of one token against a context of L: 2N + 4·L·heads·head_dim per full layer.
    decode = 0.0
    for p in s.turn_prompts:
        mean_ctx = p + s.sample_new / 2
        decode += s.sample_rows * s.sample_new * (2.0 * n + 2 * per_attn * mean_ctx)
    wm = s.wm_calls * (forward(s.wm_prompt, s.wm_rows)
                       + s.wm_rows * s.wm_new * (2.0 * n + 2 * per_attn * (s.wm_prompt + s.wm_new / 2)))
    return {"train": train, "agent prefill": prefill, "agent decode": decode, "world model": wm,
            "6N": 6.0 * n * s.train_tokens, "n_matmul": n}


def gpu_hours(flops_per_step: float, steps: int, mfu: float, peak_tflops: float) -> float:
    """Accelerator-hours of `steps` steps: FLOPs / (peak × MFU), summed over devices (device-seconds / 3600)."""
    return flops_per_step * steps / (peak_tflops * 1e12 * mfu) / 3600


def decode_floor_s(model_config, n_params: int, shapes: Shapes, plan_: Plan, hbm_tbps: float,
                   link_gbps: float) -> dict:
    """Seconds a step's agent decode takes at least on these devices, bandwidth-bound.

    Every decode step reads each device's weights (gathered over fsdp) and
    its KV cache from HBM, and under fsdp all-gathers (fsdp-1)/fsdp of the
    weights over the links; per step the larger of the two bounds the time
    (they can overlap). bf16 weights.
    """
    tensor, fsdp = plan_.mesh["tensor"], plan_.mesh["fsdp"]
    weights = n_params * 2 / tensor
    cache = plan_.kv_cache.get("agent", 0) / 2            # on average half the cache is filled
    hbm = (weights + cache) / (hbm_tbps * 1e12)
    link = (fsdp - 1) / fsdp * weights / (link_gbps * 1e9)
    steps = shapes.turns * shapes.sample_new
    return {"hbm_s": hbm * steps, "link_s": link * steps, "floor_s": max(hbm, link) * steps}


# --------------------------------------------------------------------------- knobs


def knob_candidates(config, devices: int, failing: set) -> list[tuple[str, Any, bool]]:
    """Config changes worth trying, cheapest first, for the phases in `failing`.

    Returns (description, changed config, whether the mesh changed) triples:
    more micro-batches (while B / M stays divisible by data x fsdp) and remat
    for the update; then half the data/fsdp devices moved to the tensor axis,
    which shards activations by heads / MLP width and the KV cache by KV
    heads (with micro-batches raised to keep one sequence a device).
    """
    data, fsdp, tensor = resolve_mesh(config.mesh, devices)
    batch = config.rollout.groups_per_step * config.rollout.group_size
    out = []

    def variant(**changes):
        c = copy.deepcopy(config)
        c.update_from_flattened_dict(changes)  # dotted keys; a locked config still takes existing ones
        return c

    if "train" in failing:
        micro = config.optim.micro_batches
        if batch % (2 * micro) == 0 and (batch // (2 * micro)) % (data * fsdp) == 0:
            out.append((f"optim.micro_batches {micro} -> {2 * micro}", variant(**{"optim.micro_batches": 2 * micro}),
                        False))
        if remat_policy(config.optim.remat) != "full":
            out.append((f"optim.remat {config.optim.remat} -> full", variant(**{"optim.remat": "full"}), False))
    # Trade data/fsdp for tensor parallelism: shards activations (heads, MLP) and the KV cache by heads.
    if fsdp > 1 and fsdp % 2 == 0 or data > 1 and data % 2 == 0:
        new_data, new_fsdp = (data, fsdp // 2) if fsdp > 1 and fsdp % 2 == 0 else (data // 2, fsdp)
        shards = new_data * new_fsdp
        micro = config.optim.micro_batches
        while micro > 1 and (batch % micro or (batch // micro) % shards):
            micro //= 2
        # more micro-batches as the per-step shards shrink: keep one sequence per device at a time
        while batch % (2 * micro) == 0 and (batch // (2 * micro)) % shards == 0 and batch // micro > shards:
            micro *= 2
        out.append((f"mesh data {data}, fsdp {fsdp}, tensor {tensor} -> {new_data}, {new_fsdp}, {tensor * 2}"
                    + (f"; micro_batches -> {micro}" if micro != config.optim.micro_batches else ""),
                    variant(**{"mesh.data": new_data, "mesh.fsdp": new_fsdp, "mesh.tensor": tensor * 2,
                               "optim.micro_batches": micro}), True))
    return out


__all__ = ["FlopCount", "GIB", "PAPER_GPU_HOURS", "Plan", "Program", "Shapes", "analytic_flops", "decode_floor_s",
           "device_bytes", "estimated_prompt_tokens", "gpu_hours", "knob_candidates", "matmul_flops", "model_of",
           "plan", "shapes_of"]
