"""Reading files named by the user: regular files only, bounded, never blocking.

A FIFO would block a read for ever and ``/dev/zero`` would never end, so a path is
read only if it names a regular file no larger than the caller's limit. Every problem
(missing, a folder, a device, a symlink loop, a name too long, too large, not UTF-8) is
a ``ValueError`` whose message is the reason, for the caller's one-line error.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_TEXT_BYTES = 64 * 2**20  # scenario files and texts: far beyond any real one


def regular_file(path: str | Path, limit: int | None = None) -> int:
    """The size of ``path`` if it is a regular file (within ``limit`` bytes)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    if stat.S_ISDIR(info.st_mode):
        raise ValueError("a folder, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("not a regular file")
    if limit is not None and info.st_size > limit:
        raise ValueError(f"{info.st_size} bytes, more than {limit}")
    return info.st_size


def read_bytes(path: str | Path, limit: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes."""
    regular_file(path, limit)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    if len(data) > limit:
        raise ValueError(f"more than {limit} bytes")
    return data


def read_text(path: str | Path, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes."""
    try:
        return read_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 (byte {exc.start})") from None
