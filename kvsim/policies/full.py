"""``full``: keep every key (the reference; mass 1 at every step).

Its cache at step t is every key ``0 .. t``, so its observed attention is the full row
itself: the trace comes straight from the full pass, with no decode loop.
"""

import numpy as np

from kvsim.policies.base import Group, Policy, Presentation, Trace, new_trace, snapshot_steps


def _run(group: Group, budget: int, params: dict) -> Trace:
    P, T = group.prompt_len, group.T
    trace = new_trace(group)
    trace.mass[:] = np.stack([p.decode_mass for p in group.passes()])
    trace.cache_size[:] = np.arange(P + 1, T + 1)
    # Every important key seen so far is cached: recall 1 wherever there is one.
    seen = np.cumsum(group.important, axis=1)[:, P:]
    trace.recall[:] = np.where(seen > 0, 1.0, np.nan)
    o = group.full_output
    if o.shape[2] > 0:  # observed output: o(t) renormalised by the row's mass
        norm = np.sqrt((o ** 2).sum(axis=2))
        diff = np.sqrt(((o / trace.mass[:, :, None] - o) ** 2).sum(axis=2))
        trace.error[:] = np.divide(diff, norm, out=np.zeros_like(norm), where=norm > 0.0)
    trace.kept = np.arange(T)
    steps = snapshot_steps(group, T)
    positions = np.arange(T)
    trace.snapshots = np.where(positions[None, :] <= P + steps[:, None], positions[None, :], -1)
    return trace


def _run_budgets(group: Group, budgets: list[int], params: dict) -> list[Trace]:
    # The budget is ignored: one run serves every budget.
    trace = _run(group, 0, params)
    return [trace] * len(budgets)


POLICY = Policy("full", "keep everything (reference, mass 1; budget ignored)", {}, run=_run,
                budgeted=False, run_budgets=_run_budgets,
                closed_loop=lambda params: "it keeps every key: run the model uncompressed",
                presentation=Presentation(
                    family="reference", color="#000000", marker="o",
                    reads="nothing",
                    rule="keeps everything; the reference (mass 1)"))
