"""The full-cache gate and how well the simulator's predictors foretell the model's answers.

- **Gate**: a (length, depth) cell is a reference only where the full cache answers at
  least :data:`GATE` of its trials; other cells are flagged and left out of the headline
  and of every prediction metric (the RULER practice for small models).
- **Prediction**: each predictor, computed from the full-cache attention without running
  the compressed model, is scored over the gated compressed runs by ROC AUC (with a 95%
  bootstrap interval that resamples whole trials, since the runs of one trial share a
  prompt), and by a balanced accuracy and a Brier score that are cross-validated over
  trials (:data:`FOLDS` folds: the threshold and the logistic calibration are fitted on the
  other folds), each beside the base-rate predictor's (always the training folds' share
  of successes: AUC 0.5, balanced accuracy 0.5).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
from scipy.optimize import minimize
from scipy.special import expit, log_expit
from scipy.stats import rankdata

GATE = 0.9
FOLDS = 5
PREDICTORS = {
    "retention": "needle retention (share of layer × KV head caches holding the key)",
    "kept_needle_mass": "the question's full-cache attention on the kept key digits",
    "late_needle_mass": "the same, in the late half of the global layers only",
}


def cell_of(row: dict) -> tuple[int, float]:
    return row["length"], row["depth"]


def trial_of(row: dict) -> tuple[int, float, int]:
    return row["length"], row["depth"], row["trial"]


def gate(rows: list[dict], full: str = "full") -> dict:
    """Per (length, depth) cell: the full cache's trials, successes, accuracy and whether
    it passes the gate (accuracy >= :data:`GATE`)."""
    hits: dict = defaultdict(list)
    for r in rows:
        if r["policy"] == full:
            hits[cell_of(r)].append(r["success"])
    return {c: {"trials": len(h), "successes": sum(h), "accuracy": sum(h) / len(h),
                "passes": sum(h) >= GATE * len(h)} for c, h in sorted(hits.items())}


def gated(rows: list[dict], cells: dict) -> list[dict]:
    """The rows of the cells that pass the gate."""
    return [r for r in rows if cells[cell_of(r)]["passes"]]


def auc(x: np.ndarray, y: np.ndarray) -> float:
    """ROC AUC of scores ``x`` for the binary outcome ``y`` (ties count a half; nan
    without both outcomes)."""
    pos = y > 0
    n1, n0 = int(pos.sum()), int((~pos).sum())
    if n1 == 0 or n0 == 0:
        return math.nan
    ranks = rankdata(x)
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def auc_interval(x: np.ndarray, y: np.ndarray, groups: np.ndarray, reps: int, seed: int
                 ) -> tuple[float, float, float]:
    """AUC and its 95% percentile bootstrap interval, resampling whole ``groups`` (trials)
    with replacement ``reps`` times."""
    value = auc(x, y)
    if math.isnan(value):
        return value, math.nan, math.nan
    ids, inverse = np.unique(groups, return_inverse=True)
    members = [np.flatnonzero(inverse == g) for g in range(ids.size)]
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(reps):
        pick = np.concatenate([members[g] for g in rng.integers(0, ids.size, ids.size)])
        boots.append(auc(x[pick], y[pick]))
    lo, hi = np.nanquantile(np.array(boots), [0.025, 0.975])
    return value, float(lo), float(hi)


def logistic(x: np.ndarray, y: np.ndarray):
    """A function giving P(success | x) from a maximum-likelihood logistic fit; with one
    outcome only, the share of successes; when a threshold separates the outcomes, a step
    at the middle of the gap (1/2 on it)."""
    if np.ptp(y) == 0 or np.ptp(x) == 0:
        p = float(y.mean())
        return lambda z: np.full(np.shape(z), p)
    ok, bad = x[y > 0], x[y == 0]
    for sign, low, high in ((1, bad.max(), ok.min()), (-1, ok.max(), bad.min())):
        if low < high:
            mid = (low + high) / 2
            return lambda z, s=sign, m=mid: 0.5 + 0.5 * np.sign(s * (np.asarray(z) - m))

    def nll(theta):
        z = theta[0] + theta[1] * x
        return -(y * log_expit(z) + (1 - y) * log_expit(-z)).sum()

    def grad(theta):
        r = expit(theta[0] + theta[1] * x) - y
        return np.array([r.sum(), (r * x).sum()])

    a, b = minimize(nll, np.zeros(2), jac=grad, method="BFGS").x
    return lambda z: expit(a + b * np.asarray(z))


def best_threshold(x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    """The threshold and direction (+1: predict success when ``x >= t``; -1: when
    ``x <= t``) of the highest balanced accuracy on ``(x, y)``, over the midpoints between
    consecutive values of ``x`` (and beyond both ends); ties to the lower threshold, then
    to +1."""
    v = np.unique(x)
    u = np.concatenate([[v[0] - 1.0], (v[:-1] + v[1:]) / 2, [v[-1] + 1.0]])
    pos, neg = np.sort(x[y > 0]), np.sort(x[y == 0])
    n1, n0 = pos.size, neg.size

    def rate(hits, n):
        return hits / n if n else np.full(u.size, 0.5)
    up = (rate(n1 - np.searchsorted(pos, u, "left"), n1)
          + rate(np.searchsorted(neg, u, "left"), n0)) / 2
    down = (rate(np.searchsorted(pos, u, "right"), n1)
            + rate(n0 - np.searchsorted(neg, u, "right"), n0)) / 2
    i, j = int(np.argmax(up)), int(np.argmax(down))
    if down[j] > up[i] or (down[j] == up[i] and j < i):
        return float(u[j]), -1
    return float(u[i]), 1


def balanced_accuracy(predicted: np.ndarray, actual: np.ndarray) -> float:
    """The mean of the true positive and true negative rates (a rate without its class
    counts as 1/2)."""
    rates = [(predicted[actual] > 0).mean() if actual.any() else 0.5,
             (predicted[~actual] == 0).mean() if (~actual).any() else 0.5]
    return float(np.mean(rates))


def folds(groups: np.ndarray, seed: int) -> np.ndarray:
    """The fold (0 .. FOLDS-1) of each run: its trial's place in a seeded shuffle of the
    trials, taken round-robin."""
    ids, inverse = np.unique(groups, return_inverse=True)
    order = np.random.default_rng(seed).permutation(ids.size)
    place = np.empty(ids.size, np.int64)
    place[order] = np.arange(ids.size)
    return (place % FOLDS)[inverse]


def cross_validated(x: np.ndarray, y: np.ndarray, fold: np.ndarray) -> dict:
    """Balanced accuracy and Brier score of ``x`` (threshold and logistic calibration
    fitted on the other folds) and of the base rate, on the pooled held-out runs (nan with
    fewer than two folds: nothing to fit on; balanced accuracy nan where every run fails or
    every run succeeds, as the AUC: there is no second class to tell apart)."""
    if np.unique(fold).size < 2:
        return {"balanced_accuracy": math.nan, "brier": math.nan, "base_brier": math.nan}
    hit = np.zeros(y.size, bool)
    prob = np.zeros(y.size)
    base = np.zeros(y.size)
    for k in range(FOLDS):
        test, train = fold == k, fold != k
        if not test.any():
            continue
        t, sign = best_threshold(x[train], y[train])
        hit[test] = x[test] >= t if sign > 0 else x[test] <= t
        prob[test] = logistic(x[train], y[train])(x[test])
        base[test] = y[train].mean()
    actual = y > 0
    one_class = actual.all() or not actual.any()  # nothing to tell apart
    return {"balanced_accuracy": math.nan if one_class else balanced_accuracy(hit, actual),
            "brier": float(((prob - y) ** 2).mean()),
            "base_brier": float(((base - y) ** 2).mean())}


def prediction_quality(rows: list[dict], reps: int, seed: int, full: str = "full"
                       ) -> list[dict]:
    """Per protocol and over all protocols (``"all"``), over the compressed runs of
    ``rows`` (the gated ones): the runs, the base rate, the one-sided rates of the rule
    "retained (retention >= 1/2) => answered", and per predictor of :data:`PREDICTORS` its
    AUC with interval, cross-validated balanced accuracy and Brier score, and the base
    rate's Brier score."""
    out = []
    compressed = [r for r in rows if r["policy"] != full]
    protocols = sorted({r["protocol"] for r in compressed})
    for protocol in [*protocols, "all"]:
        rs = [r for r in compressed if protocol in ("all", r["protocol"])]
        entry: dict = {"protocol": protocol, "runs": len(rs)}
        if not rs:
            out.append(entry)
            continue
        y = np.array([r["success"] for r in rs], np.float64)
        index: dict = {}
        groups = np.array([index.setdefault(trial_of(r), len(index)) for r in rs])
        fold = folds(groups, seed)
        retained = np.array([r["retention"] >= 0.5 for r in rs])
        entry.update({
            "base_rate": float(y.mean()),
            "answered_if_retained": float(y[retained].mean()) if retained.any() else math.nan,
            "failed_if_lost": float(1 - y[~retained].mean()) if (~retained).any()
            else math.nan})
        for name in PREDICTORS:
            x = np.array([r[name] for r in rs], np.float64)
            entry[name] = {"auc": auc_interval(x, y, groups, reps, seed),
                           **cross_validated(x, y, fold)}
        out.append(entry)
    return out
