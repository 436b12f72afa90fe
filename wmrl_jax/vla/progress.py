"""The VLA track's world model: a frozen progress predictor, (instruction, frame) -> progress in [0, 1] (issue #30).

    config = progress.Config(body=sft.preset("tiny", vocab_size=..., image_size=64))
    data, report = progress.load_episodes([demos_dir, rollouts_dir], config, tokenizer)
    train_rows = data.rows(data.episode_ids(exclude_states=range(7, 10)), stride=2)
    result = progress.train(config, data, train_rows, sft.SFTConfig(steps=600))
    p = progress.predict(result.params, config, data, rows)               # float32 [n] in [0, 1]
    p8 = progress.score_episodes(result.params, config, data, held_out_ids)   # [E, 8], sampled frames
    score = progress.collapse(p8, "potential")                            # one scalar a rollout: the WM reward
    report = progress.fidelity(p8, success)                               # AUC, Spearman, reliability bins

The paper scores a VLA rollout with an off-the-shelf progress model
(Robometer): per-frame progress, collapsed to one scalar by potential-based
shaping. None can be downloaded here, so one is trained on the project's
own model code: the policy's architecture (`vla.model`: the ViT of
`vision.py`, a projector, a registered text family reading the image tokens
then the instruction), with a progress head on the last position's hidden
state instead of the action tokens. Being the policy's architecture, it can
start from an SFT policy's weights (the paper's world model is the agent's
own backbone on the code track).

**Targets.** A frame at step t of an episode of T steps gets
    y = 1{episode succeeded} · t / T          (failure_label="zero", default)
i.e. time along a successful episode (demonstrations: t/T, the last frame 1),
and 0 on every frame of a failed rollout. With the binary cross-entropy on
soft targets the model's minimiser is E[y | frame, instruction]
= P(success | frame) · E[t/T | frame, success]: the expected progress
toward a success. A frame a failure shares with successes (the start, an
approach that later misses) gets partial credit, a frame only failures show
gets ~0; nothing is hand-labelled, and the model is imperfect where the
frames do not tell success from failure, as a real one is. The alternative
failure_label="time" labels failures t/T too (a pure clock, blind to
outcome), for comparison. Unknown and still-running episodes are excluded
(the Episode contract), counted in the report.

**Head.** One logit, sigmoid: a scalar in [0, 1] by construction, and the
BCE's minimiser is the conditional mean above, which the collapse averages
and the isotonic debiasing recalibrates anyway. A binned head (a
distribution over progress) would add a spread per frame, but the
corrections take their variance from the anchors' disagreement, not from
the model, so it would buy nothing downstream.

**Collapse** (`collapse`, pure, jittable): of F frames sampled evenly over a
rollout (`sample_frames`, F = 8 with the first and the last), `potential`
= mean of the last k progresses minus the first k's (k = 3; in [-1, 1]; a
model equal to its targets gives 18/21 - 3/21 = 0.714 to a success, 0 to a
failure), `final` = the last frame's, `max` = the largest, `success` =
1{final >= threshold} (threshold 0.5: the final frame's target is exactly
1{success}, so its progress reads as P(success)).

**Fidelity** (`fidelity`) against the simulator's success, per collapse
mode: ROC AUC (ties count half: scikit-learn's `roc_auc_score`) with a
stratified bootstrap 95 % interval (few held-out episodes), Spearman's
rho of the score with success (average ranks for ties: scipy's
`spearmanr`), and reliability bins of the final-frame progress as P(success)
(counts, mean predicted, observed rate, ECE).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import shutil
import zipfile
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from wmrl_jax import files
from wmrl_jax.models.layers import positions_from_valid
from wmrl_jax.vla import demos, sft
from wmrl_jax.vla import model as vla

COLLAPSE_MODES = ("potential", "final", "max", "success")
FAILURE_LABELS = ("zero", "time")
N_FRAMES, K = 8, 3   # the paper's shaping: 8 frames sampled a rollout, k = 3
SUCCESS_THRESHOLD = 0.5


@dataclasses.dataclass(frozen=True)
class Config:
    """A progress model: `body` (a `vla.model.Config`: ViT, projector, backbone; its action fields unused) and
    the target definition (`failure_label`, see the module docstring)."""

    body: vla.Config
    failure_label: str = "zero"

    def __post_init__(self):
        if self.failure_label not in FAILURE_LABELS:
            raise ValueError(f"failure_label={self.failure_label!r}: expected one of {FAILURE_LABELS}")


# --------------------------------------------------------------------------- collapse and metrics (pure)

def check_mode(mode: str) -> str:
    if mode not in COLLAPSE_MODES:
        raise ValueError(f"collapse mode {mode!r}: expected one of {COLLAPSE_MODES}")
    return mode


def sample_frames(n_recorded: int, count: int = N_FRAMES) -> np.ndarray:
    """int [count]: indices of `count` frames evenly spaced over `n_recorded`, the first and the last included
    (repeats when there are fewer frames than `count`)."""
    if n_recorded < 1 or count < 1:
        raise ValueError(f"n_recorded={n_recorded}, count={count}: expected >= 1 each")
    return np.linspace(0, n_recorded - 1, count).round().astype(np.int64)


def collapse(progress, mode: str = "potential", k: int = K, threshold: float = SUCCESS_THRESHOLD) -> jax.Array:
    """float32 [...]: one score per rollout from per-frame progress [..., F] (frames in time order).

    potential: mean(p[..., -k:]) - mean(p[..., :k])    (the paper's potential-based shaping, in [-1, 1])
    final:     p[..., -1]
    max:       max over frames
    success:   1.0 where p[..., -1] >= threshold, else 0.0
    Pure and jittable (mode, k static).
    """
    check_mode(mode)
    p = jnp.asarray(progress, jnp.float32)
    if p.ndim < 1 or (mode == "potential" and not 1 <= k <= p.shape[-1]):
        raise ValueError(f"progress of shape {p.shape}, k={k}: expected [..., F] with 1 <= k <= F")
    if mode == "potential":
        return jnp.mean(p[..., -k:], axis=-1) - jnp.mean(p[..., :k], axis=-1)
    if mode == "final":
        return p[..., -1]
    if mode == "max":
        return jnp.max(p, axis=-1)
    return (p[..., -1] >= threshold).astype(jnp.float32)


def average_ranks(x) -> np.ndarray:
    """float64 [n]: 1-based ranks of x, ties sharing their average rank."""
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(x.size)
    sorted_x = x[order]
    start = 0
    while start < x.size:
        end = start
        while end + 1 < x.size and sorted_x[end + 1] == sorted_x[start]:
            end += 1
        ranks[order[start : end + 1]] = 0.5 * (start + end) + 1.0
        start = end + 1
    return ranks


def auc(scores, labels) -> float:
    """ROC AUC = P(score of a success > score of a failure) + 0.5 P(tie) (Mann-Whitney U / (n1 n0)); NaN when
    one class is absent."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels, bool)
    n1, n0 = int(labels.sum()), int((~labels).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    r = average_ranks(scores)
    return float((r[labels].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def auc_interval(scores, labels, *, level: float = 0.95, resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `auc`, stratified: successes and failures resampled apart (each with
    replacement, its own count), as the two-sample bootstrap does. A resample's AUC is w1 · C · w0, C[i, j] =
    1{s_i > s_j} + 0.5 · 1{s_i = s_j} over (success i, failure j) and w the resample's counts / n: no ranking
    per resample. (NaN, NaN) when one class is absent."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels, bool)
    s1, s0 = scores[labels], scores[~labels]
    if s1.size == 0 or s0.size == 0:
        return float("nan"), float("nan")
    c = (s1[:, None] > s0[None, :]) + 0.5 * (s1[:, None] == s0[None, :])
    rng = np.random.default_rng(seed)
    w1 = np.stack([np.bincount(rng.integers(0, s1.size, s1.size), minlength=s1.size) for _ in range(resamples)])
    w0 = np.stack([np.bincount(rng.integers(0, s0.size, s0.size), minlength=s0.size) for _ in range(resamples)])
    values = np.einsum("bi,ij,bj->b", w1 / s1.size, c, w0 / s0.size)
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def spearman(x, y) -> float:
    """Spearman's rho: Pearson's correlation of the average ranks; NaN when either side is constant."""
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = np.sqrt((rx**2).sum() * (ry**2).sum())
    return float((rx * ry).sum() / den) if den > 0 else float("nan")


def reliability(pred, outcome, bins: int = 5) -> dict:
    """Reliability bins of predictions in [0, 1] against outcomes in [0, 1]: equal-width bins over [0, 1] (the
    last closed), per bin the count, mean prediction and mean outcome (None when empty); ECE = sum over bins of
    count/n · |mean prediction - mean outcome|."""
    pred, outcome = np.asarray(pred, np.float64), np.asarray(outcome, np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.searchsorted(edges, pred, side="right") - 1, 0, bins - 1)
    rows, ece = [], 0.0
    for b in range(bins):
        m = which == b
        n = int(m.sum())
        rows.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "count": n,
                     "mean_pred": float(pred[m].mean()) if n else None,
                     "rate": float(outcome[m].mean()) if n else None})
        if n:
            ece += n / pred.size * abs(pred[m].mean() - outcome[m].mean())
    return {"bins": rows, "ece": float(ece)}


def fidelity(frame_progress, success, *, k: int = K, threshold: float = SUCCESS_THRESHOLD, bins: int = 5) -> dict:
    """The progress model against real outcomes. frame_progress: [E, F] predicted progress of F sampled frames
    per episode (time order); success: bool [E] (the simulator's). Per collapse mode: AUC and Spearman of the
    score with success (AUC with its stratified bootstrap 95 % interval), mean score on successes and on
    failures; "calibration": reliability bins of the
    final-frame progress read as P(success)."""
    p = np.asarray(frame_progress, np.float32)
    y = np.asarray(success, bool)
    modes = {}
    for mode in COLLAPSE_MODES:
        s = np.asarray(collapse(p, mode, k, threshold))
        modes[mode] = {"auc": auc(s, y), "auc_ci95": auc_interval(s, y), "spearman": spearman(s, y.astype(np.float64)),
                       "mean_success": float(s[y].mean()) if y.any() else None,
                       "mean_failure": float(s[~y].mean()) if (~y).any() else None}
    return {"episodes": int(y.size), "successes": int(y.sum()), "modes": modes,
            "calibration": reliability(p[:, -1], y, bins)}


# --------------------------------------------------------------------------- model

def init(config: Config, rng: jax.Array) -> dict:
    """Params {"vision", "projector", "backbone"} (as `vla.model.init`) and "head": w_d [D], b [] (zeros: every
    frame starts at progress 0.5)."""
    params = vla.init(config.body, rng)
    d = config.body.backbone.hidden_size
    params["head"] = {"w_d": jnp.zeros((d,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return params


def logits(params: dict, config: Config, batch: dict) -> jax.Array:
    """float32 [B]: the progress logit of each row (cameras, "text", "text_valid" as `vla.model_inputs` reads):
    the prompt [images | instruction] through the backbone, the last position's hidden state through the head.
    Rows are left-padded, so the last position is every row's last instruction token."""
    body = config.body
    embeds, valid = vla.embed_prompt(params, body, batch)
    tokens = jnp.zeros(valid.shape, jnp.int32)   # shape only: every input is in `embeds`
    hidden, _ = body.family.forward(params["backbone"], body.backbone, tokens, positions_from_valid(valid), valid,
                                    embeds=embeds)
    h = hidden[:, -1].astype(jnp.float32)
    return h @ params["head"]["w_d"] + params["head"]["b"]


def loss(params: dict, config: Config, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(mean binary cross-entropy of sigmoid(logit) against batch["target"] float [B] in [0, 1], mean |error|)."""
    import optax

    z = logits(params, config, batch)
    y = jnp.asarray(batch["target"], jnp.float32)
    return jnp.mean(optax.sigmoid_binary_cross_entropy(z, y)), jnp.mean(jnp.abs(jax.nn.sigmoid(z) - y))


_PREDICT = jax.jit(lambda params, config, batch: jax.nn.sigmoid(logits(params, config, batch)), static_argnums=1)


# --------------------------------------------------------------------------- data

@dataclasses.dataclass
class Frames:
    """Every recorded frame of the loaded episodes; row i of each per-frame array is one frame.

    images: camera -> uint8 [N, S, S, 3]; time: float32 [N], t / T; target: float32 [N] (`Config.failure_label`);
    instruction_index, episode, frame: int32 [N] (frame: index within its episode). text, text_valid: the
    distinct instructions in the model's prompt, left-padded. episodes: one dict per episode (path, task,
    state, success, steps, wall_s, first row, frames).
    """

    images: dict
    time: np.ndarray
    target: np.ndarray
    instruction_index: np.ndarray
    episode: np.ndarray
    frame: np.ndarray
    text: np.ndarray
    text_valid: np.ndarray
    instructions: tuple
    episodes: list

    def __len__(self) -> int:
        return int(self.time.shape[0])

    def batch(self, rows) -> dict:
        rows = np.asarray(rows)
        k = self.instruction_index[rows]
        return {**{c: v[rows] for c, v in self.images.items()}, "text": self.text[k], "text_valid": self.text_valid[k],
                "target": self.target[rows]}

    def episode_ids(self, states=None, exclude_states=None) -> list[int]:
        """Episodes whose initial state is in `states` (all when None) and not in `exclude_states`."""
        keep = set(states) if states is not None else None
        drop = set(exclude_states or ())
        return [i for i, e in enumerate(self.episodes)
                if (keep is None or e["state"] in keep) and e["state"] not in drop]

    def rows(self, episode_ids, stride: int = 1) -> np.ndarray:
        """int64: every `stride`-th frame of the given episodes, each episode's last frame always included."""
        out = []
        for i in episode_ids:
            e = self.episodes[i]
            local = np.unique(np.r_[np.arange(0, e["frames"], stride), e["frames"] - 1])
            out.append(e["first_row"] + local)
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)

    def sampled_rows(self, episode_id: int, count: int = N_FRAMES) -> np.ndarray:
        e = self.episodes[episode_id]
        return e["first_row"] + sample_frames(e["frames"], count)


def targets(frame_steps, steps: int, success: bool, failure_label: str = "zero") -> np.ndarray:
    """float32 [F]: the progress target of each frame (module docstring): t/T on a success; 0 (or t/T with
    failure_label="time") on a failure."""
    if failure_label not in FAILURE_LABELS:
        raise ValueError(f"failure_label={failure_label!r}: expected one of {FAILURE_LABELS}")
    t = np.clip(np.asarray(frame_steps, np.float32) / max(int(steps), 1), 0.0, 1.0)
    return t if (success or failure_label == "time") else np.zeros_like(t)


def _check_frames(path, ep, cameras: Sequence[str], size: int) -> None:
    steps = np.asarray(ep.frame_steps)
    for cam in cameras:
        if cam not in ep.frames:
            raise demos.DemoError(f"{path}: no frames of camera {cam!r} (it has {sorted(ep.frames)}); the progress "
                                  f"model reads {list(cameras)}")
        f = ep.frames[cam]
        if f.ndim != 4 or f.shape[1:] != (size, size, 3) or f.dtype != np.uint8:
            raise demos.DemoError(f"{path}: frames[{cam!r}] are {f.dtype} {tuple(f.shape[1:])}, expected uint8 "
                                  f"({size}, {size}, 3) (the model's image_size={size})")
        if f.shape[0] != steps.shape[0] or steps.shape[0] < 2:
            raise demos.DemoError(f"{path}: {f.shape[0]} frames of {cam!r} for {steps.shape[0]} frame_steps, "
                                  f"expected one frame per entry and at least 2 (the first and the last)")


def load_episodes(folders, config: Config, tokenizer) -> tuple[Frames, dict]:
    """Every Episode `.npz` under `folders` (each searched recursively) with a known outcome, all frames.

    Raises `demos.DemoError` (one line naming the file or folder) for a missing folder, a folder without
    episodes, an unreadable file, a camera missing, a frame size other than the model's, or no episode with a
    known outcome."""
    body = config.body
    cameras, size = tuple(body.cameras), body.vision.image_size
    images = {c: [] for c in cameras}
    parts = {k: [] for k in ("time", "target", "instruction_index", "episode", "frame")}
    instructions: dict[str, int] = {}
    episodes, skipped, n_files, n_rows = [], {}, 0, 0
    paths = [p for folder in folders for p in demos._episode_files(pathlib.Path(folder))]   # checks every folder first
    for path in paths:
        n_files += 1
        ep = demos._load_one(path)
        if ep.success is None:   # unknown or running: no outcome, excluded (never a failure)
            skipped[ep.status] = skipped.get(ep.status, 0) + 1
            continue
        _check_frames(path, ep, cameras, size)
        steps_f = np.asarray(ep.frame_steps)
        n = steps_f.size
        for c in cameras:
            images[c].append(np.asarray(ep.frames[c]))
        k = instructions.setdefault(ep.instruction, len(instructions))
        parts["time"].append(np.clip(steps_f / max(ep.steps, 1), 0, 1).astype(np.float32))
        parts["target"].append(targets(steps_f, ep.steps, ep.success, config.failure_label))
        parts["instruction_index"].append(np.full(n, k, np.int32))
        parts["episode"].append(np.full(n, len(episodes), np.int32))
        parts["frame"].append(np.arange(n, dtype=np.int32))
        episodes.append({"path": str(path), "task": int(ep.task_id), "state": int(ep.init_state_index),
                         "success": bool(ep.success), "steps": int(ep.steps), "wall_s": float(ep.wall_s),
                         "first_row": n_rows, "frames": int(n)})
        n_rows += n
    if not episodes:
        raise demos.DemoError(f"{', '.join(map(str, folders))}: none of the {n_files} episodes has a known outcome "
                              f"({skipped}); expected successes and failures")
    text, valid = vla.tokenize_instructions(tokenizer, list(instructions))
    data = Frames(images={c: np.concatenate(v) for c, v in images.items()},
                  **{k: np.concatenate(v) for k, v in parts.items()}, text=text, text_valid=valid,
                  instructions=tuple(instructions), episodes=episodes)
    report = {"files": n_files, "episodes": len(episodes), "successes": sum(e["success"] for e in episodes),
              "failures": sum(not e["success"] for e in episodes), "skipped_by_status": skipped,
              "frames": len(data), "failure_label": config.failure_label,
              "image_bytes": int(sum(v.nbytes for v in data.images.values()))}
    return data, report


# --------------------------------------------------------------------------- prediction and scoring

def predict(params: dict, config: Config, data: Frames, rows, *, batch_size: int = 64) -> np.ndarray:
    """float32 [len(rows)]: predicted progress of the given frames, in fixed-size batches (the last padded with
    repeats: one shape, one compile)."""
    rows = np.asarray(rows, np.int64)
    out = np.zeros(rows.size, np.float32)
    for start in range(0, rows.size, batch_size):
        chunk = rows[start : start + batch_size]
        padded = np.concatenate([chunk, np.full(batch_size - chunk.size, chunk[0])])
        batch = {k: v for k, v in data.batch(padded).items() if k != "target"}
        out[start : start + chunk.size] = np.asarray(_PREDICT(params, config, batch))[: chunk.size]
    return out


def score_episodes(params: dict, config: Config, data: Frames, episode_ids, *, count: int = N_FRAMES) -> np.ndarray:
    """float32 [E, count]: predicted progress of `count` frames sampled evenly over each episode (time order)."""
    rows = np.stack([data.sampled_rows(i, count) for i in episode_ids]) if len(episode_ids) else np.zeros((0, count))
    return predict(params, config, data, rows.reshape(-1), batch_size=count).reshape(-1, count)


# --------------------------------------------------------------------------- training

class TrainResult(NamedTuple):
    """params after `step` updates; history: per-step "loss", "mae", "lr" and "held_out" records."""

    params: dict
    step: int
    history: dict
    resumed_from: int


@functools.lru_cache(maxsize=8)
def make_step(config: Config, tc: sft.SFTConfig):
    """jitted (params, opt_state, batch) -> (params, opt_state, loss, mae); AdamW as the VLA's SFT (`sft.make_optimizer`)."""
    import optax

    optimizer = sft.make_optimizer(tc)

    @jax.jit
    def step(params, opt_state, batch):
        (value, mae), grads = jax.value_and_grad(loss, has_aux=True)(params, config, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, mae

    return step


_LOSS = jax.jit(loss, static_argnums=1)


def evaluate(params, config: Config, data: Frames, rows, *, batch_size: int, limit: int | None = None) -> dict:
    """{"frames", "loss", "mae"} over at most `limit` of `rows` (evenly spaced); padded batches as `predict`."""
    rows = np.asarray(rows)[demos.eval_rows(len(rows), limit)]
    pred = predict(params, config, data, rows, batch_size=batch_size)
    y = data.target[rows]
    p = np.clip(pred.astype(np.float64), 1e-7, 1 - 1e-7)
    bce = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    return {"frames": int(rows.size), "loss": float(bce), "mae": float(np.mean(np.abs(pred - y)))}


def train(config: Config, data: Frames, train_rows, tc: sft.SFTConfig, workdir=None, *, held_out_rows=None,
          params: dict | None = None, progress: bool = True) -> TrainResult:
    """`tc.steps` AdamW updates on batches of `train_rows` (`demos.batch_rows`: a function of (seed, step));
    resumes from `<workdir>/checkpoints` when a checkpoint of the same run is there (another run's: ValueError
    naming what differs); held-out BCE and |error| every `tc.eval_every` steps and at the end."""
    from tqdm.auto import tqdm

    train_rows = np.asarray(train_rows, np.int64)
    if train_rows.size == 0:
        raise ValueError("train_rows: no frames to train on (expected frames of the training states' episodes)")
    optimizer = sft.make_optimizer(tc)
    params = init(config, jax.random.key(tc.seed)) if params is None else params
    opt_state = optimizer.init(params)
    history = {"loss": [], "mae": [], "lr": [], "held_out": []}
    identity = json.loads(json.dumps({"config": config_to_dict(config), "train": dataclasses.asdict(tc),
                                      "train_frames": int(train_rows.size), "episodes": len(data.episodes),
                                      "instructions": list(data.instructions)}))
    ckpt, done, params, opt_state, restored = sft.resume(workdir, params, opt_state, identity)
    history = history if restored is None else restored
    resumed_from = done

    def held_out_eval(step):
        if held_out_rows is not None and len(held_out_rows) and (not history["held_out"] or
                                                                 history["held_out"][-1]["step"] != step):
            record = evaluate(params, config, data, held_out_rows, batch_size=tc.batch_size, limit=tc.eval_samples)
            history["held_out"].append({"step": step, **record})
            return record

    def save(step):
        if ckpt is not None:
            ckpt.save(step, {"params": params, "opt_state": opt_state}, {"run": identity, "history": history})

    step_fn, lr = make_step(config, tc), sft.schedule(tc)
    bar = tqdm(range(done, tc.steps), total=tc.steps, initial=done, desc="progress model", disable=not progress,
               unit="step")
    for i in bar:
        batch = data.batch(train_rows[demos.batch_rows(train_rows.size, tc.batch_size, tc.seed, i)])
        params, opt_state, value, mae = step_fn(params, opt_state, batch)
        history["loss"].append(float(value))
        history["mae"].append(float(mae))
        history["lr"].append(float(lr(i)))
        post = {"loss": f"{history['loss'][-1]:.3f}", "mae": f"{history['mae'][-1]:.3f}"}
        if tc.eval_every and (i + 1) % tc.eval_every == 0 and i + 1 < tc.steps:
            record = held_out_eval(i + 1)
            if record:
                post["held_out_mae"] = f"{record['mae']:.3f}"
        bar.set_postfix(post)
        if (i + 1) % tc.save_every == 0 and i + 1 < tc.steps:
            save(i + 1)
    bar.close()
    if done < tc.steps or not history["held_out"]:
        held_out_eval(tc.steps)
    if ckpt is not None:
        if done < tc.steps:
            save(tc.steps)
        ckpt.wait()
        ckpt.close()
    return TrainResult(params=params, step=tc.steps, history=history, resumed_from=resumed_from)


# --------------------------------------------------------------------------- the saved model

MODEL_FILES = ("params.npz", "config.json", "meta.json")


class ProgressModel(NamedTuple):
    """A saved progress model: params (jax arrays), its `Config`, the text tokenizer, the meta dict, its folder."""

    params: dict
    config: Config
    tokenizer: Any
    meta: dict
    path: pathlib.Path


def config_to_dict(config: Config) -> dict:
    return {"body": sft.config_to_dict(config.body), "failure_label": config.failure_label}


def config_from_dict(d: dict) -> Config:
    return Config(body=sft.config_from_dict(d["body"]), failure_label=d["failure_label"])


def save_model(folder, params: dict, config: Config, tokenizer, meta: dict) -> pathlib.Path:
    """params.npz (float32), config.json, meta.json and tokenizer/ in `folder`, written beside it and swapped
    into place (an interrupted save never leaves a partial model)."""
    folder = pathlib.Path(folder)
    staging = folder.with_name(folder.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    flat = sft.flatten(jax.device_get(params))
    np.savez(staging / "params.npz", **{k: np.asarray(v, np.float32) for k, v in flat.items()})
    (staging / "config.json").write_text(json.dumps(config_to_dict(config), indent=1) + "\n")
    (staging / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    tokenizer.save_pretrained(staging / "tokenizer")
    return files.swap_into_place(staging, folder)


def check_model_folder(folder) -> pathlib.Path:
    """`folder` (or its `model/` subfolder: launch/vla_progress.py's --out) if it holds a saved progress model,
    else FileNotFoundError naming what is missing. Reads nothing."""
    folder = pathlib.Path(folder)
    if (folder / "model" / "config.json").is_file():
        folder = folder / "model"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder (expected a progress model: launch/vla_progress.py's "
                                f"--out or its model/ subfolder)")
    missing = [f for f in (*MODEL_FILES, "tokenizer") if not (folder / f).exists()]
    if missing:
        raise FileNotFoundError(f"{folder}: not a progress model folder (missing {', '.join(missing)}); expected "
                                f"launch/vla_progress.py's --out or its model/ subfolder")
    return folder


def load_model(folder) -> ProgressModel:
    """The model `save_model` wrote; a missing file, unreadable JSON or params, or a shape other than the
    config's is one ValueError / FileNotFoundError naming the file."""
    from wmrl_jax.models.tokenizer import import_transformers

    folder = check_model_folder(folder)
    try:
        raw = {name: json.loads((folder / name).read_text()) for name in ("config.json", "meta.json")}
        config = config_from_dict(raw["config.json"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{folder}: config.json / meta.json unreadable ({type(e).__name__}: {e}); expected the "
                         f"files save_model writes") from None
    path = folder / "params.npz"
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not an .npz archive (corrupt or truncated); expected the params save_model writes")
    try:
        with np.load(path) as z:
            params = sft.unflatten({k: z[k] for k in z.files})
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e}); expected the params save_model writes") from None
    want = sft.flatten_shapes(jax.eval_shape(lambda: init(config, jax.random.key(0))))
    got = sft.flatten(params)
    for key in sorted(want.keys() | got.keys()):
        a = want[key].shape if key in want else None
        b = got[key].shape if key in got else None
        if a != b:
            raise ValueError(f"{path}: {key} has shape {'missing' if b is None else b}, expected "
                             f"{'no such leaf' if a is None else a} for its config.json")
    tokenizer = import_transformers().AutoTokenizer.from_pretrained(folder / "tokenizer")
    return ProgressModel(params=jax.tree.map(jnp.asarray, params), config=config, tokenizer=tokenizer,
                         meta=raw["meta.json"], path=folder)
