"""A policy's cache under a protocol: the run (its cache, policy state, compaction and
ranking, :class:`Run`), which every protocol shares."""

from __future__ import annotations

import numpy as np

from kvsim.errors import KvsimError
from kvsim.numerics.decode import Outputs
from kvsim.numerics.jit import jit
from kvsim.policies.base import Group, Policy, context


class Run:
    """The cache, the policy state and what compaction needs to move."""

    def __init__(self, policy: Policy, state, cache: np.ndarray, n: int, slots: frozenset):
        self.policy, self.state, self.cache, self.n, self.slots = policy, state, cache, n, slots
        self.ring, self.slot_of = policy.layout.ring, policy.layout.slot_of
        self.pairs = policy.layout.pairs

    def span(self, group: Group, out: Outputs, t: int, stop: int) -> None:
        """The policy's own decode loop over tokens ``t .. stop-1`` (the cache never full)."""
        self.n = self.policy.steps.decode(context(group, t, stop), out, self.cache, self.n,
                                          self.state)

    def remove(self, drop: np.ndarray) -> None:
        """Remove the keys in slots ``drop``; the others keep their slot order."""
        mask = np.ones(self.n, bool)
        mask[drop] = False
        keep = np.flatnonzero(mask)
        m = keep.size
        for name in self.slots:
            value = getattr(self.state, name)
            value[..., :m] = value[..., keep]
        for name in self.pairs:  # their slots on the axis before the last too
            value = getattr(self.state, name)
            value[..., :m, :] = value[..., keep, :]
        self.cache[:m] = self.cache[keep]
        if self.slot_of:
            self.state.slot_of[self.cache[:m]] = np.arange(m)
        self.n = m

    def lowest(self, t: int) -> int:
        """The slot the policy's ``admit`` would evict at ``t`` from the current cache."""
        if self.ring:  # aim the ring at its oldest key (the ring is kept in age order)
            self.state = self.state._replace(start=t, width=self.n - self.state.base)
        return int(self.policy.steps.admit(self.state, self.cache[:self.n], self.n, t))

    def scores(self, t: int, seed: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``(value, protected)`` of the cached keys before ``t`` joins (``t < 0``: the
        prefill's judgement), from ``Steps.rank``, or by position for a ring (sinks and
        pins, the slots below its base, protected); None if the policy gives neither."""
        rank = self.policy.steps.rank
        if rank is not None:
            return rank(self.state, self.cache, self.n, t, seed)
        if self.ring:
            pos = self.cache[:self.n]
            return pos.astype(np.float64), np.arange(self.n) < self.state.base
        return None

    def compress(self, m: int, t: int, seed: int, since: int | None = None,
                 group: Group | None = None, params: dict | None = None) -> None:
        """Keep the ``m`` best-ranked keys at step ``t`` (before ``t`` joins); a batched
        compression passes ``since`` (the last one's step), for a policy that re-scores
        from the decode queries since then (``Policy.rescore``)."""
        if self.n <= m:
            return
        ranked = None
        if since is not None and self.policy.rescore is not None:
            value = self.policy.rescore(group, self.cache[:self.n].copy(), t, since, params)
            ranked = None if value is None else (value, np.zeros(self.n, bool))
        ranked = ranked or self.scores(t, seed)
        if ranked is not None:
            value, protected = ranked
            pos = self.cache[:self.n]
            free = np.flatnonzero(~protected)
            if free.size < self.n - m:
                raise protected(self.policy, f"the target of {m} cached keys")
            order = free[np.lexsort((-pos[free], value[free]))]  # lowest-ranked first
            self.remove(np.sort(order[:self.n - m]))
            return
        while self.n > m:
            slot = self.lowest(t)
            if slot < 0 or slot >= self.n:
                raise protected(self.policy, f"the target of {m} cached keys")
            self.remove(np.array([slot]))

    def page_scores(self, S: int, reduce: str, t: int, seed: int):
        """``(pages, score, protected)``: the held pages ascending, each one's score (its
        keys' scores reduced in position order) and whether it holds a protected key."""
        value, protected = self.scores(t, seed)
        pos = self.cache[:self.n]
        order = np.argsort(pos, kind="stable")
        pages, first = np.unique(pos[order] // S, return_index=True)
        score = np.empty(pages.size)
        reduce_pages(value[order], first, S, reduce == "max", score)
        guard = np.logical_or.reduceat(protected[order], first)
        return pages, score, guard

    def drop_pages(self, pages: np.ndarray, S: int) -> None:
        self.remove(np.flatnonzero(np.isin(self.cache[:self.n] // S, pages)))


@jit
def reduce_pages(values, first, S, use_max, out):
    """``out[i]``: the max, or the sum in order divided by ``S``, of ``values[first[i] ..
    first[i + 1] - 1]`` (the keys of page ``i`` in position order)."""
    n = values.shape[0]
    for i in range(first.shape[0]):
        hi = first[i + 1] if i + 1 < first.shape[0] else n
        acc = values[first[i]]
        for j in range(first[i] + 1, hi):
            acc = max(acc, values[j]) if use_max else acc + values[j]
        out[i] = acc if use_max else acc / S


def protected(policy: Policy, what: str) -> KvsimError:
    return KvsimError(f"{policy.name}: its protected keys alone exceed {what}", "protocol")
