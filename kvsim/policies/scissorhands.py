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
from kvsim.numerics.jit import jit, jit_inline
from kvsim.numerics.steploop import step_loop
from kvsim.policies.base import Group, Param, Policy, Trace
from kvsim.policies.h2o import recent_count
from kvsim.policies.stepped import head_rows, lowest_ranked_slot, observed_combined, run_stepped

PARAMS = {
    "recent_ratio": Param(float, 0.5, "share of the budget kept for the newest tokens",
                          check=lambda v: 0.0 <= v < 1.0, expect="a number in [0, 1)"),
    "history": Param(int, 32, "number of past queries whose importance votes count",
                     check=lambda v: v >= 1, expect="an integer >= 1"),
}


class State(NamedTuple):
    recent: int
    gqa: int
    flags: np.ndarray     # (history, budget) uint8: slot's key important to query q (row q % history)
    count: np.ndarray     # (budget,) float64: importance count over the last history queries
    rows: np.ndarray      # (G, budget) scratch
    combined: np.ndarray  # (budget,) scratch


@jit_inline
def admit(state, cache, n, t):
    slot = -1
    if n == cache.shape[0]:
        slot = lowest_ranked_slot(cache, n, state.count, t - state.recent + 1)
    new = n if slot < 0 else slot
    for r in range(state.flags.shape[0]):  # token t was important to no earlier query
        state.flags[r, new] = 0
    state.count[new] = 0.0
    return slot


@jit_inline
def observe(state, cache, n, t, obs, mass):
    observed_combined(obs, mass, n, state.gqa, state.rows, state.combined)
    row = state.flags[t % state.flags.shape[0]]  # query t - history leaves the window
    bar = 1.0 / n
    for j in range(n):
        flag = 1 if state.combined[j] >= bar else 0
        state.count[j] += np.float64(flag) - np.float64(row[j])
        row[j] = flag


@jit
def decode(ctx, out, cache, n, state):
    return step_loop(ctx, out, cache, n, state, admit, observe)


def prompt_flags(group: Group, history: int) -> tuple[np.ndarray, np.ndarray]:
    """(queries, flags): the prompt queries in the last ``history`` and, per query, which
    keys of the prompt it found important (full attention, ``n = q + 1``)."""
    P = group.prompt_len
    queries = np.arange(max(0, P - history), P)
    flags = np.zeros((queries.shape[0], P), np.uint8)
    for i, q in enumerate(queries):
        combined = group.combine(head_rows(group, int(q)))
        flags[i, :q + 1] = combined >= 1.0 / (q + 1)
    return queries, flags


def _run(group: Group, budget: int, params: dict) -> Trace:
    P, recent, history = group.prompt_len, recent_count(budget, params), params["history"]
    queries, flags = prompt_flags(group, history)
    count = flags.sum(axis=0).astype(np.float64)
    if P <= budget:
        kept = np.arange(P)
    else:
        heavy = kernels.top_ranked(count, 0, P - recent, budget - recent)
        kept = np.concatenate((heavy, np.arange(P - recent, P)))
    state = State(recent, group.gqa, np.zeros((history, budget), np.uint8), np.zeros(budget),
                  np.zeros((len(group.heads), budget)), np.zeros(budget))
    state.flags[queries % history, :kept.shape[0]] = flags[:, kept]
    state.count[:kept.shape[0]] = count[kept]
    return run_stepped(group, budget, kept, state, decode)


POLICY = Policy("scissorhands", "recent newest + the keys most often important to the last "
                "queries", PARAMS, _run)
