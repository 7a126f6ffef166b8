"""``openvino_arkv``: OpenVINO GenAI's ``CacheEvictionAlgorithm`` in its ``ADAPTIVE_RKV``
aggregation mode (openvino.genai commit ``da1db86``, ``cache_eviction.cpp``; the key
diversity of OpenVINO core's reference ``adaptive_rkv_diversity.hpp``).

The cache, its blocks, its arena and its one decision per layer are ``openvino``'s. The
scores differ: each registration (the prefill's SnapKV-window sum, then each decode query's
row, all unpooled) joins a queue of the last ``window_size``; a key's score is the mean of
the queue (rows shorter than the newest padded with zeros), max-pooled forward over
``pool`` neighbours. An eviction empties the queue (the code's ``remove_scores``).

When the cache exceeds the arena, the evictable blocks are split: the highest-scoring stay
until their scores reach ``attention_mass`` of the evictable total (at most the evictable
capacity, ``A - start - recent`` tokens); the others are candidates, and the capacity left
goes to the candidates of highest diversity, the rest are evicted. Diversity: the layer's
keys of the evictable area, L2-normalised, their cosine similarities per KV head with the
diagonal zeroed and each row's values below the row's mean zeroed, averaged over the KV
heads; a block's diversity is minus its rows' similarities to the candidates' keys,
summed over its rows and averaged over the candidates' keys. Equal scores or diversities:
the lower block first (the code's ``std::priority_queue`` leaves their order open).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvsim.params import Param
from kvsim.policies import openvino
from kvsim.policies.base import Group, Policy, Presentation, Trace

EPS = float(np.finfo(np.float32).eps)
"""OpenVINO core's ``normalize_l2`` epsilon (added to the squared norm)."""

PARAMS = {
    **{k: v for k, v in openvino.PARAMS.items() if k != "mode"},
    "attention_mass": Param(float, 0.9, "share of the evictable blocks' total score the "
                            "highest-scoring blocks keep before diversity fills the rest",
                            low=0.0, high=1.0, expect="a number in [0, 1]"),
    "window_size": Param(int, 8, "registrations whose mean gives the scores", low=1,
                         high=2**20, expect="an integer in [1, 2^20]"),
}


class MeanScores:
    """The tracked keys' scores (in cache order, the start area left out): the forward
    max-pool of the mean of the last ``window_size`` registrations since the last eviction."""

    def __init__(self, params: dict):
        self.pool = params["pool"]
        self.queue: deque[np.ndarray] = deque(maxlen=params["window_size"])
        self.acc = np.zeros(0)

    def prefill(self, scores: np.ndarray, start: int, P: int, window: int) -> None:
        if P > start:
            self.acc = scores[start:P].copy()
            self.queue.append(self.acc.copy())

    def register(self, row: np.ndarray) -> None:
        """A decode query's summed row over the tracked keys (the newest last)."""
        first = self.acc.shape[0] == 0  # the code's initial scores: the row itself
        self.queue.append(row.copy())
        if first:
            self.acc = row.copy()
            return
        total = np.zeros(row.shape[0])
        for entry in self.queue:  # in order, as the code accumulates
            total[:entry.shape[0]] += entry
        self.acc = openvino.forward_max_pool(total / len(self.queue), self.pool)

    def block_scores(self, first: int, blocks: int, S: int) -> np.ndarray:
        return openvino.block_sums(self.acc, first, blocks, S)

    def remove(self, drop: np.ndarray) -> None:
        self.acc = np.delete(self.acc, drop)
        self.queue.clear()


def unit_keys(keys: np.ndarray) -> np.ndarray:
    """Keys ``(n, d)`` over ``sqrt(|k|^2 + eps)`` (``normalize_l2``, eps added)."""
    return keys / np.sqrt(np.sum(keys * keys, axis=1, keepdims=True) + EPS)


def block_diversity(keys: list[np.ndarray], S: int) -> np.ndarray:
    """OpenVINO core's block diversity of an evictable area: ``keys`` one ``(n, d)`` array
    per KV head (``n`` a multiple of ``S``), to ``(n / S, n)``: minus, per block, the sum
    over its keys of their filtered similarity to each key."""
    n = keys[0].shape[0]
    mean = np.zeros((n, n))
    for k in keys:
        unit = unit_keys(k)
        sim = unit @ unit.T
        np.fill_diagonal(sim, 0.0)
        sim[sim < sim.mean(axis=1, keepdims=True)] = 0.0
        mean += sim
    mean /= len(keys)
    return -mean.reshape(n // S, S, n).sum(axis=1)


def best_first(values: np.ndarray) -> np.ndarray:
    """Indices by value, highest first, the lower index first among equals."""
    return np.lexsort((np.arange(values.shape[0]), -values))


def diversity_split(scores: np.ndarray, capacity: int, mass: float) -> tuple[np.ndarray, int]:
    """``get_diversity_block_set``: the blocks (ascending) left to the diversity rule after
    the highest-scoring ones are kept until their sum reaches ``mass`` of the total or
    ``capacity`` blocks, and how many were kept."""
    order = best_first(scores)
    total = 0.0
    for score in scores:  # in block order, as the code sums
        total += score
    expected, total, kept = total * mass, 0.0, 0
    while total < expected and kept < min(capacity, order.shape[0]):
        total += scores[order[kept]]
        kept += 1
    return np.sort(order[kept:]), kept


def most_diverse(diversity: np.ndarray, candidates: np.ndarray, count: int, S: int) -> np.ndarray:
    """The ``count`` candidate blocks of highest diversity to the candidates' keys
    (``get_filtered_block_diversity`` then ``get_most_diverse_blocks``)."""
    columns = openvino.slots_of(candidates, S)
    filtered = diversity[candidates][:, columns].sum(axis=1) / columns.shape[0]
    return candidates[best_first(filtered)[:count]]


def evicted_slots(scores: MeanScores, keys: list[np.ndarray], cache: np.ndarray, n: int,
                  params: dict, budget: int, extra: int = 0) -> np.ndarray:
    """The cache slots to free when the cache ``cache`` holds ``n`` keys (the incoming one
    counted) in the arena of ``budget`` widened by ``extra``; ``keys``: each KV head's
    ``(d, T)`` keys of the layer."""
    S = params["block"]
    area = openvino.evictable(n, params, budget, extra)
    if area is None:
        return np.zeros(0, np.int64)
    first, last, stay = area
    candidates, kept = diversity_split(scores.block_scores(0, last - first, S), stay,
                                       params["attention_mass"])
    if stay > kept:
        positions = cache[first * S:last * S]
        diversity = block_diversity([k[:, positions].T.astype(np.float64) for k in keys], S)
        candidates = np.setdiff1d(candidates, most_diverse(diversity, candidates, stay - kept, S))
    return openvino.slots_of(candidates + first, S)


def layer_cache(group: Group, budget: int, params: dict, keys: list[np.ndarray],
                capacity: int) -> openvino.LayerCache:
    """The layer's cache under ADAPTIVE_RKV; ``keys``: each KV head's ``(d, T)`` keys."""
    scores = MeanScores(params)
    return openvino.LayerCache(
        group, budget, params, scores,
        lambda cache, n, B, extra: evicted_slots(scores, keys, cache, n, params, B, extra),
        capacity)


def _run(group: Group, budget: int, params: dict) -> Trace:
    keys = [m.keys for m in group.layer_groups()]
    return openvino.simulate(group, layer_cache(group, budget, params, keys, budget))


POLICY = Policy("openvino_arkv", "OpenVINO GenAI's block eviction, ADAPTIVE_RKV mode: the "
                "blocks holding attention_mass of the recent mean attention, the rest of the "
                "middle by key diversity", PARAMS, run=_run, needs=frozenset({"keys"}),
                min_budget=openvino.min_budget, saturation=openvino.saturation,
                floor_reason=openvino.POLICY.floor_reason, layer_cache=layer_cache,
                presentation=Presentation(
                    family="engine", color="#00dd00", marker="s",
                    reads="attention and keys (every KV head of the layer)",
                    rule=("OpenVINO GenAI's CacheEvictionAlgorithm (ADAPTIVE_RKV): of the "
                          "middle's blocks, those holding attention_mass of the pooled mean "
                          "attention of the last window_size queries, then the most diverse "
                          "keys; one decision for every KV head of a layer")))
