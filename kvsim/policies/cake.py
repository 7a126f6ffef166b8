"""``cake``: CAKE's within-layer indicator (Qin et al. 2025, antgroup/cakekv at ``c4675ce``).

Prefill: the last ``window`` prompt queries (full causal attention) rate each prefix key
by ``mean + gamma * var`` over those queries (unbiased variance), per query head; the
ratings are average-pooled over the prefix positions (width 5, zero padding, divided by
5), combined over the group by ``gqa``, and the top ``B - window`` prefix keys are kept
with the window itself. Decode: the newest ``window`` tokens (the incoming one included)
are never evicted; when full, the key with the lowest pooled (width 5) observed attention
of the previous query, over the other cached keys in position order, goes.

The layer budgets of CAKE are the ``cake`` allocation (:mod:`kvsim.engine.allocation`).
"""

from typing import NamedTuple

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.decode import decode_kernel
from kvsim.numerics.field import probs_row
from kvsim.numerics.jit import jit, jit_inline
from kvsim.policies.base import Group, Param, Policy, Presentation, Steps
from kvsim.policies.layout import StateLayout

POOL = 5  # the authors' avg_pool1d kernel, prefill and decode

PARAMS = {
    "window": Param(int, 32, "newest tokens always kept; the prompt queries that rate keys",
                    check=lambda v: v >= 2, expect="an integer >= 2"),
    "gamma": Param(float, 200.0, "weight of the attention variance in the prefill rating",
                   low=0.0, high=1e9),
}


@jit
def avg_pool(x, m, out):
    """``out[i]`` = sum of ``x[i-2 .. i+2]`` within ``[0, m)``, divided by 5 (PyTorch's
    ``avg_pool1d(kernel_size=5, padding=2)``: zero padding counted)."""
    half = POOL // 2
    for i in range(m):
        total = 0.0
        for j in range(max(0, i - half), min(m, i + half + 1)):
            total += x[j]
        out[i] = total / POOL


@jit
def window_rating(rows, n, gamma, out):
    """``out[k] = mean + gamma * var`` over the rows (queries) of ``rows[:, k]``, ``k < n``:
    sums in query order, the variance unbiased (divided by rows - 1)."""
    w = rows.shape[0]
    for k in range(n):
        total = 0.0
        for q in range(w):
            total += rows[q, k]
        mean = total / w
        dev = 0.0
        for q in range(w):
            dev += (rows[q, k] - mean) ** 2
        out[k] = mean + gamma * (dev / (w - 1))


class State(NamedTuple):
    prev: np.ndarray    # (G, B) float64: the previous query's observed attention per slot
    pooled: np.ndarray  # (G, B) scratch: pooled rows over the candidates
    line: np.ndarray    # (B,) scratch: one head's row over the candidates
    score: np.ndarray   # (B,) scratch: combined pooled scores
    window: int
    gqa: int


@jit_inline
def admit(state, cache, n, t):
    """When full, evict the lowest combined pooled score among the cached keys outside the
    newest ``window`` (token ``t`` among them); ties: the highest position."""
    slot = n
    if n == cache.shape[0]:
        order = np.argsort(cache[:n])  # slots by position (positions are distinct)
        m = n + 1 - state.window
        for g in range(state.prev.shape[0]):
            for i in range(m):
                state.line[i] = state.prev[g, order[i]]
            avg_pool(state.line, m, state.pooled[g])
        kernels.combine_rows(state.pooled, m, state.gqa, state.score)
        best = 0
        for i in range(1, m):  # ascending positions: "<=" keeps the highest among ties
            if state.score[i] <= state.score[best]:
                best = i
        slot = order[best]
    for g in range(state.prev.shape[0]):
        state.prev[g, slot] = 0.0
    return slot


@jit_inline
def observe(state, cache, n, obs, mass, outputs):
    """Remember this query's observed attention, per query head."""
    for g in range(obs.shape[0]):
        m = mass[g]
        for j in range(n):
            state.prev[g, j] = obs[g, j] / m if m > 0.0 else 0.0


decode = decode_kernel("decode", admit, observe)


def attention_rows(group: Group, h: int, lo: int, hi: int) -> np.ndarray:
    """(hi - lo, hi) full causal attention of query head ``h``, queries ``lo .. hi-1``."""
    keys = np.arange(hi)
    rows = np.zeros((hi - lo, hi))
    work = np.empty(hi)
    for i, q in enumerate(range(lo, hi)):
        probs_row(group.field, group.row_max, group.row_sum, h, q, keys, q + 1, rows[i], work)
        rows[i, q + 1:] = 0.0
    return rows


def prefill_scores(group: Group, params: dict) -> np.ndarray:
    """Pooled ``mean + gamma * var`` ratings of the prefix keys ``0 .. P - window - 1``,
    combined over the group (needs ``P > window``)."""
    P, w = group.prompt_len, params["window"]
    n = P - w
    pooled = []
    for h in group.heads:
        rating = np.empty(P)
        window_rating(attention_rows(group, int(h), n, P), P, params["gamma"], rating)
        out = np.empty(n)
        avg_pool(rating[:n], n, out)
        pooled.append(out)
    return group.combine(pooled)


def _start(prompt: Group, budget: int, params: dict, T: int):
    P, w, G = prompt.prompt_len, params["window"], len(prompt.heads)
    if P <= budget:
        kept = np.arange(P)
    else:
        pinned = kernels.top_ranked(prefill_scores(prompt, params), 0, P - w, budget - w)
        kept = np.concatenate((pinned, np.arange(P - w, P)))
    state = State(np.zeros((G, budget)), np.zeros((G, budget)), np.zeros(budget),
                  np.zeros(budget), w, prompt.gqa)
    if P > 0:  # the last prompt query's (full) attention rates the first eviction
        for g, h in enumerate(prompt.heads):
            state.prev[g, :len(kept)] = attention_rows(prompt, int(h), P - 1, P)[0, kept]
    return kept, state


POLICY = Policy("cake", "CAKE's indicator: prefill mean + gamma var of the window's "
                "attention, pooled; decode: evict the lowest pooled previous attention",
                PARAMS, Steps(_start, admit, observe, decode),
                min_budget=lambda params: params["window"] + 1,
                fixed=lambda budget, prompt_len, params: min(params["window"], prompt_len),
                prefill_score=lambda group, budget, params: (
                    prefill_scores(group, params) if group.prompt_len > params["window"]
                    else np.zeros(0)),
                presentation=Presentation(
                    family="window vote", color="#ff9988", marker="*",
                    reads="attention",
                    rule=("CAKE's indicator (Qin et al. 2025; antgroup/cakekv `c4675ce`): prefill keeps the"
                          " window + the prefix keys of highest avg-pooled (width 5) `mean + gamma * var` "
                          "of the window's attention; decode keeps the newest `window` and evicts the "
                          "lowest avg-pooled observed attention of the previous query. Its layer budgets "
                          "are the `cake` allocation (`allocation = \"cake\"`)")),
                layout=StateLayout(frozenset({"prev", "pooled", "line", "score"})))
