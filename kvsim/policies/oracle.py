"""``oracle``: per step, the keys with the largest full attention (unrealisable bound)."""

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.decode import cached_important, copy_kept, count_important, record, snapshot
from kvsim.numerics.field import component_probs_row
from kvsim.numerics.jit import bound_kernel, jit_inline
from kvsim.policies.base import Group, Policy, Presentation, Trace, new_trace


@jit_inline
def dense_row(probs, f, row_max, row_sum, h, q, keys, n, out, work):
    """The full row of head ``h`` at query ``q`` over keys ``0 .. n-1`` of a dense field
    (``f`` is None)."""
    for k in range(n):
        out[k] = probs[h, q, k]


@jit_inline
def component_row(probs, f, row_max, row_sum, h, q, keys, n, out, work):
    """:func:`kvsim.numerics.field.component_probs_row` (``probs`` is unused)."""
    component_probs_row(f, row_max, row_sum, h, q, keys, n, out, work)


def _oracle(probs, f, row_max, row_sum, heads, values, prompt_len, important, full_output,
            budgets, by_size, gqa, out_mass, out_size, out_recall, out_error, out_kept,
            snap_steps, snapshots):
    """Per step and budget, cache the best-ranked keys of the group's combined full row,
    each full row from ``row`` (a global: :func:`kvsim.numerics.field.probs_row`'s
    arguments; :data:`oracle_loop`, :data:`dense_oracle_loop`).

    Every budget ``budgets[i]`` (``by_size``: their indices, largest budget first) shares
    one evaluation of each row; its outputs are ``out_*[i]``, ``snapshots[i]`` its caches
    at ``snap_steps``, and ``out_kept[i, :n]`` its last cached set (the prefill selection
    when there are no decode steps). Returns the number of kept keys per budget. The
    context comes unpacked (as :class:`kvsim.numerics.decode.DecodeLoop` gives it): ``f``
    is the field (None for a dense one, whose rows are ``probs``), ``values`` the KV
    head's (T, dv).
    """
    T = important.shape[1]
    G = heads.shape[0]
    rows = np.empty((G, T))
    work = np.empty(T)
    keys = np.arange(T)
    combined = np.empty(T)
    cache = np.empty(T, np.int64)
    chosen = np.empty(T, np.int64)
    value = np.empty(T)
    guess = 0.0
    hits = np.empty(G, np.int64)
    obs = np.empty((G, T))
    mass = np.empty(G)
    outputs = np.empty((G, full_output.shape[2]))
    kept = np.zeros(budgets.shape[0], np.int64)
    n_important = count_important(important, prompt_len)
    snap = 0
    advanced = 0
    for t in range(max(prompt_len - 1, 0), T):
        step = t - prompt_len
        if t >= prompt_len:
            for g in range(G):
                if important[g, t]:
                    n_important[g] += 1
        for g in range(G):
            row(probs, f, row_max, row_sum, heads[g], t, keys, t + 1, rows[g], work)  # noqa: F821
        kernels.combine_rows(rows, t + 1, gqa, combined)
        # Budgets from the largest down: each one's keys are the best-ranked of the
        # previous (larger) selection, which holds them all, as the ranking is total.
        m = t + 1
        for r in range(budgets.shape[0]):
            i = by_size[r]
            if r == 0:
                n, kth = kernels._top_ranked_above(combined, m, budgets[i], guess, chosen, cache, value)
                guess = 0.9 * kth  # rows change slowly: near the last threshold
                for j in range(n):
                    cache[j] = chosen[j]
                    value[j] = combined[chosen[j]]
            else:
                n = kernels._top_ranked_linear(value, m, budgets[i], chosen)
                for j in range(n):  # in place: chosen is ascending, chosen[j] >= j
                    cache[j] = cache[chosen[j]]
                    value[j] = value[chosen[j]]
            m = n
            kept[i] = n
            if t < prompt_len:
                copy_kept(cache, n, out_kept[i])
                continue  # the prefill selection, by the last prompt query
            for g in range(G):
                for j in range(n):
                    obs[g, j] = rows[g, cache[j]]
            out_size[i, step] = n
            cached_important(important, cache, n, hits)
            record(values, full_output, cache, n, hits, n_important, step, obs, mass, outputs,
                   out_mass[i], out_recall[i], out_error[i])
            advanced = snapshot(cache, n, step, snap_steps, snapshots[i], snap)
            if t == T - 1:
                copy_kept(cache, n, out_kept[i])
        if t >= prompt_len:
            snap = advanced  # every budget recorded this step's snapshot, or none did
    return kept


oracle_loop = bound_kernel(_oracle, "oracle_loop", __name__, row=component_row)
"""The oracle over a component field."""
dense_oracle_loop = bound_kernel(_oracle, "dense_oracle_loop", __name__, row=dense_row)
"""The oracle over a dense field: a kernel of its own, so that a run over dense matrices
compiles none of the logit code."""


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
    f = group.field
    loop = dense_oracle_loop if f.is_dense else oracle_loop
    counts = loop(f.probs, None if f.is_dense else f, group.row_max, group.row_sum, group.heads,
                  f.values[group.kv_head], group.prompt_len, group.important, group.full_output,
                  sizes, np.argsort(-sizes, kind="stable"), group.gqa,
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
                "closed loop does not have",
                presentation=Presentation(
                    family="reference", color="#bcbd22", marker="h",
                    reads="attention (full rows)",
                    rule=("per step, the `B` keys with the largest full attention: an unrealisable upper "
                          "bound")))
