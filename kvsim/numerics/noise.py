"""Counter-based noise: each entry (q, k) of a head's field is a pure function of them.

Uniforms are outputs ``2c`` and ``2c + 1`` of the SplitMix64 stream of the head's key,
for a counter ``c = q * 2^32 + i``: no state, any order, any thread, the same numbers.
Gaussian noise is Box-Muller on the two uniforms of ``i = k // 2``, whose cosine and
sine go to keys ``2i`` and ``2i + 1``; Gumbel noise is ``-log(-log(u))`` on the first
uniform of ``i = k``. Both use the vectorisable functions of :mod:`kvsim.numerics.elementary`, so
a row of noise is one SIMD loop.
"""

import numpy as np

from kvsim.numerics.jit import jit, jit_inline
from kvsim.numerics.elementary import cos_two_pi, log_positive

NOISE_NONE, NOISE_GAUSSIAN, NOISE_GUMBEL = 0, 1, 2
NOISE_KINDS = {"gaussian": NOISE_GAUSSIAN, "gumbel": NOISE_GUMBEL}

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_TWO_M52 = 1.0 / 4503599627370496.0


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
def _polar(key, q, pair):
    """Box-Muller radius ``sqrt(-2 log u)`` and turn ``v`` of keys ``2 pair, 2 pair + 1`` of row q."""
    c = ((np.uint64(q) << np.uint64(32)) | np.uint64(pair)) << np.uint64(1)
    u = _uniform(key, c)
    v = _uniform(key, c + np.uint64(1))
    return np.sqrt(-2.0 * log_positive(u)), v


@jit_inline
def gaussian(key, q, k):
    """Standard Gaussian noise of entry (q, k): Box-Muller's cosine for an even key, its
    sine (the cosine a quarter turn back, ``v - 1/4`` being exact) for the odd key."""
    radius, turn = _polar(key, q, k >> 1)
    return radius * cos_two_pi(turn - 0.25 * (k & 1))


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


@jit
def add_noise_row(kind, key, scale, q, n, out):
    """:func:`add_noise` for keys ``0 .. n-1``: Gaussian noise draws each pair of keys'
    radius once (the same numbers as key by key, half the logarithms)."""
    if kind == NOISE_GAUSSIAN:
        for pair in range(n // 2):
            radius, turn = _polar(key, q, pair)
            out[2 * pair] += scale * (radius * cos_two_pi(turn))
            out[2 * pair + 1] += scale * (radius * cos_two_pi(turn - 0.25))
        if n % 2:
            out[n - 1] += scale * gaussian(key, q, n - 1)
    elif kind == NOISE_GUMBEL:
        for k in range(n):
            out[k] += scale * gumbel(key, q, k)
