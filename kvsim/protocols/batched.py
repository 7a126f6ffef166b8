"""Run a policy under a protocol: batched compression (``interval``, ``target_ratio``),
whole pages (``page``), thresholds (``threshold``) and compression before the question
(``question_len``, ``compress = "before_question"``).

The policy's own compiled decode loop runs the tokens between two compressions (its
``admit`` then only appends: the cache is never full there), so the per-step path is the
policy's own. A compression at step ``t`` (before ``t`` joins) reads the scores the
per-step rule would use at ``t``, once:

- a policy with ``Steps.rank`` gives those scores (and the protected positions) itself; a
  ring (position rules) ranks by age, the slots below its ``base`` (sinks, pins) protected;
- otherwise (batched compression only) its ``admit`` on a full cache names the
  lowest-ranked key, which is removed, until ``m`` remain: the once-ranked top ``m`` for
  every rule whose scores of the cached keys do not depend on which other keys are cached.

Removal compacts the cache in slot order; the policy's per-slot state follows as its
declared layout says (``Policy.layout``, :class:`kvsim.policies.layout.StateLayout`: the
per-slot fields, a ``slot_of`` map of positions to slots, a ring ``base``/``start``/
``width`` re-aimed at its oldest key before ``admit`` names it). Pages and thresholds
start the policy with the whole prompt, so that every prompt key has its prefill score,
and keep the recent part of ``B``.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kvsim.errors import KvsimError
from kvsim.numerics.decode import Context, Outputs
from kvsim.numerics.jit import jit
from kvsim.policies.base import Group, Policy, Trace, context, new_trace, snapshot_steps
from kvsim.policies.layout import widen
from kvsim.protocols import question
from kvsim.protocols.settings import before_question, split


def peak_limit(budget: int, params: dict, T: int) -> int:
    """The most keys a run at ``budget`` may hold at once under the protocol of ``params``."""
    _, proto = split(params)
    if proto["target_ratio"] != 1.0 or proto["threshold"] is not None \
            or proto["filtering"] != "off":
        return T
    return budget + before_question(proto) + proto["interval"] - 1


class _Run:
    """The cache, the policy state and what compaction needs to move."""

    def __init__(self, policy: Policy, state, cache: np.ndarray, n: int, slots: frozenset):
        self.policy, self.state, self.cache, self.n, self.slots = policy, state, cache, n, slots
        self.ring, self.slot_of = policy.layout.ring, policy.layout.slot_of

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
                raise _protected(self.policy, f"the target of {m} cached keys")
            order = free[np.lexsort((-pos[free], value[free]))]  # lowest-ranked first
            self.remove(np.sort(order[:self.n - m]))
            return
        while self.n > m:
            slot = self.lowest(t)
            if slot < 0 or slot >= self.n:
                raise _protected(self.policy, f"the target of {m} cached keys")
            self.remove(np.array([slot]))

    def page_scores(self, S: int, reduce: str, t: int, seed: int):
        """``(pages, score, protected)``: the held pages ascending, each one's score (its
        keys' scores reduced in position order) and whether it holds a protected key."""
        value, protected = self.scores(t, seed)
        pos = self.cache[:self.n]
        order = np.argsort(pos, kind="stable")
        pages, first = np.unique(pos[order] // S, return_index=True)
        score = np.empty(pages.size)
        _reduce_pages(value[order], first, S, reduce == "max", score)
        guard = np.logical_or.reduceat(protected[order], first)
        return pages, score, guard

    def drop_pages(self, pages: np.ndarray, S: int) -> None:
        self.remove(np.flatnonzero(np.isin(self.cache[:self.n] // S, pages)))


@jit
def _reduce_pages(values, first, S, use_max, out):
    """``out[i]``: the max, or the sum in order divided by ``S``, of ``values[first[i] ..
    first[i + 1] - 1]`` (the keys of page ``i`` in position order)."""
    n = values.shape[0]
    for i in range(first.shape[0]):
        hi = first[i + 1] if i + 1 < first.shape[0] else n
        acc = values[first[i]]
        for j in range(first[i] + 1, hi):
            acc = max(acc, values[j]) if use_max else acc + values[j]
        out[i] = acc if use_max else acc / S


def _protected(policy: Policy, what: str) -> KvsimError:
    return KvsimError(f"{policy.name}: its protected keys alone exceed {what}", "protocol")


def run_protocol(policy: Policy, group: Group, budget: int, params: dict,
                 cap: int | None = None) -> Trace:
    """``policy`` on one KV head under the protocol of ``params``, with hard cap ``cap``
    (default ``budget``; budget allocation gives a head its own) and the fixed parts of
    ``budget``."""
    own, proto = split(params)
    cap = budget if cap is None else cap
    if proto["heads"] == "uniform":
        from kvsim.protocols.uniform import run_uniform  # it builds on this module
        return run_uniform(policy, group, budget, cap, own, proto)
    if proto["filtering"] != "off":
        from kvsim.protocols.filtering import run_filtering  # it builds on this module
        return run_filtering(policy, group, budget, cap, own, proto["filtering"],
                             proto["filter_ratio"])
    P, T = group.prompt_len, group.T
    plan = question.plan(proto["compress"], P, proto["question_len"], cap)  # shared with tasks
    Q = plan.free
    start, layout = policy.steps.start, policy.layout
    if cap != budget and policy.run_capped is not None and layout.recent is not None:
        start = functools.partial(start, recent=layout.recent(budget, own))  # the mean's
    prompt = dataclasses.replace(group, prompt_len=plan.compress_at) if Q else group
    append_only = proto["page"] != 1 or proto["threshold"] is not None
    # Pages and thresholds judge every prompt key: the policy starts with all of them.
    first = max(P, 1) if append_only else cap
    kept, state = start(prompt, first, own, T)
    if append_only and layout.recent is not None:
        state = state._replace(recent=layout.recent(budget, own))
    slots = layout.slot_fields(own)
    if append_only:
        capacity = first + T - P
    elif proto["target_ratio"] != 1.0:
        capacity = max(plan.budget, len(kept) + Q + T - P)  # never full: compressions make room
    else:
        capacity = plan.budget + proto["interval"] - 1
    state = widen(state, layout, own, first, capacity - first, group.seed)
    cache = np.zeros(capacity, np.int64)
    cache[:len(kept)] = kept
    run = _Run(policy, state, cache, len(kept), slots)
    trace = new_trace(group)
    snap_steps = snapshot_steps(group, budget if cap == budget else cap)
    trace.snapshots = np.full((snap_steps.shape[0], capacity), -1, np.int64)
    out = Outputs(trace.mass, trace.cache_size, trace.recall, trace.error, snap_steps,
                  trace.snapshots)
    if Q:  # the question joins without eviction; its queries attend and the policy observes
        G, dv = len(group.heads), group.full_output.shape[2]
        ctx = Context(group.field, group.row_max, group.row_sum, group.heads, P - Q,
                      group.important, np.zeros((G, Q, dv)), P - Q, P)
        scratch = Outputs(np.zeros((G, Q)), np.zeros(Q, np.int64), np.zeros((G, Q)),
                          np.zeros((G, Q)), np.zeros(0, np.int64), np.zeros((0, capacity), np.int64))
        run.n = policy.steps.decode(ctx, scratch, cache, run.n, run.state)
    if proto["page"] != 1:
        _paged(run, group, out, proto["page"], proto["page_reduce"], cap)
    elif proto["threshold"] is not None:
        _thresholded(run, group, out, proto["threshold"], proto["threshold_window"])
    elif proto["interval"] == 1 and proto["target_ratio"] == 1.0:  # before the question only:
        run.n = policy.steps.decode(context(group), out, cache, run.n, run.state)  # per step
    else:
        _batched(run, group, out, plan.budget, proto["interval"], proto["target_ratio"], own)
    trace.kept = np.sort(cache[:run.n])
    return trace


def _span(run: _Run, group: Group, out: Outputs, t: int, stop: int) -> None:
    """The policy's own decode loop over tokens ``t .. stop-1`` (the cache never full)."""
    run.span(group, out, t, stop)


def _batched(run: _Run, group: Group, out: Outputs, B: int, N: int, ratio: float,
             params: dict) -> None:
    """``interval = N``: down to ``B - 1`` keys when ``t`` would exceed ``B + N - 1``; with
    a ``ratio``, down to ``K - 1`` keys every ``N`` steps, ``K = max(1, floor(r (t + 1)))``.
    A policy that re-scores reads the decode queries since the last compression (or P)."""
    P, T, capacity = group.prompt_len, group.T, run.cache.shape[0]
    t = since = P
    at = P + N - 1 if ratio != 1.0 else P + capacity - run.n  # the next compression step
    while t < T:
        if at > t:  # the policy's own loop up to it (t joins there after a compression)
            _span(run, group, out, t, min(at, T))
            t = min(at, T)
            continue
        run.compress(max(1, int(ratio * (t + 1))) - 1 if ratio != 1.0 else B - 1, t, group.seed,
                     since, group, params)
        since = t
        at = t + N if ratio != 1.0 else t + capacity - run.n


def _paged(run: _Run, group: Group, out: Outputs, S: int, reduce: str, B: int) -> None:
    """Whole pages of ``S`` positions, at most ``floor(B / S)`` held (the receiving page
    included): the prefill keeps the protected pages, the receiving one and the best
    complete ones; a key that opens a page when the cap is reached evicts the
    lowest-ranked complete unprotected page first."""
    P, T, cap, seed = group.prompt_len, group.T, B // S, group.seed
    pages, score, guard = run.page_scores(S, reduce, -1, seed)
    recent = run.state.recent if run.policy.layout.recent is not None else 0
    guard |= np.isin(pages, np.unique(np.arange(max(P - recent, 0), P) // S))
    if P % S:
        guard |= pages == (P - 1) // S  # the receiving page
    if guard.sum() > cap:
        raise _protected(run.policy, f"the {cap} pages of B = {B}")
    free = np.flatnonzero(~guard)
    best = free[np.lexsort((pages[free], -score[free]))][:cap - int(guard.sum())]
    run.drop_pages(np.setdiff1d(pages, pages[np.concatenate((np.flatnonzero(guard), best))]), S)
    t = P
    while t < T:
        stop = min(t + (-t) % S, T) if t % S else t  # the next key that opens a page
        if stop > t:
            _span(run, group, out, t, stop)
            t = stop
        if t < T:
            pages, score, guard = run.page_scores(S, reduce, t, seed)
            if pages.size >= cap:
                free = np.flatnonzero(~guard)
                if free.size == 0:
                    raise _protected(run.policy, f"the {cap} pages of B = {B}")
                worst = free[np.lexsort((-pages[free], score[free]))][0]
                run.drop_pages(pages[worst:worst + 1], S)
            stop = min(t + S, T)
            _span(run, group, out, t, stop)
            t = stop


def _thresholded(run: _Run, group: Group, out: Outputs, tau: float, w: int) -> None:
    """Append-only: the ``w`` newest keys held; a key leaving the window (key ``t - w`` as
    ``t`` joins; at the prefill every key before ``P - w``) stays for good iff its current
    score is ``>= tau``."""
    P, T, seed = group.prompt_len, group.T, group.seed
    value, _ = run.scores(-1, seed)
    pos = run.cache[:run.n]
    run.remove(np.flatnonzero((pos < P - w) & ~(value >= tau)))
    for t in range(P, T):
        if t - w >= 0:
            value, _ = run.scores(t, seed)
            slot = np.flatnonzero(run.cache[:run.n] == t - w)
            if slot.size and not value[slot[0]] >= tau:
                run.remove(slot)
        _span(run, group, out, t, t + 1)
