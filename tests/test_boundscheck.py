"""Every policy's kernels on edge cases with Numba's bounds checking on (an out-of-bounds
index raises instead of corrupting the heap), results against the NumPy references:
tests/boundscheck_cases.py in a subprocess with NUMBA_BOUNDSCHECK=1 and a fresh
NUMBA_CACHE_DIR (bounds-checked kernels must neither reuse nor pollute the normal cache).
Slow: it compiles every kernel again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_every_kernel_stays_in_bounds_on_edge_cases(tmp_path):
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "boundscheck_cases.py")],
                          env=env, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "checks" in done.stdout
