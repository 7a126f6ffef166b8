"""``keydiff``: evict the key most similar to the anchor of the keys (Park et al. 2025).

The anchor ``a`` is the mean of the unit-normalised keys of the candidates (prefill: the
whole prompt; decode: the cache plus the incoming key, recomputed at each eviction), and a
key's score is ``-cos(k, a)``. The ``recent`` newest tokens are never evicted.
"""

from typing import NamedTuple

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.jit import jit, jit_inline
from kvsim.numerics.steploop import step_loop
from kvsim.policies.base import Group, Param, Policy, Trace
from kvsim.policies.h2o import recent_count
from kvsim.policies.knorm import PARAMS, key_norms
from kvsim.policies.stepped import lowest_ranked_slot, run_stepped


class State(NamedTuple):
    keys: np.ndarray        # (d, T) float32: the KV head's keys, by dimension
    norms: np.ndarray       # (T,) their L2 norms
    recent: int             # newest tokens never evicted
    candidates: np.ndarray  # (budget + 1,) int64 scratch
    anchor: np.ndarray      # (d,) scratch
    score: np.ndarray       # (budget + 1,) scratch


@jit
def anchor_scores(keys, norms, positions, n, anchor, score):
    """``score[:n] = -cos(k, a)`` for the keys at ``positions[:n]``, ``a`` the mean of their
    unit-normalised keys (summed in the order given). A zero key has a zero unit vector, and
    a zero denominator gives a cosine of 0."""
    d = keys.shape[0]
    for i in range(d):
        dim = keys[i]
        total = 0.0
        for j in range(n):
            k = positions[j]
            total += np.float64(dim[k]) / norms[k] if norms[k] > 0.0 else 0.0
        anchor[i] = total / n
    a_sq = 0.0
    for i in range(d):
        a_sq += anchor[i] * anchor[i]
    a_norm = np.sqrt(a_sq)
    for j in range(n):
        score[j] = 0.0
    for i in range(d):  # dimension by dimension: the dot products summed in order of i
        dim = keys[i]
        for j in range(n):
            score[j] += np.float64(dim[positions[j]]) * anchor[i]
    for j in range(n):
        den = norms[positions[j]] * a_norm
        score[j] = -(score[j] / den) if den > 0.0 else 0.0


@jit_inline
def admit(state, cache, n, t):
    if n < cache.shape[0]:
        return -1
    for j in range(n):
        state.candidates[j] = cache[j]
    state.candidates[n] = t
    anchor_scores(state.keys, state.norms, state.candidates, n + 1, state.anchor, state.score)
    return lowest_ranked_slot(cache, n, state.score, t - state.recent + 1)


@jit_inline
def observe(state, cache, n, t, obs, mass):
    pass


@jit
def decode(ctx, out, cache, n, state):
    return step_loop(ctx, out, cache, n, state, admit, observe)


def _run(group: Group, budget: int, params: dict) -> Trace:
    P, recent = group.prompt_len, recent_count(budget, params)
    keys = group.field.keys[int(group.heads[0]) // group.field.group]
    norms = key_norms(keys)
    state = State(keys, norms, recent, np.zeros(budget + 1, np.int64), np.zeros(keys.shape[0]),
                  np.zeros(max(budget, P) + 1))
    if P <= budget:
        kept = np.arange(P)
    else:
        anchor_scores(keys, norms, np.arange(P), P, state.anchor, state.score)
        heavy = kernels.top_ranked(state.score[:P], 0, P - recent, budget - recent)
        kept = np.concatenate((heavy, np.arange(P - recent, P)))
    return run_stepped(group, budget, kept, state, decode)


POLICY = Policy("keydiff", "recent newest + the keys least similar to the mean key direction",
                dict(PARAMS), _run, needs=("keys",))
