"""Counter-based noise: each entry (q, k) of a head's field is a pure function of them.

Gaussian noise: one SplitMix64 hash per pair of keys ``2i, 2i + 1`` of row ``q`` (output
``q * 2^32 + i`` of the stream of the head's key) gives 64 bits: the high 32 a uniform
``u = (hi + 1/2) 2^-32`` for the Box-Muller radius ``sqrt(-2 log u)``, the low 32 the
turn ``(lo + 1/2) 2^-32``, whose cosine goes to key ``2i`` and sine to key ``2i + 1``.
The turn is reduced exactly in integers (quadrant, then octant), so its cosine and sine
are two short polynomials on ``[0, pi/4]``. Gumbel noise is ``-log(-log(u))`` on output
``2c`` of the stream for ``c = q * 2^32 + k``. Both use the vectorisable functions of
:mod:`kvsim.numerics.elementary`, so a row of noise is one SIMD loop. docs/noise.md states
the distributions and their accuracy.
"""

import math

import numpy as np

from kvsim.numerics.jit import jit, jit_inline
from kvsim.numerics import elementary
from kvsim.numerics.elementary import _horner, log_positive

NOISE_NONE, NOISE_GAUSSIAN, NOISE_GUMBEL = 0, 1, 2
NOISE_KINDS = {"gaussian": NOISE_GAUSSIAN, "gumbel": NOISE_GUMBEL}

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_TWO_M52 = 1.0 / 4503599627370496.0
_TWO_M32 = 1.0 / 4294967296.0
_LOW32 = np.uint64(0xFFFFFFFF)
_QUARTER = np.int64((1 << 30) - 1)
_PI_OVER_2_TIMES_2_M30 = (math.pi / 2) / 1073741824.0
# Series in z = x^2, highest power first, cut where the draw is within 1e-11 of exact:
# cos to x^12 and sin(x)/x to x^12 on [0, pi/4]; atanh(s)/s to s^12 for |s| < 0.172.
_COS_OCTANT = tuple((-1.0) ** i / math.factorial(2 * i) for i in range(6, -1, -1))
_SIN_OCTANT = tuple((-1.0) ** i / math.factorial(2 * i + 1) for i in range(6, -1, -1))
_ATANH_SHORT = tuple(1.0 / (2 * i + 1) for i in range(6, -1, -1))


@jit
def _mix(x):
    """SplitMix64 finaliser: a bijective, well-mixed hash of a uint64."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


@jit
def _uniform(key, index):
    """Output ``index`` of the SplitMix64 stream ``key``, as a float in (0, 1).

    The top 52 bits plus one half, times 2^-52: exact, never 0 or 1.
    """
    x = _mix(key + (index + np.uint64(1)) * _GOLDEN)
    return (float(x >> np.uint64(12)) + 0.5) * _TWO_M52


@jit_inline
def _log_uniform(u):
    """``log(u)`` for a positive normal float64 ``u``: :func:`log_positive`'s reduction and
    a shorter series (relative error below 2e-12, ample for a noise's radius)."""
    bits = elementary._bits_from_float(u)
    e = (bits >> 52) - 1023
    m = elementary._float_from_bits((bits & elementary._MANTISSA) | elementary._ONE_BITS)
    high = m > elementary._SQRT2
    m = m * 0.5 if high else m
    e = e + 1 if high else e
    s = (m - 1.0) / (m + 1.0)
    fe = float(e)
    return fe * elementary._LN2_HI + (2.0 * s * _horner(s * s, _ATANH_SHORT)
                                      + fe * elementary._LN2_LO)


@jit_inline
def gaussian_pair(key, q, pair):
    """Standard Gaussian noise of keys ``2 pair`` and ``2 pair + 1`` of row ``q``.

    Branch-free (selects only), so a loop over pairs vectorises.
    """
    x = _mix(key + (((np.uint64(q) << np.uint64(32)) | np.uint64(pair)) + np.uint64(1))
             * _GOLDEN)
    u = (float(x >> np.uint64(32)) + 0.5) * _TWO_M32  # in (0, 1): 2^-33 at the least
    radius = np.sqrt(-2.0 * _log_uniform(u))
    turn = np.int64(x & _LOW32)
    within = turn & _QUARTER  # position in the quadrant, 30 bits
    mirror = within >> 29  # second octant: reflect (exactly), then swap cosine and sine
    within = within ^ (-mirror & _QUARTER)
    t = (float(within) + 0.5) * _PI_OVER_2_TIMES_2_M30  # in (0, pi/4)
    z = t * t
    c0 = _horner(z, _COS_OCTANT)
    s0 = t * _horner(z, _SIN_OCTANT)
    quadrant = turn >> 30  # each quarter turn maps (cos, sin) to (-sin, cos)
    swap = (mirror ^ quadrant) & 1
    c = s0 if swap else c0
    s = c0 if swap else s0
    c = -c if (quadrant + 1) & 2 else c  # cosine negative in quadrants 1 and 2
    s = -s if quadrant & 2 else s  # sine negative in quadrants 2 and 3
    return radius * c, radius * s


@jit_inline
def gaussian(key, q, k):
    """Standard Gaussian noise of entry (q, k): its pair's cosine draw for an even key, the
    sine draw for an odd key (the very numbers :func:`add_noise_row` gives)."""
    even, odd = gaussian_pair(key, q, k >> 1)
    return odd if k & 1 else even


@jit_inline
def gumbel(key, q, k):
    """Standard Gumbel noise of entry (q, k)."""
    c = ((np.uint64(q) << np.uint64(32)) | np.uint64(k)) << np.uint64(1)
    return -log_positive(-log_positive(_uniform(key, c)))


@jit
def add_noise(kind, key, scale, q, keys, n, out):
    """Add ``scale`` times the noise of entries ``(q, keys[j])`` to ``out[j]``, ``j < n``."""
    if kind == NOISE_GAUSSIAN:
        for j in range(n):
            out[j] += scale * gaussian(key, q, keys[j])
    elif kind == NOISE_GUMBEL:
        for j in range(n):
            out[j] += scale * gumbel(key, q, keys[j])


@jit_inline
def add_noise_span(kind, key, scale, q, lo, hi, out):
    """:func:`add_noise` for keys ``lo .. hi-1`` (``lo`` even): Gaussian noise draws each
    pair of keys once (the same numbers as key by key, half the work)."""
    span = out[lo:hi]  # indices from 0 in the loops: LLVM then vectorises them
    if kind == NOISE_GAUSSIAN:
        first = lo // 2
        for i in range((hi - lo) // 2):
            even, odd = gaussian_pair(key, q, first + i)
            span[2 * i] += scale * even
            span[2 * i + 1] += scale * odd
        if (hi - lo) % 2:
            span[hi - lo - 1] += scale * gaussian(key, q, hi - 1)
    elif kind == NOISE_GUMBEL:
        for i in range(hi - lo):
            span[i] += scale * gumbel(key, q, lo + i)


@jit
def add_noise_row(kind, key, scale, q, n, out):
    """:func:`add_noise_span` for keys ``0 .. n-1``."""
    add_noise_span(kind, key, scale, q, 0, n, out)
