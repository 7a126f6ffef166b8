"""Run a policy under a protocol: batched compression (``interval``, ``target_ratio``) and
compression before the question (``question_len``, ``compress = "before_question"``).

The policy's own compiled decode loop runs the tokens between two compressions (its
``admit`` then only appends: the cache is never full there), so the per-step path is the
policy's own. A compression at step ``t`` (before ``t`` joins) ranks the cache once by
the scores the per-step rule would use at ``t`` and keeps the best ``m``:

- a policy with ``Steps.rank`` gives those scores (and the protected positions) itself;
- otherwise its ``admit`` on a full cache names the lowest-ranked key, which is removed,
  until ``m`` remain. That is the once-ranked top ``m`` for every rule whose scores of the
  cached keys do not depend on which other keys are cached (accumulated, last-query,
  count, static scores; position rules rank by age).

Removal compacts the cache in slot order; the policy's per-slot state follows (the fields
whose last axis is the budget, found by starting the policy at two budgets; a field
``slot_of`` maps positions to slots; a ring ``base``/``start``/``width`` is re-aimed at
its oldest key).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import numpy as np

from kvsim.errors import KvsimError
from kvsim.numerics.decode import Context, Outputs
from kvsim.policies.base import Group, Policy, Trace, context, new_trace, snapshot_steps
from kvsim.protocols.question import widen
from kvsim.protocols.settings import before_question, split


def peak_limit(budget: int, params: dict, T: int) -> int:
    """The most keys a run at ``budget`` may hold at once under the protocol of ``params``."""
    _, proto = split(params)
    if proto["target_ratio"] != 1.0:
        return T
    return budget + before_question(proto) + proto["interval"] - 1


def _slot_fields(policy: Policy, start, group: Group, budget: int, params: dict, T: int):
    """Names of the state fields holding one entry per slot (last axis grows with B)."""
    _, small = start(group, budget, params, T)
    _, large = start(group, budget + 1, params, T)
    return frozenset(name for name, value in small._asdict().items()
                     if isinstance(value, np.ndarray) and value.ndim
                     and getattr(large, name).shape[-1] == value.shape[-1] + 1)


class _Run:
    """The cache, the policy state and what compaction needs to move."""

    def __init__(self, policy: Policy, state, cache: np.ndarray, n: int, slots: frozenset):
        self.policy, self.state, self.cache, self.n, self.slots = policy, state, cache, n, slots
        fields = state._fields
        self.ring = {"base", "start", "width"} <= set(fields)
        self.slot_of = "slot_of" in fields

    def remove(self, drop: np.ndarray) -> None:
        """Remove the keys in slots ``drop``; the others keep their slot order."""
        n = self.n
        keep = np.setdiff1d(np.arange(n), drop)
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

    def compress(self, m: int, t: int, seed: int) -> None:
        """Keep the ``m`` best-ranked keys at step ``t`` (before ``t`` joins)."""
        if self.n <= m:
            return
        rank = getattr(self.policy.steps, "rank", None)
        if rank is not None:
            value, limit = rank(self.state, self.cache, self.n, t, seed)
            pos = self.cache[:self.n]
            free = np.flatnonzero(pos < limit)
            if free.size < self.n - m:
                raise _protected(self.policy, m)
            order = free[np.lexsort((-pos[free], value[free]))]  # lowest-ranked first
            self.remove(np.sort(order[:self.n - m]))
            return
        while self.n > m:
            slot = self.lowest(t)
            if slot < 0 or slot >= self.n:
                raise _protected(self.policy, m)
            self.remove(np.array([slot]))


def _protected(policy: Policy, m: int) -> KvsimError:
    return KvsimError(f"{policy.name}: its protected keys alone exceed the protocol's target "
                      f"of {m} cached keys before the incoming one", "protocol")


def run_protocol(policy: Policy, group: Group, budget: int, params: dict,
                 cap: int | None = None) -> Trace:
    """``policy`` on one KV head under the protocol of ``params``, with hard cap ``cap``
    (default ``budget``; budget allocation gives a head its own) and the fixed parts of
    ``budget``."""
    own, proto = split(params)
    cap = budget if cap is None else cap
    P, T = group.prompt_len, group.T
    Q = before_question(proto)
    N, ratio = proto["interval"], proto["target_ratio"]
    start = policy.steps.start
    if cap != budget and policy.run_capped is not None \
            and "recent" in inspect.signature(start).parameters:
        start = functools.partial(start, recent=policy.fixed(budget, P, own))
    prompt = dataclasses.replace(group, prompt_len=P - Q) if Q else group
    kept, state = start(prompt, cap, own, T)
    slots = _slot_fields(policy, start, prompt, cap, own, T)
    decode_budget = cap + Q
    if ratio != 1.0:
        capacity = max(decode_budget, len(kept) + Q + T - P)  # never full: compressions make room
    else:
        capacity = decode_budget + N - 1
    state = widen(state, slots, cap, capacity - cap, group.seed)
    cache = np.zeros(capacity, np.int64)
    cache[:len(kept)] = kept
    run = _Run(policy, state, cache, len(kept), slots)
    trace = new_trace(group)
    snap_steps = snapshot_steps(group, budget if cap == budget else cap)
    trace.snapshots = np.full((snap_steps.shape[0], capacity), -1, np.int64)
    out = Outputs(trace.mass, trace.cache_size, trace.recall, trace.error, snap_steps,
                  trace.snapshots)
    decode = policy.steps.decode
    if Q:  # the question joins without eviction; its queries attend and the policy observes
        G, dv = len(group.heads), group.full_output.shape[2]
        ctx = Context(group.field, group.row_max, group.row_sum, group.heads, P - Q,
                      group.important, np.zeros((G, Q, dv)), P - Q, P)
        scratch = Outputs(np.zeros((G, Q)), np.zeros(Q, np.int64), np.zeros((G, Q)),
                          np.zeros((G, Q)), np.zeros(0, np.int64), np.zeros((0, capacity), np.int64))
        run.n = decode(ctx, scratch, cache, run.n, run.state)
    t = P
    if N == 1 and ratio == 1.0:  # before the question only: the per-step rule at B + Q
        t = T
        run.n = decode(context(group), out, cache, run.n, run.state)
    while t < T:
        if ratio != 1.0:  # the next step t' >= t with (t' - P + 1) mod N = 0
            stop = t + (-(t - P + 1)) % N
        else:  # the step at which the cache is full
            stop = t + capacity - run.n
        stop = min(stop, T)
        if stop > t:
            run.n = decode(context(group, t, stop), out, cache, run.n, run.state)
            t = stop
        if t < T:
            if ratio != 1.0:
                target = max(1, int(ratio * (t + 1))) - 1
            else:
                target = decode_budget - 1
            run.compress(target, t, group.seed)
            run.n = decode(context(group, t, t + 1), out, cache, run.n, run.state)
            t += 1
    trace.kept = np.sort(cache[:run.n])
    return trace
