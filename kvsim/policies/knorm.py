"""``knorm``: keep the keys of lowest L2 norm (Devoto et al. 2024: low-norm keys draw attention).

The score ``-||k||`` is static: keep the ``recent`` newest and the best-ranked others;
evict the lowest score outside the ``recent`` newest (the incoming token included).
"""

from typing import NamedTuple

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.decode import decode_loop
from kvsim.numerics.jit import jit, jit_inline
from kvsim.policies.base import Group, Param, Policy, Steps
from kvsim.policies.h2o import _prefill, recent_count

PARAMS = {
    "recent_ratio": Param(float, 0.0, "share of the budget kept for the newest tokens",
                          check=lambda v: 0.0 <= v < 1.0, expect="a number in [0, 1)"),
}


class State(NamedTuple):
    keys: np.ndarray     # (d, T) the KV head's keys, by dimension
    score: np.ndarray    # (B,) float64: -||k|| of each slot's key
    slot_of: np.ndarray  # (T,) int64: the slot of each cached position
    recent: int          # the newest tokens (the incoming one included) never evicted


@jit_inline
def key_norm(keys, k):
    """L2 norm of key ``k`` (keys by dimension), the squares summed in order of dimension."""
    total = 0.0
    for i in range(keys.shape[0]):
        x = np.float64(keys[i, k])
        total += x * x
    return np.sqrt(total)


@jit
def key_norms(keys, n):
    """:func:`key_norm` of keys ``0 .. n-1``."""
    out = np.empty(n)
    for k in range(n):
        out[k] = key_norm(keys, k)
    return out


@jit_inline
def admit(state, cache, n, t):
    """Evict the lowest score outside the ``recent`` newest when full; t scores ``-||k_t||``."""
    slot = n
    if n == cache.shape[0]:
        slot = kernels.lowest_ranked_slot(cache, n, state.score, t - state.recent + 1,
                                          state.slot_of)
    state.slot_of[t] = slot
    state.score[slot] = -key_norm(state.keys, t)
    return slot


@jit_inline
def observe(state, cache, n, obs, mass, outputs):
    """Static scores: nothing to learn."""
    return None


@jit
def decode(ctx, out, cache, n, state):
    """The decode loop of ``knorm``."""
    return decode_loop(ctx, out, cache, n, state, admit, observe)


def _start(prompt: Group, budget: int, params: dict, T: int):
    P, recent = prompt.prompt_len, recent_count(budget, params)
    score = -key_norms(prompt.keys, P)
    kept = _prefill(P, budget, recent, score)
    state = State(prompt.keys, np.zeros(budget), np.zeros(T, np.int64), recent)
    state.score[:len(kept)], state.slot_of[kept] = score[kept], np.arange(len(kept))
    return kept, state


POLICY = Policy("knorm", "recent newest + the keys of lowest L2 norm (static score -||k||)",
                PARAMS, Steps(_start, admit, observe, decode), needs=frozenset({"keys"}))
