"""Peak memory of scenario runs, measured, against the estimate ``validate`` prints.

A run is a child process (``python -m kvsim SCENARIO``) with an empty Numba cache
(``cold``: it compiles its kernels) or the cache its cold run filled (``warm``). Its peak
is the larger of two measures: the largest resident set of one process of the run
(``ru_maxrss`` from ``wait4``, exact: the kernel keeps it), and the largest sum, sampled
every few milliseconds, of the proportional set sizes (PSS) of the process and its
forked figure workers (pages they share counted once), what the run takes from the
machine at once.

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
import threading
import time
from pathlib import Path

FIELDS = ["scenario", "cache", "workers", "peak_bytes", "maxrss_bytes", "pss_bytes",
          "seconds", "load", "command"]
SAMPLE_S = 0.05


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from ``/proc/*/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:  # gone meanwhile
            pass
    return out


def _pss(pid: int) -> int:
    """Bytes of the proportional set size of ``pid`` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_of(command: list[str], env: dict | None = None) -> dict:
    """Run ``command``; return its peak bytes (see the module), both measures and seconds."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    pss = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            pss[0] = max(pss[0], sum(_pss(p) for p in _tree(proc.pid)))
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(command)} failed ({proc.returncode}): "
                           f"{err.decode(errors='replace')[-2000:]}")
    maxrss = usage.ru_maxrss * 1024
    return {"peak_bytes": max(maxrss, pss[0]), "maxrss_bytes": maxrss, "pss_bytes": pss[0],
            "seconds": time.perf_counter() - start}


def estimate_bytes(scenario: Path, compiling: bool) -> float:
    """The peak memory estimated for a run of ``scenario`` on this machine's cores."""
    from kvsim.engine import cost
    from kvsim.scenario.load import load_sweep

    return cost.estimate(load_sweep(scenario), compiling=compiling).peak_bytes


def measure(scenario: Path, cache: Path | None = None) -> list[dict]:
    """Rows for ``scenario``, run into a temporary report folder: ``cold`` then ``warm`` in
    an empty Numba cache, or, in the folder ``cache`` (shared by several scenarios, kept),
    one unrecorded run that fills it, then ``warm``."""
    rows = []
    with tempfile.TemporaryDirectory() as fresh, tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, NUMBA_CACHE_DIR=str(cache or fresh))
        for label in ("fill" if cache else "cold", "warm"):
            command = [sys.executable, "-m", "kvsim", str(scenario), "--out",
                       f"{out}/{label}", "--quiet"]
            load = os.getloadavg()[0]
            row = peak_of(command, env)
            if label == "fill":
                continue
            rows.append({"scenario": scenario.as_posix(), "cache": label,
                         "workers": os.cpu_count(), **row,
                         "seconds": round(row["seconds"], 1), "load": round(load, 2),
                         "command": f"python -m kvsim.tools.bench.memory "
                                    f"{scenario.as_posix()}{' --cache DIR' if cache else ''}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsim.tools.bench.memory",
                                description="Measure the peak memory of scenario runs, cold "
                                "and warm, against the estimate; append rows to a CSV.")
    p.add_argument("scenarios", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True, help="CSV file (rows are appended)")
    p.add_argument("--cache", type=Path, help="a Numba cache folder to fill and reuse: warm "
                   "runs only (default: an empty one per scenario, cold and warm)")
    args = p.parse_args(argv)
    for scenario in args.scenarios:
        rows = measure(scenario, args.cache)
        new = not args.out.exists()
        with open(args.out, "a", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(rows)
        for r in rows:
            estimate = estimate_bytes(scenario, compiling=r["cache"] == "cold")
            print(f"{r['scenario']} {r['cache']}: peak {r['peak_bytes'] / 2**20:.0f} MiB "
                  f"(maxrss {r['maxrss_bytes'] / 2**20:.0f}, pss {r['pss_bytes'] / 2**20:.0f}),"
                  f" estimate {estimate / 2**20:.0f} MiB: x{estimate / r['peak_bytes']:.3f}, "
                  f"{r['seconds']} s, load {r['load']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
