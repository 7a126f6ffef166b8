"""Summaries the report quotes: means over seeds with a Student-t interval, honest rounding,
and curves that coincide."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import stdtrit  # Student t quantiles (scipy.stats is slow to import)

LEVEL = 0.95
COINCIDE_TOL = 0.01  # curves closer than this cannot be told apart at page width...
COINCIDE_SHARE = 0.95  # ...at this share of their points (every point, up to 20 points)
EXACT_TOL = 1e-9  # closer than this: equal, not just indistinguishable


@dataclass(frozen=True)
class Estimate:
    """Mean over seeds, with the half-width of its 95 % interval (None with one seed)."""

    mean: float
    half_width: float | None
    n: int

    def text(self) -> str:
        """The mean rounded to what its interval supports, e.g. ``0.27 ± 0.04``."""
        if self.n == 0 or math.isnan(self.mean):
            return "n/a"
        if self.half_width is None:
            return f"{self.mean:.3f}"
        if self.half_width == 0:  # every seed gave the same value
            return f"{self.mean:.3f} ± 0"
        digits = decimals(self.half_width)
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def decimals(half_width: float) -> int:
    """Decimals that show an interval's half-width with two significant digits (0 to 4)."""
    if half_width <= 0 or not math.isfinite(half_width):
        return 3
    return int(min(4, max(0, 1 - math.floor(math.log10(half_width)))))


def estimate(values) -> Estimate:
    """Mean of per-seed values with a Student-t 95 % interval when there are >= 2 of them."""
    v = np.asarray([x for x in values if not math.isnan(x)], float)
    if v.size == 0:
        return Estimate(math.nan, None, 0)
    if v.size == 1:
        return Estimate(float(v[0]), None, 1)
    sem = v.std(ddof=1) / math.sqrt(v.size)
    return Estimate(float(v.mean()), float(stdtrit(v.size - 1, 0.5 + LEVEL / 2) * sem), v.size)


def twins(curves: dict[str, np.ndarray], tol: float = COINCIDE_TOL) -> dict[str, tuple[str, bool]]:
    """``{label: (earlier label, exactly equal)}`` for every curve within ``tol`` of an
    earlier one at :data:`COINCIDE_SHARE` of the points where both are defined (at every
    point for curves of 20 points or fewer; a noisy series over decoding hides the other
    for most of its length even where a few spikes part them); exactly equal means within
    :data:`EXACT_TOL` everywhere. Chains point at their first curve."""
    out: dict[str, tuple[str, bool]] = {}
    labels = list(curves)
    for i, label in enumerate(labels):
        a = np.asarray(curves[label], float)
        for other in labels[:i]:
            if other in out:
                continue
            b = np.asarray(curves[other], float)
            both = ~(np.isnan(a) | np.isnan(b))
            if a.shape != b.shape or not both.any():
                continue
            gaps = np.abs(a[both] - b[both])
            if np.quantile(gaps, COINCIDE_SHARE, method="higher") <= tol:
                out[label] = (other, float(gaps.max()) <= EXACT_TOL)
                break
    return out


def rolling_mean(series: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` steps (shorter at the start), NaN-aware, along the last
    axis. A step whose value is NaN stays NaN: the mean never fills a gap it did not see."""
    x = np.asarray(series, float)
    valid = ~np.isnan(x)
    csum = np.cumsum(np.where(valid, x, 0.0), axis=-1)
    ccount = np.cumsum(valid, axis=-1)
    pad = [(0, 0)] * (x.ndim - 1) + [(1, 0)]
    csum, ccount = np.pad(csum, pad), np.pad(ccount, pad)
    idx = np.arange(1, x.shape[-1] + 1)
    lo = np.maximum(0, idx - window)
    total = csum[..., idx] - csum[..., lo]
    count = ccount[..., idx] - ccount[..., lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(valid & (count > 0), total / np.maximum(count, 1), np.nan)


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 head``, ``4 heads``, ``2,048 decode steps``."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"
