"""The quick kernel tests again with NUMBA_DISABLE_JIT=1, so the kernels' Python runs too."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(os.environ.get("NUMBA_DISABLE_JIT") == "1", reason="already without JIT")
def test_quick_suite_without_jit():
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "quick", "-p", "no:cacheprovider",
         str(Path(__file__).parent)],
        env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
