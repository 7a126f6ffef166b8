"""What a policy is: its parameters, its budget floor, and how it runs on one head."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvsim import kernels
from kvsim.params import Param


@dataclass(frozen=True)
class Head:
    """Everything a policy may read about one attention head of one sequence.

    ``attn`` is the float64 (T, T) row-normalised causal attention; ``important`` a
    boolean mask of ground-truth positions (all False when there are none).
    """

    attn: np.ndarray
    prompt_len: int
    important: np.ndarray
    seed: int = 0
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def T(self) -> int:
        return self.attn.shape[0]

    def column_sums(self, lo: int, hi: int) -> np.ndarray:
        """Column sums of rows ``lo .. hi-1``, computed once per head and range."""
        key = (lo, hi)
        if key not in self._cache:
            self._cache[key] = kernels.column_sums(self.attn, lo, hi)
        return self._cache[key]


@dataclass
class Trace:
    """Per-step series and final cache of one simulation."""

    mass: np.ndarray
    cache_size: np.ndarray
    recall: np.ndarray
    kept: np.ndarray


@dataclass(frozen=True)
class Policy:
    """A registered policy.

    ``min_budget(params)`` is the smallest valid budget (fixed parts + 1);
    ``check(T, prompt_len, params)`` returns a cross-field problem ``"param: expected
    ..."`` or None;
    ``run(head, budget, params)`` returns a :class:`Trace`.
    """

    name: str
    summary: str
    params: dict[str, Param]
    run: Callable[[Head, int, dict], Trace]
    min_budget: Callable[[dict], int] = lambda params: 1
    check: Callable[[int, int, dict], str | None] = lambda T, prompt_len, params: None
    budgeted: bool = True


def new_trace(head: Head) -> Trace:
    """Empty per-step outputs for the decode steps of ``head``."""
    steps = head.T - head.prompt_len
    return Trace(np.zeros(steps), np.zeros(steps, np.int64), np.zeros(steps),
                 np.empty(0, np.int64))


def run_decode(head: Head, capacity: int, kept: np.ndarray, *, score=None, seen=None,
               static_score=None, evict_rule: int = kernels.EVICT_RING, ring=(0, 0, 1),
               recent: int = 0, normalize: bool = False,
               update_rule: int = kernels.UPDATE_NONE, evict_slots=None) -> Trace:
    """Run the shared decode loop from a prefill selection ``kept`` (ascending).

    ``score``/``seen`` give the state of each kept key, ``static_score`` the score a
    new token starts with (one value per position).
    """
    n = kept.shape[0]
    cache = np.zeros(capacity, np.int64)
    cache[:n] = kept
    state = np.zeros(capacity)
    counts = np.zeros(capacity)
    if score is not None:
        state[:n] = score
    if seen is not None:
        counts[:n] = seen
    trace = new_trace(head)
    n = kernels.decode(
        head.attn, head.prompt_len, cache, n, state, counts,
        np.zeros(head.T) if static_score is None else static_score,
        evict_rule, np.asarray(ring, np.int64), recent, normalize, update_rule,
        np.zeros(head.T - head.prompt_len, np.int64) if evict_slots is None else evict_slots,
        head.important, trace.mass, trace.cache_size, trace.recall)
    trace.kept = np.sort(cache[:n])
    return trace
