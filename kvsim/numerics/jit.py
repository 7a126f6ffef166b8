"""Numba options used by every kernel, kept in one place.

Numba's on-disk cache notices a change to the file that defines a kernel but not to
the kernels it calls from other files. kvsim therefore caches under a folder named by
a digest of all its sources (unless ``NUMBA_CACHE_DIR`` is set), so an edit anywhere
in the package recompiles everything that might depend on it.
"""

import hashlib
import os
from pathlib import Path

import numba
from numba import njit


def _source_digest() -> str:
    root = Path(__file__).parent.parent  # the whole kvsim package
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


if not os.environ.get("NUMBA_CACHE_DIR"):
    _base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    numba.config.CACHE_DIR = str(_base / "kvsim" / f"numba-{_source_digest()}")

# No fastmath: kept sets must match the NumPy reference exactly, and reassociated or
# contracted arithmetic can turn an exact tie between two scores into a strict order.
# error_model="numpy": a division by zero gives inf/nan (every kernel guards the ones
# that matter) instead of a Python exception, whose check keeps loops from vectorising.
_OPTIONS = {"cache": True, "nogil": True, "error_model": "numpy"}

jit = njit(**_OPTIONS)
"""Decorator for kvsim kernels: cached to disk, compiled once per signature; they release
the GIL, so Python threads run them in parallel (no parfors, whose compilation is slow)."""

jit_inline = njit(inline="always", **_OPTIONS)
"""Decorator for small per-entry functions that must be inlined into their loops (LLVM
would keep a large one as a call, and a loop with a call does not vectorise)."""


def cache_is_warm() -> bool:
    """Whether compiled kernels of this exact source are already on disk."""
    folder = numba.config.CACHE_DIR
    return not folder or any(Path(folder).rglob("*.nbi"))  # unknown without a cache folder
