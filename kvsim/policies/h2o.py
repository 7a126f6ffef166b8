"""``h2o`` (online, accumulated scores) and ``h2o_offline`` (clairvoyant global scores).

Zhang et al. 2023, Heavy-Hitter Oracle: keep the ``recent`` newest tokens and the
heavy hitters, the keys with the largest accumulated attention.
"""

from typing import NamedTuple

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.decode import decode_kernel
from kvsim.numerics.jit import jit, jit_inline
from kvsim.policies.base import (Group, Param, Plain, Policy, Presentation, Steps, Trace, current,
                                 run_decode)
from kvsim.policies.layout import StateLayout
from kvsim.policies.scored import prefill, recent_count, recent_ratio, score_policy, selectable

RECENT_RATIO = recent_ratio(0.5)

ONLINE_PARAMS = {
    "recent_ratio": RECENT_RATIO,
    "normalize": Param(bool, False, "rank by score / number of queries that saw the key"),
    "accumulate": Param(str, "observed", "add the observed (renormalised) or the full attention",
                        choices=("observed", "full")),
}


class State(NamedTuple):
    """Per slot: the score and how many queries saw the key; per position: its slot."""

    score: np.ndarray     # (B,) float64
    seen: np.ndarray      # (B,) float64
    slot_of: np.ndarray   # (T,) int64
    ranking: np.ndarray   # (B,) float64 scratch: score / seen
    combined: np.ndarray  # (B,) float64 scratch: the step's combined attention
    recent: int           # the newest tokens (the incoming one included) never evicted
    normalize: bool       # rank by score / seen
    full: bool            # accumulate the full attention p, not the observed p~
    gqa: int


@jit_inline
def admit(state, cache, n, t):
    """Evict the lowest-ranked key outside the ``recent`` newest when full."""
    slot = n
    if n == cache.shape[0]:
        value = state.score
        if state.normalize:
            for j in range(n):
                state.ranking[j] = state.score[j] / state.seen[j]
            value = state.ranking
        slot = kernels.lowest_ranked_slot(cache, n, value, t - state.recent + 1, state.slot_of)
    state.slot_of[t] = slot
    state.score[slot] = 0.0
    state.seen[slot] = 0.0
    return slot


@jit
def accumulate(state, obs, mass, n):
    """Add the group's combined attention (observed, or full) to every cached key's score."""
    if state.full:
        kernels.combine_rows(obs, n, state.gqa, state.combined)
    else:
        kernels.combine_observed(obs, mass, n, state.gqa, state.combined)
    for j in range(n):
        state.score[j] += state.combined[j]


@jit_inline
def observe(state, cache, n, obs, mass, outputs):
    """Add the step's attention (observed, or full) to every cached key's score; count the
    queries that saw each key when ranking by their mean.

    One head's observed attention is added in one loop, the numbers ``combine_observed``
    gives; other cases are one call, not inlined (their loops in the decode loop, even
    untaken, slow every step)."""
    if obs.shape[0] == 1 and not state.full:
        m = mass[0]
        for j in range(n):
            state.score[j] += obs[0, j] / m if m > 0.0 else 0.0
    else:
        accumulate(state, obs, mass, n)
    if state.normalize:
        for j in range(n):
            state.seen[j] += 1.0


@jit_inline
def observe_head(state, cache, n, obs, mass, outputs):
    """:func:`observe` of one query head adding its observed attention to unnormalised
    scores: the same numbers, without the branches of the other cases (which slow every
    step of the loop)."""
    m = mass[0]
    for j in range(n):
        state.score[j] += obs[0, j] / m if m > 0.0 else 0.0


decode = decode_kernel("decode", admit, observe)


decode_observed = decode_kernel("decode_observed", admit, observe_head, plain=True)


PLAIN = Plain(decode_observed, lambda state: not (state.full or state.normalize))


def _rank(state: State, cache: np.ndarray, n: int, t: int, seed: int):
    """The accumulated score (over the queries that saw the key with ``normalize``)."""
    value = state.score[:n] / state.seen[:n] if state.normalize else state.score
    return current(value, cache, n, t, state.recent)


def _state(budget: int, T: int, kept: np.ndarray, score: np.ndarray, seen: np.ndarray,
           recent: int, params: dict, gqa: int) -> State:
    state = State(np.zeros(budget), np.zeros(budget), np.zeros(T, np.int64),
                  np.zeros(budget), np.zeros(budget), recent, bool(params.get("normalize")),
                  params.get("accumulate") == "full", gqa)
    n = len(kept)
    state.score[:n], state.seen[:n], state.slot_of[kept] = score, seen, np.arange(n)
    return state


def _online_ranking(group: Group, params: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt scores, queries that saw each key, the ranking score) of the prompt keys."""
    P = group.prompt_len
    score = group.prompt_scores()[:P]
    seen = (P - np.arange(P)).astype(np.float64)
    return score, seen, score / seen if params["normalize"] else score


def _start_online(prompt: Group, budget: int, params: dict, T: int, recent: int | None = None):
    """Prefill and state; ``recent`` overrides the recent count (budget allocation keeps
    that of the mean budget whatever the head's cap)."""
    recent = recent_count(budget, params) if recent is None else recent
    score, seen, ranking = _online_ranking(prompt, params)
    kept = prefill(prompt.prompt_len, budget, recent, ranking)
    return kept, _state(budget, T, kept, score[kept], seen[kept], recent, params,
                        prompt.gqa)


# Budget allocation: the recent tokens are the fixed part, the older prompt keys selectable.
def _fixed(budget: int, prompt_len: int, params: dict) -> int:
    return recent_count(budget, params)


def _online_prefill_score(group: Group, budget: int, params: dict) -> np.ndarray:
    return _online_ranking(group, params)[2][:selectable(group, budget, params)]


def _run_capped(group: Group, cap: int, budget: int, params: dict) -> Trace:
    """A run with ``cap`` slots and the recent count of the mean budget ``budget``."""
    kept, state = _start_online(group, cap, params, group.T, recent_count(budget, params))
    return run_decode(group, cap, kept, decode, state)


ONLINE = Policy("h2o", "recent newest + heavy hitters by accumulated observed attention",
                ONLINE_PARAMS, Steps(_start_online, admit, observe, decode, rank=_rank,
                      plain=PLAIN),
                closed_loop=lambda params: (
                    'accumulate = "full" adds the full attention p(t, k), which a closed loop '
                    'does not have' if params["accumulate"] == "full" else None),
                fixed=_fixed, prefill_score=_online_prefill_score, run_capped=_run_capped,
                presentation=Presentation(
                    family="heavy hitters", color="#d62728", marker="^",
                    reads="attention",
                    rule=("online Heavy-Hitter Oracle (Zhang et al. 2023): the `floor(recent_ratio * B)` "
                          "newest + the highest accumulated attention")),
                layout=StateLayout(frozenset({"score", "seen", "ranking", "combined"}),
                                   slot_of=True, recent=recent_count))
OFFLINE = score_policy("h2o_offline", "recent newest + heavy hitters by global column sums "
                       "(clairvoyant)", lambda group, lo, hi, params: group.global_scores()[lo:hi],
                       recent=RECENT_RATIO.default,
                       closed_loop=lambda params: "it is clairvoyant: it ranks keys by the "
                       "attention of future queries",
                       presentation=Presentation(
                           family="heavy hitters", color="#ff7f0e", marker="v",
                           reads="attention (future rows too)",
                           rule=("H2O scored by the column sums of the whole attention matrix, future "
                                 "queries included (clairvoyant; the H2O of the seed notebook)")))
POLICIES = (ONLINE, OFFLINE)
