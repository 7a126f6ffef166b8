"""The results format, built and parsed here only: the tidy rows of ``results.csv`` (one
per experiment, policy, budget, seed, layer and query head) and the keys of ``steps.npz``
(each row's per-step series, final caches and cache snapshots).

Used by the local engine, the Python API (:func:`kvsim.simulate`, :func:`kvsim.load_report`)
and, through the local engine, Dask runs. No matplotlib here.

``steps.npz`` keys: ``[v{i}/]{experiment}/{name}`` for ``name`` in :data:`SERIES` plus
``kept`` and ``snap_steps``, and ``[v{i}/]{experiment}/snapshots/{label}/seed{s}/kv{k}``;
the ``v{i}/`` prefix (sweep variant ``i``) only when a report holds several variants.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from typing import IO

import numpy as np

from kvsim.numerics.quantize import Quantize, cache_bytes
from kvsim.policies.base import Trace
from kvsim.protocols.run import final_recall
from kvsim.protocols.settings import label as protocol_label

SERIES = {"mass": np.float64, "cache_size": np.int64, "recall": np.float64,
          "error": np.float64}
"""The per-step series of every row, with their dtypes."""


def summary(mass: np.ndarray, recall: np.ndarray, error: np.ndarray, kept: np.ndarray,
            important: np.ndarray, has_truth: bool, T: int) -> dict:
    """The summary columns of one row from its step series and final cache."""
    nan = float("nan")
    stats = {"mass_mean": nan, "mass_min": nan, "mass_p10": nan, "mass_median": nan,
             "kl_mean": nan}
    if mass.size:
        stats.update(mass_mean=float(mass.mean()), mass_min=float(mass.min()),
                     mass_p10=float(np.quantile(mass, 0.1)),
                     mass_median=float(np.median(mass)),
                     kl_mean=float(np.mean(-np.log(np.maximum(mass, 1e-300)))))
    stats["kept"] = int(kept.shape[0])
    stats["compression"] = 1.0 - kept.shape[0] / T
    defined = recall[~np.isnan(recall)]
    stats["recall_mean"] = float(defined.mean()) if has_truth and defined.size else nan
    stats["final_recall"] = final_recall(kept, important) if has_truth else nan
    defined = error[~np.isnan(error)]
    stats["error_mean"] = float(defined.mean()) if defined.size else nan
    stats["error_max"] = float(defined.max()) if defined.size else nan
    return stats


def result_row(ident: dict, kind: str, params: dict, trace: Trace, g: int,
               important: np.ndarray, has_truth: bool, T: int) -> dict:
    """The row of query head ``g`` of ``trace``: the identifying columns ``ident`` (up to
    ``steps``), the policy parameters, then the summaries."""
    row = dict(ident)
    # A parameter's column names its policy: snapkv.window is not window.window.
    row.update({f"{kind}.{name}": value for name, value in sorted(params.items())})
    row.update(summary(trace.mass[g], trace.recall[g], trace.error[g], trace.kept, important,
                       has_truth, T))
    row.update(memory(trace, T), protocol=protocol_label(params))
    return row


def memory(trace: Trace, T: int) -> dict:
    """The memory held per KV head: peak and mean cache size over the decode steps (keys,
    the incoming one included; the final cache without decode steps) and peak / T."""
    sizes = trace.cache_size if trace.cache_size.size else np.array([trace.kept.shape[0]])
    peak = int(sizes.max())
    return {"peak_size": peak, "mean_size": float(sizes.mean()), "effective_ratio": peak / T}


def bytes_columns(cache_size: np.ndarray, d: int, dv: int, quant: Quantize | None) -> dict:
    """``kv_bits`` (16 unless quantised) and the mean and peak bytes over the decode steps
    of the KV head's keys and values (NaN for a source without both)."""
    nan = float("nan")
    sizes = cache_bytes(cache_size, d, dv, quant) if d and dv and cache_size.size else None
    return {"kv_bits": quant.bits if quant else 16,
            "bytes_mean": float(sizes.mean()) if sizes is not None else nan,
            "bytes_peak": float(sizes.max()) if sizes is not None else nan}


def result_columns(rows: list[dict]) -> list[str]:
    """Every row's columns: the identifying ones (up to ``steps``), the policy parameters
    (``kind.name``, sorted), then the summaries."""
    seen = list(dict.fromkeys(k for r in rows for k in r))
    params = sorted(k for k in seen if "." in k)
    rest = [k for k in seen if "." not in k]
    cut = rest.index("steps") + 1
    return rest[:cut] + params + rest[cut:]


SIGNIFICANT_DIGITS = 12


def csv_row(row: dict) -> dict:
    """``row`` as ``results.csv`` writes it: floats rounded to 12 significant digits (then
    written as the shortest text that reads back as that float), so that a rerun on
    another CPU, whose last bits of a sum may differ, writes the same file; the
    per-step arrays of ``steps.npz`` stay exact."""
    return {k: repr(float(format(v, f".{SIGNIFICANT_DIGITS}g"))) if isinstance(v, float) else v
            for k, v in row.items()}


def write_rows(file: IO[str], rows: list[dict]) -> None:
    """``rows`` as CSV (a file opened with ``newline=""``), floats by :func:`csv_row`."""
    writer = csv.DictWriter(file, fieldnames=result_columns(rows) if rows else [], restval="")
    writer.writeheader()
    writer.writerows(csv_row(r) for r in rows)


def _typed(text: str):
    """A CSV cell as the value the run wrote: int, float, bool, or the string."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_rows(file: IO[str]) -> list[dict]:
    """The rows of a ``results.csv`` (a file opened with ``newline=""``), typed; a line
    that does not fit the header, or lacks its variant, experiment or unit, is a
    ``ValueError`` naming the line."""
    reader = csv.DictReader(file)
    rows = []
    for n, row in enumerate(reader, 2):
        if None in row or None in row.values():
            raise ValueError(f"line {n} does not have the header's "
                             f"{len(reader.fieldnames)} fields")
        rows.append({k: _typed(v) for k, v in row.items()})
        if not isinstance(rows[-1].get("unit"), int) or "variant" not in row \
                or "experiment" not in row:
            raise ValueError(f"line {n} lacks a variant, experiment or integer unit")
    return rows


@dataclass
class ExperimentSteps:
    """Per-step series of every run of one experiment, one row per results row.

    ``snapshots[(policy label, seed, kv head)]`` holds the cache at ``snap_steps`` for
    the focus budget.
    """

    mass: list = field(default_factory=list)
    cache_size: list = field(default_factory=list)
    recall: list = field(default_factory=list)
    error: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    snap_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    snapshots: dict = field(default_factory=dict)
    _stacked: tuple = (0, None)  # (rows stacked, arrays): figures ask many times

    def add(self, trace: Trace, g: int, has_truth: bool) -> None:
        """The series of query head ``g`` of ``trace`` (the next row's)."""
        self.mass.append(trace.mass[g])
        self.cache_size.append(trace.cache_size)
        self.recall.append(trace.recall[g] if has_truth
                           else np.full(trace.mass.shape[1], math.nan))
        self.error.append(trace.error[g])
        self.kept.append(trace.kept)

    def series(self, steps: int | None = None) -> dict[str, np.ndarray]:
        """The stacked series, (rows, ``steps``) each (``steps``: inferred if None)."""
        rows = len(self.mass)
        shape = (rows, -1 if steps is None else steps)
        return {name: np.array(getattr(self, name), dtype).reshape(shape)
                for name, dtype in SERIES.items()}

    def arrays(self) -> dict[str, np.ndarray]:
        """Stacked arrays; ``kept`` padded with -1 to the largest final cache."""
        if self._stacked[0] == len(self.mass) and self._stacked[1] is not None:
            return self._stacked[1]
        width = max((k.shape[0] for k in self.kept), default=0)
        kept = np.full((len(self.kept), width), -1, np.int64)
        for i, k in enumerate(self.kept):
            kept[i, :k.shape[0]] = k
        arrays = {**self.series(), "kept": kept, "snap_steps": self.snap_steps}
        self._stacked = (len(self.mass), arrays)
        return arrays


def steps_arrays(results_steps: list[dict[str, ExperimentSteps]]) -> dict[str, np.ndarray]:
    """The ``steps.npz`` entries of a report's variants (each: steps by experiment)."""
    arrays = {}
    for i, steps_of in enumerate(results_steps):
        prefix = f"v{i}/" if len(results_steps) > 1 else ""
        for exp, steps in steps_of.items():
            arrays.update({f"{prefix}{exp}/{name}": value
                           for name, value in steps.arrays().items()})
            for (label, seed, kv), snaps in steps.snapshots.items():
                arrays[f"{prefix}{exp}/snapshots/{label}/seed{seed}/kv{kv}"] = snaps
    return arrays


def parse_steps(data, variants: list[str], focus: dict) -> tuple[dict, dict]:
    """``(arrays, kept)`` of an opened ``steps.npz``: ``arrays[(variant, experiment)]`` the
    stacked arrays by name; ``kept[(variant, experiment)]`` = ``[snap_steps, {(label,
    focus budget, seed, kv): snapshots}]``. Raises IndexError or ValueError on a bad key."""
    arrays: dict = {}
    kept: dict = {}
    for name in data.files:
        parts = name.split("/")
        prefix = int(parts[0][1:]) if len(variants) > 1 else 0
        if len(variants) > 1:
            parts = parts[1:]
        key = (variants[prefix], parts[0])
        if parts[1] == "snapshots":
            label, seed, kv = parts[2], int(parts[3][4:]), int(parts[4][2:])
            budget = focus.get(key)
            kept.setdefault(key, [None, {}])[1][label, budget, seed, kv] = data[name]
        elif parts[1] == "snap_steps":
            kept.setdefault(key, [None, {}])[0] = data[name]
        else:
            arrays.setdefault(key, {})[parts[1]] = data[name]
    return arrays, kept
