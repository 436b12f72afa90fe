"""The paper's correction semantics in plain, loop-based numpy (float64).

An obviously-correct transcription of docs/design.md "Semantics of the
corrections", written for reading, not speed. It is the independent reference
the JAX functions in :mod:`wmrl_jax.corrections` are tested against, and the
"plain numpy" peer of ``launch/bench_corrections.py`` (which is why it lives
in the package, not under tests/). Rewards are Python floats or None
(ungraded), exactly the reference's contract. Nothing here imports JAX.
"""

from __future__ import annotations

import math

import numpy as np


def pav(values, weights):
    """Weighted pool-adjacent-violators, stack-based: pool while prev > last."""
    val, wt, cnt = [], [], []
    for v, w in zip(values, weights):
        val.append(float(v))
        wt.append(float(w))
        cnt.append(1)
        while len(val) > 1 and val[-2] > val[-1]:
            v2, w2, c2 = val.pop(), wt.pop(), cnt.pop()
            v1, w1, c1 = val.pop(), wt.pop(), cnt.pop()
            val.append((v1 * w1 + v2 * w2) / (w1 + w2))
            wt.append(w1 + w2)
            cnt.append(c1 + c2)
    out = []
    for v, c in zip(val, cnt):
        out += [v] * c
    return np.asarray(out)


def fit_binned(pairs, bins=10):
    """(knots_x, knots_y) of the paper's binned isotonic map, or None (identity)."""
    p = np.asarray(list(pairs), dtype=float)
    if p.ndim != 2 or p.shape[0] < 2:
        return None
    x, y = p[:, 0], p[:, 1]
    edges = np.linspace(0.0, 1.0, bins + 1)
    idx = np.clip(np.digitize(x, edges[1:-1]), 0, bins - 1)
    cx, cy, cw = [], [], []
    for b in range(bins):
        m = idx == b
        if m.sum() == 0:
            continue
        cx.append(x[m].mean())
        cy.append(y[m].mean())
        cw.append(float(m.sum()))
    if len(cx) < 2:
        return None
    return np.asarray(cx), pav(cy, cw)


def fit_exact(pairs):
    """(unique x, fitted y) of the exact isotonic regression, or None (< 2 distinct x)."""
    p = np.asarray(list(pairs), dtype=float)
    if p.ndim != 2 or p.shape[0] < 2:
        return None
    order = np.argsort(p[:, 0], kind="stable")
    xs, ys = p[order, 0], p[order, 1]
    ux, uy, uw = [], [], []
    for xv, yv in zip(xs, ys):
        if ux and xv == ux[-1]:
            uy[-1] += yv
            uw[-1] += 1.0
        else:
            ux.append(xv)
            uy.append(yv)
            uw.append(1.0)
    if len(ux) < 2:
        return None
    means = [s / w for s, w in zip(uy, uw)]
    return np.asarray(ux), pav(means, uw)


def apply_map(f, r):
    """np.interp through the knots (flat beyond the ends); None = identity."""
    if f is None:
        return np.asarray(r, dtype=float)
    return np.interp(np.asarray(r, dtype=float), f[0], f[1])


def bias_stats(x, y, f):
    x, y = np.asarray(x, float), np.asarray(y, float)
    xh = apply_map(f, x)
    before = float((((x - x.mean()) - (y - y.mean())) ** 2).mean())
    after = float((((xh - xh.mean()) - (y - y.mean())) ** 2).mean())
    return before, after, 1.0 - after / max(1e-9, before)


def group_disagreement(d, s):
    d, s = np.asarray(d, float), np.asarray(s, float)
    var_s = s.var()
    if var_s < 1e-9:
        return None
    return float((((d - d.mean()) - (s - s.mean())) ** 2).mean() / var_s)


class Debiaser:
    """FIFO of the newest ``cap`` pairs; refit after a push when due."""

    def __init__(self, cap=5000, bins=10, min_pairs=200, refit_every=64, debias=True,
                 calibration="binned"):
        self.cap, self.bins, self.min_pairs = cap, bins, min_pairs
        self.refit_every, self.debias, self.calibration = refit_every, debias, calibration
        self.pairs = []
        self.since = 0
        self.f = None
        self.n_fits = 0
        self.bias = (0.0, 0.0, 0.0)

    def push(self, x, y):
        self.pairs.append((float(x), float(y)))
        if len(self.pairs) > self.cap:
            self.pairs = self.pairs[-self.cap:]
        self.since += 1
        if self.debias and len(self.pairs) >= self.min_pairs and self.since >= self.refit_every:
            self.refit()

    def refit(self):
        fit = fit_binned if self.calibration == "binned" else fit_exact
        f = fit(self.pairs, self.bins) if self.calibration == "binned" else fit(self.pairs)
        if f is None:
            return False
        self.f, self.since, self.n_fits = f, 0, self.n_fits + 1
        p = np.asarray(self.pairs, dtype=float)
        self.bias = bias_stats(p[:, 0], p[:, 1], f)
        return True

    def apply(self, r):
        return apply_map(self.f, r)


class Weighter:
    """EWMA of the disagreement; c fixed once after warm-up; clipped weight."""

    def __init__(self, half_life=64.0, warmup=32, w_max=4.0, target_weight=2.0, denoise=True):
        self.alpha = 1.0 - 0.5 ** (1.0 / max(1.0, half_life))
        self.warmup, self.w_max, self.target, self.denoise = warmup, w_max, target_weight, denoise
        self.ewma, self.n, self.c = None, 0, None

    def observe(self, d, s):
        s2 = group_disagreement(d, s)
        if s2 is None:
            return
        self.ewma = s2 if self.ewma is None else (1 - self.alpha) * self.ewma + self.alpha * s2
        self.n += 1
        if self.c is None and self.n >= self.warmup and self.ewma > 1e-12:
            self.c = (self.target - 1.0) / self.ewma

    def weight(self):
        if not self.denoise or self.c is None:
            return 1.0
        return min(self.w_max, max(1.0, 1.0 + self.c * self.ewma))


def advantages(groups, anchor, weight, eps=1e-4, min_graded=2, standardize=True):
    """Per group over graded (non-None) rewards; < min_graded graded: skipped."""
    adv, used = [], []
    for rewards, is_anchor in zip(groups, anchor):
        idx = [j for j, r in enumerate(rewards) if r is not None]
        a = [0.0] * len(rewards)
        if len(idx) >= min_graded:
            arr = np.asarray([rewards[j] for j in idx], dtype=float)
            z = arr - arr.mean()
            if standardize:
                z = z / (arr.std() + eps)
            if is_anchor:
                z = z * weight
            for j, v in zip(idx, z):
                a[j] = float(v)
        adv.append(a)
        used.append(len(idx) >= min_graded)
    return adv, used


class CorrectionLoop:
    """One step = the ordered WMRL step of docs/design.md, over [N][G] lists."""

    def __init__(self, *, cap=5000, bins=10, min_pairs=200, refit_every=64, half_life=64.0,
                 warmup=32, w_max=4.0, target_weight=2.0, debias=True, denoise=True,
                 calibration="binned"):
        self.debiaser = Debiaser(cap, bins, min_pairs, refit_every, debias, calibration)
        self.weighter = Weighter(half_life, warmup, w_max, target_weight, denoise)

    def step(self, wm, real, anchor, eps=1e-4, min_graded=2, standardize=True):
        """wm, real: [N][G] floats or None; anchor: [N] bools -> dict of results."""
        out_rewards = []
        for wm_g, real_g, is_anchor in zip(wm, real, anchor):
            if is_anchor:
                pairs = [(c, t) for c, t in zip(wm_g, real_g) if c is not None and t is not None]
                if pairs:
                    for c, t in pairs:
                        self.debiaser.push(c, t)
                    d = [float(self.debiaser.apply(c)) for c, _ in pairs]
                    self.weighter.observe(d, [t for _, t in pairs])
                out_rewards.append(list(real_g))
            else:
                out_rewards.append([None if c is None else float(self.debiaser.apply(c)) for c in wm_g])
        w = self.weighter.weight()
        adv, used = advantages(out_rewards, anchor, w, eps, min_graded, standardize)
        return dict(rewards=out_rewards, advantages=adv, used=used, anchor_weight=w,
                    calibrated=self.debiaser.f is not None, n_fits=self.debiaser.n_fits,
                    bias=self.debiaser.bias, pairs=len(self.debiaser.pairs),
                    disagreement=self.weighter.ewma)


def to_lists(rewards, graded):
    """[N, G] arrays + mask -> nested lists with None for ungraded / non-finite."""
    out = []
    for r_row, g_row in zip(np.asarray(rewards, float), np.asarray(graded, bool)):
        out.append([float(r) if (g and math.isfinite(r)) else None for r, g in zip(r_row, g_row)])
    return out
