"""The WMRL theory on a problem whose truth is known: a GRPO-trained bandit.

Why this exists: the paper's claims (a world model alone leaves a bias floor;
debiasing and denoising remove it; a thin real stream suffices) are claims
about the reward signal, not about LLMs. Here they can be checked exactly,
in seconds, through the very functions the trainer uses:
`wmrl_jax.corrections.correct_step` and `wmrl_jax.losses.grpo_loss`.

The problem
-----------
* M tasks, K candidate "solutions" each, true quality q[m, k] in [0, 1]. In
  every task one solution belongs to an *over-rated* class (it looks
  impressive, scores mediocre), one is the true best, the rest are spread out.
* Policy: softmax over K per task, logits θ[M, K], trained by GRPO: each
  step samples G solutions per task (one group per task), scores them, and
  takes one on-policy gradient step of `grpo_loss` (ρ = 1, k3 KL to the
  initial uniform policy, token-mean over the M·G one-token "sequences").
* Real execution: q + small noise; every one is counted (the budget).
* World model: w = g_t(min(q + β·overrated, u_max)) + noise, with
  g_t(u) = u^γ_t a monotone NON-affine distortion whose exponent drifts over
  training. Non-affine on purpose: GRPO standardises each group, so an affine
  distortion would cancel and nothing would need correcting. The over-rated
  class makes the WM rank a mediocre solution first, so a WM-only policy
  converges to it (the bias floor); the noise inflates the variance.
* What the corrections can and cannot do: the isotonic map is monotone in
  the WM score, so it cannot re-rank; what it does is pull the band of WM
  scores where real results disappoint back down (pooling it with the band
  below), which takes away the WM's wrong preference. The real anchors then
  decide between the solutions the calibrated WM no longer tells apart, and
  the inverse-variance weight gives those anchors more say the more the WM
  disagrees with them.

Arms (all through `correct_step`; they differ only in which groups are
anchors and in the correction flags):
  real-only    every group executed for real, no correction (plain GRPO)
  wm-only      no group executed, raw WM rewards
  naive-mix    anchors real, other groups raw WM, weight 1
  debias-only  + isotonic calibration of the WM rewards
  denoise-only + inverse-variance anchor weight
  wmrl         both corrections

`launch/bandit.py` is the command-line entry point; this module holds the
logic so tests import it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from wmrl_jax import corrections
from wmrl_jax import losses


@dataclasses.dataclass(frozen=True)
class BanditConfig:
    """Sizes and constants of the demo. Defaults are the `launch/bandit.py` run."""

    n_tasks: int = 8  # one group per task per step; paper: 8 groups per step
    n_solutions: int = 8  # K candidates per task
    group_size: int = 8  # G rollouts per group; paper: 8
    steps: int = 200
    anchors_per_step: int = 2  # paper: 2 of 8 groups executed for real
    learning_rate: float = 2.0  # SGD on the logits; token-mean divides by M·G
    kl_coef: float = 0.04  # paper's k3 coefficient
    clip_eps: float = 0.2
    # Truth: per task one best solution, one over-rated one, the rest spread out.
    best_quality: tuple[float, float] = (0.75, 0.90)
    overrated_quality: tuple[float, float] = (0.30, 0.45)
    other_quality: tuple[float, float] = (0.05, 0.65)
    # The two reward sources.
    real_noise: float = 0.02  # a real run is nearly exact
    wm_noise: float = 0.12  # WM prediction noise (the variance term)
    overrate: float = 0.65  # β: how far the WM over-rates the over-rated class (the bias term)
    wm_ceiling: float = 0.98  # u_max: the WM's most confident distorted score
    gamma_start: float = 0.6  # g_t(u) = u^γ_t, γ drifting geometrically from ...
    gamma_end: float = 1.6  # ... to this over the run (the WM's distortion drifts)
    # Correction constants (docs/design.md, "Online debiaser"), the buffer scaled to the run length:
    # the paper keeps 5000 pairs of ~51k seen (3200 steps × 16); 512 of 3200
    # keeps a recent window here, which is what lets the map follow the drift.
    cap: int = 512
    min_pairs: int = 200
    refit_every: int = 64
    half_life: float = 64.0
    warmup: int = 32
    w_max: float = 4.0
    target_weight: float = 2.0


# name -> (which groups are executed for real, debias, denoise)
ARMS: dict[str, tuple[str, bool, bool]] = {
    "real-only": ("all", False, False),
    "wm-only": ("none", False, False),
    "naive-mix": ("anchors", False, False),
    "debias-only": ("anchors", True, False),
    "denoise-only": ("anchors", False, True),
    "wmrl": ("anchors", True, True),
}


def make_tasks(seed: int, cfg: BanditConfig) -> dict[str, np.ndarray]:
    """Draws the true qualities (host side, numpy: no compilation for set-up).

    Per task: the best solution q ~ U(cfg.best_quality); the over-rated one
    q ~ U(cfg.overrated_quality); the others q ~ U(cfg.other_quality);
    positions shuffled.

    Returns:
      {"quality": float32[M, K], "overrated": bool[M, K]}.
    """
    m, k = cfg.n_tasks, cfg.n_solutions
    if k < 3:
        raise ValueError(f"n_solutions: {k}, expected >= 3 (best, over-rated, and others)")
    rng = np.random.default_rng([seed, 0])
    best = rng.uniform(*cfg.best_quality, (m, 1))
    over = rng.uniform(*cfg.overrated_quality, (m, 1))
    rest = rng.uniform(*cfg.other_quality, (m, k - 2))
    quality = np.concatenate([best, over, rest], axis=1)
    overrated = np.zeros((m, k), bool)
    overrated[:, 1] = True
    perm = np.argsort(rng.uniform(size=(m, k)), axis=1)
    return {"quality": np.take_along_axis(quality, perm, 1).astype(np.float32),
            "overrated": np.take_along_axis(overrated, perm, 1)}


def world_model_mean(tasks: dict[str, jax.Array], progress: jax.Array, cfg: BanditConfig) -> jax.Array:
    """The WM's expected score, float[M, K], at training progress in [0, 1].

    w̄ = g_t(min(q + β·overrated, u_max)),  g_t(u) = u^γ_t,
    γ_t = γ_start·(γ_end/γ_start)^progress.
    """
    u = jnp.minimum(tasks["quality"] + cfg.overrate * tasks["overrated"], cfg.wm_ceiling)
    gamma = cfg.gamma_start * (cfg.gamma_end / cfg.gamma_start) ** progress
    return u**gamma


def true_reward(logits: jax.Array, tasks: dict[str, jax.Array]) -> jax.Array:
    """Expected true reward of the policy, averaged over tasks: mean_m Σ_k π_mk q_mk."""
    return (jax.nn.softmax(logits, axis=-1) * tasks["quality"]).sum(-1).mean()


def anchor_schedule(seed: int, arm: str, cfg: BanditConfig) -> np.ndarray:
    """bool[steps, M]: which groups are executed for real at each step (host side)."""
    mode = ARMS[arm][0]
    shape = (cfg.steps, cfg.n_tasks)
    if mode == "all":
        return np.ones(shape, bool)
    if mode == "none":
        return np.zeros(shape, bool)
    rng = np.random.default_rng(seed)
    out = np.zeros(shape, bool)
    for t in range(cfg.steps):
        idx = corrections.select_anchor_groups(
            rng, cfg.n_tasks, fraction=cfg.anchors_per_step / cfg.n_tasks, min_per_step=cfg.anchors_per_step
        )
        out[t, np.asarray(idx)] = True
    return out


def _init_state(arm: str, cfg: BanditConfig) -> Any:
    _, debias, denoise = ARMS[arm]
    return corrections.init_correction_state(
        cap=cfg.cap, min_pairs=cfg.min_pairs, refit_every=cfg.refit_every, half_life=cfg.half_life,
        warmup=cfg.warmup, w_max=cfg.w_max, target_weight=cfg.target_weight, debias=debias, denoise=denoise,
    )


def _train_step(carry, inputs, *, tasks, ref_logits, cfg, optimizer):
    """One GRPO step for one seed: sample, score, correct, update."""
    logits, opt_state, corr_state, executions = carry
    key, is_anchor, step = inputs
    m, g = cfg.n_tasks, cfg.group_size
    k_sample, k_wm, k_real = jax.random.split(key, 3)
    picks = jax.random.categorical(k_sample, logits[:, None, :], axis=-1, shape=(m, g))  # [M, G]
    quality = jnp.take_along_axis(tasks["quality"], picks, axis=1)
    wm_mean = jnp.take_along_axis(world_model_mean(tasks, step / max(cfg.steps - 1, 1), cfg), picks, axis=1)
    wm = jnp.clip(wm_mean + cfg.wm_noise * jax.random.normal(k_wm, (m, g)), 0.0, 1.0)
    real = jnp.clip(quality + cfg.real_noise * jax.random.normal(k_real, (m, g)), 0.0, 1.0)
    wm_graded = jnp.ones((m, g), bool)
    real_graded = jnp.broadcast_to(is_anchor[:, None], (m, g))
    # Only executed rollouts carry a real score; the rest must never be read.
    real = jnp.where(real_graded, real, jnp.nan)
    corr_state, out = corrections.correct_step(corr_state, wm, wm_graded, real, real_graded, is_anchor)

    def loss_fn(theta):
        logp = jnp.take_along_axis(jax.nn.log_softmax(theta, -1), picks, axis=1).reshape(m * g, 1)
        ref = jnp.take_along_axis(jax.nn.log_softmax(ref_logits, -1), picks, axis=1).reshape(m * g, 1)
        loss, metrics = losses.grpo_loss(
            logp, jax.lax.stop_gradient(logp), ref, out["advantages"].reshape(m * g),
            jnp.ones((m * g, 1), bool), clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef,
        )
        return loss, metrics

    grads, _ = jax.grad(loss_fn, has_aux=True)(logits)
    updates, opt_state = optimizer.update(grads, opt_state, logits)
    logits = optax.apply_updates(logits, updates)
    executions = executions + real_graded.sum()
    record = {
        "true_reward": true_reward(logits, tasks),
        "executions": executions,
        "anchor_weight": jnp.asarray(out["anchor_weight"], jnp.float32),
    }
    return (logits, opt_state, corr_state, executions), record


# Host-side set-up stays in numpy on purpose: every eager JAX op is its own
# small compilation, and those add up to more than the simulation. All JAX
# work runs in the one jitted function below.
@functools.partial(jax.jit, static_argnames=("cfg",))
def _simulate_chunk(carry, tasks, seed, anchors, steps, *, cfg: BanditConfig):
    """Runs `steps` of one run (one arm, one seed) as a scan.

    The step's randomness is fold_in(fold_in(key(seed), 1), step), so a run
    is the same whatever the chunking and whichever arm it belongs to (the
    arms of one seed share tasks and sampling noise).

    Not vmapped over runs on purpose: under vmap the refit inside
    `correct_step` (a `lax.cond`) becomes a select, so every run would refit
    after every pushed pair, and the batched program takes twice as long to
    compile. One compiled scan called per run is faster on CPU.
    """
    run_key = jax.random.fold_in(jax.random.key(seed), 1)
    keys = jax.vmap(lambda t: jax.random.fold_in(run_key, t))(steps)
    body = functools.partial(_train_step, tasks=tasks, ref_logits=jnp.zeros_like(carry[0]), cfg=cfg,
                             optimizer=optax.sgd(cfg.learning_rate))
    return jax.lax.scan(body, carry, (keys, anchors, steps.astype(jnp.float32)))


def _stack_np(trees):
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def run_all(seeds: list[int], cfg: BanditConfig, *, arms: tuple[str, ...] = tuple(ARMS), progress: bool = True,
            chunk: int = 50) -> dict[str, dict[str, np.ndarray]]:
    """Trains every arm for every seed; same tasks and sampling noise per seed across arms.

    Every run (arm × seed) calls the same compiled scan: the ablation flags
    are data in the correction state, so the whole table costs one compilation.

    Returns, per arm: {"true_reward": float[S, steps], "executions":
    int[S, steps], "anchor_weight": float[S, steps], "optimum": float[S]},
    S = len(seeds).
    """
    for arm in arms:
        if arm not in ARMS:
            raise ValueError(f"arm: {arm!r}, expected one of {tuple(ARMS)}")
    if not seeds:
        raise ValueError("seeds: empty, expected at least one seed")
    n = len(seeds)
    # Tasks depend on the seed only, so every arm sees the same problems.
    tasks = _stack_np([make_tasks(int(sd), cfg) for sd in seeds])
    optimum = tasks["quality"].max(-1).mean(-1)

    optimizer = optax.sgd(cfg.learning_rate)
    results = {}
    chunks = [np.arange(a, min(a + chunk, cfg.steps), dtype=np.int32) for a in range(0, cfg.steps, chunk)]
    bar = tqdm.tqdm(total=len(arms) * n * len(chunks), desc="bandit", disable=not progress)
    for arm in arms:
        bar.set_description(f"bandit: {arm}")
        state0 = _init_state(arm, cfg)
        runs = []
        for i, seed in enumerate(seeds):
            task = {k: v[i] for k, v in tasks.items()}
            schedule = anchor_schedule(seed, arm, cfg)
            logits0 = np.zeros((cfg.n_tasks, cfg.n_solutions), np.float32)
            carry = (logits0, optimizer.init(logits0), state0, np.zeros((), np.int32))
            records = []
            for steps in chunks:
                carry, rec = _simulate_chunk(carry, task, np.uint32(seed), schedule[steps], steps, cfg=cfg)
                records.append(jax.device_get(rec))
                bar.update(1)
            runs.append({k: np.concatenate([r[k] for r in records]) for k in records[0]})
        results[arm] = {k: np.stack([r[k] for r in runs]) for k in runs[0]}
        results[arm]["optimum"] = optimum
    bar.close()
    return results


def summarize(results: dict[str, dict[str, np.ndarray]], *, last: int = 20) -> dict[str, dict[str, tuple[float, float]]]:
    """Per arm: (mean, sd over seeds) of the final true reward, regret and real executions.

    "Final" averages the last `last` steps of the exact expected true reward
    (no sampling noise in it; the average only smooths the SGD jitter).
    """
    table = {}
    for arm, c in results.items():
        final = c["true_reward"][:, -last:].mean(axis=1)
        regret = c["optimum"] - final
        execs = c["executions"][:, -1].astype(np.float64)
        table[arm] = {k: (float(v.mean()), float(v.std(ddof=1) if len(v) > 1 else 0.0))
                      for k, v in (("true_reward", final), ("regret", regret), ("executions", execs))}
    return table


def format_table(table: dict[str, dict[str, tuple[float, float]]], n_seeds: int) -> str:
    lines = [f"{'arm':<13} {'final true reward':>20} {'regret':>18} {'real executions':>20}   ({n_seeds} seeds, mean ± sd)"]
    for arm, row in table.items():
        tr, rg, ex = row["true_reward"], row["regret"], row["executions"]
        lines.append(f"{arm:<13} {tr[0]:>12.3f} ± {tr[1]:.3f} {rg[0]:>10.3f} ± {rg[1]:.3f} {ex[0]:>12.0f} ± {ex[1]:<5.0f}")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, np.ndarray]], path: str) -> None:
    """True reward against real executions (left) and against steps (right); mean ± sd band over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_e, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    optimum = np.mean([c["optimum"].mean() for c in results.values()])
    for i, (arm, c) in enumerate(results.items()):
        color = f"C{i}"
        mean, sd = c["true_reward"].mean(0), c["true_reward"].std(0)
        steps = np.arange(1, mean.shape[0] + 1)
        execs = c["executions"].mean(0)
        if execs[-1] > 0:
            ax_e.plot(execs, mean, label=arm, color=color)
            ax_e.fill_between(execs, mean - sd, mean + sd, alpha=0.15, color=color)
        else:  # no real executions at all: its final level, as a reference line
            ax_e.axhline(mean[-20:].mean(), ls="--", color=color, label=f"{arm} (0 executions, final)")
        ax_s.plot(steps, mean, label=arm, color=color)
        ax_s.fill_between(steps, mean - sd, mean + sd, alpha=0.15, color=color)
    for ax in (ax_e, ax_s):
        ax.axhline(optimum, color="k", lw=0.8, ls=":", label="optimum")
        ax.set_ylabel("true reward of the policy")
    ax_e.set_xlabel("real executions used")
    ax_s.set_xlabel("GRPO step")
    ax_e.legend(fontsize=8)
    ax_e.set_title("true reward vs real-execution budget")
    ax_s.set_title("true reward vs step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
