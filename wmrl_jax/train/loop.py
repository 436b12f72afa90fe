"""The WMRL training loop: sample, score (world model + a few real runs), correct, update, log, checkpoint.

One step, as data flows (docs/design.md, "One training step, as data flows"):

1. The policy samples G episodes for each of B tasks (`agent.run_episodes`).
2. `select_anchor_groups` picks the groups that pay for real execution. Their
   solutions go to the `SandboxPool` *first*; while the sandboxes run (other
   processes), the frozen world model scores every group on this one. The two
   overlap; both are timed and the overlap is logged.
3. `correct_step` turns real and world-model rewards into advantages: online
   debiasing (isotonic map refit on recent pairs) and inverse-variance
   weighting of the anchor groups. Ungraded rollouts (a sandbox failure, an
   unparseable prediction) are masked, never scored 0.
4. The jitted GRPO update (`train.update`), against the frozen reference --
   the same parameter copy the world model reads.

`rewards.mode` selects the paper's arms through switches of the same code:
only which groups run for real, whether the world model is asked, and the
correction state's debias / denoise flags change. One compiled update serves
every arm.

Everything a resumed run needs is in the checkpoint: params, optimizer state,
correction state, the base PRNG key, the step, the task cursor and the cost
counters; per-step randomness is derived from (seed, step), so a run killed
and restarted with the same command continues exactly.

Multi-process runs (`launch/train.py` under a launcher, `train.multihost`):
every process runs this same loop on the same data; sandboxes run on process
0 only and their results are broadcast (`multihost.ProcessZeroPool`); only
process 0 writes logs, config.json, summary.json and the exported policy.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any

import numpy as np

MODES = {
    # mode: (world model asked, which groups run for real, debias, denoise)
    "real": (False, "all", False, False),          # every group executed: the expensive baseline
    "wm_only": (True, "none", False, False),       # the simulator alone: no anchors, no corrections
    "naive_mix": (True, "some", False, False),     # anchors real, the rest raw world model
    "debias_only": (True, "some", True, False),
    "denoise_only": (True, "some", False, True),
    "wmrl": (True, "some", True, True),            # both corrections
}


def seed_for(*parts: int) -> int:
    """A 31-bit seed derived from integers (stable across runs and processes)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] >> 1)


# --------------------------------------------------------------------------- tasks

def load_tasks(config, split: str) -> list:
    """The tasks of `split` for `config.benchmark`, loaded (and so validated) before any compute."""
    import sandbox
    from sandbox import suite

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


# --------------------------------------------------------------------------- rewards

@dataclasses.dataclass
class Scores:
    """One step's rollout scores, [N, G], as `correct_step` takes them."""

    wm_rewards: np.ndarray
    wm_graded: np.ndarray
    real_rewards: np.ndarray
    real_graded: np.ndarray
    is_anchor: np.ndarray
    real_results: dict          # (group, rollout) -> ExecutionResult
    wm_predictions: list        # flat, or [] when the world model was not asked
    times: dict


def score_rollouts(episodes, tasks, group_size: int, anchors: np.ndarray, *, use_wm: bool, lm, wm_config, pool,
                   seed: int) -> Scores:
    """Real runs for the anchor groups (submitted first) overlapped with world-model predictions for all."""
    from wmrl_jax import world_model

    n = len(tasks)
    is_anchor = np.zeros(n, bool)
    is_anchor[anchors] = True
    t0 = time.perf_counter()
    futures, finished_at = {}, []
    for i, e in enumerate(episodes):
        b, g = divmod(i, group_size)
        if is_anchor[b]:
            futures[(b, g)] = pool.submit(tasks[b], e.solution if e.solution is not None else "")
            futures[(b, g)].add_done_callback(lambda _: finished_at.append(time.perf_counter()))
    t_wm0 = time.perf_counter()
    preds = []
    if use_wm:
        preds = world_model.predict(lm, [tasks[i // group_size] for i in range(len(episodes))],
                                    [e.solution for e in episodes], config=wm_config, seed=seed)
    t_wm1 = time.perf_counter()
    real_results = {}
    for key, fut in futures.items():
        try:
            real_results[key] = fut.result()
        except Exception as exc:   # the sandbox itself broke: this rollout is ungraded, the run goes on
            real_results[key] = exc
    t_real_done = max(finished_at, default=t0)   # when the last sandbox finished, not when we looked
    shape = (n, group_size)
    wm_r, wm_g = np.zeros(shape, np.float32), np.zeros(shape, bool)
    real_r, real_g = np.zeros(shape, np.float32), np.zeros(shape, bool)
    for i, p in enumerate(preds):
        if p.reward is not None:
            wm_r[divmod(i, group_size)], wm_g[divmod(i, group_size)] = p.reward, True
    for key, r in real_results.items():
        reward = getattr(r, "reward", None)
        if reward is not None:
            real_r[key], real_g[key] = reward, True
    overlap = max(0.0, min(t_wm1, t_real_done) - max(t_wm0, t0)) if futures and use_wm else 0.0
    times = {"wm_s": t_wm1 - t_wm0, "sandbox_s": (t_real_done - t0) if futures else 0.0, "overlap_s": overlap}
    return Scores(wm_r, wm_g, real_r, real_g, is_anchor, real_results, preds, times)


def make_pool(config):
    """The run's sandbox pool, from `config.sandbox` (backend "local" or "ray").

    In a multi-process run only process 0 makes a real pool; every process
    gets a `multihost.ProcessZeroPool` that shares process 0's results.
    """
    import jax

    import sandbox
    from wmrl_jax.train import multihost

    s = config.sandbox
    real = None
    if multihost.is_primary():
        real = sandbox.make_pool(s.backend, ray_address=s.ray_address, workers=s.workers, timeout_s=s.timeout_s,
                                 memory_mb=s.memory_mb, cpus=s.cpus)
    return multihost.ProcessZeroPool(real) if jax.process_count() > 1 else real


# --------------------------------------------------------------------------- batch

def make_batch(episodes, advantages: np.ndarray, weights: np.ndarray, *, width: int, pad_id: int):
    """Left-pads the episodes into a `train.update.Batch` of [B, width] arrays."""
    from wmrl_jax.train.update import Batch

    batch = len(episodes)
    tokens = np.full((batch, width), pad_id, np.int32)
    valid = np.zeros((batch, width), bool)
    mask = np.zeros((batch, width), bool)
    for i, e in enumerate(episodes):
        n = len(e.tokens)
        if n > width:
            raise ValueError(f"episode {i}: {n} tokens, more than the batch width {width}")
        tokens[i, width - n:], valid[i, width - n:], mask[i, width - n:] = e.tokens, True, e.loss_mask
    return Batch(tokens=tokens, valid=valid, loss_mask=mask, advantages=advantages.astype(np.float32),
                 weights=weights.astype(np.float32))


def batch_width(config, prompt_tokens: int) -> int:
    """A fixed [B, T] width for the whole run (one compiled update): the longest possible episode, in 256s."""
    a = config.agent
    longest = prompt_tokens + a.max_turns * a.max_new_tokens + (a.max_turns - 1) * (a.observation_max_tokens + 64)
    return -(-longest // 256) * 256


# --------------------------------------------------------------------------- the run

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


def _correction_state(rewards, debias: bool, denoise: bool):
    from wmrl_jax import corrections

    return corrections.init_correction_state(
        cap=rewards.cap, bins=rewards.bins, min_pairs=rewards.min_pairs, refit_every=rewards.refit_every,
        half_life=rewards.half_life, warmup=rewards.warmup, w_max=rewards.w_max,
        target_weight=rewards.target_weight, debias=debias, denoise=denoise)


def _step_scalars(scores: Scores, out, episodes, train_metrics: dict, counters: Counters, times: dict) -> dict:
    from wmrl_jax.fidelity import spearman

    anchor_rows = scores.is_anchor[:, None] & np.ones_like(scores.real_graded)
    real = scores.real_rewards[scores.real_graded]
    raw = scores.wm_rewards[scores.wm_graded]
    calibrated = np.asarray(out.rewards)[np.asarray(out.graded) & ~anchor_rows]
    both = scores.real_graded & scores.wm_graded
    statuses = [getattr(r, "status", "unknown") for r in scores.real_results.values()]
    wm_status = [p.status for p in scores.wm_predictions]
    nan = float("nan")
    scalars = {
        "reward/real_mean": float(real.mean()) if real.size else nan,
        "reward/wm_raw_mean": float(raw.mean()) if raw.size else nan,
        "reward/wm_calibrated_mean": float(calibrated.mean()) if calibrated.size else nan,
        "wmrl/anchor_fraction": float(out.anchor_fraction),
        "wmrl/calibrated": float(out.calibrated),
        "wmrl/bias_reduction": float(out.bias_reduction),
        "wmrl/anchor_weight": float(out.anchor_weight),
        "wmrl/disagreement": float(out.disagreement),
        "wmrl/pairs_in_buffer": float(out.pairs_in_buffer),
        "wmrl/spearman_wm_real": spearman(scores.wm_rewards[both], scores.real_rewards[both]),
        "agent/valid_rate": statuses.count("valid") / len(statuses) if statuses else nan,
        "agent/wm_valid_rate": wm_status.count("valid") / len(wm_status) if wm_status else nan,
        "agent/has_solution": float(np.mean([e.solution is not None for e in episodes])),
        "agent/reply_tokens": float(np.mean([e.loss_mask.sum() for e in episodes])),
        "cost/real_executions": counters.real_executions,
        "cost/sandbox_cpu_s": counters.sandbox_cpu_s,
        "cost/wm_predictions": counters.wm_predictions,
        "cost/tokens_generated": counters.tokens_generated,
        "cost/ungraded_real": counters.ungraded_real,
        "cost/ungraded_wm": counters.ungraded_wm,
    }
    scalars.update({f"time/{k}": v for k, v in times.items()})
    scalars.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
    return scalars


def _log_pairs(path: pathlib.Path, step: int, scores: Scores, corr) -> None:
    """Appends the step's anchor (WM, real) reward pairs, the WM rewards through the map in force after the
    step's pushes, and that map's knots, as one JSON line (for reliability diagrams; a resumed run may repeat
    a step: last wins)."""
    import jax

    from wmrl_jax import corrections

    # The map as host arrays first: in a multi-process run the state is global (replicated) arrays, and
    # an op on them in process 0 alone would wait for the others.
    fitted = corrections.MonotoneMap(*(np.asarray(jax.device_get(x)) for x in corr.fitted))
    both = scores.real_graded & scores.wm_graded & scores.is_anchor[:, None]
    wm, real = scores.wm_rewards[both], scores.real_rewards[both]
    calibrated = np.asarray(corrections.apply_calibration(fitted, wm)) if wm.size else wm
    n = int(fitted.n_knots)
    record = {"step": step, "wm": wm.round(6).tolist(), "real": real.round(6).tolist(),
              "calibrated": np.asarray(calibrated, np.float64).round(6).tolist(), "map_fitted": bool(fitted.valid),
              "map_x": fitted.knots_x[:n].astype(np.float64).round(6).tolist(),
              "map_y": fitted.knots_y[:n].astype(np.float64).round(6).tolist()}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _rollout_text(episodes, scores: Scores, group_size: int, count: int) -> str:
    parts = []
    # Evenly spaced rollouts, by position (an Episode holds arrays: `list.index` would compare them).
    for idx in list(range(0, len(episodes), max(1, len(episodes) // max(1, count))))[:count]:
        e = episodes[idx]
        b, g = divmod(idx, group_size)
        real = scores.real_results.get((b, g))
        wm = scores.wm_predictions[idx] if scores.wm_predictions else None
        parts.append(f"**group {b} rollout {g}** real: {getattr(real, 'status', '-')} "
                     f"{getattr(real, 'reward', '-')}; world model: {getattr(wm, 'status', '-')} "
                     f"{getattr(wm, 'reward', '-')}\n\n```python\n{e.solution or '(no code)'}\n```")
    return "\n\n".join(parts)


@dataclasses.dataclass
class RunSummary:
    """What a run did and what it cost; `str()` is the table printed at the end."""

    mode: str
    steps: int
    counters: Counters
    rollouts_per_step: int
    final: dict
    eval_before: dict | None
    eval_after: dict | None
    seconds: float
    export_path: str | None
    workdir: str

    def __str__(self) -> str:
        c = self.counters
        per_run = c.sandbox_cpu_s / max(1, c.real_executions)
        real_equiv = self.steps * self.rollouts_per_step
        rows = [
            ("mode", self.mode), ("steps", self.steps),
            ("real executions", f"{c.real_executions} (mode=real would run {real_equiv})"),
            ("sandbox CPU-seconds", f"{c.sandbox_cpu_s:.0f} (mode=real: ~{per_run * real_equiv:.0f} at "
                                    f"{per_run:.1f} s a run)"),
            ("trainer CPU-seconds", f"{c.compute_cpu_s:.0f} (sampling, world model, update)"),
            ("world-model predictions", c.wm_predictions), ("tokens generated", c.tokens_generated),
            ("ungraded rollouts (real / world model)", f"{c.ungraded_real} / {c.ungraded_wm}"),
            ("calibrated / refits", f"{self.final.get('wmrl/calibrated')} / {self.final.get('wmrl/n_fits')}"),
            ("bias reduction", f"{self.final.get('wmrl/bias_reduction', float('nan')):.3f}"),
            ("anchor weight", f"{self.final.get('wmrl/anchor_weight', float('nan')):.3f}"),
        ]
        if self.eval_before is not None and self.eval_after is not None:
            k = self.eval_after["attempts"]
            rows.append((f"held-out avg@{k} before -> after",
                         f"{self.eval_before['score']:.4f} -> {self.eval_after['score']:.4f}"))
        rows += [("wall time", f"{self.seconds:.0f} s"), ("workdir", self.workdir), ("exported policy", self.export_path)]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def train(config, *, progress: bool = True) -> RunSummary:
    """Runs (or resumes) the training run `config` describes; returns its summary.

    Every input is checked before any compute (`configs.validate`): model
    folder, task folders and leaderboards, mode, batch vs mesh.
    """
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    from wmrl_jax import agent, chat, corrections, micro_world, world_model
    from wmrl_jax.evaluate import evaluate
    from wmrl_jax.models import make_mesh, save_hf
    from wmrl_jax.train import multihost, update
    from wmrl_jax.train.checkpoint import Checkpointer
    from wmrl_jax.train.config import agent_config, resolve_mesh, validate, world_model_config
    from wmrl_jax.train.metrics import SummaryWriter

    start = time.perf_counter()
    primary, multi_process = multihost.is_primary(), jax.process_count() > 1
    validate(config)
    use_wm, anchors_mode, debias, denoise = MODES[config.rewards.mode]
    train_tasks = load_tasks(config, config.train_split)
    eval_tasks = load_tasks(config, config.eval_split) if config.eval_split else []
    workdir = pathlib.Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    # jax.devices() lists every process's devices: in a multi-process run the mesh spans them all.
    mesh = make_mesh(resolve_mesh(config.mesh, jax.device_count())) if jax.device_count() > 1 else None
    lm = chat.load_chat_model(config.model_path or micro_world.shipped_path(), dtype=config.dtype, mesh=mesh)
    acfg, wcfg = agent_config(config), world_model_config(config)
    groups, group_size = config.rollout.groups_per_step, config.rollout.group_size
    prompt_tokens = max(len(lm.prompt_ids(agent.initial_messages(t, acfg))) for t in train_tasks)
    width = batch_width(config, prompt_tokens)

    # The frozen reference and the world model are the base checkpoint: one parameter copy, never donated.
    ref_params = lm.model.params
    family, model_config = lm.model.family, lm.model.config
    optimizer = update.make_optimizer(config.optim)
    # float32 master weights: an Adam step at lr 1e-6 is below bf16's resolution and would round away.
    state = update.init_train_state(jax.tree.map(jnp.copy, ref_params), optimizer, mesh=mesh,
                                    param_axes=family.param_axes(model_config), param_dtype=config.optim.param_dtype)
    step_fn = update.make_train_step(family, model_config, optimizer, kl_coef=config.optim.kl_coef,
                                     entropy_coef=config.optim.entropy_coef, clip_eps=config.optim.clip_eps,
                                     micro_batches=config.optim.micro_batches, remat=config.optim.remat, mesh=mesh,
                                     temperature=acfg.temperature, compute_dtype=config.dtype)
    corr = _correction_state(config.rewards, debias, denoise)
    key = jax.random.key_data(jax.random.key(config.seed))
    if multi_process:   # the same values in every process, made global arrays so Orbax can save them
        corr, key = multihost.replicate((corr, key), mesh)
    counters, cursor_pos, first_step, meta = Counters(), 0, 0, {}
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=config.checkpoint.max_to_keep)
    restored = ckpt.latest({"train": state, "corrections": corr, "rng": key})
    if restored is not None:
        first_step, tree, meta = restored
        state, corr, key = tree["train"], tree["corrections"], tree["rng"]
        counters, cursor_pos = Counters(**meta["counters"]), meta["cursor"]
        if primary:
            print(f"resumed from {workdir / 'checkpoints'} at step {first_step}")
    if primary:
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=1) + "\n")
    cursor = TaskCursor(len(train_tasks), config.seed, cursor_pos)
    writer = SummaryWriter(workdir / "tb") if primary else None
    pool = make_pool(config)
    eval_attempts = config.get("eval_attempts", 8)
    try:
        eval_before = meta.get("eval_before")
        if eval_tasks and eval_attempts and eval_before is None:
            eval_before = evaluate(lm, eval_tasks, pool, config=acfg, attempts=eval_attempts,
                                   seed=seed_for(config.seed, 1 << 20)).as_dict()
            if primary:
                print(f"held-out avg@{eval_attempts} before training: {eval_before['score']:.4f}")
        final: dict = meta.get("final", {})
        bar = tqdm(range(first_step, config.steps), initial=first_step, total=config.steps, desc=config.rewards.mode,
                   disable=not (progress and primary))
        for step in bar:
            t_step, cpu_step = time.perf_counter(), time.process_time()
            tasks = [train_tasks[i] for i in cursor.take(groups)]
            anchors = {"all": np.arange(groups), "none": np.zeros(0, int)}.get(anchors_mode)
            if anchors is None:
                anchors = corrections.select_anchor_groups(
                    seed_for(config.seed, step, 1), groups, fraction=config.rewards.anchor_fraction,
                    min_per_step=config.rewards.min_anchors, max_concurrent=None)

            def feedback(rows, solutions, tasks=tasks, anchors=set(int(a) for a in anchors)):
                # Between turns: real feedback for anchor groups, the world model's for the rest.
                real = [i for i in rows if i // group_size in anchors]
                out = {}
                if real:
                    for i, r in zip(real, pool.map([(tasks[i // group_size], solutions[i] or "") for i in real])):
                        out[i] = r.feedback
                rest = [i for i in rows if i not in out]
                if rest:
                    preds = world_model.predict(lm, [tasks[i // group_size] for i in rest],
                                                [solutions[i] for i in rest], config=wcfg,
                                                seed=seed_for(config.seed, step, 2))
                    out.update({i: p.feedback or "The outcome of the program is unknown." for i, p in zip(rest, preds)})
                return [out[i] for i in rows]

            t0 = time.perf_counter()
            policy = state.params if config.dtype == config.optim.param_dtype else \
                jax.tree.map(lambda x: x.astype(config.dtype), state.params)   # sample in the model's dtype
            episodes = agent.run_episodes(lm, tasks, group_size, config=acfg, feedback=feedback,
                                          seed=seed_for(config.seed, step, 3), params=policy)
            # The bf16 sampling copy is not needed past here: freed before the final world-model scoring and
            # the update, so neither holds it next to its own temporaries (train.plan's phase accounting).
            del policy
            t_sample = time.perf_counter() - t0
            cpu_before = pool.stats()["cpu_s"]
            scores = score_rollouts(episodes, tasks, group_size, anchors, use_wm=use_wm, lm=lm, wm_config=wcfg,
                                    pool=pool, seed=seed_for(config.seed, step, 4))
            corr, out = corrections.correct_step(corr, scores.wm_rewards, scores.wm_graded, scores.real_rewards,
                                                 scores.real_graded, scores.is_anchor)
            out = jax.device_get(out)
            graded = np.asarray(out.graded) & np.asarray(out.used)[:, None]
            batch = make_batch(episodes, np.asarray(out.advantages).reshape(-1), graded.reshape(-1),
                               width=width, pad_id=lm.pad_id)
            t0 = time.perf_counter()
            state, train_metrics = step_fn(state, ref_params, batch)
            train_metrics = jax.device_get(train_metrics)
            t_update = time.perf_counter() - t0

            counters.rollouts += len(episodes)
            counters.real_executions += len(scores.real_results)
            counters.sandbox_cpu_s += pool.stats()["cpu_s"] - cpu_before
            counters.wm_predictions += sum(not p.gated for p in scores.wm_predictions)
            counters.tokens_generated += int(sum(e.loss_mask.sum() for e in episodes))
            counters.compute_cpu_s += time.process_time() - cpu_step
            counters.ungraded_real += int(scores.is_anchor.sum() * group_size - scores.real_graded.sum())
            if use_wm:
                counters.ungraded_wm += len(episodes) - int(scores.wm_graded.sum())
            times = {"step_s": time.perf_counter() - t_step, "sample_s": t_sample, "update_s": t_update,
                     **scores.times}
            final = _step_scalars(scores, out, episodes, train_metrics, counters, times)
            final["wmrl/n_fits"] = int(out.n_fits)
            if writer is not None:
                writer.scalars(step + 1, final)
            if primary and use_wm and scores.is_anchor.any():
                _log_pairs(workdir / "pairs.jsonl", step + 1, scores, corr)
            if writer is not None and config.log.text_samples:
                writer.text(step + 1, "rollouts", _rollout_text(episodes, scores, group_size, config.log.text_samples))
            bar.set_postfix(real=f"{final['reward/real_mean']:.2f}", wm=f"{final['reward/wm_calibrated_mean']:.2f}",
                            w=f"{final['wmrl/anchor_weight']:.2f}", valid=f"{final['agent/valid_rate']:.2f}",
                            step_s=f"{times['step_s']:.0f}")
            done = step + 1
            if done % config.checkpoint.every == 0 or done == config.steps:
                ckpt.save(done, {"train": state, "corrections": corr, "rng": key},
                          {"cursor": cursor.position, "counters": dataclasses.asdict(counters),
                           "eval_before": eval_before, "final": final})
        ckpt.wait()
        if writer is not None:
            writer.flush()
        export = workdir / "export"
        # Params sharded across processes are gathered (every process takes part); process 0 writes them.
        params = multihost.to_host(state.params) if multi_process else state.params
        if primary:
            save_hf(dataclasses.replace(lm.model, params=params), export, tokenizer=lm.tokenizer)
        del params
        eval_after = None
        if eval_tasks and eval_attempts:
            eval_after = evaluate(lm, eval_tasks, pool, config=acfg, attempts=eval_attempts,
                                  seed=seed_for(config.seed, 1 << 20), params=state.params).as_dict()
        summary = RunSummary(mode=config.rewards.mode, steps=config.steps, counters=counters,
                             rollouts_per_step=groups * group_size, final=final, eval_before=eval_before,
                             eval_after=eval_after, seconds=time.perf_counter() - start, export_path=str(export),
                             workdir=str(workdir))
        if primary:
            (workdir / "summary.json").write_text(json.dumps(
                {**dataclasses.asdict(summary), "table": str(summary)}, indent=1, default=str) + "\n")
        return summary
    finally:
        pool.close(wait=False, cancel_pending=True)
        if writer is not None:
            writer.close()
        ckpt.close()
