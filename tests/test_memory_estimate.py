"""The peak memory ``validate`` estimates bounds the measured peak of a run from above,
within 25 %: measured here on small scenarios, and for the large ones against the
measurements committed in ``reports/bench/memory.csv``."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from broken import cli

from kvsim.engine import cost
from kvsim.numerics import fullpass
from kvsim.errors import ScenarioError
from kvsim.scenario.load import load_sweep
from kvsim.tools.bench.memory import markdown

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "reports" / "bench" / "memory.csv"
WITHIN = (1.0, 1.25)  # estimate / measured peak


def _rows() -> list[dict]:
    with open(TABLE, newline="") as f:
        return list(csv.DictReader(f))


def test_the_estimate_bounds_a_cold_and_a_warm_run_within_a_quarter(tmp_path):
    """``needle`` run twice by the measuring tool in an empty Numba cache: the first run
    compiles every loop it calls, the second none; each against the estimate for that."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=str(ROOT))
    scenario = ROOT / "scenarios" / "needle.toml"
    table = tmp_path / "memory.csv"
    subprocess.run([sys.executable, "-m", "kvsim.tools.bench.memory", str(scenario),
                    str(scenario), "--out", str(table)], env=env, check=True, timeout=3600,
                   capture_output=True)
    with open(table, newline="") as f:
        cold, warm = csv.DictReader(f)
    variants = load_sweep(scenario)
    assert (int(cold["compiled"]), int(warm["compiled"])) == (len(cost.kernels(variants)), 0)
    for row in (cold, warm):
        estimate = cost.estimate(variants, int(row["workers"]), compiled=int(row["compiled"]))
        ratio = estimate.peak_bytes / int(row["peak_bytes"])
        assert WITHIN[0] <= ratio <= WITHIN[1], (row["compiled"], ratio)


UNMEASURED = {  # scenario files the table leaves out, and why
    "sweep_large.toml": "more than the project's machine has (refused there): for Dask",
    "single_head_1m.toml": "30 minutes of a quiet machine",
    "engine_constraints.toml": "added with issue 39 and not measured yet (its joint-layer "
                               "runs step in Python; run kvsim.tools.bench.memory on it)",
    "engine_constraints_gemma3.toml": "added with issue 39 and not measured yet, as "
                                      "engine_constraints.toml",
}


def test_every_shipped_scenario_file_is_measured_or_named():
    measured = {Path(r["scenario"]).name for r in _rows()}
    scenarios = set()
    for path in (ROOT / "scenarios").glob("*.toml"):
        try:
            load_sweep(path)
        except ScenarioError:  # a closed-loop or task file: no scenario, no estimate
            continue
        scenarios.add(path.name)
    assert scenarios == measured | set(UNMEASURED), scenarios ^ (measured | set(UNMEASURED))


@pytest.mark.parametrize("row", _rows(),
                         ids=lambda r: f"{Path(r['scenario']).stem}-{r['compiled']}")
def test_the_estimate_bounds_the_committed_measurements(row):
    """Each measured run (compiling that many kernels) against today's estimate for the
    machine it ran on (its worker count)."""
    variants = load_sweep(ROOT / row["scenario"])
    estimate = cost.estimate(variants, int(row["workers"]), compiled=int(row["compiled"]))
    ratio = estimate.peak_bytes / int(row["peak_bytes"])
    assert WITHIN[0] <= ratio <= WITHIN[1], (row["scenario"], row["compiled"], ratio)


def test_the_docs_show_the_committed_table(monkeypatch):
    monkeypatch.chdir(ROOT)  # the table names scenario files from the project's root
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert markdown(TABLE.relative_to(ROOT)) in docs


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

    n = len(cost.kernels(variants))
    assert n > 1 + 1  # the full pass and several policies' loops
    monkeypatch.setattr(fullpass, "_dense_block", Empty)  # the seed notebook's full pass
    assert cost.uncompiled(variants) >= 1
    on = cost.estimate(variants, 2, compiled=n).peak_bytes
    off = cost.estimate(variants, 2, compiled=0).peak_bytes
    assert on - off == pytest.approx(cost.COMPILER_BYTES + n * cost.KERNEL_BYTES)
