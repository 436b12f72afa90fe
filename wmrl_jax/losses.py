"""GRPO: group-relative advantages and the clipped policy-gradient loss.

Pure functions in the rlax style: each has its formula and source written out,
checks its inputs on the first lines and stops gradients where a quantity is a
target, not a variable. Nothing here imports more than jax, chex and numpy, so
another JAX project can lift these functions as they are.

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

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


def _expect_shape(name: str, x: Array, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {tuple(shape)}")


def _expect_rank(name: str, x: Array, rank: int, what: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name}: shape {tuple(x.shape)}, expected rank {rank} ({what})")


def _expect_float(name: str, x: Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}: dtype {x.dtype}, expected a floating dtype")


def _expect_bool(name: str, x: Array) -> None:
    if x.dtype != jnp.bool_:
        raise TypeError(f"{name}: dtype {x.dtype}, expected bool")


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
    anchor weight is WMRL's inverse-variance weight (DESIGN.md, "Advantages").
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
    rewards = jnp.asarray(rewards)
    graded = jnp.asarray(graded)
    is_anchor = jnp.asarray(is_anchor)
    _expect_rank("rewards", rewards, 2, "[N groups, G rollouts]")
    _expect_float("rewards", rewards)
    _expect_shape("graded", graded, rewards.shape)
    _expect_bool("graded", graded)
    _expect_shape("is_anchor", is_anchor, rewards.shape[:1])
    _expect_bool("is_anchor", is_anchor)
    anchor_weight = jnp.asarray(anchor_weight, dtype=rewards.dtype)
    _expect_shape("anchor_weight", anchor_weight, ())

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
