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
from kvsim.numerics.decode import decode_kernel
from kvsim.numerics.jit import jit, jit_inline
from kvsim.policies.base import Group, Policy, Presentation, Steps, current
from kvsim.policies.layout import StateLayout
from kvsim.policies.rows import head_rows
from kvsim.policies.tova import admit  # the same step: evict the lowest score


class State(NamedTuple):
    values: np.ndarray   # (T, dv) the KV head's values
    score: np.ndarray    # (B,) the previous query's score of each slot's key
    slot_of: np.ndarray  # (T,) int64: the slot of each cached position
    rows: np.ndarray     # (G, B) scratch: per-head scores
    gqa: int


@jit
def head_scores(p, m, positions, n, values, output, out):
    """``out[:n]``: each key's ``(w / (1 - w)) * ||v - o||`` with ``w = p / m`` (0 if m = 0),
    ``o = output``; ``+inf`` where w = 1."""
    dv = values.shape[1]
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
def observe(state, cache, n, obs, mass, outputs):
    """Each key's score from this query's observed attention and output, per head, combined."""
    for g in range(obs.shape[0]):
        head_scores(obs[g], mass[g], cache, n, state.values, outputs[g], state.rows[g])
    kernels.combine_rows(state.rows, n, state.gqa, state.score)


decode = decode_kernel("decode", admit, observe)


def _prompt_scores(prompt: Group) -> np.ndarray:
    """(P,) each prompt key's score from the last prompt query's full attention and full
    output."""
    P, values = prompt.prompt_len, prompt.values
    if P == 0:
        return np.zeros(0)
    positions = np.arange(P)
    per_head = []
    for row in head_rows(prompt, P - 1):
        output = np.zeros(values.shape[1])
        for k in range(P):  # o = sum_k p_k v_k, in position order
            output += row[k] * values[k].astype(np.float64)
        scores = np.zeros(P)
        head_scores(row, 1.0, positions, P, values, output, scores)
        per_head.append(scores)
    return prompt.combine(per_head)


def _start(prompt: Group, budget: int, params: dict, T: int):
    state = State(prompt.values, np.zeros(budget), np.zeros(T, np.int64),
                  np.zeros((len(prompt.heads), budget)), prompt.gqa)
    score = prompt.shared(("caote",), lambda: _prompt_scores(prompt))  # any budget's
    kept = kernels.top_ranked(score, 0, prompt.prompt_len, budget)
    state.score[:len(kept)], state.slot_of[kept] = score[kept], np.arange(len(kept))
    return kept, state


def _rank(state: State, cache: np.ndarray, n: int, t: int, seed: int):
    """The previous query's output-change score of each cached key."""
    return current(state.score, cache, n, t)


POLICY = Policy("caote", "evict the key whose removal least changes the previous output", {},
                Steps(_start, admit, observe, decode, rank=_rank), needs=frozenset({"values"}),
                presentation=Presentation(
                    family="last query", color="#ff1aff", marker="o",
                    reads="attention, values",
                    rule=("CAOTE (Goel et al. 2025): evicts the key whose removal changes the previous "
                          "query's output least, `p~/(1-p~) * ‖v - o~‖`")),
                layout=StateLayout(frozenset({"score", "rows"}), slot_of=True))
