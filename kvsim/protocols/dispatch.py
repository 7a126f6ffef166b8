"""Run a policy under the protocol its settings ask for, as the registry declares it
(:mod:`kvsim.protocols.settings`).

A layer-wide protocol (``heads``, ``filtering``) runs the layer itself (``Protocol.run``).
Otherwise the policy starts on the prompt the question protocol gives it (the context
alone, before the question; :func:`kvsim.protocols.question.plan`), with the whole prompt
where the protocol judges every prompt key (``start_whole``: pages, thresholds); the
question's keys join without eviction; then the protocol's ``drive`` runs the decode
(batched compression, pages, thresholds), or the policy's own compiled loop (the
question alone).

Between two compressions the policy's own loop runs (its ``admit`` then only appends: the
cache is never full there), so the per-step path is the policy's own. A compression at
step ``t`` (before ``t`` joins) reads the scores the per-step rule would use at ``t``, once
(:meth:`kvsim.protocols.cache.Run.compress`):

- a policy with ``Steps.rank`` gives those scores (and the protected positions) itself; a
  ring (position rules) ranks by age, the slots below its ``base`` (sinks, pins) protected;
- otherwise (batched compression only) its ``admit`` on a full cache names the
  lowest-ranked key, which is removed, until ``m`` remain: the once-ranked top ``m`` for
  every rule whose scores of the cached keys do not depend on which other keys are cached.

Removal compacts the cache in slot order; the policy's per-slot state follows as its
declared layout says (``Policy.layout``, :class:`kvsim.policies.layout.StateLayout`: the
per-slot fields, a ``slot_of`` map of positions to slots, a ring ``base``/``start``/
``width`` re-aimed at its oldest key before ``admit`` names it).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kvsim.numerics.decode import Context, Outputs
from kvsim.policies.base import Group, Policy, Trace, context, new_trace, snapshot_steps
from kvsim.policies.layout import widen
from kvsim.protocols import question
from kvsim.protocols.cache import Run
from kvsim.protocols.settings import chosen, split


def run_protocol(policy: Policy, group: Group, budget: int, params: dict,
                 cap: int | None = None) -> Trace:
    """``policy`` on one KV head under the protocol of ``params``, with hard cap ``cap``
    (default ``budget``; budget allocation gives a head its own) and the fixed parts of
    ``budget``."""
    own, proto = split(params)
    cap = budget if cap is None else cap
    found = [p for _, p in chosen(proto)]
    whole = next((p for p in found if p.run is not None), None)
    if whole is not None:  # a layer-wide protocol runs the layer itself
        return whole.run(policy, group, budget, cap, own, proto)
    driver = next((p for p in found if p.drive is not None), None)
    P, T = group.prompt_len, group.T
    plan = question.plan(proto["compress"], P, proto["question_len"], cap)  # shared with tasks
    Q = plan.free
    start, layout = policy.steps.start, policy.layout
    if cap != budget and policy.run_capped is not None and layout.recent is not None:
        start = functools.partial(start, recent=layout.recent(budget, own))  # the mean's
    prompt = dataclasses.replace(group, prompt_len=plan.compress_at) if Q else group
    whole_prompt = driver is not None and driver.start_whole
    # such a protocol judges every prompt key: the policy starts with all of them
    first = max(P, 1) if whole_prompt else cap
    kept, state = start(prompt, first, own, T)
    if whole_prompt and layout.recent is not None:
        state = state._replace(recent=layout.recent(budget, own))
    slots = layout.slot_fields(own)
    capacity = plan.budget if driver is None else \
        driver.capacity(first, len(kept), Q, P, T, plan.budget, proto)
    state = widen(state, layout, own, first, capacity - first, group.seed)
    cache = np.zeros(capacity, np.int64)
    cache[:len(kept)] = kept
    run = Run(policy, state, cache, len(kept), slots)
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
    if driver is not None:
        driver.drive(run, group, out, plan.budget, proto, own)
    else:  # the question alone: the per-step rule after it
        run.n = policy.steps.decode(context(group), out, cache, run.n, run.state)
    trace.kept = np.sort(cache[:run.n])
    return trace
