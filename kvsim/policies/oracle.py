"""``oracle``: per step, the keys with the largest full attention (unrealisable bound)."""

import numpy as np

from kvsim.numerics import kernels
from kvsim.policies.base import Group, Policy, Trace, context, new_trace


def _run_budgets(group: Group, budgets: list[int], params: dict) -> list[Trace]:
    # All budgets share one evaluation of each full row.
    traces = [new_trace(group) for _ in budgets]
    stack = lambda name: np.stack([getattr(t, name) for t in traces])  # noqa: E731
    mass, size, recall, error = (stack(n) for n in ("mass", "cache_size", "recall", "error"))
    width = min(max(budgets), group.T)
    kept = np.zeros((len(budgets), width), np.int64)
    snap_steps = group.snap_steps if group.snap_budget in budgets else np.zeros(0, np.int64)
    snapshots = np.full((len(budgets), snap_steps.shape[0], width), -1, np.int64)
    sizes = np.asarray(budgets, np.int64)
    counts = kernels.oracle(context(group), sizes, np.argsort(-sizes, kind="stable"), group.gqa,
                            mass, size, recall, error, kept, snap_steps, snapshots)
    for i, (budget, trace) in enumerate(zip(budgets, traces)):
        trace.mass, trace.cache_size, trace.recall, trace.error = mass[i], size[i], recall[i], error[i]
        trace.kept = kept[i, :counts[i]].copy()
        if budget == group.snap_budget:
            trace.snapshots = snapshots[i, :, :budget]
    return traces


def _run(group: Group, budget: int, params: dict) -> Trace:
    return _run_budgets(group, [budget], params)[0]


POLICY = Policy("oracle", "per-step top B keys of the full attention (upper bound)", {},
                run=_run, run_budgets=_run_budgets,
                closed_loop=lambda params: "it ranks each step's full attention row, which a "
                "closed loop does not have")
