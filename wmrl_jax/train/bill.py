"""The accelerator bill of a run: hours by phase, each at the larger of its compute time and its bandwidth floor.

`bill(...)` prices one training step's work and multiplies by the steps
(docs/scaling.md, "The bill"). Phases and what each one does a step:

* **update** -- the GRPO update on the [B, T] batch: policy forward + backward
  (6N a token) and the reference's forward (2N), at the padded width T.
  Floor: the fsdp all-gathers of the bf16 weights (forward, and again in the
  backward under per-layer remat) and the gradients' reduce-scatter (f32),
  once per micro-batch; the tensor axis's all-reduces of activations (2 a
  layer a pass: policy forward, remat recompute, backward, reference).
* **reshard** -- the trained masters into the rollout layout (bf16), once a
  step (`train.rollout.Resharder`): each device reads its float32 shard and
  writes and receives its rollout shard.
* **agent prefill** -- every prompt and observation token prefilled once
  (multi-turn cache reuse: turn k+1 prefills only the new observation and
  its template tokens). Compute 2N a token + causal attention against the
  conversation so far.
* **agent decode** -- every generated token, 2N + attention over its
  context. Floor, per decode step (one token for every row): each device
  reads the weights it holds, its rows' KV cache and their delta-rule state
  (read and written); in the "train" layout it also all-gathers the weights
  it does not hold; the tensor group all-reduces twice a layer and gathers
  the logits.
* **world model** -- its calls between turns and the final scoring; the K
  samples of a solution share one prefill of its prompt. Prefill as above,
  decode like the agent's over rows × K.

Each phase costs max(FLOPs / (peak × MFU), floor) per device; hours are
device-seconds / 3600 over every device. The **ideal** bill prices the same
tokens with no overhead: every trained token 6N + 2N (reference) at its real
length (no padding), every prompt and observation token prefilled once,
every generated token and the world model's tokens 2N, causal attention of
each token once, all at the MFU, no bandwidth floor, no reshard.

What this does not model (and so is not in the floors): kernel launch
overheads, the host's work between turns (tokenising, sandboxes), load
imbalance between rows that stop early (every row runs to its cap here).
"""

from __future__ import annotations

import dataclasses
import math

from wmrl_jax.sampling import bucket_size

PHASES = ("update", "reshard", "agent prefill", "agent decode", "world model")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the bill assumes of each accelerator; every field is printed with the bill."""

    peak_tflops: float = 312.0          # dense bf16 peak (A100)
    mfu: float = 0.4                    # model-FLOPs utilisation every phase's compute is priced at
    hbm_tbps: float = 2.04              # HBM bandwidth (A100-80GB)
    link_gbps: float = 300.0            # per-device collective bandwidth, one way (A100 NVLink)
    collective_us: float = 10.0         # latency of one small collective (a decode step's all-reduce)


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """The per-token and per-row quantities of a model that the bill reads."""

    n_matmul: int                # N: matmul weights (the embedding table only when it is the LM head)
    hidden: int
    layers: int
    vocab: int
    attn_flops_per_t2: float     # causal forward over T tokens costs this × T² (QKᵀ and PV, half the square)
    kv_bytes_per_token: int      # bf16 K and V of every full-attention layer
    kv_heads: int
    state_bytes_per_row: int     # f32 delta-rule state + bf16 conv state of every linear-attention layer
    value_heads: int

    @staticmethod
    def of(model_config, n_params: int) -> "ModelCosts":
        c = model_config
        n = n_params
        if not getattr(c, "tie_word_embeddings", True):
            n -= c.vocab_size * c.hidden_size   # the embedding lookup is no matmul
        layer_types = getattr(c, "layer_types", None) or ("full_attention",) * c.num_layers
        full = sum(t == "full_attention" for t in layer_types)
        linear = len(layer_types) - full
        state = 0
        value_heads = 1
        if linear:
            value_heads = c.linear_num_value_heads
            state = linear * (value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
                              + (c.linear_conv_kernel - 1) * c.conv_dim * 2)
        return ModelCosts(n_matmul=n, hidden=c.hidden_size, layers=len(layer_types), vocab=c.vocab_size,
                          attn_flops_per_t2=2.0 * c.num_heads * c.head_dim * full,
                          kv_bytes_per_token=full * 2 * c.num_kv_heads * c.head_dim * 2, kv_heads=c.num_kv_heads,
                          state_bytes_per_row=state, value_heads=value_heads)


@dataclasses.dataclass(frozen=True)
class Workload:
    """The tokens of one step (at the caps unless `reply_tokens` says otherwise)."""

    batch: int              # B sequences
    rows: int               # rows of the agent's generate calls (B bucketed)
    prompt: int             # the agent's first prompt
    turns: int
    reply: int              # tokens generated a turn (every row)
    observation: int        # tokens added between turns: the observation and its template
    train_width: int        # T of the update's batch (padded)
    micro_batches: int
    wm_calls: int           # between turns, then the final scoring
    wm_rows: int            # rows of a world-model call (bucketed), before the K samples
    wm_samples: int         # K
    wm_prompt: int
    wm_new: int
    groups: int = 0         # G shared prompts of the update's batch (optim.share_prompt; 0: not shared)
    prompt_width: int = 0   # their padded width P; train_width is then what follows them

    @property
    def trained_tokens(self) -> int:
        """Tokens of one sequence, unpadded: prompt, replies, observations."""
        return self.prompt + self.turns * self.reply + (self.turns - 1) * self.observation

    def scaled(self, s: float) -> "Workload":
        """The same step with every token count (prompt, replies, observations, the world model's prompt and
        answers) times `s` (at least 1 each); the update's width as `run.batch_width` would make it."""
        def n(x):
            return max(1, round(x * s))

        out = dataclasses.replace(self, prompt=n(self.prompt), reply=n(self.reply), observation=n(self.observation),
                                  wm_prompt=n(self.wm_prompt), wm_new=n(self.wm_new))
        if self.prompt_width:
            after = out.trained_tokens - out.prompt + out.turns
            return dataclasses.replace(out, prompt_width=-(-out.prompt // 32) * 32, train_width=-(-after // 32) * 32)
        return dataclasses.replace(out, train_width=-(-out.trained_tokens // 256) * 256)


def workload_of(config, shapes, batch_shards: int) -> Workload:
    """The step's Workload from a config and the planner's `Shapes` (`train.plan.shapes_of`)."""
    a, w = config.agent, config.world_model
    return Workload(batch=shapes.batch, rows=shapes.sample_rows, prompt=shapes.prompt_tokens, turns=shapes.turns,
                    reply=a.max_new_tokens, observation=a.observation_max_tokens + 64, train_width=shapes.train_width,
                    micro_batches=config.optim.micro_batches, wm_calls=shapes.wm_calls,
                    wm_rows=bucket_size(shapes.batch, 1, batch_shards), wm_samples=w.num_samples,
                    wm_prompt=shapes.wm_prompt_raw, wm_new=w.max_new_tokens, groups=shapes.groups,
                    prompt_width=shapes.prompt_width)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the devices are used. Training: data x fsdp x tensor; generation: `groups` groups of `tensor` devices
    (the rollout layout), or the training mesh itself (`rollout` False)."""

    devices: int
    data: int
    fsdp: int
    tensor: int
    rollout: bool
    rollout_tensor: int

    @property
    def gen_tensor(self) -> int:
        return self.rollout_tensor if self.rollout else self.tensor

    @property
    def gen_groups(self) -> int:
        """Groups the rows are spread over while generating."""
        return self.devices // self.gen_tensor


def _shards(size: int, axis: int) -> int:
    """How many ways `size` heads are split over a tensor axis of `axis` (the rules table: all or nothing)."""
    return axis if size % axis == 0 else 1


def _forward_flops(m: ModelCosts, new: int, context: int) -> float:
    """FLOPs of one row's forward over `new` tokens appended to `context` cached ones (causal)."""
    return 2.0 * m.n_matmul * new + m.attn_flops_per_t2 * (new * context + new * new / 2)


def _decode_step_floor(m: ModelCosts, lay: Layout, rows: int, context: float, hw: Hardware) -> float:
    """Seconds of one decode step (one token for each of `rows`) at least, on every device at once."""
    g, groups = lay.gen_tensor, lay.gen_groups
    rows_here = rows / groups
    weights = 2.0 * m.n_matmul / g
    cache = rows_here * context * m.kv_bytes_per_token / _shards(m.kv_heads, g)
    state = 2.0 * rows_here * m.state_bytes_per_row / _shards(m.value_heads, g)   # read and written
    hbm = (weights + cache + state) / (hw.hbm_tbps * 1e12)
    link_bytes = 0.0
    collectives = 0
    if g > 1:   # 2 all-reduces of [rows, hidden] bf16 a layer, and the logits gathered over the vocabulary
        link_bytes += 2 * m.layers * 2 * (g - 1) / g * rows_here * m.hidden * 2
        link_bytes += (g - 1) / g * rows_here * m.vocab * 4
        collectives += 2 * m.layers + 1
    if not lay.rollout and lay.fsdp > 1:   # the training layout gathers the weights for every token
        link_bytes += (lay.fsdp - 1) / lay.fsdp * 2.0 * m.n_matmul / lay.tensor
        collectives += m.layers
    link = link_bytes / (hw.link_gbps * 1e9)
    return max(hbm, link) + collectives * hw.collective_us * 1e-6


def _phase(flops: float, floor_s: float, devices: int, hw: Hardware) -> dict:
    compute_s = flops / devices / (hw.peak_tflops * 1e12 * hw.mfu)
    return {"flops": flops, "compute_s": compute_s, "floor_s": floor_s, "s": max(compute_s, floor_s),
            "bound": "compute" if compute_s >= floor_s else "bandwidth"}


def step_bill(m: ModelCosts, w: Workload, lay: Layout, hw: Hardware) -> dict:
    """Seconds a step of each phase (per device, all devices busy): {phase: {flops, compute_s, floor_s, s, bound}}."""
    d = lay.devices
    out = {}
    # update: policy fwd + bwd (3 forwards) and the reference's forward, at the padded width; shared
    # prompts run once a group and the rows' continuations attend to them.
    per_seq = _forward_flops(m, w.train_width, w.prompt_width) + w.groups / w.batch * _forward_flops(m, w.prompt_width, 0)
    weights = 2.0 * m.n_matmul / lay.tensor
    gathers = 0.0
    if lay.fsdp > 1:
        ref_gathered = 0 if lay.rollout else 1          # the rollout layout's frozen copy is whole in a group
        gathers = w.micro_batches * (lay.fsdp - 1) / lay.fsdp * weights * (2 + ref_gathered + 2)  # + f32 grads
    allreduce = 0.0
    if lay.tensor > 1:
        tokens_here = (w.batch * w.train_width + w.groups * w.prompt_width) / (lay.data * lay.fsdp)
        allreduce = tokens_here * 8 * m.layers * 2 * (lay.tensor - 1) / lay.tensor * m.hidden * 2
    out["update"] = _phase(4 * per_seq * w.batch, (gathers + allreduce) / (hw.link_gbps * 1e9), d, hw)
    # reshard: read the f32 master shard, write the bf16 rollout shard, receive what this device did not hold.
    if lay.rollout:
        master = 4.0 * m.n_matmul / (lay.fsdp * lay.tensor)
        target = 2.0 * m.n_matmul / lay.rollout_tensor
        received = max(0.0, target - master / 2)
        out["reshard"] = _phase(0.0, max((master + target) / (hw.hbm_tbps * 1e12), received / (hw.link_gbps * 1e9)),
                                d, hw)
    else:
        out["reshard"] = _phase(0.0, 0.0, d, hw)
    # agent prefill, each token once: the first prompt, then each turn's observation after the context so far.
    flops = _forward_flops(m, w.prompt, 0)
    context = w.prompt
    for _ in range(w.turns - 1):
        context += w.reply
        flops += _forward_flops(m, w.observation, context)
        context += w.observation
    out["agent prefill"] = _phase(w.rows * flops, 0.0, d, hw)
    # agent decode: reply tokens a turn; context grows by one a token.
    flops, floor = 0.0, 0.0
    start = w.prompt
    for _ in range(w.turns):
        mean_ctx = start + w.reply / 2
        flops += w.rows * w.reply * (2.0 * m.n_matmul + 2 * m.attn_flops_per_t2 * mean_ctx)
        floor += w.reply * _decode_step_floor(m, lay, w.rows, mean_ctx, hw)
        start += w.reply + w.observation
    out["agent decode"] = _phase(flops, floor, d, hw)
    # world model: one prefill of each prompt, K samples decoded from it.
    rows_k = w.wm_rows * w.wm_samples
    mean_ctx = w.wm_prompt + w.wm_new / 2
    flops = w.wm_calls * (w.wm_rows * _forward_flops(m, w.wm_prompt, 0)
                          + rows_k * w.wm_new * (2.0 * m.n_matmul + 2 * m.attn_flops_per_t2 * mean_ctx))
    floor = w.wm_calls * w.wm_new * _decode_step_floor(m, lay, rows_k, mean_ctx, hw)
    out["world model"] = _phase(flops, floor, d, hw)
    return out


def ideal_step_flops(m: ModelCosts, w: Workload) -> dict:
    """The ideal bill's FLOPs a step: the same tokens, each processed once, no padding (module docstring)."""
    t = w.trained_tokens
    seq = 2.0 * m.n_matmul * t + m.attn_flops_per_t2 * t * t / 2
    update = 4 * seq * w.batch
    # sampling: every prompt / observation / generated token once, against its context.
    sampled = w.batch * _forward_flops(m, t, 0)
    wm = w.wm_calls * w.batch * (_forward_flops(m, w.wm_prompt, 0)
                                 + w.wm_samples * _forward_flops(m, w.wm_new, w.wm_prompt))
    return {"update": update, "sampling": sampled, "world model": wm}


def hours(seconds_per_step: float, devices: int, steps: int) -> float:
    return seconds_per_step * devices * steps / 3600


def bill(m: ModelCosts, w: Workload, lay: Layout, hw: Hardware, steps: int) -> dict:
    """The run's bill: per phase (hours, bound, compute and floor hours), total, ideal and their ratio."""
    per_step = step_bill(m, w, lay, hw)
    phases = {k: {"hours": hours(v["s"], lay.devices, steps), "compute_hours": hours(v["compute_s"], lay.devices,
                                                                                     steps),
                  "floor_hours": hours(v["floor_s"], lay.devices, steps), "bound": v["bound"], "flops": v["flops"]}
              for k, v in per_step.items()}
    total = sum(p["hours"] for p in phases.values())
    ideal_flops = ideal_step_flops(m, w)
    rate = hw.peak_tflops * 1e12 * hw.mfu
    ideal = {k: v * steps / rate / 3600 for k, v in ideal_flops.items()}
    ideal_total = sum(ideal.values())
    linear = (8.0 * w.batch * w.trained_tokens + 2.0 * w.batch * w.trained_tokens
              + 2.0 * w.wm_calls * w.batch * (w.wm_prompt + w.wm_samples * w.wm_new)) * m.n_matmul
    return {"phases": phases, "hours_total": total, "hours_ideal": ideal_total, "ideal_phases": ideal,
            "hours_ideal_matmuls_only": linear * steps / rate / 3600, "ratio": total / ideal_total,
            "tokens_per_step": w.batch * w.trained_tokens, "reply_tokens": w.reply}


def paper_budget(m: ModelCosts, w: Workload, lay: Layout, hw: Hardware, steps: int, paper_hours: float) -> dict:
    """The token budget a step at which the ideal bill equals `paper_hours`, and our bill at that budget.

    The budget is the caps' tokens scaled by one factor s (`Workload.scaled`:
    prompt, replies, observations, the world model's prompt and answers
    alike; turns, rows and steps unchanged), found by bisection.
    """
    def at(s):
        return bill(m, w.scaled(s), lay, hw, steps)

    lo, hi = 0.0, 1.0
    if at(hi)["hours_ideal"] <= paper_hours:
        lo = hi
    for _ in range(40):
        if hi - lo < 1e-4:
            break
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid)["hours_ideal"] <= paper_hours else (lo, mid)
    b = at(lo)
    return {"paper_hours": paper_hours, "scale": lo, "tokens_per_step": b["tokens_per_step"],
            "reply_tokens": b["reply_tokens"], "hours_ideal": b["hours_ideal"], "hours_total": b["hours_total"],
            "ratio": b["ratio"], "phases": {k: v["hours"] for k, v in b["phases"].items()}}


def choose_rollout_tensor(m: ModelCosts, w: Workload, lay: Layout, hw: Hardware, steps: int) -> list[tuple[int, float]]:
    """Rollout group sizes g (divisors of the devices), cheapest bill first: [(g, hours_total), ...]."""
    out = []
    for g in (g for g in range(1, lay.devices + 1) if lay.devices % g == 0):
        trial = dataclasses.replace(lay, rollout=True, rollout_tensor=g)
        out.append((g, bill(m, w, trial, hw, steps)["hours_total"]))
    return sorted(out, key=lambda x: x[1])


__all__ = ["Hardware", "Layout", "ModelCosts", "PHASES", "Workload", "bill", "choose_rollout_tensor", "hours",
           "ideal_step_flops", "paper_budget", "step_bill", "workload_of"]
