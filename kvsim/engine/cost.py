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

from kvsim.attention import files, trace
from kvsim.errors import KvsimError, ScenarioError
from kvsim.engine.experiments import SNAPSHOTS
from kvsim.numerics.fullpass import BLOCKS
from kvsim.resources import check_memory, size_text
from kvsim.scenario.load import Scenario

ROW_BYTES = 3000  # one results row: a dict of about 40 entries
BASE_BYTES = 256 * 2**20  # the interpreter, compiled kernels, matplotlib drawing a figure


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
    experiments: tuple = ()  # (prompt share P / T, budgets, policies) per experiment
    layers: int = 1       # layers run jointly (one after another: they add runs, not memory)


TYPICAL = {"T": 8192, "heads": 32, "dim": 128, "focus": 4, "seeds": 8}


def _size(s: Scenario) -> _Size:
    exps = tuple((e.prompt_len / s.T, e.budgets, len(e.policies)) for e in s.experiments)
    size = _Size(s.T, s.heads, s.kv_heads, len(s.seeds), experiments=exps, layers=len(s.layers))
    if s.source in ("matrix", "seed_notebook"):
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
    prompts = {round(share * T) for share, _, _ in z.experiments} or {T}
    steps = max((T - P for P in prompts), default=0)
    passes = H * len(prompts) * (4 * T + steps * z.dv) * 8.0 + 2 * BLOCKS * T * 8.0
    budget = max((max(b) for _, b, _ in z.experiments), default=0)
    decode = workers * (budget * (z.dim + 80) * 8.0 + T * 8.0 * 4)
    return field + passes + decode


def _kept(z: _Size) -> float:
    """Bytes of the results kept until the report is written (and stacked once for it)."""
    total = 0.0
    for share, budgets, policies in z.experiments:
        steps = z.T - round(share * z.T)
        total += z.seeds * z.layers * z.heads * policies * sum(
            2 * (steps * 32.0 + min(b, z.T) * 8.0) + ROW_BYTES for b in budgets)
        if steps:  # cache snapshots at the focus budget (at most the largest)
            total += z.seeds * z.kv_heads * policies * SNAPSHOTS * max(budgets) * 8.0  # layer 0
    return total


def _peak(sizes: list[_Size], workers: int) -> float:
    return max(_transient(z, workers) for z in sizes) + sum(_kept(z) for z in sizes) + BASE_BYTES


def _logits(z: _Size) -> float:
    prompts = {round(share * z.T) for share, _, _ in z.experiments} or {z.T}
    full = z.heads * len(prompts) * z.T * (z.T + 1) / 2
    decode = sum(policies * (z.T - round(share * z.T)) * min(b, z.T) * z.heads
                 for share, budgets, policies in z.experiments for b in budgets)
    return z.seeds * z.layers * (full + decode)


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
    peak = _peak(sizes, workers)
    t_key = "attention.path" if variants[0].source in ("matrix", "trace") else "attention.T"
    keys = {"T": t_key, "heads": "attention.heads", "dim": "attention.qk.dim",
            "focus": "attention.qk.focus", "seeds": "seeds"}
    best, key = 0.0, t_key
    for name, typical in TYPICAL.items():
        smaller = [replace(z, **{name: min(getattr(z, name), typical)}) for z in sizes]
        gain = peak - _peak(smaller, workers)
        if gain > best * 1.01:
            best, key = gain, keys[name]
    budgets = [replace(z, experiments=tuple((s, tuple(min(b, 1024) for b in bs), p)
                                            for s, bs, p in z.experiments)) for z in sizes]
    if peak - _peak(budgets, workers) > best * 1.01:
        best, key = peak - _peak(budgets, workers), "experiment.budgets"
    if len(sizes) > 1 and peak - _peak(sizes[:1], workers) > best * 1.01:
        key = "sweep"
    return key


def estimate(variants: list[Scenario], workers: int | None = None) -> Cost:
    """The :class:`Cost` of running every variant of a sweep on ``workers`` threads."""
    workers = workers or os.cpu_count() or 1
    sizes = [_size(v) for v in variants]
    runs = sum(sum(p * len(b) for _, b, p in z.experiments) * z.seeds * z.layers * z.heads
               for z in sizes)
    units = sum(sum(p for _, _, p in z.experiments) * z.seeds * z.layers * z.kv_heads
                for z in sizes)
    return Cost(units, runs, sum(_logits(z) for z in sizes), _peak(sizes, workers),
                _driver(variants, sizes, workers))


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
