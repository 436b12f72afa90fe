"""The jitted, sharded GRPO update: one optimizer step on one batch of rollouts.

For a batch of B = groups_per_step × group_size left-padded sequences [B, T]:

    m_bt     = loss_mask_bt ∧ valid_bt ∧ valid_b,t−1 ∧ (weights_b > 0)   tokens the loss sees
    logp, H  = token_logprobs(θ, tokens, valid, m)        chunked head: never an f32 [B, T, V]
    ref_logp = sg(token_logprobs(θ_ref, tokens, valid, m))  θ_ref: the frozen reference, the world
                                                            model's parameter copy too (unless the
                                                            checkpoint ships its own world model)
    old_logp = sg(logp)                                    one on-policy update per batch (the
                                                            paper's recipe): the ratio is exactly 1
    loss     = losses.grpo_loss(logp, old_logp, ref_logp, A, m, kl_coef, entropy=H, entropy_coef)

(with `Batch.prompt_tokens` the rows of a group share their prompt, which runs
once: `logprobs.prefix_logprobs`, same values up to float rounding) with
token-mean aggregation over the WHOLE batch: Σ_bt m·l / Σ_bt m. Ungraded
rollouts have weight 0 and drop out of the mask entirely -- they are masked,
never scored 0 (docs/design.md, "Advantages").

Gradient accumulation. The batch is cut into `micro_batches` equal slices
(strided rows b ≡ i mod M, so each slice is spread over every data shard and
slicing moves no data; whole groups i, i+M, ... when rows share prompts) and
scanned with `lax.scan`. Each slice contributes its
token SUM n_i·loss_i, and the summed gradient is divided once by the total
token count N = Σ_i n_i: the result equals the full-batch gradient up to float
rounding, never a mean of per-slice means (which would over-weight short
slices). Gradients accumulate in float32.

Sharding. With a mesh, params and optimizer state follow the family's
logical-axis rules (`models.sharding`): every param-shaped optimizer leaf
(Adam's μ, ν) is sharded like its param, scalars are replicated. The batch is
sharded over ("data", "fsdp"). The step is jitted once with the state donated.

Memory. The policy's forward runs with layer remat (`remat=True`, the
"full" policy of `models.family.REMAT_POLICIES`): each scanned layer is a
`jax.checkpoint`, so the backward holds one [B, T, D] residual per layer and
recomputes one layer at a time, at the cost of one more forward. Inside a
full-attention layer the blocked attention's own backward recomputes its
score blocks (`models.blocked_attention`, a custom VJP), so no [T, T] scores
are kept. The LM head is chunked and checkpointed by `token_logprobs`;
micro-batches bound B.
Measured (XLA's temporaries of the compiled step, CPU): the micro-world
policy (4 layers, width 256) at B=8, T=512: 1294 MiB without remat, 525 MiB
"full", 572 MiB "dots"; compiled in 65, 49 and 50 s (one run each, on a loaded
2-core machine): remat does not make the step slower to compile.

Precision. `init_train_state(param_dtype="float32")` keeps float32 master
weights while `make_train_step(compute_dtype="bfloat16")` runs the forward and
backward in bf16: at the paper's lr 1e-6 an Adam update (~1e-6 per weight) is
far below bf16's resolution (2^-8 relative), so updates applied to bf16
weights round away to nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from wmrl_jax import losses
from wmrl_jax.logprobs import prefix_logprobs, token_logprobs
from wmrl_jax.models.family import REMAT_POLICIES
from wmrl_jax.models.sharding import logical_to_spec, tree_shardings

# Loss terms that are token means; accumulated as token sums and divided by the total count once.
_TOKEN_MEAN_METRICS = ("pg_loss", "kl", "entropy", "clip_frac")


def _describe(x) -> str:
    """'float32[16, 512]' for an array (or a tracer, or a ShapeDtypeStruct)."""
    return f"{np.dtype(x.dtype).name}[{', '.join(str(d) for d in x.shape)}]"


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer) and hasattr(x, "shape") and not isinstance(x, jax.ShapeDtypeStruct)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class TrainState:
    """What the update changes: a pytree, checkpointed by Orbax as it is.

    step: int32[] number of updates applied.
    params: the policy's params (a family's nested dict; possibly float32 masters of a bf16 model).
    opt_state: the optax state; its param-shaped leaves are sharded like the params.
    """

    step: jax.Array
    params: dict
    opt_state: Any

    def __repr__(self) -> str:
        leaves = jax.tree.leaves(self.params)
        dtypes = sorted({np.dtype(x.dtype).name for x in leaves})
        count = sum(math.prod(x.shape) for x in leaves)
        step = int(self.step) if _concrete(self.step) else _describe(self.step)
        return (f"TrainState(step={step}, params={len(leaves)} arrays, {count:,} {'/'.join(dtypes)} parameters, "
                f"opt_state={len(jax.tree.leaves(self.opt_state))} arrays)")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class Batch:
    """One GRPO batch: B = groups_per_step × group_size sequences.

    tokens: int32[B, T] prompt, agent replies and observations, left-padded; or, with `prompt_tokens`,
      what follows the group's shared prompt, right-padded.
    valid: bool[B, T] real (non-padding) tokens.
    loss_mask: bool[B, T] agent tokens only (never prompt or observation tokens).
    advantages: float32[B] group-relative advantages (0 where a rollout is ungraded).
    weights: float32[B] 1.0 for rollouts in the loss, 0.0 for ungraded ones (masked out, never scored 0).
    prompt_tokens, prompt_valid: None, or int32 / bool[G, P] the prompt each group of K = B / G rows shares
      (rows g·K … g·K + K − 1), left-padded: the update runs it once per group, not once per row
      (`logprobs.prefix_logprobs`; `loop.make_batch(prompt_width=)`).
    """

    tokens: Any
    valid: Any
    loss_mask: Any
    advantages: Any
    weights: Any
    prompt_tokens: Any = None
    prompt_valid: Any = None

    @property
    def group_size(self) -> int | None:
        """K, the rows sharing one prompt (None: every row holds its whole sequence)."""
        return None if self.prompt_tokens is None else np.shape(self.tokens)[0] // np.shape(self.prompt_tokens)[0]

    def __repr__(self) -> str:
        present = [f for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
        fields = ", ".join(f"{f.name}={_describe(getattr(self, f.name))}" for f in present)
        if not all(_concrete(getattr(self, f.name)) for f in present):
            return f"Batch({fields})"
        weighted = np.asarray(self.weights) > 0
        loss_tokens = int((np.asarray(self.loss_mask) & weighted[:, None]).sum())
        real = int(np.asarray(self.valid).sum())
        if self.prompt_tokens is not None:
            real += int((np.asarray(self.prompt_valid).sum(axis=1) * self.group_size).sum())
        return (f"Batch({fields}; {real:,} real tokens, {loss_tokens:,} loss tokens, "
                f"{int(weighted.sum())}/{weighted.size} rollouts weighted)")


def make_optimizer(optim) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and a linear warm-up to a constant learning rate.

        lr(s) = learning_rate · min(1, (s + 1) / warmup_steps)      (s = updates applied before this one)

    so the first update already moves (lr / warmup_steps), and from update
    `warmup_steps` on the rate is the constant `learning_rate` (paper: 1e-6, no
    decay) until `total_steps`. Order: clip_by_global_norm(grad_clip), then
    AdamW(b1, b2, eps=1e-8) with decoupled weight decay on every weight (as
    torch's AdamW in verl, the paper's trainer). The learning rate lives in
    the optimizer state (`optax.inject_hyperparams`), so the step can log the
    rate it actually applied.

    Args:
      optim: a ConfigDict (or any object) with learning_rate, warmup_steps,
        total_steps, weight_decay, b1, b2, grad_clip.
    """
    lr, warmup = float(optim.learning_rate), int(optim.warmup_steps)
    checks = {
        "learning_rate": lr > 0,
        "warmup_steps": 0 <= warmup <= int(optim.total_steps),
        "total_steps": int(optim.total_steps) >= 1,
        "weight_decay": float(optim.weight_decay) >= 0,
        "b1": 0 <= float(optim.b1) < 1,
        "b2": 0 <= float(optim.b2) < 1,
        "grad_clip": float(optim.grad_clip) > 0,
    }
    for name, ok in checks.items():
        if not ok:
            raise ValueError(f"optim.{name}: {optim[name] if hasattr(optim, '__getitem__') else getattr(optim, name)!r}"
                             f" is out of range (learning_rate > 0, 0 <= warmup_steps <= total_steps, "
                             f"weight_decay >= 0, 0 <= b1, b2 < 1, grad_clip > 0)")

    def schedule(count):
        return lr * jnp.minimum(1.0, (count + 1.0) / max(warmup, 1))

    adamw = optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32)(
        learning_rate=schedule, b1=float(optim.b1), b2=float(optim.b2), eps=1e-8,
        weight_decay=float(optim.weight_decay))
    return optax.chain(optax.clip_by_global_norm(float(optim.grad_clip)), adamw)


def train_state_shardings(mesh, param_axes: dict, optimizer: optax.GradientTransformation, params) -> TrainState:
    """A TrainState of NamedShardings: params per the logical-axis rules, optimizer leaves like their params.

    `params` may be concrete or abstract (`jax.eval_shape`); only shapes are read.
    """
    param_sh = tree_shardings(mesh, param_axes, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shapes = jax.eval_shape(optimizer.init, params)
    opt_sh = optax.tree_map_params(optimizer, lambda _, sharding: sharding, opt_shapes, param_sh,
                                   transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_sh, opt_state=opt_sh)


def init_train_state(params, optimizer: optax.GradientTransformation, *, mesh=None, param_axes=None,
                     param_dtype=None) -> TrainState:
    """Step 0: `params` (sharded over `mesh` by `param_axes` when given) and a fresh optimizer state.

    Args:
      params: the policy's initial params (a copy: the state is donated to the step).
      optimizer: from `make_optimizer`.
      mesh, param_axes: shard params and optimizer state by the family's
        logical axes (`family.param_axes(config)`); param_axes is unused without a mesh.
      param_dtype: cast the params first (e.g. "float32" masters for a bf16
        model; see the module docstring). None keeps their dtype.
    """
    if mesh is not None and param_axes is None:
        raise ValueError("param_axes: None with a mesh; expected the family's param_axes(config) to shard by")
    if param_dtype is not None:
        params = jax.tree.map(lambda x: x.astype(param_dtype), params)

    def init(params):
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))

    if mesh is None:
        return jax.jit(init)(params)
    shardings = train_state_shardings(mesh, param_axes, optimizer, params)
    return jax.jit(init, out_shardings=shardings)(jax.device_put(params, shardings.params))


def check_batch(batch: Batch, micro_batches: int, data_shards: int = 1) -> None:
    """Raises ValueError (or TypeError for a dtype) naming the field of `batch` that is wrong and what was expected."""
    tokens = batch.tokens
    if len(np.shape(tokens)) != 2:
        raise ValueError(f"batch.tokens: shape {tuple(np.shape(tokens))}, expected int32[B, T]")
    if not np.issubdtype(np.dtype(tokens.dtype), np.integer):
        raise TypeError(f"batch.tokens: dtype {tokens.dtype}, expected int32")
    size, _ = tokens.shape
    for name, shape, kind in (("valid", tokens.shape, np.bool_), ("loss_mask", tokens.shape, np.bool_),
                              ("advantages", (size,), np.floating), ("weights", (size,), np.floating)):
        x = getattr(batch, name)
        if tuple(np.shape(x)) != tuple(shape):
            raise ValueError(f"batch.{name}: shape {tuple(np.shape(x))}, expected {tuple(shape)} "
                             f"({'like tokens, [B, T]' if len(shape) == 2 else 'one per sequence, [B]'})")
        if not np.issubdtype(np.dtype(x.dtype), kind):
            raise TypeError(f"batch.{name}: dtype {x.dtype}, expected {'bool' if kind is np.bool_ else 'float32'}")
    if size % micro_batches:
        raise ValueError(f"batch.tokens: B={size} sequences do not split into micro_batches={micro_batches} "
                         f"equal slices; expected B divisible by {micro_batches}")
    if (size // micro_batches) % data_shards:
        raise ValueError(f"batch.tokens: B={size} sequences give micro-batches of {size // micro_batches}, not "
                         f"divisible by the mesh's data×fsdp size {data_shards}; expected B divisible by "
                         f"micro_batches×data×fsdp = {micro_batches * data_shards}")
    if (batch.prompt_tokens is None) != (batch.prompt_valid is None):
        raise ValueError("batch.prompt_tokens / batch.prompt_valid: one is None; expected both (shared prompts) "
                         "or neither")
    if batch.prompt_tokens is None:
        return
    prompts = batch.prompt_tokens
    if len(np.shape(prompts)) != 2 or tuple(np.shape(batch.prompt_valid)) != tuple(np.shape(prompts)):
        raise ValueError(f"batch.prompt_tokens / prompt_valid: shapes {tuple(np.shape(prompts))}, "
                         f"{tuple(np.shape(batch.prompt_valid))}, expected equal [G, P]")
    if not np.issubdtype(np.dtype(prompts.dtype), np.integer):
        raise TypeError(f"batch.prompt_tokens: dtype {prompts.dtype}, expected int32")
    if not np.issubdtype(np.dtype(batch.prompt_valid.dtype), np.bool_):
        raise TypeError(f"batch.prompt_valid: dtype {batch.prompt_valid.dtype}, expected bool")
    groups = np.shape(prompts)[0]
    if groups == 0 or size % groups:
        raise ValueError(f"batch.prompt_tokens: {groups} prompts for B={size} rows; expected B = G × group size")
    if groups % micro_batches or (groups // micro_batches) % data_shards:
        raise ValueError(f"batch.prompt_tokens: G={groups} prompts do not split into micro_batches={micro_batches} "
                         f"slices of whole groups spread over the mesh's data×fsdp size {data_shards}; expected G "
                         f"divisible by {micro_batches * data_shards} (or unshared prompts, optim.share_prompt='never')")


def _strided_slices(x: jax.Array, micro_batches: int, rows_per_unit: int = 1) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]; slice i holds units i, i+M, i+2M, ... of `rows_per_unit` rows each
    (a row, or a group that shares a prompt; a local reshape on each data shard)."""
    units = x.shape[0] // rows_per_unit
    x = x.reshape(units // micro_batches, micro_batches, rows_per_unit, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(micro_batches, -1, *x.shape[3:])


class TrainStep:
    """`step(state, ref_params, batch) -> (new_state, metrics)`; built by `make_train_step`.

    The state is donated (do not reuse the one passed in). `batch` may hold
    numpy arrays; it is checked on the host, then placed (sharded over
    ("data", "fsdp") with a mesh). `lower(...)` gives the jitted program for
    inspection (memory, HLO).
    """

    def __init__(self, fn: Callable, *, micro_batches: int, mesh, param_axes, optimizer):
        self._fn, self.micro_batches, self.mesh = fn, micro_batches, mesh
        self._param_axes, self._optimizer, self._jitted = param_axes, optimizer, None
        self.data_shards = 1 if mesh is None else mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)

    def _batch_shardings(self, batch: Batch) -> Batch:
        shape = dict(self.mesh.shape)

        def sharding(x):
            names = ("batch", "length")[: len(np.shape(x))]
            return NamedSharding(self.mesh, logical_to_spec(names, np.shape(x), shape))

        return jax.tree.map(sharding, batch)

    def _prepare(self, state: TrainState, batch: Batch):
        check_batch(batch, self.micro_batches, self.data_shards)
        if self._jitted is None:
            if self.mesh is None:
                self._jitted = jax.jit(self._fn, donate_argnums=0)
            else:
                # Fixed output shardings: the donated state comes back laid out as it went in, every step.
                out = train_state_shardings(self.mesh, self._param_axes, self._optimizer, state.params)
                self._jitted = jax.jit(self._fn, donate_argnums=0,
                                       out_shardings=(out, NamedSharding(self.mesh, PartitionSpec())))
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch)):
            # Shapes only (AOT planning, launch/plan.py): give them the batch's shardings, place nothing.
            if self.mesh is None:
                return batch
            return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), batch,
                                self._batch_shardings(batch))
        if self.mesh is None:
            return jax.device_put(batch)
        return jax.device_put(batch, self._batch_shardings(batch))

    def __call__(self, state: TrainState, ref_params: dict, batch: Batch) -> tuple[TrainState, dict]:
        batch = self._prepare(state, batch)
        if self.mesh is None:
            return self._jitted(state, ref_params, batch)
        with jax.set_mesh(self.mesh):  # activation constraints inside the model read the mesh from here
            return self._jitted(state, ref_params, batch)

    def trace(self, state: TrainState, ref_params: dict, batch: Batch):
        """The jitted step traced (`jax.stages.Traced`: `.jaxpr`, `.lower()`); arguments may be
        `jax.ShapeDtypeStruct`s with shardings (the state's as `train_state_shardings` gives them)."""
        batch = self._prepare(state, batch)
        if self.mesh is None:
            return self._jitted.trace(state, ref_params, batch)
        with jax.set_mesh(self.mesh):
            return self._jitted.trace(state, ref_params, batch)

    def lower(self, state: TrainState, ref_params: dict, batch: Batch):
        batch = self._prepare(state, batch)
        if self.mesh is None:
            return self._jitted.lower(state, ref_params, batch)
        with jax.set_mesh(self.mesh):
            return self._jitted.lower(state, ref_params, batch)

    def __repr__(self) -> str:
        mesh = None if self.mesh is None else dict(self.mesh.shape)
        return f"TrainStep(micro_batches={self.micro_batches}, mesh={mesh})"


def make_train_step(family, model_config, optimizer: optax.GradientTransformation, *, kl_coef: float,
                    entropy_coef: float, clip_eps: float, micro_batches: int = 1, remat: bool | str | None = True, mesh=None,
                    temperature: float = 1.0, compute_dtype=None, logprob_chunk: int = 128) -> TrainStep:
    """The GRPO update as one jitted call (see the module docstring for the math).

    Args:
      family, model_config: the policy's model (`wmrl_jax.models.family` contract).
      optimizer: from `make_optimizer`.
      kl_coef, entropy_coef, clip_eps: `losses.grpo_loss` (paper: 0.04, 0.002, 0.2).
      micro_batches: M equal slices of the batch, gradients summed over them
        (one optimizer update); B must be divisible by M (and, with a mesh, B/M
        by the data×fsdp size).
      remat: layer remat of the policy's forward under the gradient
        (`family.forward(remat=)`): True or "full" recomputes each layer in the
        backward, keeping only the residual stream between layers; "dots"
        also keeps the weight matmuls' outputs; False keeps every layer's
        activations. Same gradients either way (up to float rounding).
      mesh: a `models.make_mesh` Mesh; None runs on the default device.
      temperature: the sampler's temperature (the ratio and KL use the same
        tempered softmax the rollouts were drawn from).
      compute_dtype: run forward/backward in this dtype (params cast inside the
        loss; gradients flow back to the master dtype). None: the params' dtype.
      logprob_chunk: positions unembedded at once (`token_logprobs(chunk=)`).

    Returns:
      a `TrainStep`: step(state, ref_params, batch) -> (new_state, metrics), metrics
      float32 scalars: loss, pg_loss, kl, entropy, clip_frac (token means over the
      whole batch), grad_norm (before clipping), learning_rate (the one this
      update applied), tokens (N, tokens in the loss), sequences (rollouts in it).
    """
    if not (isinstance(micro_batches, int) and micro_batches >= 1):
        raise ValueError(f"micro_batches: {micro_batches!r}, expected an int >= 1")
    if not temperature > 0:
        raise ValueError(f"temperature: {temperature!r}, expected > 0")
    # grpo_loss checks these only when it is traced; fail here, at build time, instead.
    for name, value in (("kl_coef", kl_coef), ("entropy_coef", entropy_coef), ("clip_eps", clip_eps)):
        if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
            raise ValueError(f"{name}: {value!r}, expected a finite number >= 0")
    remat = False if remat in (None, "none") else remat
    if not (isinstance(remat, bool) or (isinstance(remat, str) and remat in REMAT_POLICIES)):
        raise ValueError(f"remat: {remat!r}, expected True, False, 'none' or one of {sorted(REMAT_POLICIES)}")
    remat_policy = ("full" if remat else None) if isinstance(remat, bool) else remat
    param_axes = family.param_axes(model_config)
    logprobs_kw = dict(temperature=temperature, chunk=logprob_chunk)

    def micro_batch_sums(params, ref_params, mb: Batch):
        """Token SUMS of the loss and its terms over one micro-batch, and the gradient of the loss sum."""
        # Left-padded rows: a token is scored when the one before it is real. Continuations of a shared
        # prompt are right-padded and their first token follows the prompt's last.
        prev_valid = jnp.pad(mb.valid[:, :-1], ((0, 0), (1, 0)), constant_values=mb.prompt_tokens is not None)
        mask = mb.loss_mask & mb.valid & prev_valid & (mb.weights > 0)[:, None]
        count = mask.sum().astype(jnp.float32)

        def logprobs(params, **kw):
            if mb.prompt_tokens is None:
                return token_logprobs(params, model_config, family, mb.tokens, mb.valid, mask, **logprobs_kw, **kw)
            return prefix_logprobs(params, model_config, family, mb.prompt_tokens, mb.prompt_valid, mb.tokens,
                                   mb.valid, mask, group_size=mb.group_size, **logprobs_kw, **kw)

        ref_logp = jax.lax.stop_gradient(logprobs(ref_params)[0])

        def loss_sum(params):
            if compute_dtype is not None:
                params = jax.tree.map(lambda x: x.astype(compute_dtype), params)
            logp, entropy = logprobs(params, remat=remat_policy)
            loss, terms = losses.grpo_loss(logp, jax.lax.stop_gradient(logp), ref_logp, mb.advantages, mask,
                                           clip_eps=clip_eps, kl_coef=kl_coef, entropy=entropy,
                                           entropy_coef=entropy_coef, aggregation="token-mean")
            return loss * count, {k: terms[k] * count for k in _TOKEN_MEAN_METRICS}

        (total, sums), grads = jax.value_and_grad(loss_sum, has_aux=True)(params)
        sequences = (mask.any(axis=1)).sum().astype(jnp.float32)
        return grads, {"loss": total, **sums, "tokens": count, "sequences": sequences}

    def step(state: TrainState, ref_params: dict, batch: Batch) -> tuple[TrainState, dict]:
        shared = batch.prompt_tokens is not None
        batch = Batch(tokens=batch.tokens.astype(jnp.int32), valid=batch.valid.astype(bool),
                      loss_mask=batch.loss_mask.astype(bool), advantages=batch.advantages.astype(jnp.float32),
                      weights=batch.weights.astype(jnp.float32),
                      prompt_tokens=batch.prompt_tokens.astype(jnp.int32) if shared else None,
                      prompt_valid=batch.prompt_valid.astype(bool) if shared else None)
        if micro_batches == 1:
            grads, sums = micro_batch_sums(state.params, ref_params, batch)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        else:
            # Whole groups per slice when rows share prompts (slice i: groups i, i+M, ... and their rows).
            group = batch.group_size or 1
            slices = dataclasses.replace(
                jax.tree.map(lambda x: _strided_slices(x, micro_batches, group),
                             dataclasses.replace(batch, prompt_tokens=None, prompt_valid=None)),
                prompt_tokens=None if not shared else _strided_slices(batch.prompt_tokens, micro_batches),
                prompt_valid=None if not shared else _strided_slices(batch.prompt_valid, micro_batches))
            if mesh is not None:
                slices = jax.tree.map(
                    lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(
                        (None, "batch", "length")[: x.ndim], x.shape, dict(mesh.shape)))), slices)

            def body(carry, mb):
                grads, sums = micro_batch_sums(state.params, ref_params, mb)
                acc_grads, acc_sums = carry
                acc_grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads)
                return (acc_grads, jax.tree.map(jnp.add, acc_sums, sums)), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            if mesh is not None:
                zeros = jax.lax.with_sharding_constraint(zeros, tree_shardings(mesh, param_axes, zeros))
            zero_sums = {k: jnp.zeros((), jnp.float32)
                         for k in ("loss", *_TOKEN_MEAN_METRICS, "tokens", "sequences")}
            (grads, sums), _ = jax.lax.scan(body, (zeros, zero_sums), slices)

        denom = jnp.maximum(sums["tokens"], 1.0)   # a batch with no loss token: zero gradient, not NaN
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {k: sums[k] / denom for k in ("loss", *_TOKEN_MEAN_METRICS)}
        # inject_hyperparams keeps the rate it just applied (and, under the same name, the schedule's counter).
        learning_rate = optax.tree_utils.tree_get(opt_state, "learning_rate", jnp.nan,
                                                  filtering=lambda _, value: isinstance(value, jax.Array))
        metrics.update(grad_norm=optax.tree.norm(grads), learning_rate=learning_rate, tokens=sums["tokens"],
                       sequences=sums["sequences"])
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return TrainStep(step, micro_batches=micro_batches, mesh=mesh, param_axes=param_axes, optimizer=optimizer)
