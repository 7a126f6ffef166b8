"""Row reductions over 8 interleaved lanes: deterministic and vectorised.

Element ``k`` goes to lane ``k % 8`` (in order) and the lanes are combined pairwise at
the end. The order is fixed, so results never depend on the machine or thread count,
and LLVM turns the lanes into one SIMD register, which a strictly sequential
floating-point reduction (fastmath being off) would forbid.
"""

import numpy as np

from kvsim.numerics.jit import jit, jit_inline


@jit_inline
def _maxima(x, lo, hi, m0, m1, m2, m3, m4, m5, m6, m7):
    """The 8 lane maxima continued over ``x[lo:hi]``: element ``lo + 8i + l`` to lane
    ``l``, a last partial group to lane 0."""
    x = x[lo:hi]  # indices from 0: LLVM then vectorises the loop
    n = hi - lo
    whole = n - n % 8
    for k in range(0, whole, 8):
        m0 = m0 if m0 >= x[k] else x[k]
        m1 = m1 if m1 >= x[k + 1] else x[k + 1]
        m2 = m2 if m2 >= x[k + 2] else x[k + 2]
        m3 = m3 if m3 >= x[k + 3] else x[k + 3]
        m4 = m4 if m4 >= x[k + 4] else x[k + 4]
        m5 = m5 if m5 >= x[k + 5] else x[k + 5]
        m6 = m6 if m6 >= x[k + 6] else x[k + 6]
        m7 = m7 if m7 >= x[k + 7] else x[k + 7]
    for k in range(whole, n):
        m0 = m0 if m0 >= x[k] else x[k]
    return m0, m1, m2, m3, m4, m5, m6, m7


@jit_inline
def _sums(x, lo, hi, s0, s1, s2, s3, s4, s5, s6, s7):
    """The 8 lane sums continued over ``x[lo:hi]``, lanes as in :func:`_maxima`."""
    x = x[lo:hi]  # indices from 0: LLVM then vectorises the loop
    n = hi - lo
    whole = n - n % 8
    for k in range(0, whole, 8):
        s0 += x[k]
        s1 += x[k + 1]
        s2 += x[k + 2]
        s3 += x[k + 3]
        s4 += x[k + 4]
        s5 += x[k + 5]
        s6 += x[k + 6]
        s7 += x[k + 7]
    for k in range(whole, n):
        s0 += x[k]
    return s0, s1, s2, s3, s4, s5, s6, s7


@jit_inline
def combine_max(m):
    """The maximum of 8 lane maxima (any indexable), combined pairwise."""
    return max(max(max(m[0], m[1]), max(m[2], m[3])), max(max(m[4], m[5]), max(m[6], m[7])))


@jit_inline
def combine_sum(s):
    """The total of 8 lane sums (any indexable), combined pairwise."""
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))


@jit
def lane_max(x, n):
    """Maximum of ``x[:n]`` (n >= 1)."""
    m = x[0]
    return combine_max(_maxima(x, 0, n, m, m, m, m, m, m, m, m))


@jit_inline
def lane_sum(x, n):
    """Sum of ``x[:n]``."""
    return combine_sum(_sums(x, 0, n, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))


@jit_inline
def lane_max_span(x, lo, hi, m):
    """Continue the 8 lane maxima ``m`` over ``x[lo:hi]`` (``lo`` a multiple of 8; only
    the last span of a row may end off a multiple of 8): spans of a row, run in order from
    ``m[:] = x[0]``, then :func:`combine_max`, give :func:`lane_max` of the row."""
    m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7] = _maxima(
        x, lo, hi, m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7])


@jit_inline
def lane_sum_span(x, lo, hi, s):
    """Continue the 8 lane sums ``s`` over ``x[lo:hi]`` (spans as for
    :func:`lane_max_span`): from ``s[:] = 0``, then :func:`combine_sum`, the spans of a row
    give :func:`lane_sum` of the row, bit for bit."""
    s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7] = _sums(
        x, lo, hi, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7])


@jit_inline
def _below(x, key, k, limit):
    """``x[k]`` where ``key[k] < limit``, else +inf."""
    return x[k] if key[k] < limit else np.inf


@jit_inline
def masked_min(x, key, n, limit):
    """Minimum of ``x[j]`` over ``j < n`` with ``key[j] < limit`` (+inf if there is none)."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = np.inf
    whole = n - n % 8
    for k in range(0, whole, 8):
        v0 = _below(x, key, k, limit)
        v1 = _below(x, key, k + 1, limit)
        v2 = _below(x, key, k + 2, limit)
        v3 = _below(x, key, k + 3, limit)
        v4 = _below(x, key, k + 4, limit)
        v5 = _below(x, key, k + 5, limit)
        v6 = _below(x, key, k + 6, limit)
        v7 = _below(x, key, k + 7, limit)
        m0 = v0 if v0 < m0 else m0
        m1 = v1 if v1 < m1 else m1
        m2 = v2 if v2 < m2 else m2
        m3 = v3 if v3 < m3 else m3
        m4 = v4 if v4 < m4 else m4
        m5 = v5 if v5 < m5 else m5
        m6 = v6 if v6 < m6 else m6
        m7 = v7 if v7 < m7 else m7
    for k in range(whole, n):
        v = _below(x, key, k, limit)
        m0 = v if v < m0 else m0
    return min(min(min(m0, m1), min(m2, m3)), min(min(m4, m5), min(m6, m7)))
