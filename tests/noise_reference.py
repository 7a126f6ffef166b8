"""Plain-Python reference of kvsim's counter-based noise (kvsim.numerics.noise), written
for clarity from its definition (docs/noise.md): Python integers for the hash, exact
rational arithmetic for each fused multiply-add, so the kernels must match it bit for bit."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
LN2_HI, LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10


def splitmix64(key: int, index: int) -> int:
    """Output ``index`` of the SplitMix64 stream seeded with ``key``."""
    x = (key + (index + 1) * GOLDEN) & MASK64
    x = ((x ^ (x >> 30)) * MIX1) & MASK64
    x = ((x ^ (x >> 27)) * MIX2) & MASK64
    return x ^ (x >> 31)


def fma(a: float, b: float, c: float) -> float:
    """``a * b + c`` rounded once."""
    return float(Fraction(a) * Fraction(b) + Fraction(c))


def horner(x: float, coefficients) -> float:
    """Polynomial (highest power first) by Horner's rule with fused multiply-adds."""
    p = coefficients[0]
    for c in coefficients[1:]:
        p = fma(x, p, c)
    return p


def log_series(x: float, terms: int) -> float:
    """``log(x)``: ``x = 2^e m``, ``m`` in [sqrt(1/2), sqrt(2)), ``2 atanh((m-1)/(m+1))``
    summed to ``terms`` terms."""
    frac, exp = math.frexp(x)  # x = frac 2^exp, frac in [1/2, 1)
    m, e = frac * 2.0, exp - 1
    if m > math.sqrt(2.0):
        m, e = m * 0.5, e + 1
    s = (m - 1.0) / (m + 1.0)
    p = horner(s * s, [1.0 / (2 * i + 1) for i in range(terms - 1, -1, -1)])
    return e * LN2_HI + (2.0 * s * p + e * LN2_LO)


COS = [(-1.0) ** i / math.factorial(2 * i) for i in range(6, -1, -1)]
SIN = [(-1.0) ** i / math.factorial(2 * i + 1) for i in range(6, -1, -1)]


def gaussian_pair(key: int, q: int, pair: int) -> tuple[float, float]:
    """Gaussian draws of keys ``2 pair`` (cosine) and ``2 pair + 1`` (sine) of row ``q``."""
    x = splitmix64(key, (q << 32) | pair)
    u = ((x >> 32) + 0.5) * 2.0 ** -32
    radius = math.sqrt(-2.0 * log_series(u, 7))
    turn = x & 0xFFFFFFFF  # the angle is 2 pi (turn + 1/2) / 2^32
    quadrant, within = turn >> 30, turn & (2 ** 30 - 1)
    mirror = within >= 2 ** 29  # in the quadrant's second octant: reflect it
    if mirror:
        within = 2 ** 30 - 1 - within
    t = (within + 0.5) * ((math.pi / 2) / 2 ** 30)
    c, s = horner(t * t, COS), t * horner(t * t, SIN)  # cos t, sin t
    if mirror:
        c, s = s, c
    for _ in range(quadrant):  # a quarter turn: (cos, sin) -> (-sin, cos)
        c, s = -s, c
    return radius * c, radius * s


def gaussian(key: int, q: int, k: int) -> float:
    """Gaussian noise of entry (q, k)."""
    return gaussian_pair(key, q, k // 2)[k % 2]


def gumbel(key: int, q: int, k: int) -> float:
    """Gumbel noise of entry (q, k)."""
    x = splitmix64(key, ((q << 32) | k) << 1)
    u = ((x >> 12) + 0.5) * 2.0 ** -52
    return -log_series(-log_series(u, 10), 10)


def noise_rows(kind: str, key: int, rows, n: int) -> np.ndarray:
    """Noise of entries (q, k) for q in ``rows``, k < n, as an array."""
    draw = gaussian if kind == "gaussian" else gumbel
    return np.array([[draw(key, q, k) for k in range(n)] for q in rows])
