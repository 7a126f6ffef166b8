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

from kvsim.numerics.decode import Context, Outputs
from kvsim.policies.base import Group, Policy, Trace, context, new_trace, snapshot_steps
from kvsim.policies.layout import widen
from kvsim.protocols import question
from kvsim.protocols.cache import Run, paged, protected
from kvsim.protocols.filtering import run_filtering
from kvsim.protocols.settings import before_question, split
from kvsim.protocols.uniform import run_uniform


def peak_limit(budget: int, params: dict, T: int) -> int:
    """The most keys a run at ``budget`` may hold at once under the protocol of ``params``."""
    _, proto = split(params)
    if proto["target_ratio"] != 1.0 or proto["threshold"] is not None \
            or proto["filtering"] != "off":
        return T
    return budget + before_question(proto) + proto["interval"] - 1


def run_protocol(policy: Policy, group: Group, budget: int, params: dict,
                 cap: int | None = None) -> Trace:
    """``policy`` on one KV head under the protocol of ``params``, with hard cap ``cap``
    (default ``budget``; budget allocation gives a head its own) and the fixed parts of
    ``budget``."""
    own, proto = split(params)
    cap = budget if cap is None else cap
    if proto["heads"] == "uniform":
        return run_uniform(policy, group, budget, cap, own, proto)
    if proto["filtering"] != "off":
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
    if proto["page"] != 1:
        paged(run, group, out, proto["page"], proto["page_reduce"], cap)
    elif proto["threshold"] is not None:
        _thresholded(run, group, out, proto["threshold"], proto["threshold_window"])
    elif proto["interval"] == 1 and proto["target_ratio"] == 1.0:  # before the question only:
        run.n = policy.steps.decode(context(group), out, cache, run.n, run.state)  # per step
    else:
        _batched(run, group, out, plan.budget, proto["interval"], proto["target_ratio"], own)
    trace.kept = np.sort(cache[:run.n])
    return trace


def _batched(run: Run, group: Group, out: Outputs, B: int, N: int, ratio: float,
             params: dict) -> None:
    """``interval = N``: down to ``B - 1`` keys when ``t`` would exceed ``B + N - 1``; with
    a ``ratio``, down to ``K - 1`` keys every ``N`` steps, ``K = max(1, floor(r (t + 1)))``.
    A policy that re-scores reads the decode queries since the last compression (or P)."""
    P, T, capacity = group.prompt_len, group.T, run.cache.shape[0]
    t = since = P
    at = P + N - 1 if ratio != 1.0 else P + capacity - run.n  # the next compression step
    while t < T:
        if at > t:  # the policy's own loop up to it (t joins there after a compression)
            run.span(group, out, t, min(at, T))
            t = min(at, T)
            continue
        run.compress(max(1, int(ratio * (t + 1))) - 1 if ratio != 1.0 else B - 1, t, group.seed,
                     since, group, params)
        since = t
        at = t + N if ratio != 1.0 else t + capacity - run.n


def _thresholded(run: Run, group: Group, out: Outputs, tau: float, w: int) -> None:
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
        run.span(group, out, t, t + 1)
