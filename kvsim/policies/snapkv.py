"""``snapkv``: one-shot prompt selection voted by an observation window (Li et al. 2024)."""

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.jit import jit
from kvsim.policies.base import Group, Param, Policy, Trace, run_decode

POOLING = ("max", "avg", "none")

PARAMS = {
    "window": Param(int, 32, "observation window: the last prompt queries that vote",
                    check=lambda v: v >= 1, expect="an integer >= 1"),
    "kernel": Param(int, 7, "pooling width over key positions",
                    check=lambda v: v >= 1 and v % 2 == 1, expect="an odd integer >= 1"),
    "pooling": Param(str, "max", "1-D pooling of the votes", choices=POOLING),
    "protect_window": Param(bool, True, "always keep the observation window itself"),
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


def _pooled_votes(group: Group, params: dict) -> np.ndarray:
    """Pooled votes of the candidates: the prefix keys, or every prompt key."""
    P = group.prompt_len
    w = min(params["window"], P)
    votes = group.row_scores(P - w, P)
    n = P - w if params["protect_window"] else P
    return pool(votes[:n], params["kernel"], POOLING.index(params["pooling"]))


def _run(group: Group, budget: int, params: dict) -> Trace:
    P = group.prompt_len
    w = min(params["window"], P)
    pooled = _pooled_votes(group, params)
    if not params["protect_window"]:
        kept = kernels.top_ranked(pooled, 0, P, budget)
        return run_decode(group, budget, kept)
    prefix = P - w
    n_pinned = min(prefix, budget - w)
    pinned = kernels.top_ranked(pooled, 0, prefix, n_pinned)
    kept = np.concatenate((pinned, np.arange(prefix, P)))
    return run_decode(group, budget, kept, evict_rule=kernels.EVICT_RING,
                      ring=(n_pinned, prefix, budget - n_pinned))


def _check(T: int, prompt_len: int, params: dict) -> str | None:
    if not params["protect_window"] and prompt_len < T:
        return (f"protect_window: expected true when there are decode steps "
                f"(prompt_len {prompt_len} < T {T}), got false")
    return None


POLICY = Policy("snapkv", "pinned prompt selection voted by the last prompt queries + ring",
                PARAMS, _run, check=_check,
                min_budget=lambda params: params["window"] + 1 if params["protect_window"] else 1,
                fixed=lambda budget, prompt_len, params: (
                    min(params["window"], prompt_len) if params["protect_window"] else 0),
                prefill_score=lambda group, budget, params: _pooled_votes(group, params))
