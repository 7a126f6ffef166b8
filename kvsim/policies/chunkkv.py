"""``chunkkv``: ChunkKV (Liu et al. 2025; kvpress ``ChunkKVPress`` at commit 8bb29b9): keep
whole chunks of the prompt, the same chunks for every KV head of a layer.

The base scores are kvpress's SnapKV's, as ``snapkv`` computes them (the last ``window``
prompt queries vote, ``pooling`` over ``kernel`` keys; kvpress's defaults: 64, 5, avg),
summed over the layer's KV heads. The prefix keys (older than the window) form chunks of
``chunk`` positions from position 0, the last one partial; a chunk's score is its summed
scores divided by its length. When the prompt exceeds the budget, the top
``floor((B - w) / chunk)`` chunks (ties: the lower index) are pinned in every KV head of
the layer, and a ring over the other slots holds the window and the decode tokens, as in
``snapkv``.
"""

from __future__ import annotations

import numpy as np

from kvsim.numerics import kernels
from kvsim.policies import snapkv
from kvsim.policies.base import Group, Policy, Presentation, Steps
from kvsim.policies.dropkv import ring_state
from kvsim.params import Param

PARAMS = {
    "window": Param(int, 64, "the base SnapKV's observation window, always kept",
                    check=lambda v: v >= 1, expect="an integer >= 1"),
    "kernel": Param(int, 5, "the base SnapKV's pooling width",
                    check=lambda v: v >= 1 and v % 2 == 1, expect="an odd integer >= 1"),
    "pooling": Param(str, "avg", "the base SnapKV's pooling", choices=snapkv.POOLING),
    "chunk": Param(int, 20, "chunk length in positions",
                   check=lambda v: v >= 1, expect="an integer >= 1"),
}


def layer_scores(group: Group, params: dict) -> np.ndarray:
    """The base scores of the prefix keys, summed over the layer's KV heads in order."""
    P = group.prompt_len
    w = min(params["window"], P)
    mode = snapkv.POOLING.index(params["pooling"])
    total = np.zeros(P - w)
    for member in group.layer_groups():
        total += snapkv.pool(member.row_scores(P - w, P)[:P - w], params["kernel"], mode)
    return total


def chunk_scores(scores: np.ndarray, chunk: int) -> np.ndarray:
    """Each chunk's summed scores (in position order) divided by its length."""
    n = scores.shape[0]
    out = np.zeros(-(-n // chunk))
    for c in range(out.shape[0]):
        lo, hi = c * chunk, min(n, (c + 1) * chunk)
        total = 0.0
        for j in range(lo, hi):
            total += scores[j]
        out[c] = total / (hi - lo)
    return out


def pinned_chunks(group: Group, budget: int, params: dict) -> np.ndarray:
    """The prefix positions of the chosen chunks, ascending."""
    P, chunk = group.prompt_len, params["chunk"]
    prefix = P - min(params["window"], P)
    if P <= budget:
        return np.arange(prefix)
    n_chunks = (budget - (P - prefix)) // chunk
    if n_chunks == 0:  # no whole chunk fits beside the window
        return np.zeros(0, np.int64)
    chosen = kernels.top_ranked(chunk_scores(layer_scores(group, params), chunk), 0,
                                -(-prefix // chunk), n_chunks)
    return np.concatenate([np.arange(c * chunk, min(prefix, (c + 1) * chunk))
                           for c in chosen]).astype(np.int64)


def _start(prompt: Group, budget: int, params: dict, T: int):
    P = prompt.prompt_len
    prefix = P - min(params["window"], P)
    pinned = pinned_chunks(prompt, budget, params)
    return np.concatenate((pinned, np.arange(prefix, P))), ring_state(
        prompt, budget, len(pinned), prefix)


POLICY = Policy("chunkkv", "ChunkKV: whole prompt chunks by the layer's SnapKV scores + ring",
                PARAMS, Steps(_start, snapkv.admit, snapkv.observe, snapkv.decode),
                min_budget=lambda params: params["window"] + 1, floor_reason="its window + 1",
                fixed=lambda budget, prompt_len, params: min(params["window"], prompt_len),
                layer=True,
                presentation=Presentation(
                    family="window vote", color="#770033", marker="v",
                    reads="attention (every KV head of the layer)",
                    rule=("ChunkKV (Liu et al. 2025, kvpress): whole chunks of `chunk` prompt positions "
                          "ranked by the layer's summed SnapKV scores, the same chunks pinned in every KV "
                          "head of the layer; ring for the rest")),
                layout=snapkv.RING_LAYOUT)
