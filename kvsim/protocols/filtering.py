"""``filtering``: kvpress's append-only decode filters (kvpress pull request 258 at its head
``48cc0e2``: ``FilteringPress`` and ``UniformFilteringPress``): one keep-or-drop decision per new decode
key, nothing older ever evicted.

The prefill is the policy's own at ``B``. At decode step ``t`` key ``t`` joins and query
``t`` attends (the key is seen by its own query, as in kvpress, whose press runs after the
step); then the policy's current scores of the cached keys (``Steps.rank``, key ``t``
included) judge key ``t`` against the ``n_kept``-th highest score; it stays iff its score is
``>=`` that threshold (ties keep it), or when ``n_kept`` reaches the cache:

- ``"per_head"`` (FilteringPress): each KV head decides for itself, ``n_kept =
  max(1, int((t + 1) * (1 - filter_ratio)))`` (the tokens seen: the cache tracks ``(1 - r)``
  of them, whatever it holds now);
- ``"majority"`` (UniformFilteringPress): ``n_kept = max(1, int(n * (1 - filter_ratio)))``,
  ``n`` the cache with key ``t``; each KV head of the layer votes, and key ``t`` leaves every
  KV head unless at least half vote to keep it (a joint run of the layer, as
  ``heads = "uniform"``).

``filter_ratio`` is kvpress's ``target_compression_ratio``: the fraction **removed**. The cache
size is an outcome; results report the memory held.
"""

from __future__ import annotations

import numpy as np

from kvsim.params import Param
from kvsim.policies.base import Group, Policy, Trace
from kvsim.protocols.base import Protocol, judges_scores
from kvsim.protocols.cache import Run
from kvsim.protocols.uniform import member

def survives(value: np.ndarray, n_kept: int) -> bool:
    """Whether the newest key (``value[-1]``) is among the ``n_kept`` highest scores, ties
    kept (kvpress: ``new >= threshold``)."""
    if n_kept >= value.shape[0]:
        return True
    return bool(value[-1] >= np.sort(value)[::-1][n_kept - 1])


def per_head_target(t: int, ratio: float) -> int:
    """FilteringPress's ``n_kept`` at token ``t``: ``(1 - ratio)`` of the ``t + 1`` tokens
    seen, floored, at least 1."""
    return max(1, int((t + 1) * (1.0 - ratio)))


def majority_target(n: int, ratio: float) -> int:
    """UniformFilteringPress's ``n_kept`` over a cache of ``n`` keys."""
    return max(1, int(n * (1.0 - ratio)))


def _judge(run: Run, group: Group, t: int) -> np.ndarray:
    """The current scores of the cached keys after query ``t`` (key ``t`` last)."""
    value, _ = run.scores(t + 1, group.seed)
    return value[:run.n]


def run_filtering(policy: Policy, group: Group, budget: int, cap: int, params: dict,
                  proto: dict) -> Trace:
    """``policy`` filtered per head or by majority; the trace of ``group``'s KV head."""
    mode, ratio = proto["filtering"], proto["filter_ratio"]
    members = group.layer_groups() if mode == "majority" else [group]
    own = group.kv_head if mode == "majority" else 0
    recent = policy.layout.recent(budget, params) if policy.layout.recent is not None else None
    started = [member(policy, m, cap, cap, params, recent) for m in members]
    runs = [s[0] for s in started]
    for t in range(group.prompt_len, group.T):
        for run, m, (_, out, _) in zip(runs, members, started):
            run.span(m, out, t, t + 1)
        if mode == "per_head":
            keep = survives(_judge(runs[0], group, t), per_head_target(t, ratio))
        else:
            n_kept = majority_target(runs[0].n, ratio)
            votes = [survives(_judge(r, m, t), n_kept) for r, m in zip(runs, members)]
            keep = 2 * sum(votes) >= len(votes)
        if not keep:
            for run in runs:
                run.remove(np.array([run.n - 1]))
    trace = started[own][2]
    trace.kept = np.sort(runs[own].cache[:runs[own].n])
    return trace


FILTERING = ("off", "per_head", "majority")

PROTOCOL = Protocol(
    "filtering",
    params={
        "filtering": Param(str, "off", "append-only keep-or-drop of each decode key: per KV "
                           "head (kvpress FilteringPress) or by the layer's majority "
                           "(UniformFilteringPress)", choices=FILTERING),
        "filter_ratio": Param(float, 0.5, "the fraction of the tokens seen a filter removes "
                              "(kvpress's target_compression_ratio)",
                              check=lambda v: 0.0 <= v < 1.0, expect="a number in [0, 1)"),
    },
    asked=lambda proto: "filtering" if proto["filtering"] != "off" else None,
    label=lambda proto: f"filtering={proto['filtering']}/ratio={proto['filter_ratio']:g}",
    check=lambda policy, proto, params, budget, P, T: judges_scores(policy, "filtering"),
    extra=lambda proto: None,
    run=run_filtering,
    layer_wide=lambda proto: proto["filtering"] == "majority",
)
