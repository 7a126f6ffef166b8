"""Read ``.npy``/``.npz`` files safely: shapes from the headers first, then the arrays.

Headers tell how much memory the arrays take before any of them is read, so a file too
large for the machine is refused with one line instead of an allocation failure. A file
that cannot be read (truncated, a member failing its checksum or whose compressed stream
is broken) is a one-line :class:`KvsimError` too.
"""

from __future__ import annotations

import contextlib
import zipfile
import zlib
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError
from kvsim.paths import regular_file
from kvsim.resources import check_memory

READ_ERRORS = (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile,
               zipfile.LargeZipFile, zlib.error)
"""What reading a damaged ``.npy``/``.npz`` raises (zlib.error: a broken deflate stream)."""


@contextlib.contextmanager
def _member(name: str):
    """Name the member whose compressed stream is broken (zlib's message does not)."""
    try:
        yield
    except zlib.error as exc:
        raise zlib.error(f"{name}: {exc}") from None


def _header(f) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) \
        else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f)
    return shape, dtype


def headers(path: Path, key: str = "path") -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{name: (shape, dtype)}`` of an ``.npz``'s arrays; a single ``.npy`` array is
    named ``""``."""
    try:
        regular_file(path)
    except ValueError as exc:
        raise KvsimError(f"expected an existing .npy or .npz file, got {str(path)!r} ({exc})",
                         key) from None
    try:
        if zipfile.is_zipfile(path):
            out = {}
            with zipfile.ZipFile(path) as archive:
                for member in archive.namelist():
                    with _member(member), archive.open(member) as f:
                        out[member.removesuffix(".npy")] = _header(f)
            return out
        with open(path, "rb") as f:
            return {"": _header(f)}
    except READ_ERRORS as exc:
        raise KvsimError(f"expected a readable .npy or .npz file ({exc})", key) from None


def load(path: Path, names: list[str] | None, what: str, key: str = "path") -> dict[str, np.ndarray]:
    """The arrays ``names`` (all if None) of ``path`` (``""``: a single ``.npy`` array),
    after checking from the headers that they fit in memory as float64 (kvsim's copies)."""
    found = headers(path, key)
    names = list(found) if names is None else names
    nbytes = sum(int(np.prod(found[n][0], dtype=float)) * (found[n][1].itemsize + 8)
                 for n in names if n in found)
    check_memory(nbytes, key, what)
    try:
        data = np.load(path, allow_pickle=False)
        if isinstance(data, np.ndarray):
            return {"": data}
        out = {}
        with data:
            for n in (n for n in names if n in data.files):
                with _member(f"{n}.npy"):
                    out[n] = data[n]
        return out
    except READ_ERRORS as exc:
        raise KvsimError(f"expected a readable .npy or .npz file ({exc})", key) from None
