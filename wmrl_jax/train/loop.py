"""The WMRL training loop: sample, score (world model + a few real runs), correct, update, log, checkpoint.

One step, as data flows (docs/design.md, "One training step, as data flows"):

1. `select_anchor_groups` picks the groups that pay for real execution; a
   `rewards.RewardRouter` routes every program of the step accordingly: to
   the `SandboxPool` for anchor groups, to the frozen world model otherwise.
2. The policy samples G episodes for each of B tasks (`agent.run_episodes`),
   reading the router's feedback between turns. The final programs of the
   anchor groups go to the pool *first*; while the sandboxes run (other
   processes), the world model scores every rollout on this one. The two
   overlap; both are timed and the overlap is logged.
3. `correct_step` turns real and world-model rewards into advantages: online
   debiasing (isotonic map refit on recent pairs) and inverse-variance
   weighting of the anchor groups. Ungraded rollouts (a sandbox failure, an
   unparseable prediction) are masked, never scored 0.
4. The jitted GRPO update (`train.update`), against the frozen reference --
   the same parameter copy the world model reads.

`rewards.mode` selects the paper's arms (`run.MODES`) through switches of the same code:
only which groups run for real, whether the world model is asked, and the
correction state's debias / denoise flags change. One compiled update serves
every arm.

Everything a resumed run needs is in the checkpoint: params, optimizer state,
correction state, the base PRNG key, the step, the task cursor and the cost
counters; per-step randomness is derived from (seed, step, stream) (`run.SeedStream`),
so a run killed and restarted with the same command continues exactly. A run
already at its last step with its summary.json written does nothing when started
again: it prints "already at step N" and leaves the workdir as it is.

`train` is a short driver over named parts: `start_run` (inputs, model, state,
resume), `evaluate_held_out` (before and after), `train_step` (one step),
`log_step`, `save_checkpoint` and `finish_run` (export, summary). What each
printed or logged field means: `train.report`.

Multi-process runs (`launch/train.py` under a launcher, `train.multihost`):
every process runs this same loop on the same data; sandboxes run on process
0 only and their results are broadcast (`multihost.ProcessZeroPool`); only
process 0 writes logs, config.json, summary.json and the exported policy.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from wmrl_jax import agent, chat, corrections, world_model
from wmrl_jax.evaluate import evaluate
from wmrl_jax.models import attention, make_mesh, save_hf
from wmrl_jax.train import multihost, rollout, update
from wmrl_jax.train.checkpoint import Checkpointer
from wmrl_jax.train.config import agent_config, model_folder, resolve_mesh, shares_prompt, validate, world_model_config
from wmrl_jax.train.metrics import SummaryWriter
from wmrl_jax.train.report import (RunSummary, held_out_scalars, log_pairs, percent, progress_fields, progress_legend,
                                   rollout_text, step_scalars)
from wmrl_jax.train.rewards import RewardRouter
from wmrl_jax.train.run import (MODES, Arm, Counters, SeedStream, TaskCursor, batch_width, checkpoint_tree,
                                correction_state, eval_seed, load_tasks, make_sandbox_pool, seed_for, shared_prompt_widths,
                                step_seed)


def make_pool(config):
    """The run's sandbox pool, from `config.sandbox` (backend "local" or "ray").

    In a multi-process run only process 0 makes a real pool; every process
    gets a `multihost.ProcessZeroPool` that shares process 0's results.
    """
    real = make_sandbox_pool(config) if multihost.is_primary() else None
    return multihost.ProcessZeroPool(real) if jax.process_count() > 1 else real


def make_batch(episodes, advantages: np.ndarray, weights: np.ndarray, *, width: int, pad_id: int,
               prompt_width: int | None = None, group_size: int = 1) -> update.Batch:
    """The episodes as a `train.update.Batch`.

    prompt_width None: each row whole, left-padded to [B, width]. Otherwise
    each run of `group_size` episodes (a GRPO group: one prompt) shares its
    prompt: the prompts left-padded to [G, prompt_width], what follows them
    right-padded to [B, width] (`logprobs.prefix_logprobs`).
    """
    if prompt_width is not None:
        return _shared_prompt_batch(episodes, advantages, weights, width=width, pad_id=pad_id,
                                    prompt_width=prompt_width, group_size=group_size)
    batch = len(episodes)
    tokens = np.full((batch, width), pad_id, np.int32)
    valid = np.zeros((batch, width), bool)
    mask = np.zeros((batch, width), bool)
    for i, e in enumerate(episodes):
        n = len(e.tokens)
        if n > width:
            raise ValueError(f"episode {i}: {n} tokens, more than the batch width {width}")
        tokens[i, width - n:], valid[i, width - n:], mask[i, width - n:] = e.tokens, True, e.loss_mask
    return update.Batch(tokens=tokens, valid=valid, loss_mask=mask, advantages=advantages.astype(np.float32),
                        weights=weights.astype(np.float32))


def _shared_prompt_batch(episodes, advantages, weights, *, width, pad_id, prompt_width, group_size):
    if group_size < 1 or len(episodes) % group_size:
        raise ValueError(f"group_size: {group_size!r} for {len(episodes)} episodes; expected a divisor")
    groups = len(episodes) // group_size
    prompts = np.full((groups, prompt_width), pad_id, np.int32)
    prompt_valid = np.zeros((groups, prompt_width), bool)
    tokens = np.full((len(episodes), width), pad_id, np.int32)
    valid = np.zeros((len(episodes), width), bool)
    mask = np.zeros((len(episodes), width), bool)
    for g in range(groups):
        first = episodes[g * group_size]
        prompt = first.tokens[:first.prompt_len]
        if len(prompt) > prompt_width:
            raise ValueError(f"episode {g * group_size}: a {len(prompt)}-token prompt, more than the prompt width "
                             f"{prompt_width}")
        prompts[g, prompt_width - len(prompt):], prompt_valid[g, prompt_width - len(prompt):] = prompt, True
        for i in range(g * group_size, (g + 1) * group_size):
            e = episodes[i]
            if e.prompt_len != len(prompt) or not np.array_equal(e.tokens[:e.prompt_len], prompt):
                raise ValueError(f"episode {i}: its prompt differs from episode {g * group_size}'s, the first of its "
                                 f"group of {group_size}; expected one prompt a group (or optim.share_prompt='never')")
            n = len(e.tokens) - e.prompt_len
            if n > width:
                raise ValueError(f"episode {i}: {n} tokens after its prompt, more than the batch width {width}")
            tokens[i, :n], valid[i, :n], mask[i, :n] = e.tokens[e.prompt_len:], True, e.loss_mask[e.prompt_len:]
    return update.Batch(tokens=tokens, valid=valid, loss_mask=mask, advantages=advantages.astype(np.float32),
                        weights=weights.astype(np.float32), prompt_tokens=prompts, prompt_valid=prompt_valid)


# --------------------------------------------------------------------------- the run's parts

@dataclasses.dataclass
class Run:
    """Everything a training run holds between steps (`start_run` builds it; the steps advance it)."""

    config: Any
    arm: Arm
    workdir: pathlib.Path
    primary: bool                # process 0: writes logs, config.json, summary.json and the export
    multi_process: bool
    train_tasks: list
    eval_tasks: list
    lm: chat.ChatModel           # tokenizer and base model: the frozen reference (and world model, by default)
    wm_lm: chat.ChatModel        # the frozen world model: `lm`, or the checkpoint's own (`world_model.load`)
    agent_config: agent.AgentConfig
    wm_config: Any
    width: int                   # the update's fixed [B, T] width (with prompt_width: what follows the prompt)
    ref_params: Any              # the frozen copy (reference policy and world model), never donated
    step_fn: Any
    state: update.TrainState
    resharder: rollout.Resharder  # masters -> the weights generation reads (rollout layout, model dtype)
    corr: corrections.CorrectionState
    key: Any                     # the base PRNG key data (checkpointed; per-step seeds come from seed_for)
    counters: Counters
    cursor: TaskCursor
    first_step: int
    ckpt: Checkpointer
    writer: SummaryWriter | None
    pool: Any
    eval_before: dict | None = None
    final: dict = dataclasses.field(default_factory=dict)   # the last step's scalars
    prompt_width: int | None = None   # [G, P] shared prompts of the update's batch (optim.share_prompt), or None

    @property
    def eval_attempts(self) -> int:
        return self.config.get("eval_attempts", 8) if self.eval_tasks else 0

    def close(self) -> None:
        self.pool.close(wait=False, cancel_pending=True)
        if self.writer is not None:
            self.writer.close()
        self.ckpt.close()


def finished_summary(config) -> RunSummary | None:
    """The saved summary of a run that is already at its last step (None: there is work to do).

    Finished means: summary.json (written last) for this mode and step count,
    and a checkpoint at that step.
    """
    workdir = pathlib.Path(config.workdir)
    path = workdir / "summary.json"
    if not (path.is_file() and (workdir / "checkpoints").is_dir()):
        return None
    try:
        summary = RunSummary.from_json(path.read_text())
    except (ValueError, KeyError, TypeError):   # a torn or older file: finish the run again
        return None
    if summary.steps != config.steps or summary.mode != config.rewards.mode:
        return None
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=config.checkpoint.max_to_keep)
    try:
        steps = ckpt.all_steps()
    finally:
        ckpt.close()
    return summary if steps and max(steps) >= config.steps else None


def start_run(config) -> Run:
    """Loads the tasks and the model, builds the train and correction state, resumes from the newest checkpoint."""
    primary, multi_process = multihost.is_primary(), jax.process_count() > 1
    arm = MODES[config.rewards.mode]
    attention.set_implementation(config.get("attention", "auto"))   # for every program traced from here on
    train_tasks = load_tasks(config, config.train_split)
    eval_tasks = load_tasks(config, config.eval_split) if config.eval_split else []
    workdir = pathlib.Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    # jax.devices() lists every process's devices: in a multi-process run the mesh spans them all.
    mesh = make_mesh(resolve_mesh(config.mesh, jax.device_count())) if jax.device_count() > 1 else None
    model_path = model_folder(config)
    lm = chat.load_chat_model(model_path, dtype=config.dtype, mesh=mesh)
    # The paper's world model is the agent's base weights; a checkpoint that ships a world model of its own
    # (the micro-world's `world_model/` folder) brings a second frozen copy.
    wm_lm = world_model.load(model_path, dtype=config.dtype, mesh=mesh, base=lm) if arm.world_model else lm
    acfg = agent_config(config)
    prompt_tokens = max(len(lm.prompt_ids(agent.initial_messages(t, acfg))) for t in train_tasks)

    family, model_config = lm.model.family, lm.model.config
    optimizer = update.make_optimizer(config.optim)
    # float32 master weights: an Adam step at lr 1e-6 is below bf16's resolution and would round away.
    state = update.init_train_state(jax.tree.map(jnp.copy, lm.model.params), optimizer, mesh=mesh,
                                    param_axes=family.param_axes(model_config), param_dtype=config.optim.param_dtype)
    # The frozen reference and the world model are the base checkpoint: one parameter copy, never donated,
    # placed once in the rollout layout (train.rollout), where the world model generates from it; the update
    # reads it there too. `lm` from here on generates on the rollout mesh.
    rollout_mesh = rollout.rollout_mesh(config.rollout, jax.devices()) if mesh is not None else None
    if rollout_mesh is not None:
        shared = wm_lm is lm
        lm = rollout.generation_model(lm, rollout.place(lm.model.params, rollout_mesh, family, model_config,
                                                        config.dtype), rollout_mesh)
        wm_lm = lm if shared else rollout.generation_model(wm_lm, rollout.place(
            wm_lm.model.params, rollout_mesh, wm_lm.model.family, wm_lm.model.config, config.dtype), rollout_mesh)
    ref_params = lm.model.params
    resharder = rollout.Resharder(family, model_config, rollout_mesh, config.dtype)
    step_fn = update.make_train_step(family, model_config, optimizer, kl_coef=config.optim.kl_coef,
                                     entropy_coef=config.optim.entropy_coef, clip_eps=config.optim.clip_eps,
                                     micro_batches=config.optim.micro_batches, remat=config.optim.remat, mesh=mesh,
                                     temperature=acfg.temperature, compute_dtype=config.dtype)
    corr = correction_state(config.rewards, arm)
    key = jax.random.key_data(jax.random.key(config.seed))
    if multi_process:   # the same values in every process, made global arrays so Orbax can save them
        corr, key = multihost.replicate((corr, key), mesh)
    counters, cursor_pos, first_step, meta = Counters(), 0, 0, {}
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=config.checkpoint.max_to_keep)
    restored = ckpt.latest(checkpoint_tree(state, corr, key))
    if restored is not None:
        first_step, tree, meta = restored
        state, corr, key = tree["train"], tree["corrections"], tree["rng"]
        counters, cursor_pos = Counters(**meta["counters"]), meta["cursor"]
        if primary:
            print(f"resumed from {workdir / 'checkpoints'} at step {first_step}")
    if primary:
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=1) + "\n")
    if shares_prompt(config):
        prompt_width, width = shared_prompt_widths(config, prompt_tokens)
    else:
        prompt_width, width = None, batch_width(config, prompt_tokens)
    return Run(config=config, arm=arm, workdir=workdir, primary=primary, multi_process=multi_process,
               train_tasks=train_tasks, eval_tasks=eval_tasks, lm=lm, wm_lm=wm_lm, agent_config=acfg,
               wm_config=world_model_config(config), width=width, prompt_width=prompt_width, ref_params=ref_params,
               step_fn=step_fn, state=state, resharder=resharder, corr=corr, key=key, counters=counters,
               cursor=TaskCursor(len(train_tasks), config.seed, cursor_pos), first_step=first_step, ckpt=ckpt,
               writer=SummaryWriter(workdir / "tb") if primary else None, pool=make_pool(config),
               eval_before=meta.get("eval_before"), final=meta.get("final", {}))


def generation_params(run: Run, params):
    """The trained `params` as generation reads them: in the rollout layout and the model's dtype.

    Without a rollout mesh (one device, or `rollout.layout` "train") and with
    masters already in the model's dtype, the masters themselves (no copy).
    Resharded once a step, before sampling (`train.rollout.Resharder`).
    """
    if run.resharder.mesh is None and run.config.dtype == run.config.optim.param_dtype:
        return params
    return jax.block_until_ready(run.resharder(params))


def sampling_seed(config) -> int:
    """The held-out evaluations' sampling seed: `config.eval_sampling_seed`, or (-1) one derived from the seed."""
    seed = config.get("eval_sampling_seed", -1)
    return seed if seed >= 0 else eval_seed(config.seed)


def evaluate_held_out(run: Run, params=None) -> dict | None:
    """Held-out avg@k of the base policy (`params` None) or of `params`, through the real sandbox; None if off."""
    if not run.eval_attempts:
        return None
    if params is not None:
        params = generation_params(run, params)
    return evaluate(run.lm, run.eval_tasks, run.pool, config=run.agent_config, attempts=run.eval_attempts,
                    seed=sampling_seed(run.config), params=params).as_dict()


CURVE = "curve.jsonl"   # a run's learning curve: one line per evaluated step (0 = before training)
# The untrained policy's evaluations made outside the run, for several runs that start from the same policy with
# the same sampling seed (`wmrl_jax.compare`: once a seed, shared by the six arms): {"model", "eval_seed",
# "held_out": evaluate(...).as_dict(), "train": the same on the train tasks, or absent}.
GIVEN_BEFORE = "eval_before.json"


def given_before(run: Run) -> dict | None:
    """`<workdir>/eval_before.json` when there, checked to be what this run would compute (same model, sampling
    seed, attempts and tasks); None when absent. A file that does not match is refused, naming what differs."""
    path = run.workdir / GIVEN_BEFORE
    if not path.is_file():
        return None
    try:
        given = json.loads(path.read_text())
        held_out, train = given["held_out"], given.get("train")
        found = {"model": given["model"], "eval_seed": given["eval_seed"], "attempts": held_out["attempts"],
                 "held-out tasks": sorted(held_out["per_task"])}
        if train is not None:
            found.update({"train attempts": train["attempts"], "train tasks": sorted(train["per_task"])})
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e}); expected the untrained policy's "
                         f"evaluation written by wmrl_jax.compare (delete it and the run evaluates itself)") from e
    want = {"model": str(model_folder(run.config)), "eval_seed": sampling_seed(run.config),
            "attempts": run.eval_attempts, "held-out tasks": sorted(t.name for t in run.eval_tasks)}
    if train is not None:
        want.update({"train attempts": run.eval_attempts, "train tasks": sorted(t.name for t in run.train_tasks)})
    differ = [f"{k}: {found[k]!r}, this run's {want[k]!r}" for k in want if found[k] != want[k]]
    if differ:
        raise ValueError(f"{path}: not this run's evaluation of the untrained policy ({'; '.join(differ)}); "
                         f"delete it and the run evaluates itself")
    return given


def curve_point(run: Run, step: int, held_out: dict | None = None, train: dict | None = None) -> dict | None:
    """Evaluates the policy after `step` steps (`held_out`, `train`: those evaluations when already made) and
    appends it to `<workdir>/curve.jsonl`: held-out avg@k and, with `config.eval_train_tasks`, the train tasks'
    too. None when the run keeps no curve (`config.eval_every` 0, or no held-out evaluation)."""
    config = run.config
    if not (config.get("eval_every", 0) and run.eval_attempts):
        return None
    params = None if step == 0 else run.state.params
    if held_out is None:
        held_out = evaluate_held_out(run, params)
    point = {"step": step, "held_out": held_out["score"], "held_out_per_task": held_out["per_task"],
             "held_out_valid": held_out["mean_valid_rate"]}
    if config.get("eval_train_tasks", False):
        if train is None:
            train = evaluate(run.lm, run.train_tasks, run.pool, config=run.agent_config, attempts=run.eval_attempts,
                             seed=sampling_seed(config),
                             params=None if params is None else generation_params(run, params)).as_dict()
        point.update(train=train["score"], train_per_task=train["per_task"], train_valid=train["mean_valid_rate"])
    if run.primary:
        with open(run.workdir / CURVE, "a") as f:
            f.write(json.dumps(point) + "\n")
    return point


def read_curve(workdir) -> dict[int, dict]:
    """`curve.jsonl` of a run as {step: point}; a step evaluated twice (a resumed run) keeps its last line."""
    path = pathlib.Path(workdir) / CURVE
    if not path.exists():
        return {}
    points = {}
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            point = json.loads(line)
        except json.JSONDecodeError as e:   # a line cut by a killed run: name it, lose nothing else
            raise ValueError(f"{path}:{n}: not a JSON line ({e}); delete the line and rerun the run to redo it") from e
        points[int(point["step"])] = point
    return dict(sorted(points.items()))


def train_step(run: Run, step: int) -> dict:
    """One GRPO step (0-based `step`): sample, route and score, correct, update; returns the step's scalars.

    Advances `run.state`, `run.corr`, `run.cursor` and `run.counters`; logs
    (`log_step`) before returning.
    """
    config, arm = run.config, run.arm
    groups, group_size = config.rollout.groups_per_step, config.rollout.group_size
    t_step, cpu_step = time.perf_counter(), time.process_time()
    tasks = [run.train_tasks[i] for i in run.cursor.take(groups)]
    anchors = {"all": np.arange(groups), "none": np.zeros(0, int)}.get(arm.real_groups)
    if anchors is None:
        anchors = corrections.select_anchor_groups(
            step_seed(config.seed, step, SeedStream.ANCHORS), groups, fraction=config.rewards.anchor_fraction,
            min_per_step=config.rewards.min_anchors, max_concurrent=None)
    router = RewardRouter(tasks, group_size, anchors, run.pool, run.wm_lm, run.wm_config, use_wm=arm.world_model,
                          feedback_seed=step_seed(config.seed, step, SeedStream.WM_FEEDBACK),
                          scoring_seed=step_seed(config.seed, step, SeedStream.WM_SCORING))

    t0 = time.perf_counter()
    policy = generation_params(run, run.state.params)
    t_reshard = time.perf_counter() - t0
    episodes = agent.run_episodes(run.lm, tasks, group_size, config=run.agent_config, feedback=router.feedback,
                                  seed=step_seed(config.seed, step, SeedStream.ROLLOUTS), params=policy)
    # The bf16 sampling copy is not needed past here: freed before the final world-model scoring and
    # the update, so neither holds it next to its own temporaries (train.plan's phase accounting).
    del policy
    t_sample = time.perf_counter() - t0
    cpu_before = run.pool.stats()["cpu_s"]
    scores = router.score(episodes)
    run.corr, out = corrections.correct_step(run.corr, scores.wm_rewards, scores.wm_graded, scores.real_rewards,
                                             scores.real_graded, scores.is_anchor)
    out = jax.device_get(out)
    graded = np.asarray(out.graded) & np.asarray(out.used)[:, None]
    batch = make_batch(episodes, np.asarray(out.advantages).reshape(-1), graded.reshape(-1),
                       width=run.width, pad_id=run.lm.pad_id, prompt_width=run.prompt_width, group_size=group_size)
    t0 = time.perf_counter()
    run.state, train_metrics = run.step_fn(run.state, run.ref_params, batch)
    train_metrics = jax.device_get(train_metrics)
    t_update = time.perf_counter() - t0

    c = run.counters
    c.rollouts += len(episodes)
    c.real_executions += len(scores.real_results)
    c.sandbox_cpu_s += run.pool.stats()["cpu_s"] - cpu_before
    c.wm_predictions += sum(not p.gated for p in scores.wm_predictions)
    c.tokens_generated += int(sum(e.loss_mask.sum() for e in episodes))
    c.compute_cpu_s += time.process_time() - cpu_step
    c.ungraded_real += int(scores.is_anchor.sum() * group_size - scores.real_graded.sum())
    if arm.world_model:
        c.ungraded_wm += len(episodes) - int(scores.wm_graded.sum())
    times = {"step_s": time.perf_counter() - t_step, "reshard_s": t_reshard, "sample_s": t_sample, "update_s": t_update, **scores.times}
    run.final = step_scalars(scores, out, episodes, train_metrics, c, times)
    run.final["wmrl/n_fits"] = int(out.n_fits)
    log_step(run, step + 1, scores, episodes)
    return run.final


def log_step(run: Run, done: int, scores, episodes) -> None:
    """TensorBoard scalars and sample rollouts every `log.every` steps (and the last); pairs.jsonl every step."""
    config = run.config
    due = done % config.log.every == 0 or done == config.steps
    if run.writer is not None and due:
        run.writer.scalars(done, run.final)
    if run.primary and run.arm.world_model and scores.is_anchor.any():
        log_pairs(run.workdir / "pairs.jsonl", done, scores, run.corr)
    if run.writer is not None and due and config.log.text_samples:
        run.writer.text(done, "rollouts", rollout_text(episodes, scores, config.rollout.group_size,
                                                       config.log.text_samples))


def save_checkpoint(run: Run, done: int) -> None:
    """Saves the step `done` checkpoint: the arrays, and the task cursor, counters, held-out score, last scalars."""
    run.ckpt.save(done, checkpoint_tree(run.state, run.corr, run.key),
                  {"cursor": run.cursor.position, "counters": dataclasses.asdict(run.counters),
                   "eval_before": run.eval_before, "final": run.final})


def finish_run(run: Run, start: float) -> RunSummary:
    """Waits for the last checkpoint, exports the policy, evaluates it, writes summary.json; returns the summary."""
    config = run.config
    run.ckpt.wait()
    export = run.workdir / "export"
    # Params sharded across processes are gathered (every process takes part); process 0 writes them.
    params = multihost.to_host(run.state.params) if run.multi_process else run.state.params
    if run.primary:
        save_hf(dataclasses.replace(run.lm.model, params=params), export, tokenizer=run.lm.tokenizer)
        # The checkpoint's own world model goes along, so that a run started from the export predicts with
        # the same frozen world model (not with the trained policy's weights).
        own = world_model.checkpoint_path(run.lm.path) if run.lm.path is not None else None
        if own is not None and own != run.lm.path:
            shutil.copytree(own, export / world_model.FOLDER, dirs_exist_ok=True)
    del params
    eval_after = evaluate_held_out(run, run.state.params)
    if eval_after is not None and run.writer is not None:
        run.writer.scalars(config.steps, held_out_scalars(eval_after))
    if eval_after is not None:
        curve_point(run, config.steps, eval_after)
    if run.writer is not None:
        run.writer.flush()
    summary = RunSummary(mode=config.rewards.mode, steps=config.steps, counters=run.counters,
                         rollouts_per_step=config.rollout.groups_per_step * config.rollout.group_size,
                         final=run.final, eval_before=run.eval_before, eval_after=eval_after,
                         seconds=time.perf_counter() - start, export_path=str(export), workdir=str(run.workdir))
    if run.primary:
        (run.workdir / "summary.json").write_text(summary.to_json())
    return summary


# --------------------------------------------------------------------------- the driver

def train(config, *, progress: bool = True) -> RunSummary:
    """Runs (or resumes) the training run `config` describes; returns its summary.

    Every input is checked before any compute (`train.config.validate`): model
    folder, task folders and leaderboards, mode, batch vs mesh. A run that is
    already finished is left as it is (its saved summary is returned).
    """
    start = time.perf_counter()
    validate(config)
    finished = finished_summary(config)
    if finished is not None:
        if multihost.is_primary():
            print(f"already at step {finished.steps} of {config.steps}: nothing to do "
                  f"({pathlib.Path(config.workdir) / 'summary.json'} left as it is)")
        return finished
    run = start_run(config)
    try:
        if run.eval_before is None and run.eval_attempts:
            given = given_before(run)
            run.eval_before = evaluate_held_out(run) if given is None else given["held_out"]
            if run.writer is not None:
                run.writer.scalars(0, held_out_scalars(run.eval_before))
            if run.primary:
                made = "" if given is None else f" (given: {run.workdir / GIVEN_BEFORE})"
                print(f"held-out avg@{run.eval_attempts} before training: {percent(run.eval_before['score'])}{made}")
            curve_point(run, 0, run.eval_before, None if given is None else given.get("train"))
        show = progress and run.primary
        if show and run.first_step < config.steps:
            print(progress_legend())
        bar = tqdm(range(run.first_step, config.steps), initial=run.first_step, total=config.steps,
                   desc=config.rewards.mode, disable=not show)
        for step in bar:
            bar.set_postfix(progress_fields(train_step(run, step)))
            done = step + 1
            every = config.get("eval_every", 0)
            if every and done % every == 0 and done < config.steps:   # the last step's is finish_run's
                curve_point(run, done)
            if done % config.checkpoint.every == 0 or done == config.steps:
                save_checkpoint(run, done)
        return finish_run(run, start)
    finally:
        run.close()


__all__ = ["CURVE", "GIVEN_BEFORE", "Run", "curve_point", "given_before", "evaluate_held_out", "read_curve", "finish_run", "finished_summary", "make_batch", "make_pool",
           "save_checkpoint", "start_run", "train", "train_step"]
