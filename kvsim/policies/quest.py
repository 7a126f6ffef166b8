"""``quest``: query-aware page selection without eviction (Tang et al. 2024).

Every key stays in memory. Keys form pages of ``page_size`` positions, each holding the
per-dimension minimum ``m`` and maximum ``M`` of its keys. Query ``t`` attends only to the
positions ``<= t`` of ``floor(B / page_size)`` pages: the page holding ``t`` and the
best-ranked earlier pages by the bound ``u = sum_d max(q_d M_d, q_d m_d)`` on its logits'
q.k term (``q`` scaled by the head's logit scale; the query heads of a group combined by
``gqa``; ties to the lower page). The prefill attends fully. ``cache_size`` counts the keys
read, not the keys held: Quest saves attention reads, not memory.
"""

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.decode import Outputs, cached_important, count_important, record, snapshot
from kvsim.numerics.field import probs_at
from kvsim.numerics.jit import jit
from kvsim.policies.base import Group, Param, Policy, Presentation, Trace, context, new_trace, snapshot_steps

PARAMS = {
    "page_size": Param(int, 16, "positions per page", check=lambda v: v >= 1,
                       expect="an integer >= 1"),
}


@jit
def page_bounds(keys, page_size):
    """(pages, d) per-dimension minimum and maximum of the keys (d, T) of each page."""
    d, T = keys.shape
    pages = (T + page_size - 1) // page_size
    lo = np.empty((pages, d))
    hi = np.empty((pages, d))
    for p in range(pages):
        for i in range(d):
            a = np.float64(keys[i, p * page_size])
            b = a
            for k in range(p * page_size + 1, min(T, (p + 1) * page_size)):
                x = np.float64(keys[i, k])
                a = min(a, x)
                b = max(b, x)
            lo[p, i] = a
            hi[p, i] = b
    return lo, hi


@jit
def select(f, heads, t, n_pages, page_size, gqa, lo, hi, bound, combined, cache):
    """Fill ``cache`` with the positions query ``t`` reads; returns how many."""
    current = t // page_size
    earlier = current
    chosen = np.arange(current)
    if current >= n_pages and n_pages == 1:
        earlier = 0
    elif current >= n_pages:
        for g in range(heads.shape[0]):
            h = heads[g]
            for p in range(current):
                total = 0.0
                for i in range(lo.shape[1]):
                    q = f.qk_scale[h] * np.float64(f.queries[h, t, i])
                    total += max(q * hi[p, i], q * lo[p, i])
                bound[g, p] = total
        kernels.combine_rows(bound, current, gqa, combined)
        chosen = kernels.top_ranked(combined[:current], 0, current, n_pages - 1)
        earlier = n_pages - 1
    n = 0
    for r in range(earlier + 1):
        p = chosen[r] if r < earlier else current
        for k in range(p * page_size, min((p + 1) * page_size, t + 1)):
            cache[n] = k
            n += 1
    return n


@jit
def decode(ctx, n_pages, page_size, gqa, out, kept):
    """Per step, attend to the selected pages; returns the number of keys in ``kept`` (the
    last step's selection, or query ``prompt_len - 1``'s without decode steps)."""
    f, heads, prompt_len, important = ctx.field, ctx.heads, ctx.prompt_len, ctx.important
    T = f.key_bias.shape[1]
    G = heads.shape[0]
    kv = heads[0] // f.group
    lo, hi = page_bounds(f.keys[kv], page_size)
    values = f.values[kv]
    budget = n_pages * page_size
    bound = np.empty((G, lo.shape[0]))
    combined = np.empty(lo.shape[0])
    cache = np.empty(budget, np.int64)
    obs = np.empty((G, budget))
    work = np.empty(budget)
    mass = np.empty(G)
    hits = np.empty(G, np.int64)
    outputs = np.empty((G, ctx.full_output.shape[2]))
    n_important = count_important(important, prompt_len)
    no_cache = np.zeros((0, 0))
    snap = 0
    n = 0
    for t in range(max(prompt_len - 1, 0), T):
        n = select(f, heads, t, n_pages, page_size, gqa, lo, hi, bound, combined, cache)
        if t < prompt_len:
            continue
        step = t - prompt_len
        for g in range(G):
            n_important[g] += important[g, t]
            probs_at(f, ctx.row_max, ctx.row_sum, heads[g], t, cache, n, obs[g], work, no_cache)
        out.cache_size[step] = n
        cached_important(important, cache, n, hits)
        record(values, ctx.full_output, cache, n, hits, n_important, step, obs, mass, outputs,
               out.mass, out.recall, out.error)
        snap = snapshot(cache, n, step, out.snap_steps, out.snapshots, snap)
    for j in range(n):
        kept[j] = cache[j]
    return n


def _run(group: Group, budget: int, params: dict) -> Trace:
    trace = new_trace(group)
    snap_steps = snapshot_steps(group, budget)
    trace.snapshots = np.full((snap_steps.shape[0], budget), -1, np.int64)
    kept = np.zeros(budget, np.int64)
    page_size = params["page_size"]
    out = Outputs(trace.mass, trace.cache_size, trace.recall, trace.error, snap_steps,
                  trace.snapshots)
    n = decode(context(group), budget // page_size, page_size, group.gqa, out, kept)
    trace.kept = np.sort(kept[:n])
    return trace


POLICY = Policy("quest", "per query, the pages whose key bounds promise the largest q.k "
                "(selection, no eviction)", PARAMS, run=_run,
                closed_loop=lambda params: "it selects pages from each query vector before "
                "attention, which the Stepper does not receive",
                min_budget=lambda params: params["page_size"], needs=frozenset({"queries", "keys"}),
                floor_reason="one page",
                presentation=Presentation(
                    family="query pages", color="#000080", marker="s",
                    reads="queries, keys",
                    rule=("Quest (Tang et al. 2024): no eviction; query `t` reads its own page + the "
                          "`floor(B/page_size) - 1` pages with the highest bound `sum_d max(q_d M_d, q_d "
                          "m_d)` (cache size = keys read, not memory)")))
