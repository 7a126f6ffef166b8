"""Shared step helpers, written once for every policy: ranking with the total order (top
``k``, the lowest-ranked cached key), the ring, combining a group's heads, row sums.

The total order: a key ranks above another when its score is higher, or the scores are
equal and its position is lower.
"""

import numpy as np

from kvsim.numerics.field import FieldData, component_probs_row
from kvsim.numerics.jit import jit, jit_inline
from kvsim.numerics.lanes import masked_min

# How the query heads of a GQA group combine their scores.
GQA_MEAN, GQA_MAX, GQA_SUM = 0, 1, 2
GQA_MODES = {"mean": GQA_MEAN, "max": GQA_MAX, "sum": GQA_SUM}


def row_sums(f: FieldData, row_max: np.ndarray, row_sum: np.ndarray, h: int, lo: int,
             hi: int) -> np.ndarray:
    """Sum over queries ``lo .. hi-1`` of head ``h``'s attention rows, one value per key
    (a kernel for dense fields and one for component fields: a run compiles only the one
    its field needs)."""
    if f.is_dense:
        return _dense_row_sums(f.probs, h, lo, hi)
    return _component_row_sums(f, row_max, row_sum, h, lo, hi)


@jit
def _dense_row_sums(probs, h, lo, hi):
    """:func:`row_sums` of a dense (H, T, T) matrix."""
    out = np.zeros(probs.shape[2])
    for q in range(lo, hi):
        row = probs[h, q]
        for k in range(q + 1):
            out[k] += row[k]
    return out


@jit
def _component_row_sums(f, row_max, row_sum, h, lo, hi):
    """:func:`row_sums` of a component field."""
    T = f.key_bias.shape[1]
    keys = np.arange(T)
    row = np.empty(T)
    work = np.empty(T)
    out = np.zeros(T)
    for q in range(lo, hi):
        component_probs_row(f, row_max, row_sum, h, q, keys, q + 1, row, work)
        for k in range(q + 1):
            out[k] += row[k]
    return out


@jit
def top_ranked(scores, lo, hi, k):
    """Positions in ``[lo, hi)`` of the ``k`` best-ranked scores, ascending.

    Rank: higher score first; equal scores, lower position first.
    """
    n = hi - lo
    if k >= n:
        return np.arange(lo, hi)
    out = np.empty(k, np.int64)
    _top_ranked_linear(scores[lo:hi], n, k, out)
    return out + lo


@jit_inline
def lowest_ranked_slot(cache, n, value, limit, slot_of):
    """Slot of the worst-ranked key among positions < limit (lowest value, then highest
    position), or -1 if there is none; ``slot_of`` maps a cached position to its slot.

    Two vectorised passes: the lowest value, then the highest position holding it.
    """
    lowest = masked_min(value, cache, n, limit)
    top = -1
    for j in range(n):
        pos = cache[j] if (cache[j] < limit) & (value[j] == lowest) else -1
        top = max(top, pos)
    return slot_of[top] if top >= 0 else -1


@jit
def combine_rows(rows, n, mode, out):
    """Combine the heads' values of each key: ``out[j]`` from ``rows[:, j]``, ``j < n``.

    Mean, max or sum, accumulated in head order (mean divides the sum by the group
    size); one loop over the keys per head, so it vectorises.
    """
    G = rows.shape[0]
    for j in range(n):
        out[j] = rows[0, j]
    for g in range(1, G):
        if mode == GQA_MAX:
            for j in range(n):
                out[j] = max(out[j], rows[g, j])
        else:
            for j in range(n):
                out[j] += rows[g, j]
    if mode == GQA_MEAN:
        for j in range(n):
            out[j] /= G


@jit
def combine_observed(obs, mass, n, gqa, out):
    """``out[:n]``: the observed attention ``p~ = obs / mass`` (0 where no mass is kept)
    of the group's heads, combined by ``gqa``.

    Divided rather than multiplied by ``1 / mass`` so that equal scores stay bit-equal
    with the plain reference; ``obs`` is renormalised in place when there are several
    heads. A single head's combined value is its own (``mean`` dividing by 1).
    """
    if obs.shape[0] == 1:  # one fused loop (a loop over heads inside it would not vectorise)
        m = mass[0]
        for j in range(n):
            out[j] = obs[0, j] / m if m > 0.0 else 0.0
        return
    for g in range(obs.shape[0]):
        m = mass[g]
        for j in range(n):
            obs[g, j] = obs[g, j] / m if m > 0.0 else 0.0
    combine_rows(obs, n, gqa, out)


@jit_inline
def ring_slot(base, start, width, t):
    """Slot of token ``t`` in a ring of ``width`` slots from ``base``, whose slot ``base``
    took position ``start``: the oldest key of the ring leaves."""
    return base + (t - start) % width


@jit
def _kth_largest(scores, n, k):
    """The ``k``-th largest of ``scores[:n]`` (1 <= k <= n): quickselect on a copy.

    Hoare partitions around a median of three, so sorted runs and many equal scores stay
    O(n); deterministic (no random pivot).
    """
    work = scores[:n].copy()
    lo, hi, target = 0, n - 1, k - 1  # the target index in descending order
    while lo < hi:
        mid = (lo + hi) // 2
        a, b, c = work[lo], work[mid], work[hi]
        pivot = max(min(a, b), min(max(a, b), c))
        i, j = lo, hi
        while i <= j:
            while work[i] > pivot:
                i += 1
            while work[j] < pivot:
                j -= 1
            if i <= j:
                work[i], work[j] = work[j], work[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break  # between j and i: every element there equals the pivot
    return work[target]


@jit
def _top_ranked_linear(scores, n, k, out):
    """Like :func:`top_ranked` over ``[0, n)`` in O(n): fills ``out[:k]`` ascending."""
    if k >= n:
        for j in range(n):
            out[j] = j
        return n
    kth = _kth_largest(scores, n, k)
    count = 0
    for j in range(n):
        count += scores[j] > kth
    ties = k - count  # scores equal to the k-th to take, lowest positions first
    filled = 0
    for j in range(n):
        if scores[j] > kth:
            out[filled] = j
            filled += 1
        elif scores[j] == kth and ties > 0:
            out[filled] = j
            filled += 1
            ties -= 1
    return filled


@jit
def _at_least(scores, n, tau, positions, values):
    """Positions (ascending) and values of the scores in ``scores[:n]`` that are >= tau;
    returns how many there are."""
    m = 0
    for j in range(n):
        if scores[j] >= tau:
            positions[m] = j
            values[m] = scores[j]
            m += 1
    return m


@jit
def _top_ranked_above(scores, n, k, guess, out, cand_pos, cand_val):
    """Like :func:`_top_ranked_linear`, after keeping only scores >= a threshold.

    The threshold starts at ``guess`` and is lowered until at least ``k`` scores pass,
    so every top-ranked score (and every score tied with the k-th) is a candidate and the
    result is exact whatever the guess; a good guess only makes it fast. Returns the
    number selected and the k-th largest score (a guess for the next row).
    """
    if k >= n:
        return _top_ranked_linear(scores, n, k, out), -np.inf
    tau = guess
    m = _at_least(scores, n, tau, cand_pos, cand_val)
    while m < k:
        tau = tau * 0.5 if tau > 1e-300 else -np.inf
        m = _at_least(scores, n, tau, cand_pos, cand_val)
    chosen = _top_ranked_linear(cand_val, m, k, out)
    kth = np.inf
    for j in range(chosen):
        kth = min(kth, cand_val[out[j]])
        out[j] = cand_pos[out[j]]
    return chosen, kth
