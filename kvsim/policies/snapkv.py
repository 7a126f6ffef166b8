"""``snapkv``: one-shot prompt selection voted by an observation window (Li et al. 2024).

With ``refresh = N`` the pinned set is re-chosen every N decode steps over the cache, from
the observed attention of the last decode queries (kvpress's decode-time compression, with
a hard budget).
"""

from typing import NamedTuple

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.jit import jit, jit_inline
from kvsim.numerics.steploop import step_loop
from kvsim.policies.base import Group, Param, Policy, Trace, run_decode
from kvsim.policies.stepped import run_stepped

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


class RefreshState(NamedTuple):
    prompt_len: int
    window: int
    kernel: int
    mode: int
    refresh: int
    gqa: int
    pinned: np.ndarray    # (budget,) bool: the slot's key is pinned
    seen: np.ndarray      # (window, G, budget): observed attention of query q (row q % window)
    rows: np.ndarray      # (G, budget) scratch
    votes: np.ndarray     # (budget,) scratch


@jit
def repin(state, cache, n, t):
    """Re-choose the pinned set before step ``t``: votes of the last decode queries, pooled
    along the cached keys in position order, top ``budget - window`` pinned."""
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
def refresh_admit(state, cache, n, t):
    step = t - state.prompt_len
    if step > 0 and step % state.refresh == 0:
        repin(state, cache, n, t)
    slot = -1
    if n == cache.shape[0]:  # the oldest key of the ring (the unpinned keys) leaves
        for j in range(n):
            if not state.pinned[j] and (slot < 0 or cache[j] < cache[slot]):
                slot = j
    new = n if slot < 0 else slot
    state.pinned[new] = False
    for r in range(state.seen.shape[0]):  # token t was in no earlier query's cache
        for g in range(state.seen.shape[1]):
            state.seen[r, g, new] = 0.0
    return slot


@jit_inline
def refresh_observe(state, cache, n, t, obs, mass):
    row = state.seen[t % state.window]
    for g in range(obs.shape[0]):
        m = mass[g]
        for j in range(n):
            row[g, j] = obs[g, j] / m if m > 0.0 else 0.0


@jit
def refresh_decode(ctx, out, cache, n, state):
    return step_loop(ctx, out, cache, n, state, refresh_admit, refresh_observe)


def _run(group: Group, budget: int, params: dict) -> Trace:
    P = group.prompt_len
    w = min(params["window"], P)
    votes = group.row_scores(P - w, P)
    mode = POOLING.index(params["pooling"])
    if not params["protect_window"]:
        kept = kernels.top_ranked(pool(votes[:P], params["kernel"], mode), 0, P, budget)
        return run_decode(group, budget, kept)
    prefix = P - w
    n_pinned = min(prefix, budget - w)
    pinned = kernels.top_ranked(pool(votes[:prefix], params["kernel"], mode), 0, prefix, n_pinned)
    kept = np.concatenate((pinned, np.arange(prefix, P)))
    if params["refresh"] > 0:
        window = params["window"]
        state = RefreshState(P, window, params["kernel"], mode, params["refresh"], group.gqa,
                             np.zeros(budget, bool), np.zeros((window, len(group.heads), budget)),
                             np.zeros((len(group.heads), budget)), np.zeros(budget))
        state.pinned[:n_pinned] = True
        return run_stepped(group, budget, kept, state, refresh_decode)
    return run_decode(group, budget, kept, evict_rule=kernels.EVICT_RING,
                      ring=(n_pinned, prefix, budget - n_pinned))


def _check(T: int, prompt_len: int, params: dict) -> str | None:
    if not params["protect_window"] and prompt_len < T:
        return (f"protect_window: expected true when there are decode steps "
                f"(prompt_len {prompt_len} < T {T}), got false")
    return None


POLICY = Policy("snapkv", "pinned prompt selection voted by the last prompt queries + ring",
                PARAMS, _run, check=_check,
                min_budget=lambda params: params["window"] + 1 if params["protect_window"] else 1)
