"""Supervised fine-tuning of the VLA on demonstrations (`demos.Samples`), resumable; the policy folder it writes.

    config = sft.preset("tiny", vocab_size=sft.vocab_size_for(tokenizer), image_size=128)
    result = sft.train(config, train_set, sft.SFTConfig(steps=2000, batch_size=32), workdir, held_out=held_out)
    sft.save_policy(out / "policy", result.params, config, tokenizer, meta={...})
    policy = sft.load_policy(out / "policy")          # params, config, tokenizer, meta

The loss is `vla.model.sft_loss` (mean NLL of the 7 demonstrated action
tokens, teacher-forced), computed from the same `action_logits` that give the
action-token accuracy (argmax over the action ids equals the demonstrated
bin, teacher-forced, over rows and the 7 tokens). The optimizer is AdamW after
global-norm clipping, on a linear warm-up to `lr` and a cosine decay to 10 %
of it at `steps` (the micro-world build's recipe). One jitted step per batch.

Batches depend only on (seed, step) (`demos.batch_rows`) and nothing else is
random, so a run resumed from its checkpoint continues bit for bit as the
uninterrupted run (tested). Checkpoints are the project's `Checkpointer`
(Orbax, atomic, fingerprinted): params, optimizer state and the metric
history; a checkpoint of another run (other model, schedule, or data) in the
same workdir is refused, naming what differs.

Held-out metrics (every `eval_every` steps and at the end), on at most
`eval_samples` samples of the held-out states: the same loss and token
accuracy, and the greedy policy's mean absolute action error (decoded bin
centres against the demonstrated actions, in action units, [-1, 1] per
dimension), which is what the simulator executes.

The backbone is built from scratch for a tokenizer: its vocabulary is the
tokenizer's ids followed by `n_bins` action ids (`vocab_size_for`), so action
tokens never share an id with text (MiniVLA's extra-token layout, not
OpenVLA's overwritten rare tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import shutil
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from wmrl_jax import files
from wmrl_jax.models import FAMILIES, get_family, qwen2
from wmrl_jax.vla import demos, vision
from wmrl_jax.vla import model as vla

# Model sizes: ViT patches per side (patch_size = image_size // grid) and widths; a Qwen2 backbone of the given
# shape. "tiny" trains on 2 CPU cores (~1M parameters besides the embedding); "small" is for an accelerator.
PRESETS = {
    "tiny": dict(grid=4, vit=dict(width=64, num_layers=2, num_heads=4, mlp_size=128),
                 backbone=dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=32)),
    "small": dict(grid=8, vit=dict(width=192, num_layers=4, num_heads=6, mlp_size=768),
                  backbone=dict(hidden_size=384, intermediate_size=1152, num_layers=4, num_heads=6, num_kv_heads=2,
                                head_dim=64)),
}


def vocab_size_for(tokenizer, n_bins: int = 256) -> int:
    """The backbone vocabulary of a VLA built from scratch for `tokenizer`: its len(tokenizer) text ids, then
    `n_bins` action ids (the last n_bins ids, `ActionTokenizer`'s range)."""
    return len(tokenizer) + n_bins


def _vision(name: str, image_size: int, cameras) -> vision.VisionConfig:
    """Preset `name`'s ViT for frames of `image_size` pixels from `cameras`; a clear error for a bad size."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r}: expected one of {sorted(PRESETS)}")
    grid = PRESETS[name]["grid"]
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < grid or image_size % grid:
        raise ValueError(f"image_size={image_size!r}: expected a multiple of {grid} (preset {name!r} cuts each "
                         f"frame into {grid}x{grid} patches)")
    return vision.VisionConfig(image_size=image_size, patch_size=image_size // grid, num_cameras=len(cameras),
                               **PRESETS[name]["vit"])


def preset(name: str, *, vocab_size: int, image_size: int, cameras=("agentview", "wrist"),
           pad_token_id: int | None = None) -> vla.Config:
    """The `vla.model.Config` of a preset (`PRESETS`) for frames of `image_size` pixels and `cameras`."""
    cameras = tuple(cameras)
    vis = _vision(name, image_size, cameras)
    backbone = qwen2.Qwen2Config(vocab_size=vocab_size, pad_token_id=pad_token_id, **PRESETS[name]["backbone"])
    return vla.Config(backbone=backbone, vision=vis, cameras=cameras)


def check_tokenizer_folder(folder, what: str) -> pathlib.Path:
    """`folder` if it holds an HF tokenizer (tokenizer.json or tokenizer_config.json), else FileNotFoundError
    naming `what` (the flag or role) and what was expected."""
    folder = pathlib.Path(folder)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{what} {folder}: no tokenizer.json / tokenizer_config.json (expected an HF "
                                f"tokenizer folder)")
    return folder


class Pretrained(NamedTuple):
    """A VLA around a pretrained HF backbone (`from_hf_backbone`): its config, the backbone's params (pass them
    to `vla.init(..., backbone_params=)` or `train(params=)`), the backbone's tokenizer, and `grown`: the
    action rows appended to the vocabulary (0 when the checkpoint's padding rows held them)."""

    config: vla.Config
    backbone_params: dict
    tokenizer: Any
    grown: int


def from_hf_backbone(path, *, vision_preset: str, image_size: int, cameras=("agentview", "wrist"),
                     n_bins: int = 256) -> Pretrained:
    """A VLA whose backbone is the HF checkpoint at `path` (any registered family: MiniVLA's Qwen2.5-0.5B is
    a `qwen2`), loaded through `models.load_hf`, with its own tokenizer; the ViT is `vision_preset`'s, from
    scratch (the preset's backbone shape is not used).

    The action ids are the last `n_bins` ids of the vocabulary and must lie above every text id. Qwen2.5's
    checkpoints pad their embedding past the tokenizer (0.5B: 151,936 rows for 151,665 ids), so the 256 action
    ids fit in rows no text id reaches and nothing changes shape. Otherwise `n_bins` rows are appended to the
    embedding (and an untied LM head), each the mean of the text ids' rows, and they are the action ids
    (`grown` = n_bins).
    """
    from wmrl_jax import models
    from wmrl_jax.models.tokenizer import import_transformers

    path = pathlib.Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"backbone {path}: no config.json (expected an HF checkpoint folder, e.g. "
                                f"Qwen2.5-0.5B's)")
    check_tokenizer_folder(path, "backbone")   # the VLA reads its instructions with the backbone's own tokenizer
    cameras = tuple(cameras)
    vis = _vision(vision_preset, image_size, cameras)
    tokenizer = import_transformers().AutoTokenizer.from_pretrained(path)
    model = models.load_hf(path, dtype="float32")
    backbone, params = model.config, dict(model.params)
    n_text = len(tokenizer)
    if n_text > backbone.vocab_size:
        raise ValueError(f"backbone {path}: its tokenizer has {n_text} ids but the embedding {backbone.vocab_size} "
                         f"rows (expected a tokenizer no larger than the checkpoint's vocabulary)")
    top = backbone.vocab_size if backbone.token_count is None else backbone.token_count
    grown = 0
    if n_text > top - n_bins:   # no room above the text ids: n_bins rows appended, the action ids
        grown, top = n_bins, backbone.vocab_size + n_bins

        def grow(w, axis):
            mean = jnp.mean(w[:n_text] if axis == 0 else w[:, :n_text], axis=axis, keepdims=True)
            return jnp.concatenate([w, jnp.repeat(mean, grown, axis=axis)], axis=axis)

        params["embed_vd"] = grow(params["embed_vd"], 0)
        if "lm_head_dv" in params:
            params["lm_head_dv"] = grow(params["lm_head_dv"], 1)
        backbone = dataclasses.replace(backbone, vocab_size=top, token_count=None)
    config = vla.Config(backbone=backbone, vision=vis, cameras=cameras, n_bins=n_bins, action_vocab_size=top)
    return Pretrained(config=config, backbone_params=params, tokenizer=tokenizer, grown=grown)


# --------------------------------------------------------------------------- config and params on disk

def _family_name(backbone) -> str:
    for model_type in FAMILIES:
        if type(backbone) is get_family(model_type).Config:
            return model_type
    raise TypeError(f"backbone: {type(backbone).__name__} is not the Config of a registered family")


def _tuples(x):
    """JSON lists back to tuples (configs are frozen, hashable dataclasses)."""
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    return x


def config_to_dict(config: vla.Config) -> dict:
    """A JSON-able dict of a `vla.model.Config` (`config_from_dict` inverts it)."""
    rest = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in ("backbone", "vision")}
    return {"backbone_type": _family_name(config.backbone), "backbone": dataclasses.asdict(config.backbone),
            "vision": dataclasses.asdict(config.vision), **rest}


def config_from_dict(d: dict) -> vla.Config:
    d = _tuples(dict(d))
    backbone = get_family(d.pop("backbone_type")).Config(**d.pop("backbone"))
    return vla.Config(backbone=backbone, vision=vision.VisionConfig(**d.pop("vision")), **d)


def flatten(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """Nested dicts of arrays -> {"a/b/c": array}; anything but dicts and arrays raises."""
    out = {}
    for k, v in params.items():
        if "/" in str(k):
            raise ValueError(f"params key {prefix}{k!r}: '/' is the path separator, expected names without it")
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}/"))
        elif hasattr(v, "shape"):
            out[f"{prefix}{k}"] = np.asarray(v)
        else:
            raise TypeError(f"params[{prefix}{k}]: {type(v).__name__}, expected nested dicts of arrays")
    return out


def unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, v in flat.items():
        node = out
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


POLICY_FILES = ("params.npz", "config.json", "meta.json")


class Policy(NamedTuple):
    """A saved SFT policy: params (float32 jax arrays), its `vla.model.Config`, text tokenizer, meta dict."""

    params: dict
    config: vla.Config
    tokenizer: Any
    meta: dict
    path: pathlib.Path


def save_policy(folder, params: dict, config: vla.Config, tokenizer, meta: dict) -> pathlib.Path:
    """Write params.npz (float32), config.json, meta.json and the tokenizer (tokenizer/) to `folder`.

    Written as `<folder>.new` and renamed into place (an older folder is swapped out only once the new one
    is complete): an interrupted save never leaves a partial policy.
    """
    folder = pathlib.Path(folder)
    staging = folder.with_name(folder.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    np.savez(staging / "params.npz", **{k: v.astype(np.float32) for k, v in flatten(jax.device_get(params)).items()})
    (staging / "config.json").write_text(json.dumps(config_to_dict(config), indent=1) + "\n")
    (staging / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    tokenizer.save_pretrained(staging / "tokenizer")
    return files.swap_into_place(staging, folder)


def check_policy_folder(folder) -> pathlib.Path:
    """`folder` (or its `policy/` subfolder: an SFT run's --out) if it holds a saved policy, else
    FileNotFoundError naming what is missing. Cheap: reads nothing."""
    folder = pathlib.Path(folder)
    if (folder / "policy" / "config.json").is_file():
        folder = folder / "policy"
    missing = [f for f in (*POLICY_FILES, "tokenizer") if not (folder / f).exists()]
    if missing:
        raise FileNotFoundError(f"{folder}: not an SFT policy folder (missing {', '.join(missing)}); expected the "
                                f"--out of launch/vla_sft.py or its policy/ subfolder")
    return folder


def load_policy(folder) -> Policy:
    """The policy `save_policy` wrote (or an SFT run's --out); shapes are checked against its config."""
    from wmrl_jax.models.tokenizer import import_transformers

    folder = check_policy_folder(folder)
    config = config_from_dict(json.loads((folder / "config.json").read_text()))
    with np.load(folder / "params.npz") as z:
        params = unflatten({k: z[k] for k in z.files})
    want = jax.eval_shape(lambda: vla.init(config, jax.random.key(0)))
    flat_want = {k: v.shape for k, v in flatten_shapes(want).items()}
    flat_got = {k: v.shape for k, v in flatten(params).items()}
    for key in sorted(flat_want.keys() | flat_got.keys()):
        if flat_want.get(key) != flat_got.get(key):
            raise ValueError(f"{folder}/params.npz: {key} has shape {flat_got.get(key, 'missing')}, expected "
                             f"{flat_want.get(key, 'no such leaf')} for its config.json")
    tokenizer = import_transformers().AutoTokenizer.from_pretrained(folder / "tokenizer")
    meta = json.loads((folder / "meta.json").read_text())
    return Policy(params=jax.tree.map(jnp.asarray, params), config=config, tokenizer=tokenizer, meta=meta,
                  path=folder)


def flatten_shapes(tree: dict, prefix: str = "") -> dict:
    """`flatten` for a tree of ShapeDtypeStructs."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten_shapes(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


# --------------------------------------------------------------------------- training

@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The SFT run: `steps` updates of `batch_size` samples; AdamW at peak `lr` (warm-up, cosine to 10 %).

    eval_every: held-out metrics every this many steps (0: only at the end); eval_samples: at most this
    many held-out samples, evenly spaced (None: all). save_every: checkpoint period (and at the end).
    """

    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.98
    seed: int = 0
    eval_every: int = 100
    eval_samples: int | None = 256
    save_every: int = 100

    def __post_init__(self):
        ints = {"steps": 1, "batch_size": 1, "warmup_steps": 0, "eval_every": 0, "save_every": 1}
        for name, lo in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"SFTConfig.{name}={v!r}: expected an int >= {lo}")
        if not self.lr > 0 or not self.weight_decay >= 0 or not self.grad_clip > 0:
            raise ValueError(f"SFTConfig: lr={self.lr}, weight_decay={self.weight_decay}, grad_clip={self.grad_clip}: "
                             f"expected lr > 0, weight_decay >= 0, grad_clip > 0")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"SFTConfig: b1={self.b1}, b2={self.b2}: expected each in [0, 1)")
        if self.eval_samples is not None and self.eval_samples < 1:
            raise ValueError(f"SFTConfig.eval_samples={self.eval_samples!r}: expected >= 1 or None (all)")


def schedule(sft: SFTConfig):
    """The learning rate by update: linear warm-up from 0 to `lr` (at most steps // 2 updates), cosine to lr / 10."""
    import optax

    return optax.warmup_cosine_decay_schedule(0.0, sft.lr, min(sft.warmup_steps, sft.steps // 2), sft.steps,
                                              end_value=0.1 * sft.lr)


def make_optimizer(sft: SFTConfig):
    import optax

    return optax.chain(optax.clip_by_global_norm(sft.grad_clip),
                       optax.adamw(schedule(sft), b1=sft.b1, b2=sft.b2, weight_decay=sft.weight_decay))


def _row_metrics(params, config: vla.Config, batch: dict):
    """Per-row (NLL mean over the action tokens, teacher-forced token accuracy), float32 [B] each."""
    z = vla.action_logits(params, config, batch)
    bins = config.tokenizer.ids_to_bins(batch["action_ids"])
    logp = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), bins[..., None], axis=-1)[..., 0]
    hit = (jnp.argmax(z, axis=-1) == bins).astype(jnp.float32)
    return -jnp.mean(logp, axis=-1), jnp.mean(hit, axis=-1)


@functools.lru_cache(maxsize=8)
def make_step(config: vla.Config, sft: SFTConfig):
    """jitted (params, opt_state, batch) -> (params, opt_state, loss, accuracy); loss = `vla.sft_loss`.

    Cached by (config, sft): a resumed or repeated run in the same process reuses the compiled step."""
    import optax

    optimizer = make_optimizer(sft)

    def loss_fn(params, batch):
        nll, acc = _row_metrics(params, config, batch)
        return jnp.mean(nll), jnp.mean(acc)

    @jax.jit
    def step(params, opt_state, batch):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    return step


_METRICS = jax.jit(_row_metrics, static_argnums=1)
_INIT = jax.jit(vla.init, static_argnums=0)


def _greedy_l1(params, config, batch, actions):
    out = vla.sample_actions(params, config, {k: v for k, v in batch.items() if k != "action_ids"},
                             jax.random.key(0), 0.0)
    return jnp.mean(jnp.abs(out.actions - actions), axis=-1)


_GREEDY_L1 = jax.jit(_greedy_l1, static_argnums=1)


def evaluate(params, config: vla.Config, samples: demos.Samples, *, batch_size: int, limit: int | None = None,
             greedy: bool = True) -> dict:
    """{"samples", "loss", "accuracy", "action_l1"} over at most `limit` samples (evenly spaced).

    Batches of `batch_size` (the last one padded with repeats that are not counted: one shape, one compile).
    action_l1: the greedy policy's mean |decoded action - demonstrated action| per dimension (omitted when
    not `greedy`).
    """
    rows = demos.eval_rows(len(samples), limit)
    sums = {"loss": 0.0, "accuracy": 0.0, "action_l1": 0.0}
    for start in range(0, rows.size, batch_size):
        chunk = rows[start : start + batch_size]
        n = chunk.size
        padded = np.concatenate([chunk, np.full(batch_size - n, chunk[0])])
        batch = samples.batch(padded)
        nll, acc = (np.asarray(x)[:n] for x in _METRICS(params, config, batch))
        sums["loss"] += float(nll.sum())
        sums["accuracy"] += float(acc.sum())
        if greedy:
            sums["action_l1"] += float(np.asarray(_GREEDY_L1(params, config, batch, samples.actions[padded]))[:n].sum())
    out = {"samples": int(rows.size), **{k: v / rows.size for k, v in sums.items()}}
    if not greedy:
        del out["action_l1"]
    return out


class TrainResult(NamedTuple):
    """params after `step` updates; history: per-step "loss", "accuracy", "lr" lists and "held_out" records."""

    params: dict
    step: int
    history: dict
    resumed_from: int


def _run_identity(config: vla.Config, sft: SFTConfig, train_set: demos.Samples, held_out) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    return {"model": config_to_dict(config), "sft": dataclasses.asdict(sft),
            "train_samples": len(train_set), "train_sources": len(train_set.sources),
            "held_out_samples": 0 if held_out is None else len(held_out),
            "instructions": list(train_set.instructions)}


def _first_difference(a, b, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys(), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
        return path
    return f"{path} ({b!r} in the checkpoint, {a!r} now)"


def resume(workdir, params, opt_state, identity: dict):
    """`<workdir>/checkpoints` opened, and its latest state restored when it holds one of this run.

    Returns (checkpointer or None without a workdir, steps done, params, opt_state, the saved history or None).
    A checkpoint whose recorded run (`identity`, JSON-like) differs is refused, naming the first difference.
    """
    from wmrl_jax.train.checkpoint import Checkpointer

    if workdir is None:
        return None, 0, params, opt_state, None
    folder = pathlib.Path(workdir) / "checkpoints"
    ckpt = Checkpointer(folder, max_to_keep=2)
    restored = ckpt.latest({"params": params, "opt_state": opt_state})
    if restored is None:
        return ckpt, 0, params, opt_state, None
    done, tree, meta = restored
    if meta["run"] != identity:
        ckpt.close()
        raise ValueError(f"{folder}: holds step {done} of another run ({_first_difference(identity, meta['run'])}); "
                         "use another --out, or delete it")
    # Orbax restores committed arrays, which jit keys apart from fresh ones: through the host they are
    # uncommitted again and the compiled step is reused (~20 s of CPU compile saved per resume).
    tree = jax.tree.map(jnp.asarray, jax.device_get(tree))
    return ckpt, done, tree["params"], tree["opt_state"], meta["history"]


def train(config: vla.Config, train_set: demos.Samples, sft: SFTConfig, workdir=None, *,
          held_out: demos.Samples | None = None, params: dict | None = None, stop: int | None = None,
          progress: bool = True) -> TrainResult:
    """SFT of a VLA (`config`) on `train_set`; resumes from `workdir`/checkpoints when a checkpoint of the same
    run is there.

    Args:
      params: the initial params (default: `vla.init(config, key(sft.seed))`).
      workdir: checkpoints go to `<workdir>/checkpoints` every `sft.save_every` steps and at the end; None:
        no checkpoints.
      held_out: samples of held-out states, scored every `sft.eval_every` steps and at the end.
      stop: stop after this many updates without changing the schedule (the first updates of a longer run).
    """
    from tqdm.auto import tqdm

    if len(train_set) == 0:
        raise ValueError("train_set: no samples (expected demonstrations from the training states)")
    stop = sft.steps if stop is None else min(int(stop), sft.steps)
    optimizer = make_optimizer(sft)
    if params is None:
        params = _INIT(config, jax.random.key(sft.seed))
    opt_state = optimizer.init(params)
    history = {"loss": [], "accuracy": [], "lr": [], "held_out": []}
    identity = json.loads(json.dumps(_run_identity(config, sft, train_set, held_out)))   # as the meta reads back
    ckpt, done, params, opt_state, restored = resume(workdir, params, opt_state, identity)
    history = history if restored is None else restored
    resumed_from = done
    stop = max(stop, done)   # a checkpoint past `stop`: returned as it is

    def save(step):
        if ckpt is not None:
            ckpt.save(step, {"params": params, "opt_state": opt_state}, {"run": identity, "history": history})

    def held_out_eval(step):
        if held_out is not None and len(held_out) and (not history["held_out"] or
                                                       history["held_out"][-1]["step"] != step):
            record = evaluate(params, config, held_out, batch_size=sft.batch_size, limit=sft.eval_samples)
            history["held_out"].append({"step": step, **record})
            return record

    step_fn = make_step(config, sft)
    lr = schedule(sft)
    bar = tqdm(range(done, stop), total=stop, initial=done, desc="vla sft", disable=not progress, unit="step")
    for i in bar:
        batch = train_set.batch(demos.batch_rows(len(train_set), sft.batch_size, sft.seed, i))
        params, opt_state, loss, acc = step_fn(params, opt_state, batch)
        history["loss"].append(float(loss))
        history["accuracy"].append(float(acc))
        history["lr"].append(float(lr(i)))
        post = {"loss": f"{history['loss'][-1]:.3f}", "acc": f"{history['accuracy'][-1]:.2f}"}
        if sft.eval_every and (i + 1) % sft.eval_every == 0 and i + 1 < stop:
            record = held_out_eval(i + 1)
            if record:
                post["held_out_loss"] = f"{record['loss']:.3f}"
        bar.set_postfix(post)
        if (i + 1) % sft.save_every == 0 and i + 1 < stop:
            save(i + 1)
    bar.close()
    if done < stop or not history["held_out"]:
        held_out_eval(stop)
    if ckpt is not None:
        if done < stop:
            save(stop)
        ckpt.wait()
        ckpt.close()
    return TrainResult(params=params, step=stop, history=history, resumed_from=resumed_from)


def plot_history(history: dict, path, *, title: str = "VLA SFT") -> None:
    """Loss and action-token accuracy by step (train: per step and a moving average; held-out: points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss, acc = np.asarray(history["loss"]), np.asarray(history["accuracy"])
    steps = np.arange(1, loss.size + 1)
    window = max(1, loss.size // 50)
    smooth = lambda x: np.convolve(x, np.ones(window) / window, mode="valid")  # noqa: E731
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, values, key, label in ((ax1, loss, "loss", "NLL of the action tokens"),
                                   (ax2, acc, "accuracy", "action-token accuracy (teacher-forced)")):
        ax.plot(steps, values, color="tab:blue", alpha=0.25, lw=0.8)
        ax.plot(steps[window - 1 :], smooth(values), color="tab:blue", label=f"train (mean of {window})")
        held = [r for r in history["held_out"] if key in r]
        if held:
            ax.plot([r["step"] for r in held], [r[key] for r in held], "o-", color="tab:orange",
                    label=f"held-out states ({held[-1]['samples']} samples)")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
