"""Plain-NumPy reference implementation of kvsim's eviction policies.

Written for clarity, not speed, straight from DESIGN.md (sections 2-4) and the
README's Semantics section. The cache is a Python list of positions, simulated
token by token. Used by the tests to check the jitted kernels exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEFAULTS = {
    "full": {},
    "window": {},
    "streaming_llm": {"sinks": 4},
    "h2o": {"recent_ratio": 0.5, "normalize": False, "accumulate": "observed"},
    "h2o_offline": {"recent_ratio": 0.5},
    "snapkv": {"window": 32, "kernel": 7, "pooling": "max", "protect_window": True},
    "tova": {},
    "random": {},
    "oracle": {},
}


@dataclass
class RefResult:
    mass: np.ndarray  # float64 (T-P,)
    cache_size: np.ndarray  # int64 (T-P,)
    recall: np.ndarray | None  # float64 (T-P,) or None
    kept: np.ndarray  # sorted int64, the final cache
    final_recall: float | None
    near_tie: bool = False  # some decision hinged on a near tie (see NEAR_TIE_RTOL)


# ---------------------------------------------------------------- helpers


def rank(pos, score):
    """Sort key: higher score first, then lower position (the one total order)."""
    return (-score[pos], pos)


# Relative gap below which two *different* float scores count as a near tie: their
# order is decided by rounding noise (e.g. keys whose scores are equal in exact
# arithmetic), so another correct implementation may order them the other way.
NEAR_TIE_RTOL = 1e-12
_near_ties = []  # decisions with a near tie at the boundary, reset per simulation


def _note_boundary(a, b, what):
    if a != b and abs(a - b) <= NEAR_TIE_RTOL * max(abs(a), abs(b)):
        _near_ties.append((what, a, b))


def top_k(positions, score, k):
    """The k top-ranked positions, returned sorted by position."""
    ordered = sorted(positions, key=lambda q: rank(q, score))
    if 0 < k < len(ordered):
        _note_boundary(score[ordered[k - 1]], score[ordered[k]], "top_k")
    return sorted(ordered[:k])


def lowest_ranked(positions, score):
    """The lowest-ranked position: lowest score, then highest position."""
    ordered = sorted(positions, key=lambda q: rank(q, score))
    if len(ordered) >= 2:
        _note_boundary(score[ordered[-1]], score[ordered[-2]], "evict")
    return ordered[-1]


def cache_mass(p, t, cache):
    """mass(t) = sum_{k in C_t} p(t, k), summed in ascending position order."""
    total = 0.0
    for k in sorted(cache):
        total += p[t, k]
    return total


def observed(p, t, cache):
    """p~(t, k) = p(t, k) / mass(t) over the cache (all 0 when mass is 0)."""
    m = cache_mass(p, t, cache)
    return {k: (p[t, k] / m if m > 0 else 0.0) for k in cache}


def prompt_colsum(p, P):
    """Column sums of the prompt's full attention: sum_{q<P} p(q, k)."""
    return [sum_seq(p[k:P, k]) for k in range(P)]


def sum_seq(values):
    """Sequential float64 sum (fixed order, independent of numpy's pairwise sum)."""
    total = 0.0
    for v in values:
        total += float(v)
    return total


# ---------------------------------------------------------------- policies
# Each policy returns (prefill_selection, [C_t for t = P .. T-1]).


def policy_full(p, P, T, B):
    """Keep everything."""
    cache = list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def policy_window(p, P, T, B):
    """Last B tokens; evict the oldest."""
    cache = list(range(max(0, P - B), P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            cache.remove(min(cache))
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def policy_streaming_llm(p, P, T, B, sinks):
    """Keys 0..sinks-1 plus the newest B - sinks; evict the oldest non-sink."""
    if P > B:
        cache = list(range(sinks)) + list(range(P - (B - sinks), P))
    else:
        cache = list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            cache.remove(min(k for k in cache if k >= sinks))
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def _recent_count(recent_ratio, B):
    return int(math.floor(recent_ratio * B))


def policy_h2o(p, P, T, B, recent_ratio, normalize, accumulate, recent=None):
    """Online H2O: accumulated (optionally age-normalised) attention scores. ``recent``
    overrides the recent count (a budget-allocation cap keeps the fixed part of its mean B)."""
    r = _recent_count(recent_ratio, B) if recent is None else recent
    acc = {k: s for k, s in enumerate(prompt_colsum(p, P))}
    seen = {k: P - k for k in range(P)}

    def ranking_score():
        if normalize:
            return {k: acc[k] / seen[k] for k in acc}
        return dict(acc)

    if P > B:
        heavy = top_k(range(P - r), ranking_score(), B - r)
        cache = heavy + list(range(P - r, P))
    else:
        cache = list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            score = ranking_score()
            candidates = [k for k in cache if k <= t - r]  # the r newest include t
            cache.remove(lowest_ranked(candidates, score))
        cache.append(t)
        acc[t] = 0.0
        seen[t] = 0
        if accumulate == "observed":
            add = observed(p, t, cache)
        else:
            add = {k: p[t, k] for k in cache}
        for k in cache:
            acc[k] += add[k]
            seen[k] += 1
        steps.append(list(cache))
    return prefill, steps


def policy_h2o_offline(p, P, T, B, recent_ratio, recent=None):
    """Clairvoyant H2O: static scores = column sums over all T queries (``recent`` as for
    :func:`policy_h2o`)."""
    r = _recent_count(recent_ratio, B) if recent is None else recent
    score = [sum_seq(p[k:T, k]) for k in range(T)]
    if P > B:
        cache = top_k(range(P - r), score, B - r) + list(range(P - r, P))
    else:
        cache = list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            candidates = [k for k in cache if k <= t - r]  # the r newest include t
            cache.remove(lowest_ranked(candidates, score))
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def pool_votes(votes, kernel, pooling):
    """1-D pooling, stride 1, half-width kernel//2, clipped to the candidates."""
    n = len(votes)
    h = kernel // 2
    out = []
    for k in range(n):
        seg = votes[max(0, k - h) : min(n - 1, k + h) + 1]
        if pooling == "max":
            out.append(max(seg))
        elif pooling == "avg":
            out.append(sum_seq(seg) / kernel)
        else:
            out.append(votes[k])
    return out


def policy_snapkv(p, P, T, B, window, kernel, pooling, protect_window):
    """SnapKV: pooled observation-window votes pin prefix keys; a ring holds the rest."""
    w = min(window, P)
    n_cand = P - w if protect_window else P
    votes = [sum_seq(p[P - w : P, k]) for k in range(n_cand)]
    pooled = pool_votes(votes, kernel, pooling)
    if not protect_window:
        # Only valid for P == T: top B of all prompt keys, no decode.
        cache = top_k(range(P), pooled, B) if P > B else list(range(P))
        return list(cache), []
    n_pin = min(P - w, B - w)
    pinned = top_k(range(P - w), pooled, n_pin)
    ring = list(range(P - w, P))  # oldest first
    capacity = B - n_pin
    prefill = sorted(pinned + ring)
    steps = []
    for t in range(P, T):
        if len(ring) == capacity:
            ring.pop(0)
        ring.append(t)
        steps.append(pinned + ring)
    return prefill, steps


def policy_tova(p, P, T, B):
    """TOVA: evict the key the previous query attended to least."""
    if P > B:
        cache = top_k(range(P), p[P - 1], B)
    else:
        cache = list(range(P))
    prefill = list(cache)
    prev = {k: p[P - 1, k] for k in cache}  # for t = P: full attention of P-1
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            cache.remove(lowest_ranked(cache, prev))
        cache.append(t)
        prev = observed(p, t, cache)
        steps.append(list(cache))
    return prefill, steps


def policy_random(p, P, T, B, seed):
    """Seeded random eviction over B slots; the new token takes the evicted slot."""
    rng = np.random.default_rng(seed)
    if P > B:
        selection = [int(x) for x in np.sort(rng.choice(P, B, replace=False))]
    else:
        selection = list(range(P))
    draws = rng.integers(0, B, size=T - P)
    slots = [None] * B
    for i, k in enumerate(selection):
        slots[i] = k
    prefill = list(selection)
    steps = []
    for i, t in enumerate(range(P, T)):
        if None in slots:
            slots[slots.index(None)] = t
        else:
            slots[int(draws[i])] = t
        steps.append([k for k in slots if k is not None])
    return prefill, steps


def policy_oracle(p, P, T, B):
    """Per step, the B keys with the largest full attention (no state)."""
    prefill = top_k(range(P), p[P - 1], B) if P > 0 else []
    steps = [top_k(range(t + 1), p[t], B) for t in range(P, T)]
    return prefill, steps


# ---------------------------------------------------------------- driver


def normalise_rows(attention):
    """float64 copy with every row divided by its sum."""
    a = np.asarray(attention, dtype=np.float64)
    return a / a.sum(axis=1, keepdims=True)


def reference_simulate(attention, policy, budget, prompt_len, important=None, seed=0, **params):
    """Reference simulation; returns a RefResult with the same fields as kvsim's."""
    if policy not in DEFAULTS:
        raise ValueError(f"unknown policy {policy!r}")
    unknown = set(params) - set(DEFAULTS[policy])
    if unknown:
        raise ValueError(f"unknown parameters {sorted(unknown)} for {policy}")
    prm = {**DEFAULTS[policy], **params}
    p = normalise_rows(attention)
    _near_ties.clear()
    T = p.shape[0]
    P = int(prompt_len)
    B = int(budget)
    if not (0 <= P <= T) or B < 1:
        raise ValueError("bad prompt_len or budget")

    if policy == "full":
        prefill, steps = policy_full(p, P, T, B)
    elif policy == "window":
        prefill, steps = policy_window(p, P, T, B)
    elif policy == "streaming_llm":
        if B < prm["sinks"] + 1:
            raise ValueError("budget too small for sinks")
        prefill, steps = policy_streaming_llm(p, P, T, B, prm["sinks"])
    elif policy == "h2o":
        prefill, steps = policy_h2o(p, P, T, B, prm["recent_ratio"], prm["normalize"], prm["accumulate"])
    elif policy == "h2o_offline":
        prefill, steps = policy_h2o_offline(p, P, T, B, prm["recent_ratio"])
    elif policy == "snapkv":
        if prm["protect_window"] and B < prm["window"] + 1:
            raise ValueError("budget too small for the observation window")
        if not prm["protect_window"] and P < T:
            raise ValueError("protect_window=False needs prompt_len == T")
        prefill, steps = policy_snapkv(p, P, T, B, prm["window"], prm["kernel"], prm["pooling"], prm["protect_window"])
    elif policy == "tova":
        prefill, steps = policy_tova(p, P, T, B)
    elif policy == "random":
        prefill, steps = policy_random(p, P, T, B, seed)
    else:
        prefill, steps = policy_oracle(p, P, T, B)

    mass = np.array([cache_mass(p, t, c) for t, c in zip(range(P, T), steps)], dtype=np.float64)
    cache_size = np.array([len(c) for c in steps], dtype=np.int64)
    kept = np.array(sorted(steps[-1] if steps else prefill), dtype=np.int64)

    recall = final_recall = None
    if important is not None:
        imp = sorted(set(int(i) for i in np.asarray(important).ravel()))
        recall = np.empty(len(steps), dtype=np.float64)
        for i, (t, c) in enumerate(zip(range(P, T), steps)):
            arrived = [k for k in imp if k <= t]
            recall[i] = len(set(c) & set(arrived)) / len(arrived) if arrived else np.nan
        final_recall = len(set(kept.tolist()) & set(imp)) / len(imp) if imp else float("nan")

    return RefResult(
        mass=mass,
        cache_size=cache_size,
        recall=recall,
        kept=kept,
        final_recall=final_recall,
        near_tie=bool(_near_ties),
    )
