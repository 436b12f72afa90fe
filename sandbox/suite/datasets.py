"""Deterministic data sources for the embedded task suite (no downloads).

Every function here maps an integer seed to one full table (features and
target columns, no id column) built only from data that ships inside installed
packages (scikit-learn's bundled datasets, statsmodels' bundled datasets) or
from scikit-learn's synthetic generators with a fixed `random_state`. The same
seed gives the same table on every machine: no global RNG, no wall clock, no
set/dict iteration over unordered things.

The quirk helpers (`inject_missing`, `bin_to_strings`, `flip_labels`) are what
make the best model differ across tasks: a missing-value task punishes models
without imputation, string categories punish numeric-only pipelines, label
noise punishes deep trees, imbalance punishes accuracy-minded baselines.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from sklearn import datasets as skd


# ----------------------------------------------------------------------------- quirks


def inject_missing(frame: pd.DataFrame, columns, fraction: float, rng: np.random.Generator) -> pd.DataFrame:
    """Blanks `fraction` of the cells of each named column (missing at random)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"inject_missing: fraction {fraction}, expected in [0, 1)")
    out = frame.copy()
    for col in columns:
        if col not in out.columns:
            raise KeyError(f"inject_missing: column {col!r} not in {list(out.columns)}")
        mask = rng.random(len(out)) < fraction
        out[col] = out[col].astype("float64") if out[col].dtype.kind in "iub" else out[col]
        out.loc[mask, col] = np.nan
    return out


def bin_to_strings(values, labels) -> pd.Series:
    """Maps small integer codes 0..K-1 (or 1..K) onto string category names."""
    codes = np.asarray(values)
    codes = codes - codes.min()
    if codes.max() >= len(labels):
        raise ValueError(f"bin_to_strings: {int(codes.max()) + 1} codes, only {len(labels)} labels")
    return pd.Series(np.asarray(labels, dtype=object)[codes.astype(int)])


def flip_labels(y, fraction: float, rng: np.random.Generator):
    """Label noise: replaces `fraction` of labels by a uniformly drawn class."""
    y = np.asarray(y).copy()
    classes = np.unique(y)
    mask = rng.random(len(y)) < fraction
    y[mask] = rng.choice(classes, size=int(mask.sum()))
    return y


# ----------------------------------------------------------------------------- scikit-learn bundled data


def iris_species(seed: int) -> pd.DataFrame:
    data = skd.load_iris(as_frame=True)
    frame = data.frame.rename(columns=lambda c: c.replace(" (cm)", "_cm").replace(" ", "_"))
    frame["species"] = np.asarray(data.target_names)[data.target]
    return frame.drop(columns=["target"])


def wine_cultivar(seed: int) -> pd.DataFrame:
    data = skd.load_wine(as_frame=True)
    frame = data.frame.rename(columns={"od280/od315_of_diluted_wines": "od280_od315"})
    frame["cultivar"] = frame.pop("target").map({0: "c0", 1: "c1", 2: "c2"})
    return frame


def breast_cancer_diagnosis(seed: int) -> pd.DataFrame:
    data = skd.load_breast_cancer(as_frame=True)
    frame = data.frame.rename(columns=lambda c: c.replace(" ", "_"))
    # sklearn codes malignant as 0; the competition asks for P(malignant).
    frame["malignant"] = 1 - frame.pop("target")
    return frame


def digits_recognition(seed: int) -> pd.DataFrame:
    data = skd.load_digits(as_frame=True)
    frame = data.frame.copy()
    frame["digit"] = frame.pop("target")
    return frame


def diabetes_progression(seed: int) -> pd.DataFrame:
    # scaled=False: raw units (age in years, sex 1/2) as a clinic would export them.
    data = skd.load_diabetes(as_frame=True, scaled=False)
    frame = data.frame.copy()
    frame["progression"] = frame.pop("target")
    return frame


# ----------------------------------------------------------------------------- statsmodels bundled data


def _statsmodels(name: str) -> pd.DataFrame:
    import statsmodels.api as sm  # heavy import, only when a statsmodels task is built

    return getattr(sm.datasets, name).load_pandas().data.copy()


def rand_health_visits(seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = _statsmodels("randhie")
    # 20 190 rows; keep 12 000: the largest task of the suite, yet cheap enough that the ~60
    # reference solutions (random forests, boosting, an MLP) run in minutes on a laptop.
    keep = np.sort(rng.permutation(len(frame))[:12000])
    frame = frame.iloc[keep].reset_index(drop=True)
    frame["health"] = np.select(
            [frame.hlthp == 1, frame.hlthf == 1, frame.hlthg == 1], ["poor", "fair", "good"], "excellent")
    frame = frame.drop(columns=["hlthg", "hlthf", "hlthp"])
    frame = inject_missing(frame, ["disea", "lpi"], 0.06, rng)
    frame["doctor_visits"] = frame.pop("mdvis")
    return frame


def fair_affairs(seed: int) -> pd.DataFrame:
    frame = _statsmodels("fair")
    jobs = ["student", "farming", "white_collar", "teacher", "manager", "professional"]
    frame["occupation"] = bin_to_strings(frame.occupation.astype(int), jobs)
    frame["occupation_husb"] = bin_to_strings(frame.occupation_husb.astype(int), jobs)
    frame["religious"] = bin_to_strings(frame.religious.astype(int), ["not", "mildly", "fairly", "strongly"])
    frame["had_affair"] = (frame.pop("affairs") > 0).astype(int)
    return frame


def anes96_vote(seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = _statsmodels("anes96").drop(columns=["logpopul"])
    frame["PID"] = bin_to_strings(frame.PID.astype(int), [
            "strong_dem", "weak_dem", "indep_dem", "independent", "indep_rep", "weak_rep", "strong_rep"])
    frame["educ"] = bin_to_strings(frame.educ.astype(int), [
            "grade_school", "some_high_school", "high_school", "some_college", "community_college", "ba", "postgrad"])
    frame = inject_missing(frame, ["selfLR", "ClinLR", "DoleLR", "income", "age"], 0.08, rng)
    frame["vote_dole"] = frame.pop("vote").astype(int)
    return frame


def star98_math(seed: int) -> pd.DataFrame:
    frame = _statsmodels("star98")
    frame["pct_above_median"] = frame.NABOVE / (frame.NABOVE + frame.NBELOW)
    return frame.drop(columns=["NABOVE", "NBELOW"])


# ----------------------------------------------------------------------------- synthetic generators


def friedman_nonlinear(seed: int) -> pd.DataFrame:
    x, y = skd.make_friedman1(n_samples=3000, n_features=10, noise=1.0, random_state=seed)
    frame = pd.DataFrame(x, columns=[f"x{i}" for i in range(10)])
    frame["response"] = y
    return frame


def transaction_fraud(seed: int) -> pd.DataFrame:
    x, y = skd.make_classification(
            n_samples=8000, n_features=16, n_informative=6, n_redundant=4, weights=[0.97, 0.03],
            class_sep=0.8, flip_y=0.005, random_state=seed)
    frame = pd.DataFrame(x, columns=[f"v{i}" for i in range(16)])
    frame["amount"] = np.round(np.exp(2.5 + 0.8 * x[:, 0] + 0.5 * y), 2)
    frame["is_fraud"] = y
    return frame


def customer_churn(seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    n = 5000
    x, y = skd.make_classification(
            n_samples=n, n_features=8, n_informative=5, n_redundant=1, flip_y=0.0, random_state=seed)
    frame = pd.DataFrame(x[:, :6], columns=[
            "tenure_z", "monthly_charges_z", "support_calls_z", "usage_trend", "late_payments_z", "discount_z"])
    plan = rng.integers(0, 3, n)
    region = rng.integers(0, 5, n)
    # The plan and region carry signal of their own, so dropping string columns costs accuracy.
    logit = 2.0 * x[:, 6] + np.array([-1.2, 0.0, 1.4])[plan] + np.array([0.6, -0.6, 0.0, 0.9, -0.9])[region]
    y = np.where(rng.random(n) < 0.5, y, (logit + x[:, 7] > 0).astype(int))
    frame["plan"] = bin_to_strings(plan, ["basic", "standard", "premium"])
    frame["region"] = bin_to_strings(region, ["north", "south", "east", "west", "central"])
    frame = inject_missing(frame, ["monthly_charges_z", "support_calls_z", "plan"], 0.08, rng)
    frame["churned"] = flip_labels(y, 0.15, rng)
    return frame


def multi_sensor_calibration(seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    x, y = skd.make_regression(
            n_samples=1500, n_features=12, n_informative=8, n_targets=3, noise=5.0, random_state=seed)
    # A non-linear term per target: trees and boosting can find it, a linear model cannot.
    y = y + np.stack([25 * np.sin(2 * x[:, 0]), 15 * x[:, 1] ** 2, 20 * np.abs(x[:, 2])], axis=1)
    frame = pd.DataFrame(x, columns=[f"raw_{i}" for i in range(12)])
    frame = inject_missing(frame, ["raw_5", "raw_9"], 0.03, rng)
    for i, name in enumerate(["temperature", "humidity", "pressure"]):
        frame[name] = y[:, i]
    return frame


def hastie_signal(seed: int) -> pd.DataFrame:
    x, y = skd.make_hastie_10_2(n_samples=6000, random_state=seed)
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(10)])
    frame["signal"] = (y > 0).astype(int)
    return frame


def two_moons_noisy(seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    x, y = skd.make_moons(n_samples=4000, noise=0.3, random_state=seed)
    frame = pd.DataFrame(x, columns=["u", "v"])
    for i in range(6):  # distractors on a larger scale: unscaled kNN suffers
        frame[f"noise_{i}"] = rng.normal(0.0, 3.0, len(frame))
    frame["label"] = flip_labels(y, 0.05, rng)
    return frame


def wide_linear_signal(seed: int) -> pd.DataFrame:
    x, y = skd.make_regression(
            n_samples=400, n_features=150, n_informative=30, noise=10.0, random_state=seed)
    frame = pd.DataFrame(x, columns=[f"g{i:03d}" for i in range(150)])
    frame["outcome"] = y
    return frame
