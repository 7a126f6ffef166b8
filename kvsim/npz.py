"""Writing ``.npz`` archives (read by ``np.load``) that an interrupt cannot turn into a
second error.

``np.savez`` and a ``with zipfile.ZipFile`` block close the archive on the way out of an
exception; when the exception (a Ctrl-C) arrived while a member was being opened, that
close raises its own ``ValueError`` and the user sees a traceback instead of the one-line
interrupt message. Here an unfinished archive is abandoned, the exception goes on as
itself, and the caller removes the file (it writes to a temporary name or folder).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

STAMP = (1980, 1, 1, 0, 0, 0)  # a fixed timestamp: the same arrays give the same bytes


class _Archive(zipfile.ZipFile):
    """A zip archive that only an explicit ``close`` finishes: dropped unfinished (an
    interrupt, even one inside ``__init__``), the collector leaves it alone."""

    def __del__(self) -> None:
        pass


def write_npz(path: Path, arrays: dict[str, np.ndarray], level: int) -> None:
    """Write ``arrays`` to ``path`` as ``np.savez`` does, deflated at zlib ``level``
    (1-9; ``np.savez_compressed`` is 6) or stored as they are (0). On any exception the
    archive is left unfinished and the exception goes on as itself."""
    with open(path, "wb") as raw:
        archive = _Archive(raw, "w")
        for name, value in arrays.items():
            entry = zipfile.ZipInfo(f"{name}.npy", date_time=STAMP)
            entry.compress_type = zipfile.ZIP_DEFLATED if level else zipfile.ZIP_STORED
            entry._compresslevel = level or None  # as ZipFile.open sets it for a name
            with archive.open(entry, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=False)
        archive.close()
