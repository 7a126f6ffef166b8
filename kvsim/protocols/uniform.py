"""``heads = "uniform"``: one ranking for every KV head of a layer, as a paged serving engine
needs (a page spans all heads).

Every KV head of the layer holds the same cache. Each keeps its own policy state, learning
from its own query heads' attention through that cache (its own compiled decode loop); a
decision ranks the cached keys by the **sum over the layer's KV heads** (in order) of their
current scores (``Steps.rank``), protects what the policy protects, and removes the same
keys from every KV head. Per step: when key ``t`` would exceed ``B``, the lowest-ranked
unprotected key goes first (higher sum, then lower position ranks above). With ``page = S``:
the pages of :func:`kvsim.protocols.pages.paged`, ranked by the summed scores. The prefill
keeps the ``recent`` newest prompt keys and the top ``B - recent`` older ones by the
summed prefill scores.

A run on one KV head simulates the layer jointly and reports its own KV head (as
``openvino`` does; docs/semantics.md).
"""

from __future__ import annotations

import numpy as np

from kvsim.numerics.decode import Outputs
from kvsim.params import Param
from kvsim.policies.base import Group, Policy, Trace, context, new_trace, snapshot_steps
from kvsim.policies.layout import widen
from kvsim.protocols.base import Protocol
from kvsim.protocols.cache import Run
from kvsim.protocols.pages import paged


class LayerRun(Run):
    """The runs of every KV head of a layer over one cache, ranked together; reads as the
    run of its own KV head ``own`` (its cache, size and state)."""

    def __init__(self, runs: list[Run], groups: list[Group], outs: list[Outputs], own: int):
        self.runs, self.groups, self.outs, self.own = runs, groups, outs, own
        self.policy = runs[own].policy

    @property
    def cache(self) -> np.ndarray:
        return self.runs[self.own].cache

    @property
    def n(self) -> int:
        return self.runs[self.own].n

    @property
    def state(self):
        return self.runs[self.own].state

    def scores(self, t: int, seed: int):
        """The KV heads' current scores summed in order; the protected positions (alike in
        every KV head: they are positions)."""
        total, protected = None, None
        for run, group in zip(self.runs, self.groups):
            value, guard = run.scores(t, group.seed)
            total = np.array(value, np.float64) if total is None else total + value
            protected = guard if protected is None else protected
        return total, protected

    def remove(self, drop: np.ndarray) -> None:
        for run in self.runs:
            run.remove(drop)

    def span(self, group: Group, out: Outputs, t: int, stop: int) -> None:
        """Every KV head's own decode loop over tokens ``t .. stop-1``."""
        for run, member, member_out in zip(self.runs, self.groups, self.outs):
            run.span(member, member_out, t, stop)


def member(policy: Policy, group: Group, first: int, cap: int, params: dict,
           recent: int | None = None) -> tuple[Run, Outputs, Trace]:
    """One KV head started at budget ``first`` (the policy's own prefill; the recent count
    ``recent`` where given), room for every decode key, its outputs (cache snapshots at
    ``cap``)."""
    P, T, layout = group.prompt_len, group.T, policy.layout
    kept, state = policy.steps.start(group, first, params, T)
    if recent is not None and layout.recent is not None:
        state = state._replace(recent=recent)
    capacity = max(first, len(kept)) + T - P
    state = widen(state, layout, params, first, capacity - first, group.seed)
    cache = np.zeros(capacity, np.int64)
    cache[:len(kept)] = kept
    trace = new_trace(group)
    snap_steps = snapshot_steps(group, cap)
    trace.snapshots = np.full((snap_steps.shape[0], capacity), -1, np.int64)
    out = Outputs(trace.mass, trace.cache_size, trace.recall, trace.error, snap_steps,
                  trace.snapshots)
    return Run(policy, state, cache, len(kept), layout.slot_fields(params)), out, trace


def layer_prefill(run: LayerRun, P: int, budget: int, recent: int) -> None:
    """Keep the ``recent`` newest prompt keys and the top ``budget - recent`` others by the
    summed prefill scores (higher, then lower position)."""
    if run.n <= budget:
        return
    value, _ = run.scores(-1, 0)
    pos = run.cache[:run.n]
    free = np.flatnonzero(pos < P - recent)
    best = free[np.lexsort((pos[free], -value[free]))][:budget - (run.n - free.size)]
    run.remove(np.setdiff1d(free, best))


def run_uniform(policy: Policy, group: Group, budget: int, cap: int, params: dict,
                proto: dict) -> Trace:
    """``policy`` with one ranking for the layer of ``group``, at most ``cap`` keys with the
    fixed parts of ``budget`` (pages of ``proto["page"]`` where given); the trace of
    ``group``'s KV head."""
    members = group.layer_groups()
    recent = policy.layout.recent(budget, params) if policy.layout.recent is not None else None
    started = [member(policy, m, max(group.prompt_len, 1), cap, params, recent)
               for m in members]  # every prompt key scored
    run = LayerRun([s[0] for s in started], members, [s[1] for s in started], group.kv_head)
    own_out, trace = started[group.kv_head][1:]
    P, T = group.prompt_len, group.T
    if proto["page"] != 1:
        paged(run, group, own_out, proto["page"], proto["page_reduce"], cap)
    else:
        layer_prefill(run, P, cap, policy.layout.recent_count(budget, params))
        t = P
        while t < T:
            if run.n + 1 > cap:
                run.compress(cap - 1, t, group.seed)
            stop = min(T, t + max(1, cap - run.n))  # up to the next full cache
            run.span(group, own_out, t, stop)
            t = stop
    trace.kept = np.sort(run.cache[:run.n])
    return trace


def _check(policy: Policy, proto: dict, params: dict, budget: int, P: int, T: int) -> str | None:
    position_rule = policy.layout.position_rule
    if policy.steps.rank is not None and not position_rule and not policy.layout.seeded_rank:
        return None
    return (f"{policy.name} takes no heads = \"uniform\": "
            + ("a position rule already decides alike for every KV head" if position_rule
               else "its random orders, seeded per KV head, have no sum to rank a layer by"
               if policy.layout.seeded_rank else "it gives no per-key scores to sum over the "
               "layer's KV heads (Steps.rank)"))


HEADS = ("per_head", "uniform")
"""``heads``: a ranking per KV head (the default), or one for a whole layer."""

PROTOCOL = Protocol(
    "heads",
    params={"heads": Param(str, "per_head", "one ranking per KV head, or one for every KV head "
                           "of a layer (the sum of their scores)", choices=HEADS)},
    asked=lambda proto: "heads" if proto["heads"] != "per_head" else None,
    label=lambda proto: f"heads={proto['heads']}",
    check=_check,
    combines=("page",),
    run=run_uniform,
    steps_in_model=True,
    layer_wide=lambda proto: proto["heads"] != "per_head",
)
