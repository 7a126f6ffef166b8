"""A policy's run under KIVI storage (``[experiment.quantize]``): the policy decides on
the exact attention (open loop, as every simulator run), and its cache at every decode
step is then measured over quantised keys and values
(:func:`kvsim.numerics.quantize.quantised_steps`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvsim.numerics.quantize import Quantize, quantised_steps
from kvsim.policies import Group, Policy, Trace
from kvsim.protocols.run import run_budgets, run_capped


def run_quantised(policy: Policy, group: Group, budget: int, cap: int | None, params: dict,
                  focus: bool, source: str, quant: Quantize) -> Trace:
    """One trace of ``policy`` at ``budget`` (at most ``cap`` keys if given: an allocation's
    cap) whose mass and output error are those of attention over the quantised cache.
    The trace keeps cache snapshots only if ``focus`` and the group records them."""
    steps = group.T - group.prompt_len
    width = group.T if not policy.budgeted else (budget if cap is None else cap)
    every = dataclasses.replace(group, snap_budget=width, snap_steps=np.arange(steps))
    if cap is None or not policy.budgeted:
        trace = run_budgets(policy, every, [budget], params, source)[0]
    else:
        trace = run_capped(policy, every, cap, budget, params, True, source)
    trace = dataclasses.replace(trace, mass=trace.mass.copy(), error=trace.error.copy())
    if steps:
        quantised_steps(group.field, group.row_max, group.row_sum, group.heads,
                        group.prompt_len, trace.snapshots,
                        np.ascontiguousarray(group.keys, np.float64),
                        np.ascontiguousarray(group.values, np.float64), quant.bits,
                        quant.group, quant.residual, group.full_output, trace.mass,
                        trace.error)
    keep = focus and group.snap_budget >= 0
    trace.snapshots = trace.snapshots[group.snap_steps] if keep else np.zeros((0, 0), np.int64)
    return trace
