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
    fn = jax.jit(losses.group_advantages, static_argnames=("standardize",))
    adv, used = fn(rewards, graded, is_anchor, 2.5, standardize=standardize)
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
    adv, used = jax.jit(losses.group_advantages)(rewards, graded, np.array([False, True]), 2.0)
    # Group 0 is {0.2, 0.8}: mean 0.5, std 0.3.
    np.testing.assert_allclose(np.asarray(adv[0]), [-0.3 / 0.3001, 0, 0.3 / 0.3001, 0], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(used), [True, False])
    np.testing.assert_array_equal(np.asarray(adv[1]), 0.0)


def test_group_advantages_bad_input_names_the_argument():
    r = np.zeros((4, 8), np.float32)
    g = np.ones((4, 8), bool)
    a = np.zeros(4, bool)
    cases = [
        # Structure: chex asserts (AssertionError): chex's finding, then the argument and what was expected.
        ((r, g[:, :7], a, 1.0), {}, AssertionError,
         r"has shape \(4, 7\) but expected \(4, 8\)\. \[graded: expected shape \[4, 8\] \(like rewards\)\]"),
        ((r, g, np.zeros(5, bool), 1.0), {}, AssertionError,
         r"has shape \(5,\) but expected \(4\)\. \[is_anchor: expected shape \[4\]"),
        ((r, g.astype(np.float32), a, 1.0), {}, AssertionError,
         r"has type float32 but expected bool\. \[graded: expected a bool dtype\]"),
        ((r.astype(np.int32), g, a, 1.0), {}, AssertionError,
         r"has type int32 but expected <class 'float'>\. \[rewards: expected a float dtype\]"),
        ((r[0], g[0], a, 1.0), {}, AssertionError,
         r"has rank 1 \(shape \(8,\)\) but expected 2\. \[rewards: expected shape \[n, m\] \(\[N groups"),
        ((r, g, a, np.ones(4, np.float32)), {}, AssertionError,
         r"has rank 1 \(shape \(4,\)\) but expected 0\. \[anchor_weight: expected shape \[\] \(a scalar\)\]"),
        # Values: ValueError.
        ((r, g, a, 1.0), {"eps": 0.0}, ValueError, "eps: 0.0, expected a finite number > 0.0"),
        ((r, g, a, 1.0), {"min_graded": 0}, ValueError, "min_graded: 0, expected an int >= 1"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message) as caught:
            losses.group_advantages(*args, **kwargs)
        print(caught.value)
    # Centring only never divides, so eps=0 is fine there.
    losses.group_advantages(r, g, a, 1.0, eps=0.0, standardize=False)


# ---------------------------------------------------------------- grpo_loss


def _np_grpo_per_token(logp, old, ref, adv_bt, eps_low, eps_high, kl_coef, ent, ent_coef):
    rho = np.exp(logp - old)
    pg = np.maximum(-adv_bt * rho, -adv_bt * np.clip(rho, 1 - eps_low, 1 + eps_high))
    d = ref - logp
    return pg + kl_coef * (np.exp(d) - d - 1) - ent_coef * ent


def _inputs(seed=0, b=4, t=6):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.5, 0.5, (b, t))
    old = logp + rng.normal(0, 0.3, (b, t))
    ref = logp + rng.normal(0, 0.3, (b, t))
    adv = rng.normal(size=b)
    mask = rng.uniform(size=(b, t)) < 0.7
    mask[:, 0] = True
    ent = rng.uniform(0, 2, (b, t))
    return [x.astype(np.float32) if x.dtype == np.float64 else x for x in (logp, old, ref, adv, mask, ent)]


def test_policy_gradient_at_ratio_one_is_minus_advantage_over_tokens():
    """∂L/∂logp_bt = −A_b·m_bt / Σm when ρ = 1 and no KL: REINFORCE with a group baseline."""
    logp, _, _, adv, mask, _ = _inputs()
    grad = jax.jit(jax.grad(lambda lp: losses.grpo_loss(lp, logp, logp, adv, mask, kl_coef=0.0)[0]))(logp)
    expected = -adv[:, None] * mask / mask.sum()
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-7)


def test_clipping_cases_by_hand():
    # One token per sequence: (A, ρ) covers both signs, inside and outside the clip range.
    adv = np.array([1.0, 1.0, -1.0, -1.0, 1.0, -1.0], np.float32)
    rho = np.array([1.5, 0.5, 0.5, 1.5, 1.1, 0.9], np.float32)
    old = np.zeros((6, 1), np.float32)
    logp = np.log(rho)[:, None]
    # ε = 0.2, ε_high = 0.3. A>0,ρ=1.5: clipped at 1.3 → −1.3, no grad. A>0,ρ=0.5: −0.5 (min over
    # the pessimistic bound keeps the unclipped). A<0,ρ=0.5: clipped at 0.8 → 0.8, no grad.
    # A<0,ρ=1.5: 1.5 unclipped. Inside the range: −A·ρ.
    expected_pg = np.array([-1.3, -0.5, 0.8, 1.5, -1.1, 0.9])
    expected_grad = np.array([0.0, -0.5, 0.0, 1.5, -1.1, 0.9]) / 6  # ∂(−Aρ)/∂logp = −Aρ
    fn = lambda lp: losses.grpo_loss(
        lp, old, old, adv, np.ones((6, 1), bool), clip_eps=0.2, clip_eps_high=0.3, kl_coef=0.0,
        aggregation="seq-mean-token-mean")
    (loss, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(logp)
    np.testing.assert_allclose(float(metrics["pg_loss"]), expected_pg.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), expected_pg.mean(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad)[:, 0], expected_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["clip_frac_high"]), 1 / 6, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["clip_frac_low"]), 1 / 6, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["clip_frac"]), 2 / 6, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["ratio_min"]), 0.5, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["ratio_max"]), 1.5, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["ratio_mean"]), rho.mean(), rtol=1e-6)


def test_k3_kl_value_and_gradient():
    logp = np.array([[-1.0, -2.0, -0.5]], np.float32)
    ref = np.array([[-1.5, -1.0, -0.5]], np.float32)
    zeros = np.zeros((1,), np.float32)
    mask = np.ones((1, 3), bool)
    fn = lambda lp: losses.grpo_loss(lp, lp, ref, zeros, mask, kl_coef=0.5)
    (loss, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(logp)
    d = ref.astype(np.float64) - logp
    kl = np.exp(d) - d - 1  # [e^-0.5 - 0.5, e - 2, 0]
    np.testing.assert_allclose(float(metrics["kl"]), kl.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(loss), 0.5 * kl.mean(), rtol=1e-6)
    # ∂k3/∂logp = 1 − exp(ref − logp); the policy term is 0 (A = 0).
    np.testing.assert_allclose(np.asarray(grad), 0.5 * (1 - np.exp(d)) / 3, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("aggregation,per_token_adv", [("token-mean", True), ("seq-mean-token-mean", False)])
def test_loss_matches_numpy_and_aggregation_by_hand(aggregation, per_token_adv):
    logp, old, ref, adv, mask, ent = _inputs(seed=3)
    adv_in = np.broadcast_to(adv[:, None], logp.shape).copy() if per_token_adv else adv
    loss, metrics = jax.jit(
        lambda *a: losses.grpo_loss(*a, clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.04, entropy=ent,
                                    entropy_coef=0.01, aggregation=aggregation)
    )(logp, old, ref, adv_in, mask)
    per = _np_grpo_per_token(logp.astype(np.float64), old, ref, adv[:, None], 0.2, 0.28, 0.04, ent, 0.01)
    if aggregation == "token-mean":
        expected = (per * mask).sum() / mask.sum()
    else:
        expected = np.mean([(per[b] * mask[b]).sum() / mask[b].sum() for b in range(len(per))])
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    ent_expected = (ent * mask).sum() / mask.sum() if aggregation == "token-mean" else np.mean(
        [(ent[b] * mask[b]).sum() / mask[b].sum() for b in range(len(ent))])
    np.testing.assert_allclose(float(metrics["entropy"]), ent_expected, rtol=1e-5)


def test_token_mean_and_seq_mean_differ_as_by_hand():
    # Sequence 0 has 1 token with loss 3, sequence 1 has 3 tokens with loss 1 (A = −1, ρ = 1).
    adv = np.array([-3.0, -1.0], np.float32)
    mask = np.array([[1, 0, 0], [1, 1, 1]], bool)
    z = np.zeros((2, 3), np.float32)
    f = jax.jit(losses.grpo_loss, static_argnames=("aggregation",))
    tok, _ = f(z, z, z, adv, mask, kl_coef=0.0, aggregation="token-mean")
    seq, _ = f(z, z, z, adv, mask, kl_coef=0.0, aggregation="seq-mean-token-mean")
    np.testing.assert_allclose(float(tok), (3 + 3 * 1) / 4, rtol=1e-6)
    np.testing.assert_allclose(float(seq), (3 + 1) / 2, rtol=1e-6)


def test_masked_tokens_change_nothing():
    logp, old, ref, adv, mask, ent = _inputs(seed=5)
    f = lambda lp, o, r, e: losses.grpo_loss(lp, o, r, adv, mask, entropy=e, entropy_coef=0.01)
    (loss, metrics), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(logp, old, ref, ent)
    garbage = ~mask
    lp2, old2, ref2, ent2 = (np.where(garbage, v, x).astype(np.float32) for x, v in
                             ((logp, -np.inf), (old, 50.0), (ref, np.nan), (ent, 1e6)))
    (loss2, metrics2), grad2 = jax.jit(jax.value_and_grad(f, has_aux=True))(lp2, old2, ref2, ent2)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    for k in metrics:
        np.testing.assert_allclose(float(metrics2[k]), float(metrics[k]), rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(np.asarray(grad2), np.asarray(grad), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad)[garbage], 0.0)


def test_no_gradient_through_old_ref_or_advantages():
    logp, old, ref, adv, mask, _ = _inputs(seed=6)
    g_old, g_ref, g_adv = jax.jit(jax.grad(lambda o, r, a: losses.grpo_loss(logp, o, r, a, mask)[0],
                                           argnums=(0, 1, 2)))(old, ref, adv)
    for g in (g_old, g_ref, g_adv):
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_grpo_loss_bad_input_names_the_argument():
    logp, old, ref, adv, mask, ent = _inputs()
    b, t = logp.shape
    cases = [
        ((logp, old[:, :3], ref, adv, mask), {}, AssertionError,
         rf"has shape \({b}, 3\) but expected \({b}, {t}\)\. \[old_logp: expected shape \[{b}, {t}\] \(like logp"),
        ((logp, old, ref, adv[:2], mask), {}, AssertionError,
         rf"has shape \(2,\) but expected \({b}\)\. \[advantages: expected shape \[{b}\] "
         rf"\(\[B\] = \({b},\) or \[B, T\] = \({b}, {t}\)\)\]"),
        ((logp, old, ref, adv, mask.T), {}, AssertionError,
         rf"has shape \({t}, {b}\) but expected \({b}, {t}\)\. \[mask: expected shape \[{b}, {t}\]"),
        ((logp[0], old[0], ref[0], adv, mask[0]), {}, AssertionError,
         rf"has rank 1 \(shape \({t},\)\) but expected 2\. \[logp: expected shape \[n, m\]"),
        ((logp, old.astype(np.int32), ref, adv, mask), {}, AssertionError,
         r"has type int32 but expected <class 'float'>\. \[old_logp: expected a float dtype\]"),
        ((logp, old, ref, adv, mask), {"entropy": ent[:, :1]}, AssertionError, r"\[entropy: expected shape"),
        ((logp, old, ref, adv, mask), {"aggregation": "sum"}, ValueError,
         r"aggregation: 'sum', expected one of \('token-mean', 'seq-mean-token-mean'\)"),
        ((logp, old, ref, adv, mask), {"clip_eps": -0.2}, ValueError, "clip_eps: -0.2, expected a finite number >= 0"),
        ((logp, old, ref, adv, mask), {"clip_eps_high": float("nan")}, ValueError, "clip_eps_high: nan, expected"),
        ((logp, old, ref, adv, mask), {"kl_coef": float("inf")}, ValueError, "kl_coef: inf, expected"),
        ((logp, old, ref, adv, mask), {"entropy_coef": 0.002}, ValueError,
         rf"entropy_coef: 0.002 but entropy is None; expected the per-token entropy float\[B, T\] = \({b}, {t}\)"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message) as caught:
            losses.grpo_loss(*args, **kwargs)
        print(caught.value)