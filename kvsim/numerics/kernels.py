"""Shared Numba kernels: ranking, row sums, and the token-by-token decode loop.

Every policy is a prefill selection plus one eviction rule and one score-update rule
from this module; the decode loop runs them with preallocated, fixed-size state for
one KV head and the query heads that share it.
"""

import numpy as np

from kvsim.numerics.jit import jit, jit_inline
from kvsim.numerics.field import probs_at, probs_row
from kvsim.numerics.lanes import lane_sum, masked_min

# Eviction rules (which cached key leaves when the budget is reached).
EVICT_RING = 0  # oldest key of a ring: slot = base + (t - start) % cap
EVICT_LOWEST = 1  # lowest-ranked key by score among positions <= t - recent
EVICT_SLOT = 2  # a slot drawn in advance (random policy)

# Score-update rules (applied after query t has attended over the cache).
UPDATE_NONE = 0
UPDATE_ADD_OBSERVED = 1  # score += p~(t, k), seen += 1
UPDATE_ADD_FULL = 2  # score += p(t, k), seen += 1
UPDATE_SET_OBSERVED = 3  # score = p~(t, k)

# How the query heads of a GQA group combine their scores.
GQA_MEAN, GQA_MAX, GQA_SUM = 0, 1, 2
GQA_MODES = {"mean": GQA_MEAN, "max": GQA_MAX, "sum": GQA_SUM}


@jit
def row_sums(f, row_max, row_sum, h, lo, hi):
    """Sum over queries ``lo .. hi-1`` of head ``h``'s attention rows, one value per key."""
    T = f.key_bias.shape[1]
    keys = np.arange(T)
    row = np.empty(T)
    work = np.empty(T)
    out = np.zeros(T)
    for q in range(lo, hi):
        probs_row(f, row_max, row_sum, h, q, keys, q + 1, row, work)
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


@jit
def _lowest_ranked_slot(cache, n, value, limit, slot_of):
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


@jit_inline
def _record(f, heads, cache, n, hits, n_important, full_output, step, obs, mass, approx,
            out_mass, out_recall, out_error):
    """Metrics of step ``step`` from the observed full attention ``obs[g, :n]`` of each head
    and the number ``hits[g]`` of its important keys in the cache."""
    kv = heads[0] // f.group
    dv = full_output.shape[2]
    for g in range(heads.shape[0]):
        m = lane_sum(obs[g], n)
        mass[g] = m
        out_mass[g, step] = m
        out_recall[g, step] = hits[g] / n_important[g] if n_important[g] > 0 else np.nan
        if dv > 0:
            for i in range(dv):
                approx[i] = 0.0
            for j in range(n):
                w = obs[g, j] / m if m > 0.0 else 0.0
                value = f.values[kv, cache[j]]  # a row view: LLVM then vectorises over i
                for i in range(dv):
                    approx[i] += w * value[i]
            diff = 0.0
            norm = 0.0
            for i in range(dv):
                diff += (approx[i] - full_output[g, step, i]) ** 2
                norm += full_output[g, step, i] ** 2
            out_error[g, step] = np.sqrt(diff / norm) if norm > 0.0 else 0.0


@jit
def _copy_kept(cache, n, out):
    """``out[:n] = cache[:n]``, as a loop: a slice copy would compile Numba's shape-mismatch
    error formatting into every kernel that uses it (seconds of cold start)."""
    for j in range(n):
        out[j] = cache[j]


@jit
def _snapshot(cache, n, step, snap_steps, snapshots, index):
    """Copy the cache into ``snapshots[index]`` if ``step`` is the next snapshot step."""
    if index < snap_steps.shape[0] and snap_steps[index] == step:
        for j in range(snapshots.shape[1]):  # loops, not slice copies: see _copy_kept
            snapshots[index, j] = cache[j] if j < n else -1
        return index + 1
    return index


@jit
def _cached_important(important, cache, n, hits):
    """``hits[g]``: the number of query head g's important keys among ``cache[:n]``."""
    for g in range(important.shape[0]):
        hits[g] = 0
        for j in range(n):
            hits[g] += important[g, cache[j]]


@jit
def _count_important(important, prompt_len):
    """Number of important keys before the first decode step, per query head."""
    counts = np.zeros(important.shape[0], np.int64)
    for g in range(important.shape[0]):
        for k in range(prompt_len):
            if important[g, k]:
                counts[g] += 1
    return counts


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
def _update_scores(obs, mass, n, update_rule, gqa, combined, score, seen):
    """Apply a score-update rule from the observed full attention ``obs[g, :n]`` of each head.

    For the observed rules ``obs`` is renormalised in place to ``p~ = p / mass`` (0 where
    no mass is kept), divided rather than multiplied by ``1 / mass`` so that equal scores
    stay bit-equal with the plain reference. A single head applies its value directly (its
    combined value is the value itself, ``mean`` dividing by 1).
    """
    if obs.shape[0] == 1:  # one fused loop (a loop over heads inside it would not vectorise)
        m = mass[0]
        for j in range(n):
            if update_rule == UPDATE_ADD_FULL:
                v = obs[0, j]
            else:
                v = obs[0, j] / m if m > 0.0 else 0.0
            if update_rule == UPDATE_SET_OBSERVED:
                score[j] = v
            else:
                score[j] += v
                seen[j] += 1.0
        return
    if update_rule != UPDATE_ADD_FULL:
        for g in range(obs.shape[0]):
            m = mass[g]
            for j in range(n):
                obs[g, j] = obs[g, j] / m if m > 0.0 else 0.0
    combine_rows(obs, n, gqa, combined)
    if update_rule == UPDATE_SET_OBSERVED:
        for j in range(n):
            score[j] = combined[j]
    else:
        for j in range(n):
            score[j] += combined[j]
            seen[j] += 1.0


@jit
def decode(f, row_max, row_sum, heads, prompt_len, cache, n, score, seen, static_score,
           evict_rule, ring, recent, normalize, update_rule, gqa, evict_slots, important,
           full_output, out_mass, out_size, out_recall, out_error, snap_steps, snapshots):
    """Simulate decode steps ``prompt_len .. T-1`` for one KV head; fill the outputs.

    ``cache``/``score``/``seen`` hold the prefill state in slots ``0 .. n-1`` and have
    one slot per budgeted key; ``heads`` are the query heads sharing this cache. At the
    decode steps ``snap_steps`` (ascending) the cached positions go to ``snapshots``
    (padded with -1). Returns the final number of cached keys.
    """
    budget = cache.shape[0]
    T = f.key_bias.shape[1]
    G = heads.shape[0]
    obs = np.empty((G, budget))
    mass = np.empty(G)
    approx = np.empty(full_output.shape[2])
    ranking = np.empty(budget)
    combined = np.empty(budget)
    n_important = _count_important(important, prompt_len)
    slot_of = np.empty(T, np.int64)  # the slot of each cached position
    for j in range(n):
        slot_of[cache[j]] = j
    hits = np.empty(G, np.int64)
    _cached_important(important, cache, n, hits)  # then kept up to date as keys come and go
    work = np.empty(budget)
    kv = heads[0] // f.group
    d = f.keys.shape[1]
    cached = np.empty((d, budget))  # the cached keys' vectors, by dimension (q.k fields)
    for j in range(n):
        for i in range(d):
            cached[i, j] = f.keys[kv, i, cache[j]]
    snap = 0
    for t in range(prompt_len, T):
        step = t - prompt_len
        if n == budget:
            if evict_rule == EVICT_RING:
                slot = ring[0] + (t - ring[1]) % ring[2]
            elif evict_rule == EVICT_LOWEST:
                if normalize:
                    for j in range(n):
                        ranking[j] = score[j] / seen[j]
                # The `recent` newest keys, token t included, are protected.
                slot = _lowest_ranked_slot(cache, n, ranking if normalize else score,
                                           t - recent + 1, slot_of)
            else:
                slot = evict_slots[step]
            for g in range(G):
                hits[g] -= important[g, cache[slot]]
        else:
            slot = n
            n += 1
        cache[slot] = t
        slot_of[t] = slot
        for i in range(d):
            cached[i, slot] = f.keys[kv, i, t]
        score[slot] = static_score[t]
        seen[slot] = 0.0
        for g in range(G):
            n_important[g] += important[g, t]
            hits[g] += important[g, t]
        out_size[step] = n
        for g in range(G):
            probs_at(f, row_max, row_sum, heads[g], t, cache, n, obs[g], work, cached)
        _record(f, heads, cache, n, hits, n_important, full_output, step, obs, mass, approx,
                out_mass, out_recall, out_error)
        snap = _snapshot(cache, n, step, snap_steps, snapshots, snap)

        if update_rule == UPDATE_NONE:
            continue
        _update_scores(obs, mass, n, update_rule, gqa, combined, score, seen)
    return n


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


@jit
def oracle(f, row_max, row_sum, heads, prompt_len, budgets, by_size, gqa, important, full_output,
           out_mass, out_size, out_recall, out_error, out_kept, snap_steps, snapshots):
    """Per step and budget, cache the best-ranked keys of the group's combined full row.

    Every budget ``budgets[i]`` (``by_size``: their indices, largest budget first) shares
    one evaluation of each row; its outputs are ``out_*[i]``, ``snapshots[i]`` its caches
    at ``snap_steps``, and ``out_kept[i, :n]`` its last cached set (the prefill selection
    when there are no decode steps). Returns the number of kept keys per budget.
    """
    T = f.key_bias.shape[1]
    G = heads.shape[0]
    rows = np.empty((G, T))
    work = np.empty(T)
    keys = np.arange(T)
    combined = np.empty(T)
    cache = np.empty(T, np.int64)
    chosen = np.empty(T, np.int64)
    value = np.empty(T)
    guess = 0.0
    hits = np.empty(G, np.int64)
    obs = np.empty((G, T))
    mass = np.empty(G)
    approx = np.empty(full_output.shape[2])
    kept = np.zeros(budgets.shape[0], np.int64)
    n_important = _count_important(important, prompt_len)
    snap = 0
    advanced = 0
    for t in range(max(prompt_len - 1, 0), T):
        step = t - prompt_len
        if t >= prompt_len:
            for g in range(G):
                if important[g, t]:
                    n_important[g] += 1
        for g in range(G):
            probs_row(f, row_max, row_sum, heads[g], t, keys, t + 1, rows[g], work)
        combine_rows(rows, t + 1, gqa, combined)
        # Budgets from the largest down: each one's keys are the best-ranked of the
        # previous (larger) selection, which holds them all, as the ranking is total.
        m = t + 1
        for r in range(budgets.shape[0]):
            i = by_size[r]
            if r == 0:
                n, kth = _top_ranked_above(combined, m, budgets[i], guess, chosen, cache, value)
                guess = 0.9 * kth  # rows change slowly: near the last threshold
                for j in range(n):
                    cache[j] = chosen[j]
                    value[j] = combined[chosen[j]]
            else:
                n = _top_ranked_linear(value, m, budgets[i], chosen)
                for j in range(n):  # in place: chosen is ascending, chosen[j] >= j
                    cache[j] = cache[chosen[j]]
                    value[j] = value[chosen[j]]
            m = n
            kept[i] = n
            if t < prompt_len:
                _copy_kept(cache, n, out_kept[i])
                continue  # the prefill selection, by the last prompt query
            for g in range(G):
                for j in range(n):
                    obs[g, j] = rows[g, cache[j]]
            out_size[i, step] = n
            _cached_important(important, cache, n, hits)
            _record(f, heads, cache, n, hits, n_important, full_output, step, obs, mass,
                    approx, out_mass[i], out_recall[i], out_error[i])
            advanced = _snapshot(cache, n, step, snap_steps, snapshots[i], snap)
            if t == T - 1:
                _copy_kept(cache, n, out_kept[i])
        if t >= prompt_len:
            snap = advanced  # every budget recorded this step's snapshot, or none did
    return kept
