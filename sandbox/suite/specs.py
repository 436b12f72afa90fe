"""The embedded task suite: one `TaskSpec` per competition.

Tasks are chosen so that no single model family wins everywhere: tiny clean
tables (linear / kNN win), wide linear signal (regularised linear wins),
smooth non-linear signal (boosting wins), noisy moons (kNN / forests win),
string categories and missing values (only pipelines that encode and impute
them do well), heavy imbalance (ranking metrics), label noise (shallow models
and ensembles win), and a multi-target task. Both metric directions appear in
the train split and in the held-out split.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pandas as pd

from sandbox.suite import datasets as ds
from sandbox.suite.metrics import METRICS


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    title: str
    category: str  # "classification" | "regression" | "multi-target regression"
    metric: str  # key of metrics.METRICS
    split: str  # "train" (the agent and the world model may learn from it) | "test" (held out)
    make: Callable[[int], pd.DataFrame]  # seed -> full table (features + targets, no id)
    targets: tuple[str, ...]
    source: str  # provenance, printed in the description and README
    overview: str
    fields: dict[str, str] = dataclasses.field(default_factory=dict)
    quirks: tuple[str, ...] = ()
    test_fraction: float = 0.3

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"task {self.name}: metric {self.metric!r}, expected one of {sorted(METRICS)}")
        if self.split not in ("train", "test"):
            raise ValueError(f"task {self.name}: split {self.split!r}, expected 'train' or 'test'")

    @property
    def higher_is_better(self) -> bool:
        return METRICS[self.metric].higher_is_better

    @property
    def is_classification(self) -> bool:
        return self.category == "classification"


_SK = "scikit-learn's bundled `sklearn.datasets.{}`"
_SM = "statsmodels' bundled `statsmodels.api.datasets.{}`"
_GEN = "a deterministic synthetic generator (`sklearn.datasets.{}`, fixed random_state) with added quirks"

TASKS: tuple[TaskSpec, ...] = (
    TaskSpec(
        "iris_species", "Iris Species", "classification", "accuracy", "train", ds.iris_species,
        ("species",), _SK.format("load_iris"),
        "Botanists measured sepals and petals of 150 iris flowers from three species. Predict the "
        "species of each flower in the test set from its four measurements.",
        {"species": "setosa, versicolor or virginica (the target)"}, ("tiny dataset",)),
    TaskSpec(
        "wine_cultivar", "Wine Cultivar Probabilities", "classification", "multi_log_loss", "train",
        ds.wine_cultivar, ("cultivar",), _SK.format("load_wine"),
        "Chemical analysis of wines grown in the same region of Italy by three cultivators. Predict, "
        "for every test wine, the probability that it comes from each cultivar (c0, c1, c2).",
        {"cultivar": "c0, c1 or c2 (the target; submit one probability column per cultivar)"},
        ("tiny dataset", "probabilistic multi-class submission")),
    TaskSpec(
        "breast_cancer_diagnosis", "Breast Cancer Diagnosis", "classification", "roc_auc", "train",
        ds.breast_cancer_diagnosis, ("malignant",), _SK.format("load_breast_cancer"),
        "Features computed from digitised images of fine needle aspirates of breast masses. Predict "
        "the probability that a mass is malignant.",
        {"malignant": "1 if the mass is malignant, 0 if benign (the target)"}, ("correlated features",)),
    TaskSpec(
        "digits_recognition", "Handwritten Digits", "classification", "f1_macro", "train",
        ds.digits_recognition, ("digit",), _SK.format("load_digits"),
        "8x8 grey-level images of handwritten digits, flattened into 64 pixel intensities (0..16). "
        "Predict the digit shown in each test image.",
        {"pixel_r_c": "intensity of the pixel in row r, column c (0..16)", "digit": "0..9 (the target)"},
        ("64 pixel features",)),
    TaskSpec(
        "diabetes_progression", "Diabetes Progression", "regression", "rmse", "train",
        ds.diabetes_progression, ("progression",), _SK.format("load_diabetes") + " (raw units)",
        "Ten baseline variables (age, sex, body mass index, blood pressure and six blood serum "
        "measurements) of diabetes patients. Predict a quantitative measure of disease progression "
        "one year after baseline.",
        {"progression": "disease progression one year after baseline (the target)",
         "s1..s6": "blood serum measurements"}, ("small noisy regression",)),
    TaskSpec(
        "rand_health_visits", "RAND Health Insurance: Doctor Visits", "regression", "mae", "train",
        ds.rand_health_visits, ("doctor_visits",), _SM.format("randhie") + " (12 000 of its 20 190 rows)",
        "Records of the RAND Health Insurance Experiment. Predict the number of outpatient doctor "
        "visits of each person from their insurance plan and health status.",
        {"lncoins": "log(coinsurance + 1)", "idp": "1 if an individual deductible plan",
         "lpi": "log(annual participation incentive payment)", "fmde": "log(max(medical deductible expenditure))",
         "physlm": "1 if the person has a physical limitation", "disea": "number of chronic diseases",
         "health": "self-rated health: excellent, good, fair or poor",
         "doctor_visits": "number of outpatient visits to a medical doctor (the target)"},
        ("missing values", "string categories", "skewed count target")),
    TaskSpec(
        "fair_affairs", "Extramarital Affairs Survey", "classification", "f1", "train",
        ds.fair_affairs, ("had_affair",), _SM.format("fair"),
        "A 1974 magazine survey of married women. Predict whether a respondent reported having had an "
        "extramarital affair.",
        {"rate_marriage": "self-rated marriage quality, 1 (very poor) .. 5 (very good)",
         "religious": "not, mildly, fairly or strongly", "occupation": "the respondent's occupation",
         "occupation_husb": "the husband's occupation", "had_affair": "1 if any affair reported (the target)"},
        ("string categories", "class imbalance (about 1 in 3 positive)")),
    TaskSpec(
        "anes96_vote", "1996 US Election Vote", "classification", "accuracy", "train",
        ds.anes96_vote, ("vote_dole",), _SM.format("anes96"),
        "The 1996 American National Election Study. Predict whether a respondent voted for Dole "
        "(rather than Clinton) from their party identification, ideology and demographics.",
        {"popul": "population of the respondent's location, thousands", "TVnews": "days a week watching TV news",
         "selfLR / ClinLR / DoleLR": "left-right placement (1..7) of self, Clinton, Dole",
         "PID": "party identification", "educ": "education level", "income": "income group (1..24)",
         "vote_dole": "1 if voted for Dole (the target)"},
        ("missing values", "string categories")),
    TaskSpec(
        "friedman_nonlinear", "Friedman Response Surface", "regression", "rmse", "train",
        ds.friedman_nonlinear, ("response",), _GEN.format("make_friedman1"),
        "An engineering response measured at 3 000 design points of ten inputs in [0, 1]. Only some "
        "inputs matter, and they act non-linearly. Predict the response at the test design points.",
        {"x0..x9": "design inputs in [0, 1]", "response": "measured response (the target)"},
        ("non-linear interactions", "irrelevant inputs")),
    TaskSpec(
        "transaction_fraud", "Card Transaction Fraud", "classification", "roc_auc", "train",
        ds.transaction_fraud, ("is_fraud",), _GEN.format("make_classification"),
        "Anonymised card transactions (principal-component style features v0..v15 and the amount). "
        "Predict the probability that a transaction is fraudulent.",
        {"amount": "transaction amount", "is_fraud": "1 if fraudulent (the target)"},
        ("severe class imbalance (about 3% positive)",)),
    TaskSpec(
        "customer_churn", "Telecom Customer Churn", "classification", "accuracy", "train",
        ds.customer_churn, ("churned",), _GEN.format("make_classification"),
        "Standardised account metrics of telecom customers plus their plan and region. Predict which "
        "customers left during the quarter.",
        {"plan": "basic, standard or premium (sometimes missing)", "region": "sales region",
         "churned": "1 if the customer left (the target)"},
        ("missing values", "string categories", "label noise")),
    TaskSpec(
        "multi_sensor_calibration", "Multi-Sensor Calibration", "multi-target regression", "mcrmse", "train",
        ds.multi_sensor_calibration, ("temperature", "humidity", "pressure"), _GEN.format("make_regression"),
        "Twelve raw channels of a low-cost weather sensor, recorded next to a reference station. "
        "Predict the reference temperature, humidity and pressure readings (three targets) for each "
        "test record.",
        {"raw_0..raw_11": "raw sensor channels (raw_5 and raw_9 drop out sometimes)",
         "temperature / humidity / pressure": "reference readings (the three targets)"},
        ("multi-target", "missing values", "non-linear terms")),
    # ---------------------------------------------------------------- held-out test tasks
    TaskSpec(
        "star98_math", "California Schools Math Scores", "regression", "r2", "test",
        ds.star98_math, ("pct_above_median",), _SM.format("star98"),
        "California school districts in 1998. Predict the fraction of a district's students who scored "
        "above the national median on the math test, from demographics and school resources.",
        {"LOWINC": "% low-income students", "PERASIAN / PERBLACK / PERHISP / PERMINTE": "% minority groups",
         "AVYRSEXP": "average teacher experience (years)", "AVSALK": "average teacher salary (thousands)",
         "PTRATIO": "pupil-teacher ratio", "pct_above_median": "fraction above the median (the target)"},
        ("tiny dataset", "interaction features")),
    TaskSpec(
        "hastie_signal", "Hastie Radial Signal", "classification", "log_loss", "test",
        ds.hastie_signal, ("signal",), _GEN.format("make_hastie_10_2"),
        "Ten Gaussian measurements per event; the event is a signal when the measurements are far from "
        "the origin. Predict the probability that each test event is a signal.",
        {"f0..f9": "standard normal measurements", "signal": "1 for a signal event (the target)"},
        ("radial decision boundary",)),
    TaskSpec(
        "two_moons_noisy", "Noisy Two Moons", "classification", "accuracy", "test",
        ds.two_moons_noisy, ("label",), _GEN.format("make_moons"),
        "Points from two interleaving half-circles, observed with noise and six distractor channels. "
        "Predict which moon each test point belongs to.",
        {"u, v": "the informative coordinates", "noise_0..noise_5": "distractor channels",
         "label": "0 or 1 (the target)"},
        ("non-linear boundary", "distractor features on a larger scale", "label noise")),
    TaskSpec(
        "wide_linear_signal", "Wide Gene Expression Signal", "regression", "mae", "test",
        ds.wide_linear_signal, ("outcome",), _GEN.format("make_regression"),
        "150 expression levels measured on 400 samples, of which 30 carry a linear signal. Predict the "
        "outcome of each test sample.",
        {"g000..g149": "expression levels", "outcome": "the measured outcome (the target)"},
        ("more features than a tree can use", "few rows")),
)


def get_spec(name: str) -> TaskSpec:
    for spec in TASKS:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown embedded task {name!r}; known: {[s.name for s in TASKS]}")
