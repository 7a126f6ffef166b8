"""Shared Numba kernels: ranking, column sums, and the token-by-token decode loop.

Every policy is a prefill selection plus one eviction rule and one score-update rule
from this module; the decode loop runs them with preallocated, fixed-size state.
"""

import numpy as np

from kvsim._numba import jit

# Eviction rules (which cached key leaves when the budget is reached).
EVICT_RING = 0  # oldest key of a ring: slot = base + (t - start) % cap
EVICT_LOWEST = 1  # lowest-ranked key by score among positions <= t - recent
EVICT_SLOT = 2  # a slot drawn in advance (random policy)

# Score-update rules (applied after query t has attended over the cache).
UPDATE_NONE = 0
UPDATE_ADD_OBSERVED = 1  # score += p~(t, k), seen += 1
UPDATE_ADD_FULL = 2  # score += p(t, k), seen += 1
UPDATE_SET_OBSERVED = 3  # score = p~(t, k)


@jit
def column_sums(attn, lo, hi):
    """Sum of attention rows ``lo .. hi-1`` (float64), one value per key."""
    out = np.zeros(attn.shape[1])
    for q in range(lo, hi):
        for k in range(q + 1):
            out[k] += attn[q, k]
    return out


@jit
def top_ranked(scores, lo, hi, k):
    """Positions in ``[lo, hi)`` of the ``k`` best-ranked scores, ascending.

    Rank: higher score first; equal scores, lower position first.
    """
    n = hi - lo
    if k >= n:
        return np.arange(lo, hi)
    # A stable sort of the negated scores keeps equal scores in position order.
    order = np.argsort(-scores[lo:hi], kind="mergesort")
    return np.sort(order[:k]) + lo


@jit
def _lowest_ranked_slot(cache, n, value, limit):
    """Slot of the worst-ranked key among positions < limit (lowest value, then highest position)."""
    best = -1
    for j in range(n):
        pos = cache[j]
        if pos >= limit:
            continue
        if best < 0 or value[j] < value[best] or (value[j] == value[best] and pos > cache[best]):
            best = j
    return best


@jit
def decode(attn, prompt_len, cache, n, score, seen, static_score, evict_rule, ring,
           recent, normalize, update_rule, evict_slots, important,
           out_mass, out_size, out_recall):
    """Simulate decode steps ``prompt_len .. T-1`` and fill the per-step outputs.

    ``cache``/``score``/``seen`` hold the prefill state in slots ``0 .. n-1`` and have
    one slot per budgeted key; the function returns the final number of cached keys.
    """
    budget = cache.shape[0]
    T = attn.shape[0]
    obs = np.empty(budget)
    ranking = np.empty(budget)
    n_important = 0
    for k in range(prompt_len):
        if important[k]:
            n_important += 1
    for t in range(prompt_len, T):
        step = t - prompt_len
        if n == budget:
            if evict_rule == EVICT_RING:
                slot = ring[0] + (t - ring[1]) % ring[2]
            elif evict_rule == EVICT_LOWEST:
                for j in range(n):
                    ranking[j] = score[j] / seen[j] if normalize else score[j]
                # The `recent` newest keys, token t included, are protected.
                slot = _lowest_ranked_slot(cache, n, ranking, t - recent + 1)
            else:
                slot = evict_slots[step]
        else:
            slot = n
            n += 1
        cache[slot] = t
        score[slot] = static_score[t]
        seen[slot] = 0.0
        if important[t]:
            n_important += 1

        mass = 0.0
        hits = 0
        for j in range(n):
            v = attn[t, cache[j]]
            obs[j] = v
            mass += v
            if important[cache[j]]:
                hits += 1
        out_mass[step] = mass
        out_size[step] = n
        out_recall[step] = hits / n_important if n_important > 0 else np.nan

        if update_rule == UPDATE_NONE:
            continue
        for j in range(n):
            # p~ = p / mass, divided rather than multiplied by 1 / mass so that equal
            # scores stay bit-equal with the plainly written reference.
            observed = obs[j] / mass if mass > 0.0 else 0.0
            if update_rule == UPDATE_ADD_OBSERVED:
                score[j] += observed
                seen[j] += 1.0
            elif update_rule == UPDATE_ADD_FULL:
                score[j] += obs[j]
                seen[j] += 1.0
            else:
                score[j] = observed
    return n


@jit
def oracle(attn, prompt_len, budget, important, out_mass, out_size, out_recall):
    """Per step, cache the ``budget`` best-ranked keys of the full row; return the last set."""
    T = attn.shape[0]
    n_important = 0
    for k in range(prompt_len):
        if important[k]:
            n_important += 1
    kept = top_ranked(attn[prompt_len - 1], 0, prompt_len, budget) if prompt_len > 0 \
        else np.empty(0, np.int64)
    for t in range(prompt_len, T):
        step = t - prompt_len
        if important[t]:
            n_important += 1
        kept = top_ranked(attn[t], 0, t + 1, budget)
        mass = 0.0
        hits = 0
        for j in range(kept.shape[0]):
            mass += attn[t, kept[j]]
            if important[kept[j]]:
                hits += 1
        out_mass[step] = mass
        out_size[step] = kept.shape[0]
        out_recall[step] = hits / n_important if n_important > 0 else np.nan
    return kept
