"""Peak memory of scenario runs, measured, against the estimate ``validate`` prints.

A run is a child process (``python -m kvsim SCENARIO``) with an empty Numba cache
(``cold``: it compiles its kernels) or a cache its kernels are in (``warm``). A run is one
process (its figures are drawn in it), so its peak is that process's largest resident set,
``ru_maxrss`` from ``wait4``: exact, kept by the kernel, whatever the machine's load.

``python -m kvsim.tools.bench.memory SCENARIO... --out FILE.csv`` measures, appends the
measurements to a table and prints them beside today's estimate;
``tests/test_memory_estimate.py`` checks the estimate against the committed table.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIELDS = ["scenario", "compiled", "workers", "peak_bytes", "seconds", "load", "command"]


def peak_of(command: list[str], env: dict | None = None) -> dict:
    """Run ``command``; return its peak resident bytes (``ru_maxrss``) and seconds."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(command)} failed ({proc.returncode}): "
                           f"{err.decode(errors='replace')[-2000:]}")
    return {"peak_bytes": usage.ru_maxrss * 1024, "seconds": time.perf_counter() - start}


def measure(scenario: Path) -> dict:
    """A row for one run of ``scenario`` into a temporary folder, in the Numba cache of the
    environment (``NUMBA_CACHE_DIR``, read by this process and the run alike), with the
    number of kernels the run compiles (:func:`kvsim.engine.cost.uncompiled`, asked before
    it starts: 0 in a warm cache) and the estimate ``validate`` gives it (printed, not kept: the test
    checks today's estimate against the measured rows)."""
    from kvsim.engine import cost
    from kvsim.scenario.load import load_sweep

    variants = load_sweep(scenario)
    compiled = cost.uncompiled(variants)
    estimate = cost.estimate(variants, compiled=compiled).peak_bytes
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out:
        run = peak_of([sys.executable, "-m", "kvsim", str(scenario), "--out", f"{out}/run",
                       "--quiet"])
    return {"scenario": scenario.as_posix(), "compiled": compiled, "workers": os.cpu_count(), "peak_bytes": run["peak_bytes"],
            "estimate_bytes": round(estimate), "seconds": round(run["seconds"], 1),
            "load": round(load, 2),
            "command": f"python -m kvsim.tools.bench.memory {scenario.as_posix()}"}


def markdown(table: Path) -> str:
    """The rows of ``table`` beside today's estimate, as the Markdown table the docs show."""
    from kvsim.engine import cost
    from kvsim.scenario.load import load_sweep

    lines = ["| scenario | loops compiled | measured peak | estimate | estimate / peak | load |",
             "| --- | --- | --- | --- | --- | --- |"]
    with open(table, newline="") as f:
        for row in csv.DictReader(f):
            peak = int(row["peak_bytes"])
            estimate = cost.estimate(load_sweep(Path(row["scenario"])), int(row["workers"]),
                                     compiled=int(row["compiled"])).peak_bytes
            lines.append(f"| `{Path(row['scenario']).stem}` | {row['compiled']} | "
                         f"{peak / 2**20:,.0f} MiB | {estimate / 2**20:,.0f} MiB | "
                         f"{estimate / peak:.2f} | {float(row['load']):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvsim.tools.bench.memory",
        description="Run scenarios one after another, each in its own process, and measure "
        "each run's peak memory (ru_maxrss) against the estimate validate gives it; append "
        "a row per run to a CSV. Runs use the Numba cache of NUMBA_CACHE_DIR: give an empty "
        "folder and a scenario twice for a cold run, then a warm one.")
    p.add_argument("scenarios", nargs="*", type=Path)
    p.add_argument("--out", type=Path, required=True, help="CSV file (rows are appended)")
    p.add_argument("--markdown", action="store_true", help="measure nothing: print the "
                   "rows of --out beside today's estimate, the table docs/benchmarks.md shows")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(args.out))
        return 0
    for scenario in args.scenarios:
        row = measure(scenario)
        new = not args.out.exists()
        with open(args.out, "a", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            if new:
                writer.writeheader()
            writer.writerow({k: row[k] for k in FIELDS})
        print(f"{row['scenario']} ({row['compiled']} kernels compiled): peak {row['peak_bytes'] / 2**20:.0f} MiB, "
              f"estimate {row['estimate_bytes'] / 2**20:.0f} MiB: "
              f"x{row['estimate_bytes'] / row['peak_bytes']:.3f}, {row['seconds']} s, "
              f"load {row['load']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
