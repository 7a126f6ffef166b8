"""The cost of a run, estimated before any work: runs, logit evaluations, peak memory.

The estimate follows the engine's shape: one sequence's field and full
passes live at a time, each policy run keeps per-step series until the report is written.
A run whose peak would exceed the memory limit (:mod:`kvsim.resources`) is refused,
naming the scenario key that drives the cost: the key whose reduction to a typical value
lowers the estimate the most.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from kvsim.attention import files, trace
from kvsim.errors import KvsimError, ScenarioError
from kvsim.engine.experiments import SNAPSHOTS
from kvsim.numerics import fullpass
from kvsim.numerics.decode import DecodeLoop
from kvsim.numerics.fullpass import BLOCKS
from kvsim.policies import POLICIES
from kvsim.resources import check_memory, size_text
from kvsim.scenario.load import Scenario

DENSE = ("matrix", "seed_notebook")  # sources read as a (heads, T, T) matrix
ROW_BYTES = 3000  # one results row: a dict of about 40 entries
# Fitted to the measured peaks of the shipped scenarios (reports/bench/memory.csv):
BASE_BYTES = 226 * 2**20  # one process: interpreter, NumPy, Numba, kvsim, matplotlib, kernels
COMPILER_BYTES = 19 * 2**20  # what LLVM keeps once it has compiled anything,
KERNEL_BYTES = 41 * 2**20  # and what Numba and LLVM keep of each of a run's loops compiled
FIGURE_BYTES = 40 * 2**20  # drawing one figure (in the run's process, one at a time),
FIGURE_HEAD_BYTES = 12 * 2**20  # and per query head of the largest variant (a panel each)
KEPT = 1.1  # the results, times this for the Python objects around their arrays
STACKED = 1.5  # the report's stacked arrays, times this for the copies drawing takes


class _Exp(NamedTuple):
    """The numbers of one experiment the cost depends on."""

    share: float           # prompt share P / T
    budgets: tuple         # token budgets
    policies: int
    snap: int              # the focus budget, whose caches are recorded (SNAPSHOTS of them)
    whole: bool            # a policy keeps every key whatever the budget (``full``)


@dataclass(frozen=True)
class _Size:
    """The numbers a variant's cost depends on."""

    T: int
    heads: int
    kv_heads: int
    seeds: int
    dim: int = 0          # query/key dimension (qk fields, traces)
    dv: int = 0           # value dimension
    focus: int = 0        # qk clusters mixed per query
    boosts: int = 0
    dense: bool = False   # a (heads, T, T) matrix
    file_bytes: int = 0   # a trace's arrays as loaded
    experiments: tuple = ()  # an _Exp per experiment
    layers: int = 1       # layers run jointly (one after another: they add runs, not memory)


TYPICAL = {"T": 8192, "heads": 32, "dim": 128, "focus": 4, "seeds": 8}


def _size(s: Scenario) -> _Size:
    exps = tuple(_Exp(e.prompt_len / s.T, tuple(e.budgets), len(e.policies), e.focus_budget,
                      any(not POLICIES[p.kind].budgeted for p in e.policies))
                 for e in s.experiments)
    size = _Size(s.T, s.heads, s.kv_heads, len(s.seeds), experiments=exps,
                 layers=len(s.layers))
    if s.source in DENSE:
        return replace(size, dense=True)
    if s.source == "trace":
        found = files.headers(trace.trace_path(s.attention, Path(s.path).parent))
        q, v = found["queries"][0], found.get("values", ((0, 0, 0, 0),))[0]
        nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in found.values())
        return replace(size, dim=q[3], dv=v[3], file_bytes=nbytes)
    qk = [c["qk"] for c in s.attention["per_head"] if "qk" in c]
    return replace(size, dim=qk[0]["dim"] if qk else 0,
                   dv=qk[0]["dim"] if any(q["values"] for q in qk) else 0,
                   focus=max((q["focus"] for q in qk), default=0),
                   boosts=sum(len(c["boost"]) for c in s.attention["per_head"]))


def _transient(z: _Size, workers: int) -> float:
    """Bytes live while one sequence runs: field, full passes, decode buffers."""
    T, H = z.T, z.heads
    if z.dense:
        field = (H + 2) * T * T * 8.0
    else:
        field = H * T * 16.0 + z.boosts * T + (H + 2 * z.kv_heads) * T * z.dim * 4.0 \
            + T * z.dim * 8.0 * (4 + z.focus) + z.file_bytes
    prompts = {round(e.share * T) for e in z.experiments} or {T}
    steps = max((T - P for P in prompts), default=0)
    # kept passes; while one runs, its blocks' column sums and each thread's row buffers
    passes = H * len(prompts) * (4 * T + steps * z.dv) * 8.0 + 2 * BLOCKS * T * 8.0 \
        + workers * 3 * T * 8.0
    budget = max((max(e.budgets) for e in z.experiments), default=0)
    decode = workers * (budget * (z.dim + 80) * 8.0 + T * 8.0 * 4)
    return field + passes + decode


def _kept(z: _Size) -> float:
    """Bytes of the results kept until the report is written: per-step series, final
    caches (``T`` keys for a policy that keeps every key), rows, cache snapshots."""
    total = 0.0
    for e in z.experiments:
        steps = z.T - round(e.share * z.T)
        caches = sum(min(b, z.T) for b in e.budgets) * (e.policies - e.whole) \
            + z.T * len(e.budgets) * e.whole
        total += z.seeds * z.layers * z.heads * (
            e.policies * len(e.budgets) * (steps * 32.0 + ROW_BYTES) + caches * 8.0)
        if steps:  # cache snapshots at the focus budget, of the first layer
            total += z.seeds * z.kv_heads * e.policies * min(SNAPSHOTS, steps) \
                * min(e.snap, z.T) * 8.0
    return total


def _stacked(z: _Size) -> float:
    """Bytes of the arrays the report stacks from the results (``steps.npz``, figures):
    the series, (rows, steps) each, and the final caches padded to the widest."""
    total = 0.0
    for e in z.experiments:
        steps = z.T - round(e.share * z.T)
        width = z.T if e.whole else min(max(e.budgets), z.T)
        total += z.seeds * z.layers * z.heads * e.policies * len(e.budgets) \
            * (steps * 32.0 + width * 8.0)
    return total


def _peak(sizes: list[_Size], workers: int, compiled: int) -> float:
    """The base of one process, what compiling the kernels keeps, the largest sequence's
    transient arrays (their pages stay with the process), every result, the arrays the
    report stacks from them, and the figure being drawn (the run is one process)."""
    figure = FIGURE_BYTES + FIGURE_HEAD_BYTES * max(z.heads for z in sizes)
    return BASE_BYTES + (COMPILER_BYTES if compiled else 0) + KERNEL_BYTES * compiled \
        + max(_transient(z, workers) for z in sizes) + KEPT * sum(_kept(z) for z in sizes) \
        + STACKED * sum(_stacked(z) for z in sizes) + figure


def _logits(z: _Size) -> float:
    prompts = {round(e.share * z.T) for e in z.experiments} or {z.T}
    full = z.heads * len(prompts) * z.T * (z.T + 1) / 2
    decode = sum(e.policies * (z.T - round(e.share * z.T)) * min(b, z.T) * z.heads
                 for e in z.experiments for b in e.budgets)
    return z.seeds * z.layers * (full + decode)


def kernels(variants: list[Scenario]) -> list:
    """The compiled loops a run of ``variants`` calls: the full pass's (of a dense or a
    component field) and each policy's decode loop for that field (each once)."""
    found = {}
    for v in variants:
        dense = v.source in DENSE
        block = fullpass.block_kernel(dense)
        found.setdefault(id(block), block)
        for p in (p for e in v.experiments for p in e.policies):
            loop = POLICIES[p.kind].steps.decode if POLICIES[p.kind].steps else None
            if loop is not None:
                loop = loop.for_field(dense) if isinstance(loop, DecodeLoop) else loop
                found.setdefault(id(loop), loop)
    return list(found.values())


def uncompiled(variants: list[Scenario]) -> int:
    """How many of the run's :func:`kernels` have no code on disk for the current source
    (none yet, or stale): a run compiles them."""
    def on_disk(kernel) -> bool:
        index = getattr(getattr(kernel, "_cache", None), "_cache_file", None)
        return index is not None and bool(index._load_index())

    return sum(not on_disk(k) for k in kernels(variants))


@dataclass(frozen=True)
class Cost:
    """What a run will do: units (policy x seed x layer x KV head, each at every budget:
    what ``--resume`` stores), runs (policy x budget x seed x layer x head), logit
    evaluations (full passes and decode steps) and the estimated peak memory in bytes."""

    units: int
    runs: int
    logits: float
    peak_bytes: float
    driver: str  # the scenario key that drives the peak memory

    def text(self) -> str:
        return (f"cost: {self.units} units ({self.runs} runs), {self.logits:.3g} logit "
                f"evaluations, peak memory about {size_text(self.peak_bytes)}")


def _driver(variants: list[Scenario], sizes: list[_Size], workers: int) -> str:
    """The key whose reduction to a typical value lowers the peak the most."""
    def peak(sizes):
        return _peak(sizes, workers, compiled=0)

    full = peak(sizes)
    t_key = "attention.path" if variants[0].source in ("matrix", "trace") else "attention.T"
    keys = {"T": t_key, "heads": "attention.heads", "dim": "attention.qk.dim",
            "focus": "attention.qk.focus", "seeds": "seeds"}
    best, key = 0.0, t_key
    for name, typical in TYPICAL.items():
        smaller = [replace(z, **{name: min(getattr(z, name), typical)}) for z in sizes]
        gain = full - peak(smaller)
        if gain > best * 1.01:
            best, key = gain, keys[name]
    budgets = [replace(z, experiments=tuple(
        e._replace(budgets=tuple(min(b, 1024) for b in e.budgets), snap=min(e.snap, 1024))
        for e in z.experiments)) for z in sizes]
    if full - peak(budgets) > best * 1.01:
        best, key = full - peak(budgets), "experiment.budgets"
    if len(sizes) > 1 and full - peak(sizes[:1]) > best * 1.01:
        key = "sweep"
    return key


def estimate(variants: list[Scenario], workers: int | None = None,
             compiled: int | None = None) -> Cost:
    """The :class:`Cost` of running every variant of a sweep on ``workers`` threads,
    compiling ``compiled`` of its :func:`kernels` (default: those the kernel cache lacks,
    :func:`uncompiled`)."""
    workers = workers or os.cpu_count() or 1
    compiled = uncompiled(variants) if compiled is None else compiled
    sizes = [_size(v) for v in variants]
    runs = sum(sum(e.policies * len(e.budgets) for e in z.experiments)
               * z.seeds * z.layers * z.heads for z in sizes)
    units = sum(sum(e.policies for e in z.experiments) * z.seeds * z.layers * z.kv_heads
                for z in sizes)
    return Cost(units, runs, sum(_logits(z) for z in sizes),
                _peak(sizes, workers, compiled), _driver(variants, sizes, workers))


def check(variants: list[Scenario], workers: int | None = None) -> Cost:
    """:func:`estimate`, refused with a one-line :class:`KvsimError` (on the driving key)
    when the peak memory exceeds the limit."""
    cost = estimate(variants, workers)
    try:
        check_memory(cost.peak_bytes, cost.driver, "the run")
    except KvsimError as exc:
        raise ScenarioError([(str(variants[0].path), exc.key, f"{exc.message}; {cost.units} "
                              f"units, {cost.logits:.3g} logit evaluations")]) from None
    return cost
