"""``full``: keep every key (the reference; mass 1 at every step)."""

import numpy as np

from kvsim.policies.base import Group, Policy, Trace, run_decode


def _run(group: Group, budget: int, params: dict) -> Trace:
    # A capacity of T is never reached before the last step, so nothing is evicted.
    return run_decode(group, group.T, np.arange(group.prompt_len))


def _run_budgets(group: Group, budgets: list[int], params: dict) -> list[Trace]:
    # The budget is ignored: one run serves every budget (and its cache needs no snapshots).
    trace = _run(group, 0, params)
    return [trace] * len(budgets)


POLICY = Policy("full", "keep everything (reference, mass 1; budget ignored)", {}, _run,
                budgeted=False, run_budgets=_run_budgets)
