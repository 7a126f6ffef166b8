"""``caote``: evict the key whose removal changes the previous query's output least
(Goel et al. 2025, on TOVA's step rule).

A cached key's score is ``(p~_k / (1 - p~_k)) * ||v_k - o~||`` from the previous query's
observed attention ``p~`` and output ``o~``, per query head, combined over the group by its
``gqa`` rule (``+inf`` where ``p~_k = 1``). At prefill the last prompt query's full attention
and full output rank the prompt keys, and rank the first decode eviction too.
"""

from typing import NamedTuple

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.jit import jit, jit_inline
from kvsim.numerics.steploop import step_loop
from kvsim.policies.base import Group, Policy, Trace
from kvsim.policies.stepped import head_rows, lowest_ranked_slot, run_stepped


class State(NamedTuple):
    values: np.ndarray  # (T, dv) float32: the KV head's values
    gqa: int
    score: np.ndarray   # (budget,) the previous query's score of each slot's key
    rows: np.ndarray    # (G, budget) scratch: per-head scores
    output: np.ndarray  # (dv,) scratch


@jit
def head_scores(p, m, positions, n, values, output, out):
    """``out[:n]``: each key's ``(w / (1 - w)) * ||v - o||`` with ``w = p / m`` (0 if m = 0)
    and ``o = sum_j w_j v_j`` (in the order of ``positions[:n]``); ``+inf`` where w = 1."""
    dv = values.shape[1]
    for i in range(dv):
        output[i] = 0.0
    for j in range(n):
        w = p[j] / m if m > 0.0 else 0.0
        v = values[positions[j]]
        for i in range(dv):
            output[i] += w * np.float64(v[i])
    for j in range(n):
        w = p[j] / m if m > 0.0 else 0.0
        if w >= 1.0:
            out[j] = np.inf
            continue
        v = values[positions[j]]
        dist = 0.0
        for i in range(dv):
            diff = np.float64(v[i]) - output[i]
            dist += diff * diff
        out[j] = (w / (1.0 - w)) * np.sqrt(dist)


@jit_inline
def admit(state, cache, n, t):
    if n < cache.shape[0]:
        return -1
    return lowest_ranked_slot(cache, n, state.score, t + 1)


@jit_inline
def observe(state, cache, n, t, obs, mass):
    for g in range(obs.shape[0]):
        head_scores(obs[g], mass[g], cache, n, state.values, state.output, state.rows[g])
    kernels.combine_rows(state.rows, n, state.gqa, state.score)


@jit
def decode(ctx, out, cache, n, state):
    return step_loop(ctx, out, cache, n, state, admit, observe)


def prefill_scores(group: Group, values: np.ndarray) -> np.ndarray:
    """Scores of the prompt keys from the last prompt query's full attention and output."""
    P = group.prompt_len
    positions = np.arange(P)
    output = np.zeros(values.shape[1])
    per_head = []
    for row in head_rows(group, P - 1):
        scores = np.zeros(P)
        head_scores(row, 1.0, positions, P, values, output, scores)
        per_head.append(scores)
    return group.combine(per_head)


def _run(group: Group, budget: int, params: dict) -> Trace:
    P = group.prompt_len
    values = group.field.values[int(group.heads[0]) // group.field.group]
    state = State(values, group.gqa, np.zeros(budget), np.zeros((len(group.heads), budget)),
                  np.zeros(values.shape[1]))
    kept = np.arange(0)
    if P > 0:
        score = prefill_scores(group, values)
        kept = kernels.top_ranked(score, 0, P, budget)
        state.score[:kept.shape[0]] = score[kept]
    return run_stepped(group, budget, kept, state, decode)


POLICY = Policy("caote", "evict the key whose removal least changes the previous output",
                {}, _run, needs=("values",))
