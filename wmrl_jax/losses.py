"""GRPO: group-relative advantages and the clipped policy-gradient loss.

Pure functions in the rlax style: each has its formula and source written out,
checks its inputs on the first lines (`wmrl_jax.checks`: chex asserts for
rank, shape and dtype at trace time, AssertionError; ValueError for a bad
value; both name the argument and what was expected) and stops gradients
where a quantity is a target, not a variable. Nothing here imports more than
jax and chex, so another JAX project can lift these functions as they are.

Conventions
-----------
* A "group" is the G rollouts sampled for one task; rewards are ``[N, G]``.
* An ungraded rollout (no score: the grader or world model gave none) is
    masked out, never scored 0 -- a 0 would be a reward, and a wrong one.
    NaN or inf rewards count as ungraded, so they can never reach a gradient.
* Token arrays are ``[B, T]`` with ``mask`` marking completion tokens that
    the loss sees (prompt and padding are False).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from wmrl_jax.checks import check_array, check_choice, check_int, check_number

Array = jax.Array


def group_advantages(
    rewards: Array,
    graded: Array,
    is_anchor: Array,
    anchor_weight: Array | float,
    *,
    eps: float = 1e-4,
    min_graded: int = 2,
    standardize: bool = True,
) -> tuple[Array, Array]:
    """Group-relative advantages (GRPO), anchor groups up-weighted.

    For group i with graded rollouts S_i = {j : graded[i, j] and rewards[i, j]
    finite}, skipped when |S_i| < min_graded (advantages 0, used False):

            mean_i = (1/|S_i|) Σ_{j∈S_i} r_ij
            std_i  = sqrt((1/|S_i|) Σ_{j∈S_i} (r_ij − mean_i)²)      (population)
            A_ij   = (r_ij − mean_i) / (std_i + eps)      if standardize
             = (r_ij − mean_i)                      otherwise
            A_ij  *= anchor_weight                        if is_anchor[i]
            A_ij   = 0                                    for j ∉ S_i

    GRPO: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), §4.1.2. The
    anchor weight is WMRL's inverse-variance weight (docs/design.md, "Advantages").
    A degenerate group (all rewards equal) gives A = 0 exactly, which is why eps
    sits outside the square root: no division by zero, no spurious signal.

    Args:
        rewards: float[N, G] rewards (real for anchors, calibrated WM otherwise).
        graded: bool[N, G] True where the rollout has a score.
        is_anchor: bool[N] True for groups scored by real executions.
        anchor_weight: float scalar multiplying the anchor groups' advantages.
        eps: added to the group std before dividing.
        min_graded: groups with fewer graded rollouts are skipped.
        standardize: divide by the group std (True) or only centre (False).

    Returns:
        advantages: float[N, G] (rewards' dtype), 0 where ungraded or unused.
        used: bool[N] True for groups that contribute to the loss.
    """
    rewards = check_array("rewards", rewards, "float", (None, None), "[N groups, G rollouts]")
    graded = check_array("graded", graded, "bool", rewards.shape, "like rewards")
    is_anchor = check_array("is_anchor", is_anchor, "bool", rewards.shape[:1], "one per group of rewards")
    anchor_weight = check_array("anchor_weight", jnp.asarray(anchor_weight, dtype=rewards.dtype), "float", (),
                                "a scalar")
    if standardize:
        check_number("eps", eps, 0.0, strict=True)   # a degenerate group would divide 0 by 0
    check_int("min_graded", min_graded, 1)

    valid = graded & jnp.isfinite(rewards)
    # Zero out invalid entries before any arithmetic: NaN * 0 is still NaN.
    r = jnp.where(valid, rewards, 0.0)
    count = valid.sum(axis=1)
    used = count >= min_graded
    denom = jnp.maximum(count, 1).astype(rewards.dtype)[:, None]
    mean = r.sum(axis=1, keepdims=True) / denom
    centred = jnp.where(valid, r - mean, 0.0)
    if standardize:
        std = jnp.sqrt((centred**2).sum(axis=1, keepdims=True) / denom)
        adv = centred / (std + eps)
    else:
        adv = centred
    scale = jnp.where(is_anchor, anchor_weight, jnp.ones((), rewards.dtype))
    adv = adv * scale[:, None]
    adv = jnp.where(valid & used[:, None], adv, 0.0)
    return adv, used


AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def _aggregate(per_token: Array, weight: Array, aggregation: str) -> Array:
    """Masked mean of a [B, T] array: over all tokens, or per sequence then over sequences."""
    if aggregation == "token-mean":
        return (per_token * weight).sum() / jnp.maximum(weight.sum(), 1.0)
    # seq-mean-token-mean: sequences without a loss token are left out of the outer mean.
    seq_tokens = weight.sum(axis=1)
    seq_mean = (per_token * weight).sum(axis=1) / jnp.maximum(seq_tokens, 1.0)
    has_tokens = (seq_tokens > 0).astype(per_token.dtype)
    return (seq_mean * has_tokens).sum() / jnp.maximum(has_tokens.sum(), 1.0)


def grpo_loss(
    logp: Array,
    old_logp: Array,
    ref_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.04,
    entropy: Array | None = None,
    entropy_coef: float = 0.0,
    aggregation: str = "token-mean",
) -> tuple[Array, dict[str, Array]]:
    """GRPO loss: clipped surrogate + k3 KL to a frozen reference − entropy bonus.

    Per token t of sequence b, with ρ = exp(logp − sg(old_logp)),
    A = sg(advantages) and d = sg(ref_logp) − logp:

        pg_bt  = max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε_high))
        kl_bt  = exp(d) − d − 1                                    (k3, ≥ 0)
        l_bt   = pg_bt + kl_coef·kl_bt − entropy_coef·entropy_bt

    and the loss aggregates l over the tokens where mask is True:

        "token-mean":          Σ_bt m·l / Σ_bt m          (verl's default; the paper's)
        "seq-mean-token-mean": mean_b [Σ_t m·l / Σ_t m]   (sequences with no token skipped)

    References: PPO clipping, Schulman et al. 2017 (arXiv:1707.06347);
    GRPO and the k3 KL to the reference in the loss, Shao et al. 2024
    (arXiv:2402.03300) eq. 3-4; k3 estimator, Schulman 2020, "Approximating
    KL divergence" (joschu.net/blog/kl-approx.html); asymmetric clip-higher
    ε_high, Yu et al. 2025, "DAPO" (arXiv:2503.14476).

    At ρ = 1 (on-policy, first minibatch) the gradient of pg_bt with respect to
    logp_bt is −A, the REINFORCE policy gradient with a group baseline.

    Args:
      logp: float[B, T] log π_θ(token) of the policy being trained.
      old_logp: float[B, T] log-probs of the sampling policy (no gradient).
      ref_logp: float[B, T] log-probs of the frozen reference (no gradient).
      advantages: float[B] (one per sequence, broadcast over tokens) or
        float[B, T] (per token). No gradient.
      mask: bool[B, T] (or float weights) True on completion tokens in the loss.
      clip_eps: ε, the lower clip range (and the upper one if ε_high is None).
      clip_eps_high: ε_high, the upper clip range; None means ε.
      kl_coef: weight of the k3 KL to the reference (paper: 0.04).
      entropy: optional float[B, T] per-token entropy of π_θ (differentiable).
      entropy_coef: weight of the entropy bonus (paper: 0.002).
      aggregation: "token-mean" or "seq-mean-token-mean".

    Returns:
      loss: float scalar.
      metrics: dict of scalars, all masked token means (same aggregation as the
        loss for the three loss terms): "pg_loss", "kl" (k3 to the reference),
        "entropy" (0 if not given), "clip_frac", "clip_frac_low",
        "clip_frac_high" (fraction of tokens where the clipped branch is the
        active one, split by side), "approx_kl_old" (k3 estimate of
        KL(π_old ‖ π_θ) = ρ − 1 − log ρ: how far this update moved), "ratio_mean", "ratio_min", "ratio_max".
    """
    logp = check_array("logp", logp, "float", (None, None), "[B sequences, T tokens]")
    old_logp = check_array("old_logp", old_logp, "float", logp.shape, "like logp")
    ref_logp = check_array("ref_logp", ref_logp, "float", logp.shape, "like logp")
    mask = check_array("mask", mask, None, logp.shape, "like logp; bool or float weights")
    advantages = jnp.asarray(advantages)
    # [B] (one per sequence) or [B, T] (per token): checked against the prefix of logp's shape of its rank.
    check_array("advantages", advantages, "float", logp.shape[:max(1, min(2, advantages.ndim))],
                f"[B] = {tuple(logp.shape[:1])} or [B, T] = {tuple(logp.shape)}")
    if entropy is not None:
        entropy = check_array("entropy", entropy, "float", logp.shape, "like logp")
    elif isinstance(entropy_coef, numbers.Real) and entropy_coef != 0:
        # Otherwise the bonus would silently be 0.
        raise ValueError(f"entropy_coef: {entropy_coef!r} but entropy is None; expected the per-token "
                         f"entropy float[B, T] = {tuple(logp.shape)}, or entropy_coef=0")
    check_choice("aggregation", aggregation, AGGREGATIONS)
    check_number("clip_eps", clip_eps, 0.0)
    if clip_eps_high is not None:
        check_number("clip_eps_high", clip_eps_high, 0.0)
    check_number("kl_coef", kl_coef, 0.0)
    check_number("entropy_coef", entropy_coef, 0.0)
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    dtype = logp.dtype
    weight = jnp.asarray(mask).astype(dtype)
    # Targets, not variables: only logp (and entropy) carry gradient.
    old_logp = jax.lax.stop_gradient(jnp.asarray(old_logp, dtype))
    ref_logp = jax.lax.stop_gradient(jnp.asarray(ref_logp, dtype))
    adv = jax.lax.stop_gradient(advantages.astype(dtype))
    if adv.ndim == 1:
        adv = adv[:, None]
    adv = jnp.broadcast_to(adv, logp.shape)
    # Masked tokens may hold garbage (padding log-probs of -inf): keep them out
    # of exp() so neither the loss nor its gradient ever sees a NaN.
    on = weight > 0
    log_ratio = jnp.where(on, logp - old_logp, 0.0)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg = jnp.maximum(-adv * ratio, -adv * clipped_ratio)

    d = jnp.where(on, ref_logp - logp, 0.0)
    kl = jnp.exp(d) - d - 1.0

    ent = jnp.zeros_like(logp) if entropy is None else jnp.where(on, entropy, 0.0)
    per_token = pg + kl_coef * kl - entropy_coef * ent
    loss = _aggregate(per_token, weight, aggregation)

    def mean(x):
        return _aggregate(x, weight, aggregation)

    sg = jax.lax.stop_gradient
    clip_low = ((ratio < 1.0 - eps_low) & (adv < 0)).astype(dtype)
    clip_high = ((ratio > 1.0 + eps_high) & (adv > 0)).astype(dtype)
    big = jnp.asarray(jnp.finfo(dtype).max, dtype)
    metrics = {
        "pg_loss": sg(mean(pg)),
        "kl": sg(mean(kl)),
        "entropy": sg(mean(ent)),
        "clip_frac": sg(mean(clip_low + clip_high)),
        "clip_frac_low": sg(mean(clip_low)),
        "clip_frac_high": sg(mean(clip_high)),
        "approx_kl_old": sg(mean(ratio - 1.0 - log_ratio)),
        "ratio_mean": sg(mean(ratio)),
        "ratio_min": sg(jnp.where(on.any(), jnp.where(on, ratio, big).min(), 1.0)),
        "ratio_max": sg(jnp.where(on.any(), jnp.where(on, ratio, -big).max(), 1.0)),
    }
    return loss, metrics
