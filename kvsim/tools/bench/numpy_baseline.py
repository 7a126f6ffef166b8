"""The same simulations written as a competent NumPy user would: vectorised per decode step.

These are the baselines ``python -m kvsim bench`` measures kvsim against, on a dense
attention matrix. They follow kvsim's semantics (the README's Semantics section) for the
three policies benchmarked, and the benchmark checks that they agree with kvsim.
"""

from __future__ import annotations

import numpy as np


def streaming_llm(attn: np.ndarray, prompt_len: int, budget: int, sinks: int = 4):
    """Per-step mass and final cache of StreamingLLM (sinks + window)."""
    T = attn.shape[0]
    mass = np.empty(T - prompt_len)
    window = budget - sinks
    for t in range(prompt_len, T):
        lo = max(sinks, t + 1 - window)
        mass[t - prompt_len] = attn[t, :min(sinks, t + 1)].sum() + attn[t, lo:t + 1].sum()
    lo = max(sinks, T - window)
    return mass, np.concatenate([np.arange(min(sinks, T)), np.arange(lo, T)])


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k best scores (ties: lower position), ascending."""
    order = np.lexsort((np.arange(scores.size), -scores))
    return np.sort(order[:k])


def h2o(attn: np.ndarray, prompt_len: int, budget: int, recent_ratio: float = 0.5):
    """Online H2O with observed (renormalised) score accumulation."""
    T, P = attn.shape[0], prompt_len
    recent = int(recent_ratio * budget)
    colsum = attn[:P, :P].sum(axis=0)
    if P <= budget:
        cache = np.arange(P)
    else:
        cache = np.concatenate([_top(colsum[:P - recent], budget - recent),
                                np.arange(P - recent, P)])
    score = colsum[cache].copy()
    mass = np.empty(T - P)
    for t in range(P, T):
        if cache.size == budget:
            candidates = np.flatnonzero(cache <= t - recent)
            cand_scores = score[candidates]
            lowest = cand_scores.min()
            ties = candidates[cand_scores == lowest]
            slot = ties[np.argmax(cache[ties])]  # among equal lowest scores, the newest goes
            cache[slot] = t
            score[slot] = 0.0
        else:
            cache = np.append(cache, t)
            score = np.append(score, 0.0)
        p = attn[t, cache]
        m = p.sum()
        mass[t - P] = m
        if m > 0:
            score += p / m
    return mass, np.sort(cache)


def snapkv(attn: np.ndarray, prompt_len: int, budget: int, window: int = 32, kernel: int = 7):
    """SnapKV with max pooling: pinned prompt selection plus a ring of the newest tokens."""
    T, P = attn.shape[0], prompt_len
    w = min(window, P)
    votes = attn[P - w:P, :P - w].sum(axis=0)
    half = kernel // 2
    padded = np.pad(votes, half, constant_values=-np.inf)
    pooled = (np.lib.stride_tricks.sliding_window_view(padded, kernel).max(axis=1)
              if votes.size else votes)
    pinned = _top(pooled, min(P - w, budget - w))
    ring = budget - pinned.size
    mass = np.empty(T - P)
    for t in range(P, T):
        lo = max(P - w, t + 1 - ring)
        mass[t - P] = attn[t, pinned].sum() + attn[t, lo:t + 1].sum()
    lo = max(P - w, T - ring)
    return mass, np.concatenate([pinned, np.arange(lo, T)])


BASELINES = {"streaming_llm": streaming_llm, "h2o": h2o, "snapkv": snapkv}
