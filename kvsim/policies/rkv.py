"""``rkv``: R-KV (Cai et al. 2025), redundancy-aware selection for long decodes.

The rule of the authors' ``r1_kv.py`` (R-KV commit ``d15c976``). The ``window`` newest
cached keys always stay. Every other candidate gets ``lam * a - (1 - lam) * r``:

- ``a``: the attention of the window's queries (the ``window`` newest positions). Per
  query, the logit of each non-window key is the **max** over the group's query heads of
  ``scale * q . k``, softmaxed over the non-window keys; ``a`` is the mean over the
  queries, max-pooled over ``kernel`` neighbouring keys (clipped at the ends);
- ``r``: redundancy. Keys are unit-normalised (``k / (||k|| + 1e-8)``), their cosine
  matrix has a zero diagonal, and in each row the last key (in position order) with a
  cosine above 0.5 is set to 0 (the first key when there is none, as the code's index
  trick does); ``r`` is the softmax over all candidates of the column means.

Prefill keeps the window and the top ``B - window`` older prompt keys when the prompt
exceeds the budget. At decode, token ``t`` joins and, when the cache was full, the
lowest-scored non-window candidate of the cache plus ``t`` leaves, scored with the
queries of the window (``t - window + 1 .. t``) before query ``t`` attends. Cached keys
are taken in position order (for the pooling and the first-key fallback). Under
``interval`` (or ``target_ratio``) a compression ranks the cache plus ``t`` once with
those scores (:func:`interval_scores`), as the code compresses its buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.decode import decode_kernel, observe_nothing
from kvsim.numerics.elementary import exp_nonpositive
from kvsim.numerics.jit import jit, jit_inline
from kvsim.params import Param
from kvsim.policies.base import Group, Policy, Presentation, Steps
from kvsim.policies.layout import StateLayout
from kvsim.policies.snapkv import pool

PARAMS = {
    "window": Param(int, 8, "newest keys always kept; their queries vote",
                    check=lambda v: v >= 1, expect="an integer >= 1"),
    "kernel": Param(int, 7, "max-pooling width of the attention votes",
                    check=lambda v: v >= 1 and v % 2 == 1, expect="an odd integer >= 1"),
    "mix_lambda": Param(float, 0.07, "weight of attention against redundancy (code: 0.07)",
                        check=lambda v: 0.0 <= v <= 1.0, expect="a number in [0, 1]"),
}

THRESHOLD = 0.5  # cosine above which a key counts as a duplicate of another
NORM_EPS = 1e-8  # added to a key's norm before unit-normalising


class State(NamedTuple):
    """Per-slot arrays have the slot on their last axis (slot ``B``: the incoming key), so
    that a wider cache pads them (:func:`kvsim.protocols.question.widen`)."""

    keys: np.ndarray      # (d, T) the KV head's keys, by dimension
    queries: np.ndarray   # (G, T, d) the group's query vectors
    scale: np.ndarray     # (G,) float64: logit = scale * q . k
    window: int
    kernel: int
    lam: float
    unit: np.ndarray      # (d, B + 1): the unit key of each slot
    cos: np.ndarray       # (B + 1, B + 1): the cosine of the unit keys of two cached slots
    logits: np.ndarray    # (B + 1, B + 1): the group max logit of a slot's query on a
                          # slot's key, for keys older than the query
    voted: np.ndarray     # (B + 1,) int64: 1 where the slot's query row of logits is set
    idx: np.ndarray       # (B + 1,) int64 scratch: the candidates' slots in position order
    pos: np.ndarray       # (B + 1,) int64 scratch: their positions
    score: np.ndarray     # (B + 1,) scratch
    work: np.ndarray      # (3, B + 1) scratch


@jit
def unit_key(keys, k, unit, slot):
    """``unit[:, slot] = k / (||k|| + 1e-8)``, the squares summed in order of dimension."""
    d = keys.shape[0]
    total = 0.0
    for i in range(d):
        x = np.float64(keys[i, k])
        total += x * x
    den = np.sqrt(total) + NORM_EPS
    for i in range(d):
        unit[i, slot] = np.float64(keys[i, k]) / den


@jit
def cosine(units, a, b):
    """The cosine of unit keys ``units[:, a]`` and ``units[:, b]``, summed in order of
    dimension (the same number either way round)."""
    total = 0.0
    for dim in range(units.shape[0]):
        total += units[dim, a] * units[dim, b]
    return total


@jit
def mask_and_add(row, i, n, colsum):
    """Row ``i`` of the cosine matrix (``row[:n]``): zero its diagonal and its last cosine
    above the threshold (the first key when there is none, the code's index trick), then
    add it to the column sums."""
    row[i] = 0.0
    last = 0
    for j in range(n):
        if row[j] > THRESHOLD:
            last = j
    row[last] = 0.0
    for j in range(n):
        colsum[j] += row[j]


@jit
def vote(logit, m, out):
    """``out[:m] +=`` the softmax of ``logit[:m]`` (``logit`` then holds its exponentials)."""
    top = -np.inf
    for j in range(m):
        top = max(top, logit[j])
    total = 0.0
    for j in range(m):
        logit[j] = exp_nonpositive(logit[j] - top)
        total += logit[j]
    for j in range(m):
        out[j] += logit[j] / total


@jit
def softmax_of_means(colsum, n, out):
    """``out[:n]``: the softmax of the column means ``colsum[:n] / n``."""
    for j in range(n):
        colsum[j] = colsum[j] / n
        out[j] = 0.0
    vote(colsum, n, out)


@jit
def redundancy(units, n, out, colsum, row):
    """``out[:n]``: the softmax of the masked column means of the cosine matrix of the unit
    keys ``units[:, :n]`` (in position order), one row at a time."""
    for j in range(n):
        colsum[j] = 0.0
    for i in range(n):
        for j in range(n):
            row[j] = 0.0
        for dim in range(units.shape[0]):  # each cosine summed in order of dimension
            x = units[dim, i]
            for j in range(n):
                row[j] += x * units[dim, j]
        mask_and_add(row, i, n, colsum)
    softmax_of_means(colsum, n, out)


@jit
def cached_redundancy(cos, idx, n, out, colsum, row):
    """:func:`redundancy` of the slots ``idx[:n]`` (in position order) from their cosines
    ``cos``, kept between steps: the same numbers without the ``n^2 d`` products."""
    for j in range(n):
        colsum[j] = 0.0
    for i in range(n):
        a = idx[i]
        for j in range(n):
            row[j] = cos[a, idx[j]]
        mask_and_add(row, i, n, colsum)
    softmax_of_means(colsum, n, out)


@jit
def join(units, cos, slot, n):
    """The cosines of slot ``slot``'s unit key with those of slots ``0 .. n-1``."""
    for j in range(n):
        c = cosine(units, slot, j)
        cos[slot, j] = c
        cos[j, slot] = c


@jit
def group_logit(keys, queries, scale, q, k):
    """The max over the group's query heads at position ``q`` of ``scale * q . k`` for the
    key at position ``k``, each dot summed in order of dimension."""
    d = keys.shape[0]
    best = -np.inf
    for g in range(queries.shape[0]):
        dot = 0.0
        for i in range(d):
            dot += np.float64(queries[g, q, i]) * np.float64(keys[i, k])
        best = max(best, scale[g] * dot)
    return best


@jit
def attention_votes(keys, queries, scale, pos, n, window, out, logit):
    """``out[:n - window]``: the mean over the queries at ``pos[n - window:n]`` of the
    softmax, over the keys at ``pos[:n - window]``, of the group's max logit."""
    m = n - window
    for j in range(m):
        out[j] = 0.0
    for w in range(n - window, n):
        for j in range(m):
            logit[j] = group_logit(keys, queries, scale, pos[w], pos[j])
        vote(logit, m, out)
    for j in range(m):
        out[j] = out[j] / window


@jit
def cached_votes(state, cache, n, t, out, logit):
    """:func:`attention_votes` of the cache plus ``t`` (slot ``B``), in position order in
    ``state.idx`` and ``state.pos`` (``n + 1`` of them), from logits kept between steps: a
    window query's row is computed once, the first time it votes, over the keys cached then
    (every key older than it: the candidates it will ever vote on)."""
    m = n + 1 - state.window
    for j in range(m):
        out[j] = 0.0
    for w in range(m, n + 1):
        row = state.idx[w]
        if state.voted[row] == 0:
            for j in range(n):
                state.logits[row, j] = group_logit(state.keys, state.queries, state.scale,
                                                   state.pos[w], cache[j])
            state.voted[row] = 1
        for j in range(m):
            logit[j] = state.logits[row, state.idx[j]]
        vote(logit, m, out)
    for j in range(m):
        out[j] = out[j] / state.window


@jit
def scores(keys, queries, scale, pos, units, n, window, kernel, lam, out, work):
    """``out[:n - window]``: ``lam * a - (1 - lam) * r`` of the non-window candidates
    (positions ``pos[:n]`` ascending, unit keys ``units[:, :n]``)."""
    redundancy(units, n, work[0], work[1], work[2])
    attention_votes(keys, queries, scale, pos, n, window, out, work[1])
    mix(out, n - window, kernel, lam, work[0])


@jit
def mix(votes, m, kernel, lam, redundancy):
    """``votes[:m] = lam * a - (1 - lam) * r``: ``a`` the votes max-pooled."""
    pooled = pool(votes[:m], kernel, 0)
    for j in range(m):
        votes[j] = pooled[j] * lam - redundancy[j] * (1.0 - lam)


@jit_inline
def admit(state, cache, n, t):
    """Token ``t`` joins; when the cache was full, the lowest-scored non-window candidate
    of the cache plus ``t`` leaves (``t`` takes its slot)."""
    budget = cache.shape[0]
    if n < budget:
        unit_key(state.keys, t, state.unit, n)
        join(state.unit, state.cos, n, n)
        state.voted[n] = 0
        return n
    unit_key(state.keys, t, state.unit, budget)
    join(state.unit, state.cos, budget, n)
    state.voted[budget] = 0
    order = np.argsort(cache[:n])  # t is the newest: it comes last
    for i in range(n + 1):
        slot = order[i] if i < n else budget
        state.idx[i] = slot
        state.pos[i] = cache[slot] if i < n else t
    m = n + 1 - state.window
    cached_redundancy(state.cos, state.idx, n + 1, state.work[0], state.work[1],
                      state.work[2])
    cached_votes(state, cache, n, t, state.score, state.work[1])
    mix(state.score, m, state.kernel, state.lam, state.work[0])
    worst = 0  # lowest score, then highest position: the last such in position order
    for j in range(1, m):
        if state.score[j] <= state.score[worst]:
            worst = j
    slot = state.idx[worst]  # never t's: t is in the window
    for dim in range(state.unit.shape[0]):
        state.unit[dim, slot] = state.unit[dim, budget]
    for j in range(budget):
        state.cos[slot, j] = state.cos[budget, j]
        state.cos[j, slot] = state.cos[j, budget]
        state.logits[slot, j] = state.logits[budget, j]  # t's row (keys older than t)
    state.voted[slot] = state.voted[budget]
    return slot


decode = decode_kernel("decode", admit, observe_nothing)


def candidate_scores(keys: np.ndarray, queries: np.ndarray, scale: np.ndarray,
                     pos: np.ndarray, params: dict) -> np.ndarray:
    """The scores of the non-window candidates among positions ``pos`` (ascending): the
    first ``len(pos) - window``."""
    n, window = pos.shape[0], params["window"]
    units = np.zeros((keys.shape[0], n))
    for i in range(n):
        unit_key(keys, pos[i], units, i)
    out, work = np.zeros(n), np.zeros((3, n))
    scores(keys, queries, scale, pos, units, n, window, params["kernel"],
           params["mix_lambda"], out, work)
    return out[:n - window]


def prompt_scores(keys: np.ndarray, queries: np.ndarray, scale: np.ndarray, P: int,
                  params: dict) -> np.ndarray:
    """The scores of prompt keys ``0 .. P - window - 1`` at the end of prefill."""
    return candidate_scores(keys, queries, scale, np.arange(P), params)


def interval_scores(group: Group, cache: np.ndarray, t: int, since: int,
                    params: dict) -> np.ndarray:
    """One ranking per batched compression, as R-KV's code compresses its whole buffer at
    once: the cached keys and the incoming ``t`` scored together, with the queries of the
    newest ``window`` of them (``t`` among them), as the per-step rule scores them at
    ``t``; the window's cached keys score ``+inf`` (always kept). ``since`` is unused
    (the window's queries are the newest, whenever the last compression was)."""
    order = np.argsort(cache)
    pos = np.append(cache[order], t)
    old = candidate_scores(group.keys, group.queries, group.qk_scale, pos, params)
    value = np.full(cache.shape[0], np.inf)
    value[order[:old.shape[0]]] = old
    return value


def _start(prompt: Group, budget: int, params: dict, T: int):
    P, window = prompt.prompt_len, params["window"]
    keys, queries, scale = prompt.keys, prompt.queries, prompt.qk_scale
    if P > budget:
        ranking = prompt.shared(("rkv", window, params["kernel"], params["mix_lambda"]),
                                lambda: prompt_scores(keys, queries, scale, P, params))
        selected = kernels.top_ranked(ranking, 0, P - window, budget - window)
        kept = np.concatenate((selected, np.arange(P - window, P)))
    else:
        kept = np.arange(P)
    d = keys.shape[0]
    state = State(keys, queries, scale, window, params["kernel"], params["mix_lambda"],
                  np.zeros((d, budget + 1)), np.zeros((budget + 1, budget + 1)),
                  np.zeros((budget + 1, budget + 1)), np.zeros(budget + 1, np.int64),
                  np.zeros(budget + 1, np.int64), np.zeros(budget + 1, np.int64),
                  np.zeros(budget + 1), np.zeros((3, budget + 1)))
    for s, k in enumerate(kept):
        unit_key(keys, k, state.unit, s)
        join(state.unit, state.cos, s, s)
    return kept, state


POLICY = Policy("rkv", "R-KV: newest window + attention minus redundancy (key cosines)",
                PARAMS, Steps(_start, admit, observe_nothing, decode),
                min_budget=lambda params: params["window"] + 1,
                floor_reason="its window + 1",
                fixed=lambda budget, prompt_len, params: min(params["window"], prompt_len),
                needs=frozenset({"keys", "queries"}), rescore=interval_scores,
                presentation=Presentation(
                    family="window vote", color="#1a4d1a", marker="D",
                    reads="queries, keys",
                    rule=("R-KV (Cai et al. 2025): the `window` newest + the best `lam * a - (1 - lam) * "
                          "r`, `a` the window queries' attention (group max logit, max-pooled), `r` the "
                          "key's redundancy (softmax of masked cosine column means); recomputed at every "
                          "eviction")),
                layout=StateLayout(frozenset({"unit", "cos", "logits", "voted", "idx", "pos",
                                              "score", "work"}),
                                   pairs=frozenset({"cos", "logits"})))
