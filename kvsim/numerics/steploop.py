"""The generic decode loop of a policy given as a state plus ``admit`` and ``observe``."""

from typing import NamedTuple

import numpy as np

from kvsim.numerics.field import probs_at
from kvsim.numerics.jit import jit_inline
from kvsim.numerics.kernels import _cached_important, _count_important, _record, _snapshot


class Context(NamedTuple):
    """What the loop reads about one KV head and the query heads sharing it."""

    field: tuple
    row_max: np.ndarray
    row_sum: np.ndarray
    heads: np.ndarray
    prompt_len: int
    important: np.ndarray
    full_output: np.ndarray


class Outputs(NamedTuple):
    """The per-step outputs the loop fills."""

    mass: np.ndarray
    cache_size: np.ndarray
    recall: np.ndarray
    error: np.ndarray
    snap_steps: np.ndarray
    snapshots: np.ndarray


@jit_inline
def step_loop(ctx, out, cache, n, state, admit, observe):
    """Decode steps ``prompt_len .. T-1``: ``admit(state, cache, n, t)`` gives the slot of
    token t (a slot to overwrite, or -1 to append), then query t attends over the cache and
    ``observe(state, cache, n, t, obs, mass)`` sees its full attention ``obs[g, :n]`` and
    the mass of each head. Returns the final number of cached keys."""
    f = ctx.field
    heads = ctx.heads
    budget = cache.shape[0]
    G = heads.shape[0]
    obs = np.empty((G, budget))
    mass = np.empty(G)
    approx = np.empty(ctx.full_output.shape[2])
    n_important = _count_important(ctx.important, ctx.prompt_len)
    hits = np.empty(G, np.int64)
    _cached_important(ctx.important, cache, n, hits)
    work = np.empty(budget)
    cached = np.zeros((0, 0))
    snap = 0
    for t in range(ctx.prompt_len, f.key_bias.shape[1]):
        step = t - ctx.prompt_len
        slot = admit(state, cache, n, t)
        if slot < 0:
            slot = n
            n += 1
        else:
            for g in range(G):
                hits[g] -= ctx.important[g, cache[slot]]
        cache[slot] = t
        for g in range(G):
            n_important[g] += ctx.important[g, t]
            hits[g] += ctx.important[g, t]
        out.cache_size[step] = n
        for g in range(G):
            probs_at(f, ctx.row_max, ctx.row_sum, heads[g], t, cache, n, obs[g], work, cached)
        _record(f, heads, cache, n, hits, n_important, ctx.full_output, step, obs, mass, approx,
                out.mass, out.recall, out.error)
        snap = _snapshot(cache, n, step, out.snap_steps, out.snapshots, snap)
        observe(state, cache, n, t, obs, mass)
    return n
