"""wmrl_jax.stats against scipy and statsmodels: the exact sign test, the percentile bootstrap interval, the paired
t-test, the Wilson interval; verdicts by hand."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats

from wmrl_jax import stats


@pytest.mark.parametrize("d", [[0.1, 0.2, 0.05, 0.3, 0.01], [0.1, -0.2, 0.05, 0.3, -0.01],
                               [-1, -2, -3, -4, -5, -6, 1], [0.0, 0.0, 1.0], [0.2] * 9 + [-0.1] * 3])
def test_sign_test_equals_scipy_binomtest(d):
    d = np.asarray(d)
    pos, n = int((d > 0).sum()), int((d != 0).sum())
    assert stats.sign_test(d) == pytest.approx(scipy.stats.binomtest(pos, n, 0.5).pvalue, abs=1e-12)


def test_five_seeds_all_one_way_give_the_smallest_sign_p():
    assert stats.sign_test([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)
    assert stats.sign_test([0, 0]) == 1.0


@pytest.mark.parametrize("d", [[0.1, 0.2, 0.05, 0.3, 0.01], [0.1, -0.2, 0.05, 0.3, -0.01], [3.0, -1.0]])
def test_t_test_equals_statsmodels(d):
    from statsmodels.stats.weightstats import DescrStatsW

    _, p, _ = DescrStatsW(np.asarray(d)).ttest_mean(0.0)
    assert stats.t_test(d) == pytest.approx(p, rel=1e-10)
    assert stats.paired_bootstrap(d, np.zeros(len(d))).t_p == pytest.approx(p, rel=1e-10)


def test_t_test_edges():
    assert np.isnan(stats.t_test([0.3]))                                  # one seed: no spread to test against
    assert stats.t_test([0.2, 0.2, 0.2]) == 0.0 and stats.t_test([0.0, 0.0]) == 1.0   # sd 0


def test_bootstrap_interval_equals_scipy_percentile_bootstrap():
    d = np.random.default_rng(3).normal(0.05, 0.1, size=14)
    low, high = stats.bootstrap_mean_ci(d, resamples=40_000, seed=1)
    ref = scipy.stats.bootstrap((d,), np.mean, method="percentile", n_resamples=40_000, confidence_level=0.95,
                                random_state=np.random.default_rng(2)).confidence_interval
    spread = ref.high - ref.low
    assert low == pytest.approx(ref.low, abs=0.02 * spread) and high == pytest.approx(ref.high, abs=0.02 * spread)


def test_paired_bootstrap_and_verdicts():
    real = [0.50, 0.52, 0.48, 0.55, 0.51]
    better = [x + dx for x, dx in zip(real, [0.03, 0.05, 0.02, 0.04, 0.06])]
    p = stats.paired_bootstrap(better, real)
    assert p.mean == pytest.approx(0.04) and 0.02 <= p.low < p.mean < p.high <= 0.06
    assert (p.positive, p.negative, p.n) == (5, 0, 5) and p.sign_p == pytest.approx(0.0625)
    assert stats.verdict(p, "greater") == "reproduced"
    assert stats.verdict(p, "less") == "not reproduced"
    assert stats.verdict(p, "greater", margin=0.1) == "not reproduced"
    mixed = stats.paired_bootstrap([0.5, 0.6, 0.4], [0.55, 0.5, 0.45])
    assert stats.verdict(mixed) == "inconclusive"
    assert "95 % CI, n=5" in str(p) and "sign 5+/0-" in str(p) and "t-test p=0.005" in str(p)


def test_bad_input_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"shapes \(3,\) and \(2,\), expected two equal 1-D arrays"):
        stats.paired_bootstrap([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="a NaN or inf"):
        stats.paired_bootstrap([1, float("nan")], [1, 2])
    with pytest.raises(ValueError, match="level: 1.5, expected in"):
        stats.bootstrap_mean_ci([1.0, 2.0], level=1.5)
    with pytest.raises(ValueError, match="direction: 'up'"):
        stats.verdict(stats.paired_bootstrap([1.0], [0.0]), "up")


@pytest.mark.parametrize("k, n, level", [(0, 10, 0.95), (10, 10, 0.95), (3, 10, 0.95), (1, 1, 0.95), (37, 50, 0.9),
                                         (7, 20, 0.99)])
def test_wilson_interval_equals_statsmodels(k, n, level):
    from statsmodels.stats.proportion import proportion_confint

    low, high = stats.wilson_interval(k, n, level=level)
    ref = proportion_confint(k, n, alpha=1 - level, method="wilson")
    assert low == pytest.approx(ref[0], abs=1e-12) and high == pytest.approx(ref[1], abs=1e-12)
    assert 0.0 <= low <= k / n <= high <= 1.0 and high > low


def test_wilson_interval_refuses_bad_counts():
    for k, n in ((1, 0), (-1, 5), (6, 5), (1.5, 5)):
        with pytest.raises(ValueError, match="expected integers with n >= 1 and 0 <= successes <= n"):
            stats.wilson_interval(k, n)
