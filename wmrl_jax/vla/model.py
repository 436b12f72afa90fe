"""The VLA policy: camera images + instruction -> 7 discrete action tokens, on any registered text family.

OpenVLA / MiniVLA's recipe with an image encoder of our own (`vision.py`, a
small ViT, no pretrained weights). One row's sequence, LEFT-padded as every
family expects (family.py):

    [pad ... pad | C·P image tokens | instruction tokens | a_0 ... a_6]
                   ^ ViT patches of each camera, through a 2-layer GELU MLP
                     projector to the backbone's width, fed as `embeds`

The backbone (Qwen2 / Qwen3 / Qwen3.5 through the family contract) reads
the image tokens as input vectors (`forward(..., embeds=)`), the text and
action tokens through its own embedding. Action k is predicted at the
position before it (the last prompt token predicts a_0), as the text model
predicts a next token. Actions are ids of the backbone vocabulary,
`actions.ActionTokenizer` (the last n_bins ids, OpenVLA's binning).

The policy is the softmax over the n_bins action ids only (the logits at
those ids; other ids are never sampled and get no mass): `act` samples from
it, `action_logprobs` scores under it, `sft_loss` is its negative
log-likelihood of demonstrated actions (teacher forcing; no loss on prompt
tokens: they have no target). Restricting to the action ids changes nothing
where a trained model's argmax is an action id anyway, and gives GRPO one
distribution for sampling and for its ratio.

Observations (what `simulator.SimPool` returns, plus the tokenized
instruction): a dict with one uint8 [B, image_size, image_size, 3] array per
camera of `config.cameras`, "text": int [B, T] instruction ids LEFT-padded,
"text_valid": bool [B, T]; other keys are ignored (`model_inputs`).
A batch for `action_logprobs` / `sft_loss` adds "action_ids": int [B, 7].
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from wmrl_jax.models import family_of
from wmrl_jax.models.layers import positions_from_valid
from wmrl_jax.vla import vision
from wmrl_jax.vla.actions import ActionTokenizer

# OpenVLA's prompt (prismatic's PurePromptBuilder as `predict_action` uses it); MiniVLA keeps it.
PROMPT = "In: What action should the robot take to {instruction}?\nOut:"


@dataclasses.dataclass(frozen=True)
class Config:
    """A VLA: `backbone` (any registered family's Config), a ViT per `vision`, actions as tokens.

    action_vocab_size: the action ids are the last `n_bins` ids below it
      (`ActionTokenizer.vocab_size`); None = the backbone's vocab_size.
    """

    backbone: Any
    vision: vision.VisionConfig
    cameras: tuple[str, ...] = ("agentview", "wrist")
    action_dim: int = 7
    n_bins: int = 256
    action_vocab_size: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self):
        family_of(self.backbone)  # a clear error for anything that is not a registered family's Config
        if len(self.cameras) != self.vision.num_cameras or len(set(self.cameras)) != len(self.cameras):
            raise ValueError(f"cameras={self.cameras}: expected {self.vision.num_cameras} distinct names "
                             f"(vision.num_cameras)")
        top = self.tokenizer.vocab_size
        limit = self.backbone.vocab_size if self.backbone.token_count is None else self.backbone.token_count
        if top > limit:
            raise ValueError(f"action_vocab_size={top}: the action ids [{top - self.n_bins}, {top}) must be real ids "
                             f"of the backbone (< {limit}: vocab_size / token_count)")

    @property
    def tokenizer(self) -> ActionTokenizer:
        vocab = self.backbone.vocab_size if self.action_vocab_size is None else self.action_vocab_size
        return ActionTokenizer(vocab_size=vocab, n_bins=self.n_bins, action_dim=self.action_dim)

    @property
    def family(self):
        return family_of(self.backbone)

    @property
    def image_tokens(self) -> int:
        """Tokens the cameras put before the text: cameras × patches."""
        return len(self.cameras) * self.vision.num_patches


def init(config: Config, rng: jax.Array, dtype: Any = jnp.float32, *, backbone_params: dict | None = None) -> dict:
    """Params {"vision", "projector", "backbone"}: random, or the given backbone (e.g. `load_hf(...).params`).

    projector: in_wd [W, D], in_bias_d [D], out_dd [D, D], out_bias_d [D] (W the ViT width, D the backbone's).
    """
    dtype = jnp.dtype(dtype)
    k_vision, k_proj, k_backbone = jax.random.split(rng, 3)
    w, d = config.vision.width, config.backbone.hidden_size
    std = config.initializer_range
    k_in, k_out = jax.random.split(k_proj)
    params = {
        "vision": vision.init_params(config.vision, k_vision, dtype),
        "projector": {
            "in_wd": (std * jax.random.normal(k_in, (w, d))).astype(dtype),
            "in_bias_d": jnp.zeros((d,), dtype),
            "out_dd": (std * jax.random.normal(k_out, (d, d))).astype(dtype),
            "out_bias_d": jnp.zeros((d,), dtype),
        },
    }
    if backbone_params is None:
        backbone_params = config.family.init_params(config.backbone, k_backbone, dtype)
    else:
        _check_backbone(config, backbone_params)
    params["backbone"] = backbone_params
    return params


def _check_backbone(config: Config, given: dict) -> None:
    """A clear error for backbone params whose tree or shapes are not those of `config.backbone`."""
    want = jax.eval_shape(lambda: config.family.init_params(config.backbone, jax.random.key(0)))
    flat_want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(want)}
    flat_given = {jax.tree_util.keystr(k): np.shape(v) for k, v in jax.tree_util.tree_leaves_with_path(given)}
    for key in sorted(flat_want.keys() | flat_given.keys()):
        if flat_want.get(key) != flat_given.get(key):
            raise ValueError(f"backbone_params{key}: shape {flat_given.get(key, 'missing')}, expected "
                             f"{flat_want.get(key, 'no such leaf')} for {type(config.backbone).__name__} "
                             f"(hidden_size={config.backbone.hidden_size}, vocab_size={config.backbone.vocab_size})")


def model_inputs(config: Config, obs: dict) -> dict:
    """The arrays the model reads from an observation dict (cameras, "text", "text_valid", and "action_ids" if
    present), checked: a missing key, a wrong shape or dtype raises naming it."""
    missing = [k for k in (*config.cameras, "text", "text_valid") if k not in obs]
    if missing:
        raise ValueError(f"obs: missing {missing}; expected the cameras {list(config.cameras)}, 'text' and "
                         f"'text_valid' (got keys {sorted(obs)})")
    out = {name: jnp.asarray(obs[name]) for name in config.cameras}
    for name in config.cameras:
        vision.check_images(config.vision, out[name], f"obs[{name!r}]")
    batch = out[config.cameras[0]].shape[0]
    text, valid = jnp.asarray(obs["text"]), jnp.asarray(obs["text_valid"])
    if text.ndim != 2 or text.shape[0] != batch or not jnp.issubdtype(text.dtype, jnp.integer):
        raise ValueError(f"obs['text']: {text.dtype} {tuple(text.shape)}, expected int [{batch}, T] token ids")
    if valid.shape != text.shape:
        raise ValueError(f"obs['text_valid']: shape {tuple(valid.shape)}, expected the text's {tuple(text.shape)}")
    for name in config.cameras:
        if out[name].shape[0] != batch:
            raise ValueError(f"obs[{name!r}]: {out[name].shape[0]} rows, expected {batch} (as {config.cameras[0]!r})")
    out.update(text=text.astype(jnp.int32), text_valid=valid.astype(bool))
    if "action_ids" in obs:
        ids = jnp.asarray(obs["action_ids"])
        if ids.shape != (batch, config.action_dim) or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"action_ids: {ids.dtype} {tuple(ids.shape)}, expected int [{batch}, {config.action_dim}] "
                             f"(action_dim={config.action_dim})")
        out["action_ids"] = ids.astype(jnp.int32)
    return out


def embed_prompt(params: dict, config: Config, obs: dict) -> tuple[jax.Array, jax.Array]:
    """The prompt as input vectors: (embeds [B, S, D], valid bool[B, S]), S = C·P + T, left-padded.

    Each row's text pads move to the far left, before its image tokens:
    row i is [pad × n_i | images | its n_real text tokens].
    """
    obs = model_inputs(config, obs)
    bp = params["backbone"]
    parts = [vision.encode(params["vision"], config.vision, obs[name], i) for i, name in enumerate(config.cameras)]
    pr = params["projector"]
    img = jnp.concatenate(parts, axis=1)
    img = jax.nn.gelu(jnp.einsum("bpw,wd->bpd", img, pr["in_wd"]) + pr["in_bias_d"])
    img = jnp.einsum("bpd,de->bpe", img, pr["out_dd"]) + pr["out_bias_d"]
    text, valid = obs["text"], obs["text_valid"]
    seq = jnp.concatenate([img.astype(bp["embed_vd"].dtype), jnp.take(bp["embed_vd"], text, axis=0)], axis=1)
    seq_valid = jnp.concatenate([jnp.ones(img.shape[:2], bool), valid], axis=1)
    # Source slot of each output slot: pads (text slots [P, P + n)) first, then the images, then the real text.
    p, n = img.shape[1], jnp.sum(~valid, axis=1, keepdims=True)
    j = jnp.arange(seq.shape[1])[None, :]
    src = jnp.where(j < n, p + j, jnp.where(j < n + p, j - n, j))
    return jnp.take_along_axis(seq, src[..., None], axis=1), jnp.take_along_axis(seq_valid, src, axis=1)


def _teacher_forced_hidden(params, config, obs, action_ids, *, remat=None):
    """Final hidden [B, S + k, D] of the prompt followed by `action_ids` [B, k] (k <= action_dim)."""
    bp, bc = params["backbone"], config.backbone
    embeds, valid = embed_prompt(params, config, obs)
    embeds = jnp.concatenate([embeds, jnp.take(bp["embed_vd"], action_ids, axis=0)], axis=1)
    valid = jnp.concatenate([valid, jnp.ones(action_ids.shape, bool)], axis=1)
    tokens = jnp.zeros(valid.shape, jnp.int32)  # shape only: every input is in `embeds`
    hidden, _ = config.family.forward(bp, bc, tokens, positions_from_valid(valid), valid, remat=remat, embeds=embeds)
    return hidden


def logits(params: dict, config: Config, batch: dict) -> jax.Array:
    """float32[B, S + A, V] full-vocabulary logits of the prompt followed by all A action tokens.

    Position S - 1 + k predicts action k. For inspection and tests: training
    and scoring use `action_logprobs`, which unembeds only the A positions.
    """
    obs = model_inputs(config, batch)
    hidden = _teacher_forced_hidden(params, config, obs, obs["action_ids"])
    return config.family.unembed(params["backbone"], config.backbone, hidden).astype(jnp.float32)


def _action_slice(config: Config, logits_btv: jax.Array) -> jax.Array:
    """The policy's logits [..., n_bins]: the columns of the action ids (bin b = id - first_id)."""
    tok = config.tokenizer
    return jax.lax.slice_in_dim(logits_btv, tok.first_id, tok.vocab_size, axis=-1)


def action_logits(params: dict, config: Config, batch: dict, *, remat: str | None = None) -> jax.Array:
    """float32[B, A, n_bins]: the policy's logits for each action k given the prompt and actions < k."""
    obs = model_inputs(config, batch)
    a = config.action_dim
    hidden = _teacher_forced_hidden(params, config, obs, obs["action_ids"][:, :-1], remat=remat)
    z = config.family.unembed(params["backbone"], config.backbone, hidden[:, -a:])
    return _action_slice(config, z).astype(jnp.float32)


def action_logprobs(params: dict, config: Config, batch: dict, *, remat: str | None = None) -> jax.Array:
    """float32[B, A]: log π(a_k | obs, a_<k) of the given action ids (batch["action_ids"], int [B, A]).

    The log-softmax over the action ids (the policy's support) at temperature
    1, teacher-forced: what GRPO's ratio and KL read.
    """
    z = action_logits(params, config, batch, remat=remat)
    bins = config.tokenizer.ids_to_bins(jnp.asarray(batch["action_ids"], jnp.int32))
    return jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), bins[..., None], axis=-1)[..., 0]


def sft_loss(params: dict, config: Config, batch: dict, *, remat: str | None = None) -> jax.Array:
    """Mean negative log-likelihood of the demonstrated action ids, over rows and the A action tokens."""
    return -jnp.mean(action_logprobs(params, config, batch, remat=remat))


class Acted(NamedTuple):
    """`sample_actions`' result: ids int32[B, A] (action ids), logprobs float32[B, A], actions float32[B, A]."""

    ids: jax.Array
    logprobs: jax.Array
    actions: jax.Array


def sample_actions(params: dict, config: Config, obs: dict, rng: jax.Array, temperature: float = 0.0) -> Acted:
    """A action tokens per row, one at a time through the backbone's KV cache (batched over environments).

    temperature 0: greedy (argmax over the action ids), log-probs the
    policy's own; > 0: sampled from softmax(z / temperature), log-probs
    under that distribution (as `sampling.sample`). Token k uses
    fold_in(rng, k). Jittable with config and temperature static.
    """
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature}: expected >= 0 (0 = greedy)")
    fam, bp, bc, a = config.family, params["backbone"], config.backbone, config.action_dim
    embeds, valid = embed_prompt(params, config, obs)
    batch, width = valid.shape
    positions = positions_from_valid(valid)
    cache = fam.init_cache(bc, batch, width + a, embeds.dtype)
    hidden, cache = fam.forward(bp, bc, jnp.zeros((batch, width), jnp.int32), positions, valid, cache, embeds=embeds)

    def step(carry, k):
        hidden, cache, pos = carry
        z = _action_slice(config, fam.unembed(bp, bc, hidden)[:, 0]).astype(jnp.float32)
        if temperature == 0:
            bins, logp = jnp.argmax(z, axis=-1), jax.nn.log_softmax(z, axis=-1)
        else:
            logp = jax.nn.log_softmax(z / temperature, axis=-1)
            bins = jax.random.categorical(jax.random.fold_in(rng, k), logp, axis=-1)
        ids = config.tokenizer.bins_to_ids(bins).astype(jnp.int32)
        chosen = jnp.take_along_axis(logp, bins[:, None], axis=-1)[:, 0]
        # The last step's forward is unused (one token of A + prompt): simpler than a special case.
        hidden, cache = fam.forward(bp, bc, ids[:, None], pos[:, None], jnp.ones((batch, 1), bool), cache)
        return (hidden, cache, pos + 1), (ids, chosen)

    carry = (hidden[:, -1:], cache, positions[:, -1] + 1)
    _, (ids, logp) = jax.lax.scan(step, carry, jnp.arange(a))
    ids, logp = ids.T, logp.T
    return Acted(ids=ids, logprobs=logp, actions=config.tokenizer.decode(ids))


def act(params: dict, config: Config, obs: dict, rng: jax.Array, temperature: float = 0.0) -> jax.Array:
    """float32[N, action_dim] actions in [-1, 1] for N environments' observations (`sample_actions`, jitted)."""
    return sample_jit(params, config, model_inputs(config, obs), rng, temperature).actions


sample_jit = jax.jit(sample_actions, static_argnames=("config", "temperature"))


def tokenize_instructions(tokenizer, instructions: Sequence[str], *, template: str = PROMPT,
                          pad_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(int32[B, T] ids LEFT-padded, bool[B, T] valid) of each instruction in `template` (OpenVLA's prompt,
    the instruction lower-cased as OpenVLA does), for obs["text"] / obs["text_valid"]."""
    if isinstance(instructions, str) or not len(instructions):
        raise ValueError(f"instructions: expected a non-empty list of strings, got {instructions!r}")
    rows = [tokenizer(template.format(instruction=s.lower()), add_special_tokens=False)["input_ids"]
            for s in instructions]
    pad = pad_id if pad_id is not None else (tokenizer.pad_token_id or 0)
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, np.int32)
    valid = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], valid[i, width - len(r) :] = r, True
    return ids, valid
