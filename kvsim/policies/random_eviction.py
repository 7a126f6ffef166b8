"""``random``: a uniformly random prompt subset, then uniformly random evictions."""

from typing import NamedTuple

import numpy as np

from kvsim.numerics.decode import decode_kernel, observe_nothing
from kvsim.numerics.jit import jit_inline
from kvsim.policies.base import Group, Policy, Presentation, Steps
from kvsim.policies.layout import StateLayout


class State(NamedTuple):
    slots: np.ndarray  # (T - P,) int64: the slot evicted at each decode step, drawn in advance
    prompt_len: int


@jit_inline
def admit(state, cache, n, t):
    """Evict the slot drawn for this step (the new token always joins)."""
    return n if n < cache.shape[0] else state.slots[t - state.prompt_len]


decode = decode_kernel("decode", admit, observe_nothing)


def _start(prompt: Group, budget: int, params: dict, T: int):
    P = prompt.prompt_len
    rng = np.random.default_rng(prompt.seed)
    kept = np.sort(rng.choice(P, size=budget, replace=False)) if P > budget else np.arange(P)
    slots = rng.integers(0, budget, size=T - P).astype(np.int64)
    return kept.astype(np.int64), State(slots, P)


def _rank(state: State, cache: np.ndarray, n: int, t: int, seed: int):
    """Uniform scores in [0, 1) (seeded by the run's seed and ``t``): a compression ranks
    the cache in a uniformly random order."""
    return np.random.default_rng((seed, t + 1)).random(n), np.zeros(n, bool)


def _widen(state: State, budget: int, extra: int, seed: int) -> State:
    """The evictions, drawn over the budget's slots, drawn again uniformly over the
    ``budget + extra`` slots of a wider cache (seeded by ``seed`` and ``extra``)."""
    slots = np.random.default_rng((seed, extra)).integers(0, budget + extra,
                                                          size=state.slots.size)
    return state._replace(slots=slots.astype(np.int64))


POLICY = Policy("random", "random prompt subset, random evictions (seeded baseline)", {},
                Steps(_start, admit, observe_nothing, decode, rank=_rank),
                presentation=Presentation(
                    family="baseline", color="#8c8c8c", marker="X",
                    reads="nothing",
                    rule="random prompt subset, random evictions; seeded"),
                layout=StateLayout(seeded_rank=True, widen=_widen))
