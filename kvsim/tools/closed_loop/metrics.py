"""What the closed loop measures, and how well each open-loop metric ranks it.

Closed loop, per decode step ``t`` (the model reads token ``t`` and predicts ``t + 1``):
the KL divergence ``KL(p_full || p_cache)`` of the next-token distributions and the NLL of
the true next token (none at the last step: the text has no next token there).

Open loop, per policy and budget, from the simulator's mass ``m(l, h, t)`` on the full run:
``m(t)`` is the mean over layers and query heads; ``mass_mean``, ``mass_min`` and
``mass_p10`` summarise it over the decode steps; ``mass_layer_weighted`` weights each layer
by the mean norm of its attention block's output in the full run; ``neg_log_mass`` is the
mean of ``-log m(l, h, t)``, the KL from full to renormalised attention; ``output_error``
the mean relative output error ``|o~ - o| / |o|``.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata

# (column, sign): sign * column grows with the damage it predicts
PREDICTORS = {
    "mass_mean": -1.0,
    "mass_min": -1.0,
    "mass_p10": -1.0,
    "mass_layer_weighted": -1.0,
    "output_error": 1.0,
    "neg_log_mass": 1.0,
}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row log-softmax in float64."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_nll(full_logp: np.ndarray, logits: np.ndarray, target: int | None) -> tuple:
    """(KL(full || cache) per row, NLL of ``target`` per row or NaN) for (C, V) logits."""
    logp = log_softmax(logits)
    kl = (np.exp(full_logp) * (full_logp - logp)).sum(axis=-1)
    nll = -logp[:, target] if target is not None else np.full(logp.shape[0], np.nan)
    return np.maximum(kl, 0.0), nll


def layer_weights(attn_out_norm: np.ndarray, prompt_len: int) -> np.ndarray:
    """Per layer: mean norm of its attention output over the decode steps, summing to 1."""
    w = attn_out_norm[:, prompt_len:].mean(axis=1)
    return w / w.sum()


def open_metrics(mass: np.ndarray, error: np.ndarray, weights: np.ndarray) -> dict:
    """The open-loop predictors of one policy and budget from (L, H, steps) arrays."""
    per_step = mass.mean(axis=(0, 1))
    weighted = weights @ mass.mean(axis=1)
    return {"mass_mean": float(per_step.mean()), "mass_min": float(per_step.min()),
            "mass_p10": float(np.quantile(per_step, 0.1)),
            "mass_layer_weighted": float(weighted.mean()),
            "output_error": float(error.mean()),
            "neg_log_mass": float(-np.log(np.maximum(mass, 1e-300)).mean()) + 0.0}


CHUNK = 1 << 20  # bootstrap values drawn at a time


def _rowwise_spearman(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman rho of each row pair (average ranks for ties); NaN for a constant row."""
    rx, ry = rankdata(x, axis=-1), rankdata(y, axis=-1)
    rx = rx - rx.mean(axis=-1, keepdims=True)
    ry = ry - ry.mean(axis=-1, keepdims=True)
    den = np.sqrt((rx * rx).sum(axis=-1) * (ry * ry).sum(axis=-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (rx * ry).sum(axis=-1) / den


def spearman_ci(x: np.ndarray, y: np.ndarray, reps: int, seed: int) -> tuple[float, float, float]:
    """Spearman rho of ``x`` and ``y`` and its 95% percentile bootstrap interval.

    The points (policy and budget pairs) are resampled with replacement, ``reps`` times,
    in chunks of about :data:`CHUNK` values (the same draws as in one piece, in bounded
    memory).
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    rho = float(_rowwise_spearman(x, y))
    boots = np.concatenate([_rowwise_spearman(x[idx], y[idx])
                            for idx in _resamples(x.size, reps, seed)])
    lo, hi = np.nanquantile(boots, [0.025, 0.975])
    return rho, float(lo), float(hi)


def _resamples(n: int, reps: int, seed: int):
    """``reps`` resamples with replacement of ``n`` points, as index arrays of up to
    :data:`CHUNK` values, drawn from ``seed``."""
    rng, rows = np.random.default_rng(seed), max(1, CHUNK // max(n, 1))
    for i in range(0, reps, rows):
        yield rng.integers(0, n, (min(rows, reps - i), n))


def paired_difference(a: np.ndarray, b: np.ndarray, y: np.ndarray, reps: int,
                      seed: int) -> tuple[float, float, float]:
    """Spearman rho of ``a`` with ``y`` minus that of ``b`` with ``y``, and its 95%
    percentile bootstrap interval: both from the same resamples of the points (a paired
    bootstrap, :func:`spearman_ci`'s draws)."""
    a, b, y = (np.asarray(v, np.float64) for v in (a, b, y))
    diff = float(_rowwise_spearman(a, y) - _rowwise_spearman(b, y))
    boots = np.concatenate([_rowwise_spearman(a[idx], y[idx]) - _rowwise_spearman(b[idx], y[idx])
                            for idx in _resamples(y.size, reps, seed)])
    lo, hi = np.nanquantile(boots, [0.025, 0.975])
    return diff, float(lo), float(hi)


def gaps_from_best(rows: list[dict], ranks: list[dict], reps: int, seed: int) -> list[dict]:
    """Each predictor of ``ranks`` (one target's, best first) with its rho's difference from
    the best's and that difference's 95% interval by a paired bootstrap (``gap``,
    ``gap_low``, ``gap_high``; 0 for the best itself): a predictor whose ``gap_low`` is 0
    or below cannot be told from the best."""
    best, target = ranks[0]["predictor"], ranks[0]["target"]
    y = np.array([r[target] for r in rows])

    def oriented(name: str) -> np.ndarray:
        return PREDICTORS[name] * np.array([r[name] for r in rows])
    out = [{**ranks[0], "gap": 0.0, "gap_low": 0.0, "gap_high": 0.0}]
    for r in ranks[1:]:
        gap, lo, hi = paired_difference(oriented(best), oriented(r["predictor"]), y, reps,
                                        seed)
        out.append({**r, "gap": gap, "gap_low": lo, "gap_high": hi})
    return out


def rank_predictors(rows: list[dict], target: str, reps: int, seed: int) -> list[dict]:
    """rho (with its interval) of every predictor against ``target``, best first."""
    y = np.array([r[target] for r in rows])
    out = []
    for name, sign in PREDICTORS.items():
        x = sign * np.array([r[name] for r in rows])
        if not np.isfinite(x).all():
            continue
        rho, lo, hi = spearman_ci(x, y, reps, seed)
        out.append({"predictor": name, "target": target, "rho": rho, "ci_low": lo,
                    "ci_high": hi})
    return sorted(out, key=lambda r: -r["rho"])
