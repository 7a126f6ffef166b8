"""The generic decode loop: one KV head, token by token, driving a policy's two steps.

A policy is a state (a ``NamedTuple`` of arrays and scalars, defined at module level;
mutable counters are 1-element arrays) and two steps, compiled with ``jit_inline``:

``admit(state, cache, n, t) -> slot``
    Token ``t`` joins the cache ``cache[:n]`` (cached positions in slot order;
    ``cache.shape[0]`` is the budget). Return the slot it takes: ``n`` while the cache
    is not full, else the slot of the key to evict (``cache[slot]`` is still the evicted
    position). Set the policy's own per-slot state for ``t`` there; the loop then writes
    ``cache[slot] = t`` (and ``n += 1`` if ``slot == n``). Slots never move.
``observe(state, cache, n, obs, mass, outputs) -> None``
    Query ``t`` attended over ``cache[:n]``: ``obs[g, :n]`` is the attention of query
    head ``g`` of the group over the cache and ``mass[g]`` its sum (the observed
    attention is ``obs / mass``; ``obs`` may be overwritten); ``outputs[g]`` is the
    observed output ``o~`` of head ``g`` where the field has values (shape (G, 0)
    otherwise). Update the state from them.

The loop is generic: it knows no policy. Each policy compiles its own copy of it, with
its steps as globals: ``decode = decode_kernel("decode", admit, observe)``
(:func:`decode_kernel`, :func:`kvsim.numerics.jit.bound_kernel`), one per kind of field
(:class:`DecodeLoop`). The same ``admit``/``observe`` run
one step at a time from Python in :class:`kvsim.protocols.stepping.Stepper`.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from kvsim.numerics.field import FieldData, component_probs_at
from kvsim.numerics.jit import bound_kernel, jit, jit_inline
from kvsim.numerics.lanes import lane_sum
from kvsim.numerics.prefetch import prefetch


class Context(NamedTuple):
    """What the decode loop reads about one KV head and its ``G`` query heads."""

    field: FieldData
    row_max: np.ndarray      # (H, T) float64 row statistics of the full pass
    row_sum: np.ndarray      # (H, T) float64
    heads: np.ndarray        # (G,) int64: the query heads sharing this KV head
    prompt_len: int
    important: np.ndarray    # (G, T) bool: ground-truth positions per query head
    full_output: np.ndarray  # (G, steps, dv) float64: o(t), dv = 0 without values
    start: int               # the loop runs tokens start .. stop-1 (a protocol runs the
    stop: int                # decode in spans between its compressions; else P .. T-1)


class Outputs(NamedTuple):
    """What the decode loop writes, one entry per decode step ``t - prompt_len``."""

    mass: np.ndarray         # (G, steps) float64: full-attention mass of the cache
    cache_size: np.ndarray   # (steps,) int64
    recall: np.ndarray       # (G, steps) float64: share of important keys cached
    error: np.ndarray        # (G, steps) float64: relative output error (dv > 0)
    snap_steps: np.ndarray   # (S,) int64 ascending: steps whose cache is recorded
    snapshots: np.ndarray    # (S, width) int64: cached positions, -1 padded


@jit
def observed_outputs(values, cache, n, obs, mass, outputs):
    """``outputs[g] = sum_j (obs[g, j] / mass[g]) * values[cache[j]]``, in slot order: the
    observed output ``o~`` of each head (0 where no mass is kept)."""
    dv = outputs.shape[1]
    for g in range(outputs.shape[0]):
        m = mass[g]
        for i in range(dv):
            outputs[g, i] = 0.0
        for j in range(n):
            w = obs[g, j] / m if m > 0.0 else 0.0
            value = values[cache[j]]  # a row view: LLVM then vectorises over i
            for i in range(dv):
                outputs[g, i] += w * value[i]


@jit
def output_error(values, full_output, cache, n, step, obs, mass, outputs, out_error):
    """The relative output error of step ``step`` for each head, with values (T, dv):
    ``outputs`` gets ``o~``, compared with ``full_output``."""
    observed_outputs(values, cache, n, obs, mass, outputs)
    for g in range(obs.shape[0]):
        diff = 0.0
        norm = 0.0
        for i in range(outputs.shape[1]):
            diff += (outputs[g, i] - full_output[g, step, i]) ** 2
            norm += full_output[g, step, i] ** 2
        out_error[g, step] = np.sqrt(diff / norm) if norm > 0.0 else 0.0


@jit_inline
def record_plain(n, hits, n_important, step, obs, mass, out_mass, out_recall):
    """Mass and recall of step ``step``, as :func:`record` (without the output error)."""
    for g in range(obs.shape[0]):
        m = lane_sum(obs[g], n)
        mass[g] = m
        out_mass[g, step] = m
        out_recall[g, step] = hits[g] / n_important[g] if n_important[g] > 0 else np.nan


@jit
def record(values, full_output, cache, n, hits, n_important, step, obs, mass, outputs, out_mass,
           out_recall, out_error):
    """Metrics of step ``step`` from the full attention ``obs[g, :n]`` of each head over the
    cache: mass (into ``mass`` too), recall (``hits[g]`` of the ``n_important[g]`` important
    keys are cached) and, with values (T, dv), the output error against ``full_output``
    (``outputs`` gets ``o~``). One kernel that every decode loop calls once a step, not
    inlined into each: compiled once, not once per policy and kind of field."""
    record_plain(n, hits, n_important, step, obs, mass, out_mass, out_recall)
    if outputs.shape[1] > 0:
        output_error(values, full_output, cache, n, step, obs, mass, outputs, out_error)


@jit
def copy_kept(cache, n, out):
    """``out[:n] = cache[:n]``, as a loop: a slice copy would compile Numba's shape-mismatch
    error formatting into every kernel that uses it (seconds of cold start)."""
    for j in range(n):
        out[j] = cache[j]


@jit
def copy_snapshot(cache, n, snapshots, index):
    """``snapshots[index]``: ``cache[:n]``, -1 padded (loops, not slice copies: see
    copy_kept)."""
    for j in range(snapshots.shape[1]):
        snapshots[index, j] = cache[j] if j < n else -1


@jit_inline
def snapshot(cache, n, step, snap_steps, snapshots, index):
    """Copy the cache into ``snapshots[index]`` if ``step`` is the next snapshot step (one
    call, not inlined: the copy's loop inside the decode loop slows every step)."""
    if index < snap_steps.shape[0] and snap_steps[index] == step:
        copy_snapshot(cache, n, snapshots, index)
        return index + 1
    return index


@jit
def cached_important(important, cache, n, hits):
    """``hits[g]``: the number of query head g's important keys among ``cache[:n]``."""
    for g in range(important.shape[0]):
        hits[g] = 0
        for j in range(n):
            hits[g] += important[g, cache[j]]


@jit
def count_important(important, prompt_len):
    """Number of important keys before the first decode step, per query head."""
    counts = np.zeros(important.shape[0], np.int64)
    for g in range(important.shape[0]):
        for k in range(prompt_len):
            if important[g, k]:
                counts[g] += 1
    return counts


@jit_inline
def observe_nothing(state, cache, n, obs, mass, outputs):
    """The ``observe`` of a policy that learns nothing from attention (a ring, static
    scores, scores of the vectors only)."""
    return None


def is_plain(ctx: Context, out: Outputs) -> bool:
    """Whether a run is plain: one query head of a dense matrix, no values, no snapshots."""
    return (ctx.field.probs.shape[1] > 0 and ctx.heads.shape[0] == 1
            and ctx.full_output.shape[2] == 0 and out.snap_steps.shape[0] == 0)


@jit_inline
def _no_field(f, row_max, row_sum, h, q, keys, n, out, work, cached):
    """The ``field_probs`` of a loop for dense fields, which never calls it: the loop
    then inlines none of the logit code."""
    return None


class DecodeLoop:
    """A policy's compiled decode loop, called as ``loop(ctx, out, cache, n, state) -> n``:
    the steps ``admit`` and ``observe`` (``jit_inline``) driven token by token over decode
    steps ``ctx.start .. ctx.stop-1`` of one KV head, filling ``out`` (step
    ``t - prompt_len`` for token ``t``).

    ``cache[:n]`` holds the prefill selection (slot order) and ``state`` the policy's
    decode state; ``cache.shape[0]`` is the budget. Per step: ``admit`` the token, read
    the full attention of each query head over the cache, record the metrics and the
    snapshot, ``observe``. Returns the final number of cached keys.

    One kernel per kind of field (:meth:`for_field`: a dense matrix, or components), each
    compiled only when a run has that kind: a dense run compiles none of the logit code.
    """

    def __init__(self, name: str, admit, observe, plain: bool = False):
        module = admit.__module__ if numba.config.DISABLE_JIT else admit.py_func.__module__
        self.name, self.module, self.plain = name, module, plain
        bind = dict(admit=admit, observe=observe, PLAIN=plain)
        self.dense = bound_kernel(_decode_span, f"{name}.dense", module, DENSE=True,
                                  field_probs=_no_field, **bind)
        self.components = self.dense if plain else bound_kernel(
            _decode_span, f"{name}.components", module, DENSE=False, field_probs=component_probs_at,
            **bind)

    def for_field(self, dense: bool):
        """The kernel for a dense field (``dense``) or a component field."""
        return self.dense if dense else self.components

    def __call__(self, ctx: Context, out: Outputs, cache: np.ndarray, n: int, state) -> int:
        f = ctx.field
        dense = f.probs.shape[1] > 0
        if self.plain and not is_plain(ctx, out):
            raise ValueError("decode_plain: expected one dense head, no values, no snapshots")
        kv = int(ctx.heads[0]) // f.group
        # The bundles unpacked here, not in the kernel: a kernel taking them compiles
        # their unboxing and the reference counts of every array in them, about half of
        # a loop's compile time. A dense kernel takes no field (it reads ``probs`` only).
        return self.for_field(dense)(
            f.probs, None if dense else f, ctx.row_max, ctx.row_sum, ctx.heads, f.keys[kv],
            f.values[kv], ctx.prompt_len, ctx.important, ctx.full_output, ctx.start, ctx.stop,
            out.mass, out.cache_size, out.recall, out.error, out.snap_steps, out.snapshots,
            cache, n, state)

    def __repr__(self) -> str:
        return f"<decode loop {self.module}.{self.name}>"


def decode_kernel(name: str, admit, observe, plain: bool = False) -> DecodeLoop:
    """The decode loop ``name`` of the policy whose steps are ``admit`` and ``observe``
    (:class:`DecodeLoop`; it belongs to the module of ``admit``).

    ``plain``: a loop for plain runs only (:func:`is_plain`; any other run raises): the
    same steps and numbers, compiled without the code of the other cases (component
    fields, several heads, output error, snapshots), which slows each of its short steps
    by about half.
    """
    return DecodeLoop(name, admit, observe, plain)


def _decode_span(probs, f, row_max, row_sum, heads, keys, values, prompt_len, important,
                 full_output, start, stop, out_mass, cache_size, out_recall, out_error,
                 snap_steps, snapshots, cache, n, state):
    """The code of every policy's decode loop (:class:`DecodeLoop`, which unpacks its
    arguments from a :class:`Context` and :class:`Outputs`), compiled per policy and kind
    of field with the steps ``admit`` and ``observe``, the flags ``PLAIN`` and ``DENSE``
    and, for component fields, ``field_probs`` (:func:`component_probs_at`) as globals. ``f`` is the
    field (None for a dense one), ``keys`` (d, T) and ``values`` (T, dv) the KV head's."""
    budget = cache.shape[0]
    T = important.shape[1]
    G = 1 if PLAIN else heads.shape[0]  # noqa: F821 (a global of each compiled copy)
    dense = DENSE  # noqa: F821
    obs = np.empty((G, budget))
    mass = np.empty(G)
    outputs = np.empty((G, full_output.shape[2]))
    n_important = count_important(important, start)
    hits = np.empty(G, np.int64)
    cached_important(important, cache, n, hits)  # then kept up to date as keys come and go
    work = np.empty(budget)
    d = 0 if dense else keys.shape[0]  # a dense matrix reads no key vectors
    cached = np.empty((d, budget))  # the cached keys' vectors, by dimension (q.k fields)
    for j in range(n):
        for i in range(d):
            cached[i, j] = keys[i, cache[j]]
    snap = 0
    while snap < snap_steps.shape[0] and snap_steps[snap] < start - prompt_len:
        snap += 1
    for t in range(start, stop):
        step = t - prompt_len
        slot = admit(state, cache, n, t)  # noqa: F821 (a global of each compiled copy)
        if slot < n:
            for g in range(G):
                hits[g] -= important[g, cache[slot]]
        else:
            n += 1
        cache[slot] = t
        for i in range(d):
            cached[i, slot] = keys[i, t]
        for g in range(G):
            n_important[g] += important[g, t]
            hits[g] += important[g, t]
        cache_size[step] = n
        for g in range(G):
            if dense:  # the gather inlined, without array views (each costs two
                h = heads[g]  # reference-count calls, as much as a short step's work)
                for j in range(n):
                    obs[g, j] = probs[h, t, cache[j]]
                if t + 1 < T:  # the next row's entries of these keys, while this step runs
                    for j in range(n):
                        prefetch(probs, h, t + 1, cache[j])
            else:
                field_probs(f, row_max, row_sum, heads[g], t, cache, n, obs[g], work,  # noqa: F821
                            cached)
        if PLAIN:  # noqa: F821
            record_plain(n, hits, n_important, step, obs, mass, out_mass, out_recall)
        else:
            record(values, full_output, cache, n, hits, n_important, step, obs, mass, outputs,
                   out_mass, out_recall, out_error)
            snap = snapshot(cache, n, step, snap_steps, snapshots, snap)
        observe(state, cache, n, obs, mass, outputs)  # noqa: F821
    return n
