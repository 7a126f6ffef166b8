"""``openvino``: OpenVINO GenAI's ``CacheEvictionAlgorithm`` (openvino.genai commit
``da1db86``, ``src/cpp/src/continuous_batching/cache/cache_eviction.cpp``): whole blocks
evicted from the middle of the cache, one decision for every KV head of a layer.

The cache is ``start`` | evictable middle | ``recent``, in blocks of ``block`` tokens. The
layer's attention (every query head's observed row, summed over the query heads of each KV
head, then over the KV heads) is max-pooled forward over ``pool`` cached neighbours
(``max(v[i .. i + pool - 1])``, the start area left out) and accumulated per key: ``sum``,
or ``norm_sum`` (the sum divided by the number of registered queries that saw the key). At
the prefill end, the last ``snapkv_window`` prompt queries (0: every prompt query) give the
first scores. When the cache (the incoming key counted) exceeds the arena's ``A + block - 1``
keys, ``A = block * floor((B + 1) / block) - block``, the lowest-scoring whole blocks of the
middle go (a block's score: its keys' scores summed in order; ties: the lower block first, as
the code's ``nth_element`` comparator), leaving ``A - start - recent`` tokens of middle.

Every KV head of the layer holds the same cache (:class:`LayerCache`), so a run simulates
the layer jointly (each KV head's rows through the shared cache) and reports its own KV head
(:func:`simulate`, which ``openvino_arkv``, the ``ADAPTIVE_RKV`` mode, shares); inside a
model, :class:`~kvsim.protocols.stepping.BlockLayer` steps the same cache. Left out: KVCrush's add-back
(off by default in the code) and RoPE re-rotation (``apply_rotation``, off by default:
kvsim's keys keep their positions).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.decode import Outputs, decode_kernel
from kvsim.numerics.jit import jit_inline
from kvsim.numerics.lanes import lane_sum
from kvsim.params import Param
from kvsim.policies.base import Group, Policy, Presentation, Trace, context, new_trace, snapshot_steps

MODES = ("sum", "norm_sum")

PARAMS = {
    "mode": Param(str, "norm_sum", "score aggregation: SUM, or NORM_SUM (divided by the queries "
                  "that saw the key)", choices=MODES),
    "block": Param(int, 16, "KV-cache block size in tokens", low=1, high=2**20,
                   expect="an integer in [1, 2^20]"),
    "start_blocks": Param(int, 1, "blocks at the start never evicted", low=1, high=2**20,
                          expect="an integer in [1, 2^20]"),
    "recent_blocks": Param(int, 2, "newest blocks never evicted", low=1, high=2**20,
                           expect="an integer in [1, 2^20]"),
    "snapkv_window": Param(int, 8, "prompt queries whose attention gives the first scores "
                           "(0: every prompt query)", low=0, high=2**31,
                           expect="an integer >= 0"),
    "pool": Param(int, 7, "forward max-pool width over cached neighbours", low=1, high=2**20,
                  expect="an integer in [1, 2^20]"),
}


def arena(budget: int, block: int) -> int:
    """OpenVINO's ``max_cache_size`` at budget ``B``: the largest multiple of the block
    whose peak (``max_cache_size + block - 1`` keys) fits in ``B``."""
    return block * ((budget + 1) // block) - block


def saturation(T: int, params: dict) -> int:
    """The smallest budget whose arena holds ``T`` keys (``A + block - 1 >= T``)."""
    S = params["block"]
    return S * -(-(T + 1) // S) - 1


def min_budget(params: dict) -> int:
    """The arena must hold one evictable block beside the start and recent areas."""
    return params["block"] * (params["start_blocks"] + params["recent_blocks"] + 2) - 1


class Recorder(NamedTuple):
    """The step's attention, summed over the KV head's query heads, per slot."""

    row: np.ndarray  # (capacity,) float64


@jit_inline
def admit(state, cache, n, t):
    """Append: evictions happen between steps, for the whole layer."""
    return n


@jit_inline
def observe(state, cache, n, obs, mass, outputs):
    """Sum the query heads' observed attention (``obs / mass``) in head order."""
    for j in range(n):
        state.row[j] = 0.0
    for g in range(obs.shape[0]):
        m = mass[g]
        for j in range(n):
            state.row[j] += obs[g, j] / m if m > 0.0 else 0.0


decode = decode_kernel("decode", admit, observe)


def forward_max_pool(values: np.ndarray, width: int) -> np.ndarray:
    """``out[i] = max(values[i .. i + width - 1])``, clipped at the end (the code's
    ``_max_pool``)."""
    out = values.copy()
    for k in range(1, width):
        np.maximum(out[:-k], values[k:], out=out[:-k])
    return out


class _Member:
    """One KV head of the layer: its group, its copy of the shared cache, its outputs."""

    def __init__(self, group: Group, capacity: int, kept: np.ndarray):
        self.group, self.trace = group, new_trace(group)
        self.cache = np.zeros(capacity, np.int64)
        self.cache[:len(kept)] = kept
        snap_steps = snapshot_steps(group, capacity)
        self.trace.snapshots = np.full((snap_steps.shape[0], capacity), -1, np.int64)
        self.out = Outputs(self.trace.mass, self.trace.cache_size, self.trace.recall,
                           self.trace.error, snap_steps, self.trace.snapshots)
        self.state = Recorder(np.zeros(capacity))

    def step(self, t: int, n: int) -> np.ndarray:
        """Token ``t`` joins and attends; the summed observed row over the ``n + 1`` keys."""
        decode(context(self.group, t, t + 1), self.out, self.cache, n, self.state)
        return self.state.row[:n + 1]


def prompt_scores(group: Group, window: int) -> np.ndarray:
    """The layer's prefill scores of positions ``0 .. P-1``: each query head's full
    attention summed over the window's queries, then over the KV head's query heads, then
    over the layer's KV heads (all in order)."""
    P = group.prompt_len
    lo = P - min(window, P) if window > 0 else 0
    total = np.zeros(P)
    for member in group.layer_groups():
        summed = np.zeros(P)
        for h in member.heads:
            summed += kernels.row_sums(member.field, member.row_max, member.row_sum, int(h),
                                       lo, P)[:P]
        total += summed
    return total


def block_sums(value: np.ndarray, first: int, blocks: int, S: int) -> np.ndarray:
    """``value`` summed over ``blocks`` whole blocks from index ``first``, in order within
    each block (as the code sums)."""
    out = np.zeros(blocks)
    for j in range(S):
        out += value[first + j:first + blocks * S:S]
    return out


class Tracked(Protocol):
    """Scores of the keys past the start area, as :func:`simulate` drives them."""

    def prefill(self, scores: np.ndarray, start: int, P: int, window: int) -> None: ...

    def register(self, row: np.ndarray) -> None: ...

    def remove(self, drop: np.ndarray) -> None: ...


class Scores:
    """The tracked keys' accumulated scores and, for ``norm_sum``, how many registered
    queries saw each (in cache order, the start area left out)."""

    def __init__(self, params: dict):
        self.pool, self.norm = params["pool"], params["mode"] == "norm_sum"
        self.acc, self.seen = np.zeros(0), np.zeros(0)

    def prefill(self, scores: np.ndarray, start: int, P: int, window: int) -> None:
        if P > start:
            self.acc = forward_max_pool(scores[start:P], self.pool)
            seen_by = P if window == 0 else min(window, P)
            self.seen = np.minimum(P - np.arange(start, P), seen_by).astype(np.float64)

    def register(self, row: np.ndarray) -> None:
        """A decode query's summed row over the tracked keys (the newest last)."""
        pooled = forward_max_pool(row, self.pool)
        acc = np.zeros(pooled.shape[0])
        acc[:self.acc.shape[0]] = self.acc
        self.acc = acc + pooled
        self.seen = np.append(self.seen + 1.0, 1.0)

    def block_scores(self, first: int, blocks: int, S: int) -> np.ndarray:
        """Scores of ``blocks`` whole blocks from tracked index ``first``, summed in order."""
        return block_sums(self.acc / self.seen if self.norm else self.acc, first, blocks, S)

    def remove(self, drop: np.ndarray) -> None:
        self.acc, self.seen = np.delete(self.acc, drop), np.delete(self.seen, drop)


def evictable(n: int, params: dict, budget: int, extra: int = 0
              ) -> tuple[int, int, int] | None:
    """When the cache holds ``n`` keys (the incoming one counted) and exceeds the arena
    (widened by ``extra`` keys: a task's question): the evictable blocks ``first .. last -
    1`` and how many of them stay (``A - start - recent`` tokens); None while ``n`` fits."""
    S = params["block"]
    start, recent = S * params["start_blocks"], S * params["recent_blocks"]
    A = arena(budget, S) + extra
    if n <= A + S - 1:
        return None
    return start // S, n // S - recent // S, (A - start - recent) // S


def slots_of(blocks: np.ndarray, S: int) -> np.ndarray:
    """The cache slots of whole blocks (ascending block indices)."""
    return (blocks[:, None] * S + np.arange(S)).ravel()


def evicted_slots(scores: Scores, n: int, params: dict, budget: int, extra: int = 0
                  ) -> np.ndarray:
    """The cache slots to free when the cache holds ``n`` keys (the incoming one
    counted): the lowest-scoring blocks of the middle, none while ``n`` fits the arena
    (widened by ``extra``)."""
    S = params["block"]
    area = evictable(n, params, budget, extra)
    if area is None or area[1] - area[0] <= area[2]:
        return np.zeros(0, np.int64)
    first, last, stay = area
    score = scores.block_scores(0, last - first, S)
    order = np.lexsort((np.arange(score.shape[0]), score))  # lowest first, then lower index
    return slots_of(np.sort(order[:last - first - stay]) + first, S)


class LayerCache:
    """The one cache of a layer under the block rule, one token at a time: what
    :func:`simulate` runs and a model's decoder steps
    (:class:`~kvsim.protocols.stepping.BlockLayer`).

    ``scores`` (``prefill``, ``register``, ``remove``) tracks the keys past the start area;
    ``choose(cache, n, budget, extra)`` gives the slots to free when ``cache`` (its first
    keys) holds ``n`` keys, the incoming one counted, in the arena of ``budget`` widened by
    ``extra`` keys. The prefill scores come from ``group``, the layer's prompt (every KV
    head's attention). :attr:`extra` may grow: a task's question and answer join the arena
    of ``B`` widened by their keys, without eviction, as they join every other cache."""

    def __init__(self, group: Group, budget: int, params: dict, scores: Tracked,
                 choose: Callable[[np.ndarray, int, int, int], np.ndarray], capacity: int):
        P, window = group.prompt_len, params["snapkv_window"]
        self.start = params["block"] * params["start_blocks"]
        self.scores, self.choose, self.budget, self.extra = scores, choose, budget, 0
        scores.prefill(group.shared(("openvino", window), lambda: prompt_scores(group, window)),
                       self.start, P, window)
        self.cache, self.n = np.zeros(max(capacity, P), np.int64), P
        self.cache[:P] = np.arange(P)
        self.make_room(P)

    def make_room(self, n: int) -> np.ndarray:
        """Free what the rule frees when the cache holds ``n`` keys (its own, or one more:
        the incoming key); the freed slots (the others keep their order)."""
        drop = self.choose(self.cache, n, self.budget, self.extra)
        if drop.size:
            self.scores.remove(drop - self.start)
            self.cache[:self.n - drop.size] = np.delete(self.cache[:self.n], drop)
            self.n -= drop.size
        return drop

    def append(self, t: int) -> None:
        """Key ``t`` joins (room made first, :meth:`make_room`)."""
        self.cache[self.n] = t
        self.n += 1

    def head_row(self, attention: np.ndarray, out: np.ndarray) -> None:
        """``out[:n]``: one KV head's row, its query heads' observed ``attention`` (G, n)
        over the cached keys each taken over its own sum, summed in head order (the decode
        loop's :func:`observe`, the very arithmetic of :func:`simulate`)."""
        n = self.n
        mass = np.array([lane_sum(row, n) for row in attention])
        observe(Recorder(out), self.cache, n, attention, mass, np.zeros((0, 0)))

    def register(self, row: np.ndarray) -> None:
        """The layer's summed observed row over the ``n`` cached keys, the newest last."""
        if self.n > self.start:
            self.scores.register(row[self.start:self.n])


def simulate(group: Group, layer: LayerCache) -> Trace:
    """Run the layer of ``group`` through its one cache ``layer``: each KV head's decode
    loop through the shared cache, their summed rows registered; the trace of ``group``'s
    KV head."""
    n = layer.n
    members = [_Member(m, layer.budget, layer.cache[:n]) for m in group.layer_groups()]
    for t in range(group.prompt_len, group.T):
        if layer.make_room(n + 1).size:
            n = layer.n
            for m in members:
                m.cache[:n] = layer.cache[:n]
        row = np.zeros(n + 1)
        for m in members:
            row += m.step(t, n)
        layer.append(t)
        n += 1
        layer.register(row)
    own = members[group.kv_head]
    own.trace.kept = np.sort(own.cache[:n])
    return own.trace


def layer_cache(group: Group, budget: int, params: dict, keys: list[np.ndarray],
                capacity: int) -> LayerCache:
    """The layer's cache under SUM / NORM_SUM (``keys``: unread)."""
    scores = Scores(params)
    return LayerCache(group, budget, params, scores,
                      lambda cache, n, B, extra: evicted_slots(scores, n, params, B, extra),
                      capacity)


def _run(group: Group, budget: int, params: dict) -> Trace:
    return simulate(group, layer_cache(group, budget, params, [], budget))


POLICY = Policy("openvino", "OpenVINO GenAI's block eviction: one decision per layer, whole "
                "blocks of the middle by pooled accumulated attention", PARAMS, run=_run,
                min_budget=min_budget, saturation=saturation,
                floor_reason="start, recent and one evictable block, less 1 (block * "
                             "(start_blocks + recent_blocks + 2) - 1)",
                layer_cache=layer_cache,
                presentation=Presentation(
                    family="engine", color="#0077ee", marker="D",
                    reads="attention (every KV head of the layer)",
                    rule=("OpenVINO GenAI's CacheEvictionAlgorithm (SUM / NORM_SUM): whole blocks of "
                          "the middle, lowest pooled accumulated attention of the layer first; one "
                          "decision for every KV head of a layer")))
