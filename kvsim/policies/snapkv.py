"""``snapkv``: one-shot prompt selection voted by an observation window (Li et al. 2024).

The selection stays pinned and a ring holds the newest tokens. With ``refresh = N > 0`` the
pinned set is re-chosen every N decode steps over the cache, from the observed attention of
the last decode queries (kvpress's decode-time compression, with a hard budget).
"""

from typing import NamedTuple

import numpy as np

from kvsim.errors import Problem
from kvsim.numerics import kernels
from kvsim.numerics.decode import decode_kernel
from kvsim.numerics.jit import jit, jit_inline
from kvsim.policies.base import Group, Param, Policy, Presentation, Steps
from kvsim.policies.layout import StateLayout

POOLING = ("max", "avg", "none")

PARAMS = {
    "window": Param(int, 32, "observation window: the last prompt queries that vote",
                    check=lambda v: v >= 1, expect="an integer >= 1"),
    "kernel": Param(int, 7, "pooling width over key positions",
                    check=lambda v: v >= 1 and v % 2 == 1, expect="an odd integer >= 1"),
    "pooling": Param(str, "max", "1-D pooling of the votes", choices=POOLING),
    "protect_window": Param(bool, True, "always keep the observation window itself"),
    "refresh": Param(int, 0, "re-choose the pinned set every N decode steps (0: never)",
                     check=lambda v: v >= 0, expect="an integer >= 0"),
}


@jit
def pool(votes, kernel, mode):
    """Stride-1 pooling of ``votes`` over a ``kernel``-wide neighbourhood (0 max, 1 avg, 2 none)."""
    L = votes.shape[0]
    half = kernel // 2
    out = np.empty(L)
    for k in range(L):
        lo = max(0, k - half)
        hi = min(L, k + half + 1)
        if mode == 0:
            best = votes[lo]
            for j in range(lo + 1, hi):
                if votes[j] > best:
                    best = votes[j]
            out[k] = best
        elif mode == 1:
            total = 0.0
            for j in range(lo, hi):
                total += votes[j]
            out[k] = total / kernel  # zero padding: the kernel width divides
        else:
            out[k] = votes[k]
    return out


class State(NamedTuple):
    """Without refresh, a ring: slots ``base .. base + width - 1``, slot ``base`` took
    ``start``. With refresh, the pinned slots and the observed attention of recent queries."""

    base: int
    start: int
    width: int
    refresh: int          # re-choose the pinned set every ``refresh`` decode steps (0: never)
    prompt_len: int
    window: int
    kernel: int
    mode: int             # pooling: 0 max, 1 avg, 2 none
    gqa: int
    pinned: np.ndarray    # (B,) bool: the slot's key is pinned
    seen: np.ndarray      # (window, G, B): row q % window: query q's observed attention
    rows: np.ndarray      # (G, B) scratch
    votes: np.ndarray     # (B,) scratch
    now: np.ndarray       # (1,) int64: the current step's token


RING_SLOTS = frozenset({"pinned", "rows", "votes"})
"""The per-slot fields of :class:`State` without refresh (``seen`` too with it)."""
RING_LAYOUT = StateLayout(RING_SLOTS, ring=True)
"""The layout of a :class:`State` without refresh (``dropkv``, ``chunkkv``)."""


@jit
def repin(state, cache, n, t):
    """Re-choose the pinned set before step ``t``: the observed attention of the last
    ``min(window, t - prompt_len)`` decode queries summed per head (0 where a key was not
    cached), combined, pooled along the cached keys in position order; the top
    ``B - window`` are pinned, the other keys form the ring."""
    order = np.argsort(cache[:n])
    queries = min(state.window, t - state.prompt_len)
    for g in range(state.rows.shape[0]):
        for i in range(n):
            total = 0.0
            for q in range(t - queries, t):
                total += state.seen[q % state.window, g, order[i]]
            state.rows[g, i] = total
    kernels.combine_rows(state.rows, n, state.gqa, state.votes)
    pooled = pool(state.votes[:n], state.kernel, state.mode)
    chosen = kernels.top_ranked(pooled, 0, n, min(n, cache.shape[0] - state.window))
    for j in range(n):
        state.pinned[j] = False
    for i in chosen:
        state.pinned[order[i]] = True


@jit_inline
def admit(state, cache, n, t):
    """Append while there is room, then replace the oldest key of the ring (the unpinned
    keys); with refresh, first re-choose the pinned set every ``refresh`` decode steps."""
    if state.refresh == 0:
        return n if n < cache.shape[0] else kernels.ring_slot(state.base, state.start,
                                                              state.width, t)
    step = t - state.prompt_len
    if step > 0 and step % state.refresh == 0:
        repin(state, cache, n, t)
    slot = n
    if n == cache.shape[0]:
        slot = -1
        for j in range(n):
            if not state.pinned[j] and (slot < 0 or cache[j] < cache[slot]):
                slot = j
    state.pinned[slot] = False
    for r in range(state.seen.shape[0]):  # token t was in no earlier query's cache
        for g in range(state.seen.shape[1]):
            state.seen[r, g, slot] = 0.0
    state.now[0] = t
    return slot


@jit_inline
def observe(state, cache, n, obs, mass, outputs):
    """With refresh, remember this query's observed attention of each head."""
    if state.refresh == 0:
        return None
    row = state.seen[state.now[0] % state.window]
    for g in range(obs.shape[0]):
        m = mass[g]
        for j in range(n):
            row[g, j] = obs[g, j] / m if m > 0.0 else 0.0
    return None


decode = decode_kernel("decode", admit, observe)


def _state(params: dict, P: int, budget: int, G: int, gqa: int, n_pinned: int,
           ring: tuple[int, int, int]) -> State:
    refresh = params["refresh"]
    window = params["window"] if refresh else 0
    state = State(*ring, refresh, P, params["window"], params["kernel"],
                  POOLING.index(params["pooling"]), gqa, np.zeros(budget, bool),
                  np.zeros((window, G, budget if refresh else 0)), np.zeros((G, budget)),
                  np.zeros(budget), np.zeros(1, np.int64))
    state.pinned[:n_pinned] = True
    return state


def _pooled_votes(group: Group, params: dict) -> np.ndarray:
    """Pooled votes of the candidates: the prefix keys, or every prompt key."""
    P = group.prompt_len
    w = min(params["window"], P)
    votes = group.row_scores(P - w, P)
    n = P - w if params["protect_window"] else P
    return pool(votes[:n], params["kernel"], POOLING.index(params["pooling"]))


def _start(prompt: Group, budget: int, params: dict, T: int):
    P = prompt.prompt_len
    w = min(params["window"], P)
    pooled = _pooled_votes(prompt, params)
    if not params["protect_window"]:  # only without decode steps (see _check)
        kept = kernels.top_ranked(pooled, 0, P, budget)
        return kept, _state(params, P, budget, len(prompt.heads), prompt.gqa, 0, (0, 0, budget))
    prefix = P - w
    n_pinned = min(prefix, budget - w)
    pinned = kernels.top_ranked(pooled, 0, prefix, n_pinned)
    kept = np.concatenate((pinned, np.arange(prefix, P)))
    return kept, _state(params, P, budget, len(prompt.heads), prompt.gqa, n_pinned,
                        (n_pinned, prefix, budget - n_pinned))


def _check(T: int, prompt_len: int, params: dict) -> Problem | None:
    if not params["protect_window"] and prompt_len < T:
        return Problem("protect_window", f"expected true when there are decode steps "
                                         f"(prompt_len {prompt_len} < T {T}), got false")
    return None


POLICY = Policy("snapkv", "pinned prompt selection voted by the last prompt queries + ring",
                PARAMS, Steps(_start, admit, observe, decode), check=_check,
                min_budget=lambda params: params["window"] + 1 if params["protect_window"] else 1,
                fixed=lambda budget, prompt_len, params: (
                    min(params["window"], prompt_len) if params["protect_window"] else 0),
                prefill_score=lambda group, budget, params: _pooled_votes(group, params),
                presentation=Presentation(
                    family="window vote", color="#2ca02c", marker="P",
                    reads="attention",
                    rule=("SnapKV (Li et al. 2024): the last `window` prompt queries vote once at prefill; "
                          "the selection stays pinned, a ring holds the newest tokens. `refresh = N > 0`: "
                          "every N decode steps the pinned set is re-chosen over the cache from the "
                          "observed attention of the last `window` decode queries (kvpress's decode-time "
                          "compression, hard budget)")),
                layout=StateLayout(lambda params: RING_SLOTS | (
                    {"seen"} if params["refresh"] else set()), ring=True))
