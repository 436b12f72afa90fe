"""GRPO advantages and loss against hand formulas in plain numpy."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from wmrl_jax import losses


def _np_group_advantages(rewards, graded, is_anchor, weight, eps=1e-4, min_graded=2, standardize=True):
    """Independent reference: a Python loop over groups, as the paper's code does it."""
    n, g = rewards.shape
    adv = np.zeros((n, g), np.float64)
    used = np.zeros(n, bool)
    for i in range(n):
        idx = [j for j in range(g) if graded[i, j] and np.isfinite(rewards[i, j])]
        if len(idx) < min_graded:
            continue
        used[i] = True
        r = rewards[i, idx].astype(np.float64)
        a = r - r.mean()
        if standardize:
            a = a / (r.std() + eps)
        if is_anchor[i]:
            a = a * weight
        adv[i, idx] = a
    return adv, used


@pytest.mark.parametrize("standardize", [True, False])
def test_group_advantages_match_loop_reference(standardize):
    rng = np.random.default_rng(0)
    rewards = rng.uniform(0, 1, (16, 8)).astype(np.float32)
    rewards[rng.uniform(size=rewards.shape) < 0.1] = np.nan
    rewards[3, 2] = np.inf
    rewards[5] = 0.3  # degenerate group
    graded = rng.uniform(size=rewards.shape) < 0.8
    graded[7, :] = False
    graded[7, 0] = True  # one graded rollout only: skipped
    is_anchor = rng.uniform(size=16) < 0.3
    adv, used = losses.group_advantages(rewards, graded, is_anchor, 2.5, standardize=standardize)
    ref_adv, ref_used = _np_group_advantages(rewards, graded, is_anchor, 2.5, standardize=standardize)
    np.testing.assert_array_equal(np.asarray(used), ref_used)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(adv)))
    assert not bool(used[7])
    np.testing.assert_array_equal(np.asarray(adv[5]), 0.0)


def test_group_advantages_sum_to_zero_per_group():
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(12, 8)).astype(np.float32)
    graded = rng.uniform(size=rewards.shape) < 0.7
    is_anchor = np.arange(12) % 3 == 0
    adv, _ = jax.jit(losses.group_advantages)(rewards, graded, is_anchor, 3.0)
    np.testing.assert_allclose(np.asarray(adv).sum(axis=1), 0.0, atol=1e-5)


def test_nan_rewards_are_ungraded_and_never_propagate():
    rewards = np.array([[0.2, np.nan, 0.8, np.inf], [np.nan, np.nan, np.nan, 1.0]], np.float32)
    graded = np.ones_like(rewards, bool)
    adv, used = losses.group_advantages(rewards, graded, np.array([False, True]), 2.0)
    # Group 0 is {0.2, 0.8}: mean 0.5, std 0.3.
    np.testing.assert_allclose(np.asarray(adv[0]), [-0.3 / 0.3001, 0, 0.3 / 0.3001, 0], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(used), [True, False])
    np.testing.assert_array_equal(np.asarray(adv[1]), 0.0)


def test_group_advantages_bad_input_names_the_argument():
    r = np.zeros((4, 8), np.float32)
    g = np.ones((4, 8), bool)
    with pytest.raises(ValueError, match="graded"):
        losses.group_advantages(r, g[:, :7], np.zeros(4, bool), 1.0)
    with pytest.raises(ValueError, match="is_anchor"):
        losses.group_advantages(r, g, np.zeros(5, bool), 1.0)
    with pytest.raises(TypeError, match="graded"):
        losses.group_advantages(r, g.astype(np.float32), np.zeros(4, bool), 1.0)
    with pytest.raises(ValueError, match="rewards"):
        losses.group_advantages(r[0], g[0], np.zeros(4, bool), 1.0)
