"""Memory the machine can give a run, and the one-line refusal when a run needs more.

The limit is the machine's available memory (``MemAvailable``) unless set explicitly
(``--max-memory``); estimates are checked against it before anything large is allocated.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

from kvsim.errors import KvsimError

_limit: int | None = None  # bytes; None: the machine's available memory
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def available_bytes() -> int:
    """Memory available to a new allocation now (``MemAvailable``, else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit() -> int:
    """The memory a run may use, in bytes."""
    return _limit if _limit is not None else available_bytes()


def set_memory_limit(nbytes: int | None) -> None:
    """Set the memory limit (None: the machine's available memory)."""
    global _limit
    _limit = nbytes


@contextmanager
def memory_limit_of(nbytes: int | None):
    """Within the block, the memory limit is ``nbytes`` (None: unchanged)."""
    previous = _limit
    if nbytes is not None:
        set_memory_limit(nbytes)
    try:
        yield
    finally:
        set_memory_limit(previous)


def parse_size(text: str) -> int:
    """``"4G"``, ``"512M"``, ``"1.5G"`` or a byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or float(m[1]) <= 0:
        raise KvsimError(f"expected a size such as 4G, 512M or a byte count, got {text!r}",
                         "--max-memory")
    return int(float(m[1]) * _UNITS[m[2].upper()])


def size_text(nbytes: float) -> str:
    """Bytes as a short human-readable size (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(nbytes) < 1024 or unit == "PiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} PiB"


def check_memory(nbytes: float, key: str, what: str) -> None:
    """Raise a one-line :class:`KvsimError` on ``key`` if ``nbytes`` exceed the limit."""
    limit = memory_limit()
    if nbytes > limit:
        source = "--max-memory" if _limit is not None else "available memory"
        raise KvsimError(f"expected {what} to fit in memory, got an estimated peak of "
                         f"{size_text(nbytes)} against {size_text(limit)} of {source} "
                         f"(--max-memory sets the limit)", key)
