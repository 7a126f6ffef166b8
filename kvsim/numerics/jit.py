"""Numba options used by every kernel, kept in one place, and where their cache lives.

Numba's on-disk cache notices a change to the file that defines a kernel but not to
the kernels it calls from other files. kvsim's kernels therefore carry a source stamp of
their module *and every kvsim module it imports* (transitively, read from the import
statements): editing ``policies/knorm.py`` recompiles knorm's kernels and those of the
modules importing it, and an edit elsewhere (``report/``, say) recompiles nothing. The
cache lives in ``NUMBA_CACHE_DIR`` if set, else in the user's cache folder.
"""

import ast
import functools
import hashlib
import os
import sys
from pathlib import Path
from types import FunctionType
from typing import Callable

import numba
from numba import njit
from numba.core import caching

_PACKAGE = Path(__file__).resolve().parent.parent  # the kvsim package


def _module_file(name: str) -> Path | None:
    """The file of kvsim module ``name`` (a package's ``__init__.py``), or None."""
    path = _PACKAGE.parent.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _imports(path: Path) -> frozenset[Path]:
    """The kvsim modules that ``path`` imports, anywhere in it (a name imported from a
    package counts as its submodule if there is one, else as the package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" if _module_file(f"{node.module}.{alias.name}")
                     else node.module for alias in node.names]
        else:
            continue
        found.update(f for name in names if name.split(".")[0] == "kvsim"
                     and (f := _module_file(name)) is not None)
    return frozenset(found)


@functools.cache
def source_stamp(path: Path) -> str:
    """Digest of the module at ``path`` and every kvsim module it imports, transitively."""
    seen, todo = set(), [path]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(_imports(current))
    digest = hashlib.sha256()
    for file in sorted(seen):  # a file outside kvsim (a policy of one's own) by its path
        name = file.relative_to(_PACKAGE) if _PACKAGE in file.parents else file
        digest.update(str(name).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def _source_digest() -> str:
    """Digest of every kvsim source file (Dask workers must run the sources the client runs)."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class _KernelLocator(caching.UserProvidedCacheLocator):
    """Numba's cache locator for kvsim's own kernels: stamped by :func:`source_stamp`.

    A kernel whose code lives in a kvsim file but which belongs to another module (a
    policy's decode loop: the loop's code with the policy's steps as globals,
    :func:`bound_kernel`) is stamped by both files and named by its module;
    such a kernel is not cached if that module has no file (:func:`bound_kernel`)."""

    def __init__(self, py_func, py_file, home: Path | None = None):
        super().__init__(py_func, py_file)
        self._home, self._module = home, py_func.__module__

    def get_source_stamp(self):
        stamp = source_stamp(Path(self._py_file).resolve())
        return stamp if self._home is None else stamp + source_stamp(self._home)

    def get_disambiguator(self):
        base = super().get_disambiguator()
        return base if self._home is None else f"{base}-{self._module.replace('.', '_')}"

    @classmethod
    def from_function(cls, py_func, py_file):
        if _PACKAGE not in Path(py_file).resolve().parents or not numba.config.CACHE_DIR:
            return None
        home = getattr(sys.modules.get(py_func.__module__), "__file__", None)
        home = home and Path(home).resolve()
        self = cls(py_func, py_file, None if home in (None, Path(py_file).resolve()) else home)
        try:
            self.ensure_cache_path()
        except OSError:
            return None
        return self


if not os.environ.get("NUMBA_CACHE_DIR"):
    _base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    numba.config.CACHE_DIR = str(_base / "kvsim" / "numba")
if _KernelLocator not in caching.CacheImpl._locator_classes:
    caching.CacheImpl._locator_classes.insert(0, _KernelLocator)

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


def threads() -> int:
    """How many threads kvsim's kernels may share out work to: Numba's configured count
    (``NUMBA_NUM_THREADS``). Read from the configuration, never from
    ``numba.get_num_threads()``, which starts Numba's OpenMP pool: that resets the OpenMP
    thread count torch shares, so a model run held to one torch thread ran on every core,
    each small op of its decode waiting on spinning threads."""
    return int(numba.config.NUMBA_NUM_THREADS)


def cache_is_warm() -> bool:
    """Whether compiled kernels are already on disk (of this source or an earlier one)."""
    folder = numba.config.CACHE_DIR
    return not folder or any(Path(folder).rglob("*.nbi"))  # unknown without a cache folder


def bound_kernel(code: Callable, name: str, module: str, **names) -> Callable:
    """A kernel ``name`` of module ``module`` compiled from the code of the plain function
    ``code`` with ``names`` bound as globals (compiled functions, constants): a kernel
    generic in the functions it calls, each binding compiled directly.

    Not a kernel that inlines a generic ``jit_inline`` body and is passed the functions:
    Numba's inlining copies the callee's whole body, once per level and once more for
    safekeeping, which made half of a cold start's compilation. Nor a kernel that takes
    the functions as arguments: that is never an on-disk cache hit (Numba types a
    dispatcher per process). Cached (stamped by both files) if ``module`` has a file."""
    fn = FunctionType(code.__code__, {**code.__globals__, **names}, name)
    fn.__qualname__, fn.__module__, fn.__doc__ = name, module, code.__doc__
    if getattr(sys.modules.get(module), "__file__", None) is None:
        return njit(**dict(_OPTIONS, cache=False))(fn)
    return jit(fn)
