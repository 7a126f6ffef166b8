"""``keydiff``: evict the key most similar to the anchor of the keys (Park et al. 2025).

The anchor ``a`` is the mean of the unit-normalised keys of the candidates (prefill: the
whole prompt; decode: the cache plus the incoming key, recomputed at each eviction), and a
key's score is ``-cos(k, a)``. The ``recent`` newest tokens are never evicted, and the
incoming token always joins.
"""

from typing import NamedTuple

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.decode import decode_kernel, observe_nothing
from kvsim.numerics.jit import jit, jit_inline
from kvsim.policies.base import Group, Policy, Presentation, Steps, current
from kvsim.policies.layout import StateLayout
from kvsim.policies.knorm import key_norm, key_norms
from kvsim.policies.scored import prefill, recent_count, recent_ratio


class State(NamedTuple):
    keys: np.ndarray        # (d, T) the KV head's keys, by dimension
    norm: np.ndarray        # (B + 1,) the L2 norm of each slot's key, then token t's
    slot_of: np.ndarray     # (T,) int64: the slot of each cached position
    recent: int             # the newest tokens (the incoming one included) never evicted
    candidates: np.ndarray  # (B + 1,) int64 scratch: the cache, then token t
    anchor: np.ndarray      # (d,) scratch
    score: np.ndarray       # (B + 1,) scratch


@jit
def anchor_scores(keys, norm, positions, n, anchor, score):
    """``score[:n] = -cos(k, a)`` for the keys at ``positions[:n]`` (``norm[j]``: the norm
    of ``positions[j]``), ``a`` the mean of their unit-normalised keys, summed in the order
    given. A zero key's unit vector is 0, and a zero ``||k|| ||a||`` gives a cosine of 0."""
    d = keys.shape[0]
    for i in range(d):
        total = 0.0
        for j in range(n):
            total += np.float64(keys[i, positions[j]]) / norm[j] if norm[j] > 0.0 else 0.0
        anchor[i] = total / n
    a_sq = 0.0
    for i in range(d):
        a_sq += anchor[i] * anchor[i]
    a_norm = np.sqrt(a_sq)
    for j in range(n):
        score[j] = 0.0
    for i in range(d):  # dimension by dimension: each dot product summed in order of i
        for j in range(n):
            score[j] += np.float64(keys[i, positions[j]]) * anchor[i]
    for j in range(n):
        den = norm[j] * a_norm
        score[j] = -(score[j] / den) if den > 0.0 else 0.0


@jit_inline
def admit(state, cache, n, t):
    """When full, evict the lowest ``-cos(k, a)`` outside the ``recent`` newest, ``a`` the
    anchor of the cache and token t."""
    budget = cache.shape[0]
    state.norm[budget] = key_norm(state.keys, t)
    slot = n
    if n == budget:
        for j in range(n):
            state.candidates[j] = cache[j]
        state.candidates[n] = t
        anchor_scores(state.keys, state.norm, state.candidates, n + 1, state.anchor,
                      state.score)
        slot = kernels.lowest_ranked_slot(cache, n, state.score, t - state.recent + 1,
                                          state.slot_of)
    state.slot_of[t] = slot
    state.norm[slot] = state.norm[budget]
    return slot


decode = decode_kernel("decode", admit, observe_nothing)


def _start(prompt: Group, budget: int, params: dict, T: int):
    P, recent = prompt.prompt_len, recent_count(budget, params)
    keys = prompt.keys
    norms = key_norms(keys, 0, P)
    state = State(keys, np.zeros(budget + 1), np.zeros(T, np.int64), recent,
                  np.zeros(budget + 1, np.int64), np.zeros(keys.shape[0]), np.zeros(budget + 1))
    score = np.zeros(P)
    if P > budget:
        anchor_scores(keys, norms, np.arange(P), P, state.anchor, score)
    kept = prefill(P, budget, recent, score)
    state.norm[:len(kept)], state.slot_of[kept] = norms[kept], np.arange(len(kept))
    return kept, state


def _rank(state: State, cache: np.ndarray, n: int, t: int, seed: int):
    """A compression before ``t`` joins ranks the cache by one anchor over the cache and
    token t (the cache alone when ``t < 0``)."""
    m = n + (t >= 0)
    positions = np.append(cache[:n], t)[:m]
    norms = np.append(state.norm[:n], key_norm(state.keys, max(t, 0)))[:m]
    score = np.empty(m)
    anchor_scores(state.keys, norms, positions, m, np.empty(state.keys.shape[0]), score)
    return current(score, cache, n, t, state.recent)


POLICY = Policy("keydiff", "recent newest + the keys least similar to the mean key direction",
                {"recent_ratio": recent_ratio(0.0)}, Steps(_start, admit, observe_nothing, decode, rank=_rank),
                needs=frozenset({"keys"}),
                presentation=Presentation(
                    family="key geometry", color="#e377c2", marker=">",
                    reads="keys",
                    rule=("KeyDiff (Park et al. 2025): evicts the key most similar (cosine) to the mean "
                          "unit key of the cache and the incoming key")),
                layout=StateLayout(frozenset({"norm", "candidates", "score"}), slot_of=True,
                                   recent=recent_count))
