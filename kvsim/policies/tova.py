"""``tova``: evict the key the previous query attended to least (Oren et al. 2024)."""

from typing import NamedTuple

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.decode import decode_kernel
from kvsim.numerics.jit import jit_inline
from kvsim.policies.base import Group, Policy, Presentation, Steps, current
from kvsim.policies.layout import StateLayout


class State(NamedTuple):
    score: np.ndarray    # (B,) float64: the previous query's observed attention
    slot_of: np.ndarray  # (T,) int64: the slot of each cached position
    gqa: int


@jit_inline
def admit(state, cache, n, t):
    """Evict the key with the lowest score (the newest token always joins)."""
    slot = n if n < cache.shape[0] else kernels.lowest_ranked_slot(cache, n, state.score, t + 1,
                                                                   state.slot_of)
    state.slot_of[t] = slot
    state.score[slot] = 0.0
    return slot


@jit_inline
def observe(state, cache, n, obs, mass, outputs):
    """The score becomes this query's observed attention, combined over the group."""
    kernels.combine_observed(obs, mass, n, state.gqa, state.score)


decode = decode_kernel("decode", admit, observe)


def _last_attention(group: Group) -> np.ndarray:
    """The last prompt query's attention, combined over the group (zeros without a prompt)."""
    P = group.prompt_len
    return group.row_scores(P - 1, P) if P > 0 else np.zeros(P)


def _start(prompt: Group, budget: int, params: dict, T: int):
    P = prompt.prompt_len
    last = _last_attention(prompt)
    kept = kernels.top_ranked(last, 0, P, budget)
    state = State(np.zeros(budget), np.zeros(T, np.int64), prompt.gqa)
    state.score[:len(kept)], state.slot_of[kept] = last[kept], np.arange(len(kept))
    return kept, state


def _rank(state: State, cache: np.ndarray, n: int, t: int, seed: int):
    """The previous query's observed attention (before the first decode query: the last prompt query's full row)."""
    return current(state.score, cache, n, t)


POLICY = Policy("tova", "evict the lowest attention of the previous query", {},
                Steps(_start, admit, observe, decode, rank=_rank),
                prefill_score=lambda group, budget, params: _last_attention(group)[:group.prompt_len],
                presentation=Presentation(
                    family="last query", color="#6a3d9a", marker="*",
                    reads="attention",
                    rule="evicts the key the previous query attended to least (Oren et al. 2024)"),
                layout=StateLayout(frozenset({"score"}), slot_of=True))
