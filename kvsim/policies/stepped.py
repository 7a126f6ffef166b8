"""Helpers shared by the policies written as a state plus ``admit`` and ``observe``."""

from __future__ import annotations

import numpy as np

from kvsim.numerics.jit import jit_inline
from kvsim.numerics.kernels import combine_rows, row_sums
from kvsim.numerics.steploop import Context, Outputs
from kvsim.policies.base import Group, Trace, new_trace, snapshot_steps


@jit_inline
def lowest_ranked_slot(cache, n, score, limit):
    """Slot of the worst-ranked key among positions < limit: the lowest score, and among
    equal lowest scores the highest position; -1 if there is none."""
    best = -1
    for j in range(n):
        if cache[j] < limit:
            if best < 0 or score[j] < score[best] or (score[j] == score[best]
                                                      and cache[j] > cache[best]):
                best = j
    return best


@jit_inline
def observed_combined(obs, mass, n, gqa, rows, out):
    """``out[:n]``: the observed attention ``p~ = p / mass`` of each head (0 where no mass is
    kept), combined over the heads by ``gqa``; ``rows`` (G, >= n) is scratch."""
    for g in range(obs.shape[0]):
        m = mass[g]
        for j in range(n):
            rows[g, j] = obs[g, j] / m if m > 0.0 else 0.0
    combine_rows(rows, n, gqa, out)


def run_stepped(group: Group, budget: int, kept: np.ndarray, state, kernel) -> Trace:
    """Run a policy's decode ``kernel(ctx, out, cache, n, state)`` from the prefill selection
    ``kept`` (its slot order is ``state``'s) and return the :class:`Trace`."""
    trace = new_trace(group)
    cache = np.zeros(budget, np.int64)
    cache[:kept.shape[0]] = kept
    snap_steps = snapshot_steps(group, budget)
    trace.snapshots = np.full((snap_steps.shape[0], budget), -1, np.int64)
    ctx = Context(group.field, group.row_max, group.row_sum, group.heads, group.prompt_len,
                  group.important, group.full_output)
    out = Outputs(trace.mass, trace.cache_size, trace.recall, trace.error, snap_steps,
                  trace.snapshots)
    n = kernel(ctx, out, cache, kept.shape[0], state)
    trace.kept = np.sort(cache[:n])
    return trace


def head_rows(group: Group, q: int) -> list[np.ndarray]:
    """Full attention row of query ``q`` (keys ``0 .. q``) of each head of the group."""
    return [row_sums(group.field, group.row_max, group.row_sum, int(h), q, q + 1)[:q + 1]
            for h in group.heads]
