"""``python -m kvsim.tools.bench.dask_scaling [SCENARIO]``: a scenario's units on local
threads against ``LocalCluster(1)`` and ``LocalCluster(2)``, and the Dask overhead per unit.

The scenario runs once untimed (compiling its kernels); each cluster is started, and
its workers' Numba caches loaded (one run of a small scenario), before anything is
timed; the start-up is reported on its own. The overhead per unit comes from a scenario
of near-empty units (T = 64): its time on the cluster minus its time on one local
thread, divided by its units. Every cluster run is checked to give the local rows.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvsim.engine.distributed import simulate_variants
from kvsim.engine.experiments import count_runs, simulate_scenario
from kvsim.scenario.load import load_sweep

TINY = """\
name = "tiny"
seeds = [{seeds}]
[attention]
source = "field"
T = 64
[attention.noise]
scale = 0.5
[policies.h2o]
[policies.window]
[[experiment]]
prompt_len = 32
budgets = [8]
"""
TINY_SEEDS = 40  # tasks (one KV head each), of 2 units


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _units(variants) -> int:
    return sum(len(e.policies) for v in variants for e in v.experiments) \
        * len(variants[0].seeds) * variants[0].kv_heads


def main(argv: list[str] | None = None) -> None:
    from dask.distributed import Client, LocalCluster

    p = argparse.ArgumentParser(prog="python -m kvsim.tools.bench.dask_scaling")
    p.add_argument("scenario", nargs="?", default="scenarios/long_context.toml")
    args = p.parse_args(argv)
    variants = load_sweep(args.scenario)
    with tempfile.TemporaryDirectory() as tmp:
        tiny_path = Path(tmp) / "tiny.toml"
        tiny_path.write_text(TINY.format(seeds=", ".join(map(str, range(TINY_SEEDS)))))
        tiny = load_sweep(tiny_path)
        for v in variants:  # compile (or load) every kernel the scenario uses
            simulate_scenario(v, progress=False)
        local = {}
        for threads in (1, None):  # None: every core
            simulate_scenario(tiny[0], progress=False, workers=threads)  # warm
            local[threads] = (_timed(lambda: simulate_scenario(tiny[0], progress=False,
                                                               workers=threads))[0],
                              _timed(lambda: [simulate_scenario(v, progress=False,
                                                                workers=threads)
                                              for v in variants]))
        rows = [r for res in local[None][1][1] for r in res.rows]
        units, runs = _units(variants), sum(count_runs(v) for v in variants)
        print(f"{args.scenario}: {runs} runs, {units} units, "
              f"{len(variants) * len(variants[0].seeds) * variants[0].kv_heads} Dask tasks")
        print("| mode | start-up | scenario wall time | speed-up | overhead per unit |")
        print("| --- | --- | --- | --- | --- |")
        for threads, label in ((1, "local, 1 thread"), (None, "local threads (every core)")):
            print(f"| {label} | | {local[threads][1][0]:.1f} s | "
                  f"x{local[1][1][0] / local[threads][1][0]:.2f} | |")
        for n in (1, 2):
            start = time.perf_counter()
            with LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                              dashboard_address=":0") as cluster, Client(cluster) as client:
                simulate_variants(client, tiny)  # workers import kvsim, load kernels
                startup = time.perf_counter() - start
                tiny_time = _timed(lambda: simulate_variants(client, tiny))[0]
                wall, results = _timed(lambda: simulate_variants(client, variants))
            if repr([r for res in results for r in res.rows]) != repr(rows):  # NaN-safe
                raise SystemExit("LocalCluster results differ from the local run's")
            overhead = (tiny_time - local[1][0]) / (2 * TINY_SEEDS)
            print(f"| LocalCluster({n}) | {startup:.1f} s | {wall:.1f} s | "
                  f"x{local[1][1][0] / wall:.2f} | {overhead * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
