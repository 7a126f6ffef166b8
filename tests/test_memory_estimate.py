"""The peak memory ``validate`` estimates bounds the measured peak of a run from above,
within 25 %: measured here on small scenarios, and for the large ones against the
measurements committed in ``reports/bench/memory.csv``."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest
from broken import cli

from kvsim.engine import cost
from kvsim.scenario.load import load_sweep
from kvsim.tools.bench.memory import peak_of

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "reports" / "bench" / "memory.csv"
WITHIN = (1.0, 1.25)  # estimate / measured peak
NOISE = 0.08  # a live run's spread below its typical peak


def _rows() -> list[dict]:
    with open(TABLE, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("name", ["seed_notebook", "needle"])
def test_the_estimate_bounds_a_small_run_within_a_quarter(name, tmp_path):
    scenario = ROOT / "scenarios" / f"{name}.toml"
    command = [sys.executable, "-m", "kvsim", str(scenario), "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    peak_of(command + ["--out", str(tmp_path / "first")], env)  # compiled: a warm run next
    estimate = cost.estimate(load_sweep(scenario), compiling=False).peak_bytes
    peak = peak_of(command + ["--out", str(tmp_path / "warm")], env)["peak_bytes"]
    # One live run of a small scenario varies by about 7 % between runs (a 290 MiB peak
    # measured 276-316 MiB): the lower bound allows that noise here, while the committed
    # measurements below hold the estimate to [1.0, 1.25] exactly.
    assert WITHIN[0] - NOISE <= estimate / peak <= WITHIN[1], (estimate / 2**20, peak / 2**20)


@pytest.mark.parametrize("row", _rows(), ids=lambda r: f"{Path(r['scenario']).stem}-{r['cache']}")
def test_the_estimate_bounds_the_committed_measurements(row):
    """Each measured run (cold: compiling its kernels; warm: not) against today's estimate
    for the machine it ran on (its worker count)."""
    variants = load_sweep(ROOT / row["scenario"])
    estimate = cost.estimate(variants, int(row["workers"]), compiling=row["cache"] == "cold")
    ratio = estimate.peak_bytes / int(row["peak_bytes"])
    assert WITHIN[0] <= ratio <= WITHIN[1], (row["scenario"], row["cache"], ratio)


def test_the_flagship_is_refused_below_its_peak_naming_the_sequence_length():
    path = ROOT / "scenarios" / "long_context.toml"
    warm = min(int(r["peak_bytes"]) for r in _rows() if r["scenario"].endswith(path.name))
    status, out, err = cli(["validate", path, "--max-memory", str(warm)])
    assert status == 2 and err.startswith(f"{path}: attention.T: expected the run to fit"), err
    assert cost.estimate(load_sweep(path)).driver == "attention.T"


def test_a_run_compiles_unless_its_kernels_are_on_disk(monkeypatch):
    variants = load_sweep(ROOT / "scenarios" / "seed_notebook.toml")

    class Empty:  # a kernel cache index with nothing for the current source
        class _cache:
            class _cache_file:
                @staticmethod
                def _load_index():
                    return {}

    monkeypatch.setattr(cost, "_full_pass_block", Empty)
    assert cost.compiles(variants)
    on = cost.estimate(variants, 2, compiling=True).peak_bytes
    off = cost.estimate(variants, 2, compiling=False).peak_bytes
    assert on - off == pytest.approx(cost.COMPILE_BYTES)
