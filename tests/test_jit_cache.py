"""The Numba cache key is per kernel module and what it imports (kvsim.numerics.jit): an
edit recompiles the kernels of the edited module and of those importing it, nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

# Per module, its stamp; and one small kernel called, with its cache hits and misses.
PROBE = """
from pathlib import Path
import numpy as np
from kvsim.numerics import jit
from kvsim.numerics.lanes import lane_sum
lane_sum(np.ones(3), 3)
package = Path(jit.__file__).resolve().parents[1]
for name in ("policies/knorm.py", "policies/h2o.py", "numerics/lanes.py"):
    print(name, jit.source_stamp(package / name))
print("lane_sum", len(lane_sum.stats.cache_hits), len(lane_sum.stats.cache_misses))
"""


@pytest.fixture
def package(tmp_path):
    """A copy of the kvsim package, its own Numba cache, and a way to run the probe."""
    shutil.copytree(ROOT / "kvsim", tmp_path / "kvsim",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    def probe(script: str = PROBE) -> dict[str, str]:
        proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return dict(line.split(" ", 1) for line in proc.stdout.splitlines())

    return tmp_path / "kvsim", probe


def comment(path: Path) -> None:
    path.write_text(path.read_text() + "\n# an edit\n")


def test_an_edit_recompiles_its_module_and_its_importers_only(package):
    root, probe = package
    first = probe()
    assert first["lane_sum"] == "0 1"  # compiled into an empty cache
    comment(root / "report" / "markdown.py")
    assert probe() == dict(first, lane_sum="1 0")  # nothing imports the report: a hit
    comment(root / "policies" / "knorm.py")
    after = probe()
    assert after["policies/knorm.py"] != first["policies/knorm.py"]
    assert after["policies/h2o.py"] == first["policies/h2o.py"]
    assert after["lane_sum"] == "1 0"
    comment(root / "numerics" / "lanes.py")
    last = probe()
    assert last["lane_sum"] == "0 1"  # its own module changed: compiled again
    assert last["policies/h2o.py"] != after["policies/h2o.py"]  # h2o imports lanes (via decode)


# A policy's decode loop (kvsim.numerics.decode.decode_kernel): the functions Numba inlines
# into it, and its cache hits and misses.
LOOP_PROBE = """
import numpy as np
from numba.core import inline_closurecall
import kvsim
from kvsim.policies import ring

inlined = set()
inline = inline_closurecall.InlineWorker.inline_function
def recorded(self, caller_ir, block, i, function, arg_typs=None):
    caller = caller_ir.func_id
    if (caller.modname, caller.func_qualname) == ("kvsim.policies.ring", "decode.dense"):
        inlined.add(function.__name__)
    return inline(self, caller_ir, block, i, function, arg_typs)
inline_closurecall.InlineWorker.inline_function = recorded
A = np.tril(np.ones((32, 32)))
kvsim.simulate(A / A.sum(1, keepdims=True), "window", 8, 16)
print("inlined", " ".join(sorted(inlined)))
loop = ring.decode.dense
print("ring.decode", len(loop.stats.cache_hits), len(loop.stats.cache_misses))
print("components", len(ring.decode.components.signatures))
"""


def test_a_policy_loop_is_compiled_whole_and_cached_under_its_policy(package):
    """The loop's body is compiled as the policy's kernel, not inlined into it (Numba's
    inlining copies the whole body: that was half of a cold start), only for the kind of
    field the run has, and its cache entry belongs to the policy's module: an edit there
    compiles it again."""
    root, probe = package
    first = probe(LOOP_PROBE)
    assert first["ring.decode"] == "0 1"
    assert first["components"] == "0"  # a dense run compiles no loop for component fields
    inlined = set(first["inlined"].split())
    assert "admit" in inlined  # the policy's step is inlined into its loop ...
    assert not inlined & {"_decode_span", "decode_loop", "probs_at", "logits_at",
                           "record"}  # ... no body, nor the metrics every loop shares (called)
    cache = root.parent / "cache"
    assert any("kvsim_policies_ring" in p.name for p in cache.rglob("*.nbi"))
    assert probe(LOOP_PROBE)["ring.decode"] == "1 0"
    comment(root / "policies" / "ring.py")
    assert probe(LOOP_PROBE)["ring.decode"] == "0 1"
