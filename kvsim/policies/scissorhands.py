"""``scissorhands``: keep the keys that recent queries found important (Liu et al. 2023).

A key is important to a query when the query's attention to it (combined over the group's
query heads by ``gqa``) is at least ``1 / n``, ``n`` the number of keys the query attends:
prompt queries on their full attention (``n = q + 1``), decode queries on the observed
attention (``n = |C_q|``). A key's score before step ``t`` is how many of the last
``history`` queries found it important; the lowest score outside the ``recent`` newest goes.
"""

from typing import NamedTuple

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.decode import decode_kernel
from kvsim.numerics.jit import jit_inline
from kvsim.policies.base import Group, Param, Policy, Presentation, Steps, current
from kvsim.policies.layout import StateLayout
from kvsim.policies.scored import prefill, recent_count
from kvsim.policies.rows import head_rows

PARAMS = {
    "recent_ratio": Param(float, 0.5, "share of the budget kept for the newest tokens",
                          check=lambda v: 0.0 <= v < 1.0, expect="a number in [0, 1)"),
    "history": Param(int, 32, "number of past queries whose importance votes count",
                     check=lambda v: v >= 1, expect="an integer >= 1"),
}


class State(NamedTuple):
    flags: np.ndarray     # (history, B) uint8: row q % history: the keys query q found important
    count: np.ndarray     # (B,) float64: importance count over the last history queries
    slot_of: np.ndarray   # (T,) int64: the slot of each cached position
    now: np.ndarray       # (1,) int64: the current step's token
    combined: np.ndarray  # (B,) scratch: the step's combined observed attention
    recent: int           # the newest tokens (the incoming one included) never evicted
    gqa: int


@jit_inline
def admit(state, cache, n, t):
    """Evict the lowest count outside the ``recent`` newest when full; token t starts with
    no votes (no earlier query saw it)."""
    slot = n
    if n == cache.shape[0]:
        slot = kernels.lowest_ranked_slot(cache, n, state.count, t - state.recent + 1,
                                          state.slot_of)
    for r in range(state.flags.shape[0]):
        state.flags[r, slot] = 0
    state.count[slot] = 0.0
    state.slot_of[t] = slot
    state.now[0] = t
    return slot


@jit_inline
def observe(state, cache, n, obs, mass, outputs):
    """Query t votes for the keys it found important; query t - history's votes expire."""
    kernels.combine_observed(obs, mass, n, state.gqa, state.combined)
    row = state.flags[state.now[0] % state.flags.shape[0]]
    bar = 1.0 / n
    for j in range(n):
        flag = 1 if state.combined[j] >= bar else 0
        state.count[j] += np.float64(flag) - np.float64(row[j])
        row[j] = flag


decode = decode_kernel("decode", admit, observe)


def _votes(prompt: Group, history: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The last ``history`` prompt queries, which keys each found important (full
    attention, ``n = q + 1``) and each key's count of votes: the same for every budget."""
    P = prompt.prompt_len
    queries = np.arange(max(0, P - history), P)
    flags = np.zeros((queries.shape[0], P), np.uint8)
    for i, q in enumerate(queries):
        flags[i, :q + 1] = prompt.combine(head_rows(prompt, int(q))) >= 1.0 / (q + 1)
    return queries, flags, flags.sum(axis=0).astype(np.float64)


def _start(prompt: Group, budget: int, params: dict, T: int):
    P, recent, history = prompt.prompt_len, recent_count(budget, params), params["history"]
    queries, flags, count = prompt.shared(("scissorhands", history),
                                          lambda: _votes(prompt, history))
    kept = prefill(P, budget, recent, count)
    state = State(np.zeros((history, budget), np.uint8), np.zeros(budget),
                  np.zeros(T, np.int64), np.zeros(1, np.int64), np.zeros(budget), recent,
                  prompt.gqa)
    n = len(kept)
    state.flags[queries % history, :n] = flags[:, kept]
    state.count[:n], state.slot_of[kept] = count[kept], np.arange(n)
    return kept, state


def _rank(state: State, cache: np.ndarray, n: int, t: int, seed: int):
    """The importance count over the last ``history`` queries; the recent newest protected."""
    return current(state.count, cache, n, t, state.recent)


POLICY = Policy("scissorhands", "recent newest + the keys most often important to the last "
                "queries", PARAMS, Steps(_start, admit, observe, decode, rank=_rank),
                presentation=Presentation(
                    family="heavy hitters", color="#0000ff", marker="p",
                    reads="attention",
                    rule=("Scissorhands (Liu et al. 2023): the newest + the keys most often important "
                          "(attention `>= 1/n`) to the last `history` queries")),
                layout=StateLayout(frozenset({"flags", "count", "combined"}), slot_of=True,
                                   recent=recent_count))
