"""Paired statistics over seeds: bootstrap confidence intervals, the sign test and a claim's verdict.

The paper's claims are comparisons of two arms run with the same seeds (the
same task order, anchor schedule and sampling seeds), so every test here is
paired: it works on the per-seed differences ``d_s = a_s - b_s``.

* `paired_bootstrap` -- the mean difference and its percentile bootstrap
  interval: resample the seeds with replacement, take the mean of d over the
  resample, and read the (1 - level) / 2 and (1 + level) / 2 quantiles of
  those means. With 5 seeds there are only 126 distinct resamples, so the
  interval is coarse; it is what the data supports.
* `sign_test` -- the exact two-sided binomial test of "d is as often
  positive as negative" (ties dropped): no assumption on d's distribution.
  With 5 seeds its smallest p-value is 2 / 32 = 0.0625: five seeds cannot
  pass it at 0.05 alone, which is why the verdict reads the interval.
* `t_test` -- the paired Student t-test's two-sided p-value, beside them as
  a check on the interval: the percentile bootstrap of 5 seeds is narrower
  than a t-interval (it ignores the uncertainty of the seeds' spread), so a
  claim whose interval just excludes 0 reads with its t p-value.
* `verdict` -- "reproduced" when the interval lies on the claimed side of 0,
  "not reproduced" when it lies wholly on the other side, "inconclusive"
  otherwise.

And one unpaired helper, for success rates (the VLA track's per-task
success over initial states):

* `wilson_interval` -- the Wilson score interval of a binomial proportion,
  which stays inside [0, 1] and is not empty at 0 / n or n / n (where the
  normal-approximation interval collapses to a point).

Numpy, and scipy for the t distribution; `tests/test_stats.py` checks against scipy and statsmodels.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Sequence

import numpy as np

VERDICTS = ("reproduced", "not reproduced", "inconclusive")


@dataclasses.dataclass(frozen=True)
class Paired:
    """One paired comparison: mean of d = a - b over n seeds, its bootstrap CI, the sign test."""

    n: int
    mean: float
    low: float
    high: float
    level: float
    positive: int        # seeds with d > 0
    negative: int        # seeds with d < 0
    sign_p: float        # exact two-sided sign test
    t_p: float = float("nan")   # paired t-test, two-sided (nan with one seed)

    def __str__(self) -> str:
        return (f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}] ({100 * self.level:.0f} % CI, n={self.n}; "
                f"sign {self.positive}+/{self.negative}-, p={self.sign_p:.3f}; t-test p={self.t_p:.3f})")


def _diffs(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(f"a, b: shapes {a.shape} and {b.shape}, expected two equal 1-D arrays (one value a seed)")
    if a.size == 0:
        raise ValueError("a, b: empty, expected one value a seed")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("a, b: a NaN or inf, expected finite values (drop the seed from both arms)")
    return a - b


def bootstrap_mean_ci(d: Sequence[float], *, level: float = 0.95, resamples: int = 10_000,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `d` (resampled with replacement, `resamples` times)."""
    d = np.asarray(d, np.float64)
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: {level!r}, expected in (0, 1)")
    if resamples < 1:
        raise ValueError(f"resamples: {resamples!r}, expected >= 1")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    low, high = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(low), float(high)


def sign_test(d: Sequence[float]) -> float:
    """Exact two-sided sign test of median(d) = 0: P(|#positive - n/2| >= observed) under Binomial(n, 1/2).

    Zeros are dropped; with none left the p-value is 1.
    """
    d = np.asarray(d, np.float64)
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    n = pos + neg
    if n == 0:
        return 1.0
    k = min(pos, neg)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return float(min(1.0, 2.0 * tail))


def t_test(d: Sequence[float]) -> float:
    """Two-sided p-value of the one-sample Student t-test of mean(d) = 0: t = mean / (sd / sqrt(n)), n - 1
    degrees of freedom (sd with ddof=1). nan for fewer than 2 values; with sd 0, 1 at mean 0 and 0 otherwise."""
    from scipy import stats

    d = np.asarray(d, np.float64)
    if d.size < 2:
        return float("nan")
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if np.ptp(d) == 0.0:   # all equal (sd may come out a rounding error above 0)
        return 1.0 if mean == 0.0 else 0.0
    t = mean / (sd / math.sqrt(d.size))
    return float(2.0 * stats.t.sf(abs(t), d.size - 1))


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, level: float = 0.95, resamples: int = 10_000,
                     seed: int = 0) -> Paired:
    """a - b paired by seed: mean, percentile bootstrap CI, sign test, t-test."""
    d = _diffs(a, b)
    low, high = bootstrap_mean_ci(d, level=level, resamples=resamples, seed=seed)
    return Paired(n=int(d.size), mean=float(d.mean()), low=low, high=high, level=level,
                  positive=int((d > 0).sum()), negative=int((d < 0).sum()), sign_p=sign_test(d), t_p=t_test(d))


def verdict(p: Paired, direction: str = "greater", margin: float = 0.0) -> str:
    """The claim "mean(a - b) > margin" ("greater") or "< margin" ("less") read off the interval."""
    if direction not in ("greater", "less"):
        raise ValueError(f"direction: {direction!r}, expected 'greater' or 'less'")
    low, high = (p.low - margin, p.high - margin)
    if direction == "less":
        low, high = -high, -low
    if low > 0:
        return "reproduced"
    if high < 0:
        return "not reproduced"
    return "inconclusive"


def wilson_interval(successes: int, n: int, *, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a success rate, `successes` of `n` trials, at confidence `level`.

        p = k / n,  z = Phi^-1((1 + level) / 2)
        centre = (p + z^2 / 2n) / (1 + z^2 / n),  half = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: {level!r}, expected in (0, 1)")
    if isinstance(n, bool) or int(n) != n or n < 1 or int(successes) != successes or not 0 <= successes <= n:
        raise ValueError(f"successes={successes!r}, n={n!r}: expected integers with n >= 1 and 0 <= successes <= n")
    z = statistics.NormalDist().inv_cdf((1.0 + level) / 2.0)
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At k = 0 (k = n) the low (high) end is exactly 0 (1); the formula leaves rounding there.
    return (0.0 if successes == 0 else centre - half), (1.0 if successes == n else centre + half)


__all__ = ["Paired", "VERDICTS", "bootstrap_mean_ci", "paired_bootstrap", "sign_test", "t_test", "verdict", "wilson_interval"]
