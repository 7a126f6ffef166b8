"""``dropkv``: DropKV (kvpress PR 285, revision 1): keep the keys whose removal would
change the window's outputs most.

Dropping key ``j`` from query ``i``'s attention moves its output by
``p_ij / (1 - p_ij) * (o_i - v_j)``. The score of a prompt key is that change, squared and
summed over the observation window (the last ``w = min(window, P)`` prompt queries, their
full causal rows and outputs): ``s_j = sum_i (p_ij / (1 - p_ij + 1e-6))^2 ||v_j - o_i||^2``,
per query head, combined by ``gqa`` and average-pooled over every prompt position
(``kernel`` wide, zero padding, divided by the kernel). The top ``B - w`` keys older than
the window are pinned; the window and the decode tokens share the other slots as a ring,
as in ``snapkv``.
"""

from __future__ import annotations

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.jit import jit
from kvsim.params import Param
from kvsim.policies import snapkv
from kvsim.policies.base import Group, Policy, Presentation, Steps
from kvsim.policies.rows import head_rows

PARAMS = {
    "window": Param(int, 32, "observation window: the last prompt queries, always kept",
                    check=lambda v: v >= 1, expect="an integer >= 1"),
    "kernel": Param(int, 7, "average-pooling width over key positions",
                    check=lambda v: v >= 1 and v % 2 == 1, expect="an odd integer >= 1"),
}

EPSILON = 1e-6  # in the sensitivity weight p / (1 - p + epsilon), as the code has it


@jit
def add_drop_scores(row, q, values, out):
    """``out[j] += (p_j / (1 - p_j + eps))^2 ||v_j - o||^2`` for keys ``j <= q`` of query
    ``q`` (``row``: its full attention; ``o = sum_j p_j v_j`` in position order)."""
    dv = values.shape[1]
    o = np.zeros(dv)
    for j in range(q + 1):
        for i in range(dv):
            o[i] += row[j] * np.float64(values[j, i])
    for j in range(q + 1):
        weight = row[j] / (1.0 - row[j] + EPSILON)
        dist = 0.0
        for i in range(dv):
            diff = np.float64(values[j, i]) - o[i]
            dist += diff * diff
        out[j] += weight * weight * dist


def drop_scores(group: Group, params: dict) -> np.ndarray:
    """The pooled scores of every prompt position (keys past a query add nothing to it)."""
    P = group.prompt_len
    w = min(params["window"], P)
    per_head = [np.zeros(P) for _ in group.heads]
    for q in range(P - w, P):
        for out, row in zip(per_head, head_rows(group, q)):
            add_drop_scores(row, q, group.values, out)
    return snapkv.pool(group.combine(per_head), params["kernel"], 1)


def _start(prompt: Group, budget: int, params: dict, T: int):
    P = prompt.prompt_len
    w = min(params["window"], P)
    prefix = P - w
    n_pinned = min(prefix, budget - w)
    pinned = np.arange(prefix) if n_pinned == prefix else kernels.top_ranked(
        drop_scores(prompt, params), 0, prefix, n_pinned)
    return np.concatenate((pinned, np.arange(prefix, P))), ring_state(
        prompt, budget, n_pinned, prefix)


def ring_state(prompt: Group, budget: int, n_pinned: int, prefix: int) -> snapkv.State:
    """``snapkv``'s decode state without refresh: ``n_pinned`` pinned slots, and a ring over
    the other slots whose first slot holds position ``prefix``."""
    G = len(prompt.heads)
    return snapkv.State(n_pinned, prefix, budget - n_pinned, 0, prompt.prompt_len, 1, 1, 2,
                        prompt.gqa, np.zeros(budget, bool), np.zeros((0, G, 0)),
                        np.zeros((G, budget)), np.zeros(budget), np.zeros(1, np.int64))


def _prefill_score(group: Group, budget: int, params: dict) -> np.ndarray:
    return drop_scores(group, params)[:group.prompt_len - min(params["window"],
                                                              group.prompt_len)]


POLICY = Policy("dropkv", "DropKV: pin the keys whose removal most changes the window's "
                          "outputs + ring", PARAMS,
                Steps(_start, snapkv.admit, snapkv.observe, snapkv.decode),
                min_budget=lambda params: params["window"] + 1, floor_reason="its window + 1",
                fixed=lambda budget, prompt_len, params: min(params["window"], prompt_len),
                prefill_score=_prefill_score, needs=frozenset({"values"}),
                presentation=Presentation(
                    family="window vote", color="#ff0080", marker="^",
                    reads="attention, values",
                    rule=("DropKV (kvpress PR 285): pins the prompt keys whose removal most changes the "
                          "window's outputs, `sum_i (p/(1-p+1e-6))^2 ‖v - o_i‖^2`, avg-pooled; ring for the"
                          " window and decode tokens")),
                layout=snapkv.RING_LAYOUT)
