"""Where a cold start goes: the compile time of each kernel a scenario run compiles.

``python -m kvsim.tools.bench.compile SCENARIO OUT.json`` runs the scenario in this
process with Numba's compile events recorded (:mod:`numba.core.event`) and writes one row
per compiled kernel: how many signatures it compiled, its own seconds (those of the kernels
it called excluded: they have rows of their own) and its inclusive seconds, with the
seconds of Numba's passes summed over every compilation (inlining, typing, lowering). Run
with an empty ``NUMBA_CACHE_DIR`` it shows a first run's compilation (``python -m kvsim
bench`` runs it so: ``--only end_to_end`` for these rows alone).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

PASSES = {"inline_inlinables": "inlining (inline='always')",
          "nopython_type_inference": "typing", "native_lowering": "lowering and LLVM"}
"""Numba's passes shown by name; the rest are summed as ``other``."""
TYPING = "nopython_type_inference"  # compiles the kernels called: their seconds are theirs


def _recorder():
    """A Numba event listener: each compilation's inclusive and own seconds, by kernel."""
    from numba.core import event

    class Recorder(event.Listener):
        def __init__(self):
            self.stacks: dict = defaultdict(list)  # per thread: [start, seconds of callees]
            self.rows: dict = defaultdict(lambda: {"signatures": 0, "self_s": 0.0, "total_s": 0.0})
            self.passes: dict = defaultdict(float)

        def notify(self, event) -> None:
            stack = self.stacks[threading.get_ident()]
            if event.is_start:
                stack.append([time.perf_counter(), 0.0])
                return
            start, inner = stack.pop()
            seconds = time.perf_counter() - start
            if stack:
                stack[-1][1] += seconds
            fn = event.data["dispatcher"].py_func
            row = self.rows[f"{fn.__module__}.{fn.__qualname__}"]
            row["signatures"] += 1
            row["self_s"] += seconds - inner
            row["total_s"] += seconds
            compiled = event.data["dispatcher"].overloads.get(tuple(event.data["args"]))
            times = getattr(compiled, "metadata", None) or {}
            for pipeline in times.get("pipeline_times", {}).values():
                for name, timing in pipeline.items():
                    key = name.split("_", 1)[1]  # "12_nopython_type_inference"
                    own = timing.run - inner if key == TYPING else timing.run
                    self.passes[key if key in PASSES else "other"] += max(own, 0.0)

        on_start = on_end = notify

    return Recorder()


def record(scenario: str | Path, out: str | Path) -> dict:
    """Run the scenario file ``scenario`` in this process into the report folder ``out``
    (as ``python -m kvsim SCENARIO --out OUT --quiet`` does), recording its compilations:
    ``{"seconds", "kernels": {name: row}, "passes": {pass: seconds}}``."""
    from numba.core import event

    from kvsim.api.run import run

    recorder = _recorder()
    event.register("numba:compile", recorder)
    start = time.perf_counter()
    try:
        run(scenario, out, command=f"python -m kvsim {scenario} --out {out} --quiet")
    finally:
        event.unregister("numba:compile", recorder)
    kernels = dict(sorted(recorder.rows.items(), key=lambda kv: -kv[1]["self_s"]))
    return {"seconds": time.perf_counter() - start, "kernels": kernels,
            "passes": dict(recorder.passes)}


def lines(result: dict, top: int = 12) -> list[str]:
    """The table as printed lines: the ``top`` kernels by own seconds, then the passes."""
    kernels = result["kernels"]
    own = sum(r["self_s"] for r in kernels.values())
    out = [f"{len(kernels)} kernels compiled, {own:.1f} s of compilation in a "
           f"{result['seconds']:.1f} s run"]
    for name, r in list(kernels.items())[:top]:
        out.append(f"  {r['self_s']:6.2f} s own {r['total_s']:6.2f} s with callees  "
                   f"x{r['signatures']}  {name}")
    passes = result["passes"]
    out.append("  Numba passes: " + ", ".join(
        f"{PASSES.get(k, k)} {v:.1f} s" for k, v in sorted(passes.items(), key=lambda kv: -kv[1])))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m kvsim.tools.bench.compile SCENARIO OUT.json", file=sys.stderr)
        return 2
    scenario, out = argv
    with tempfile.TemporaryDirectory() as reports:
        result = record(scenario, f"{reports}/run")
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
