"""Finished units of work on disk, so an interrupted run can resume (``--resume``).

The store of a report target lives beside it (``.NAME.units``) and is used only by the
run that owns the target (:mod:`kvsim.report.lock`).

A unit is one policy configuration at every budget of one experiment, for one
sequence (seed) and one KV head. It is stored under a hash of everything that
determines its result, written atomically, and read back only when that hash matches.
Once the run closes the store (it ended, was interrupted or failed), a policy thread still
finishing writes nothing: removing the folder cannot race a late save.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import zipfile
from pathlib import Path

import numpy as np

from kvsim._version import __version__
from kvsim.interrupts import held
from kvsim.policies import Trace

FIELDS = ("mass", "cache_size", "recall", "error", "kept", "snapshots")


def unit_key(**parts) -> str:
    """A stable hash of a unit's resolved configuration (JSON of ``parts``)."""
    text = json.dumps({"kvsim": __version__, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class UnitStore:
    """A folder of finished units; ``resume`` says whether existing ones are reused."""

    def __init__(self, folder: Path, resume: bool):
        self.folder = folder
        self.resume = resume
        self._closed = False
        self._lock = threading.Lock()  # a save and the closing never interleave

    def load(self, key: str) -> list[Trace] | None:
        """The stored traces of unit ``key``, or None (also when not resuming)."""
        path = self.folder / f"{key}.npz"
        if not self.resume or not path.exists():
            return None
        try:
            with np.load(path) as data:
                count = int(data["count"])
                return [Trace(*(data[f"{i}/{name}"] for name in FIELDS)) for i in range(count)]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            return None  # damaged: run the unit again

    def save(self, key: str, traces: list[Trace]) -> None:
        """Store unit ``key`` atomically (a temporary file, then a rename); nothing once
        the store is closed."""
        arrays = {f"{i}/{name}": getattr(t, name) for i, t in enumerate(traces) for name in FIELDS}
        with self._lock:
            if self._closed:
                return
            self.folder.mkdir(parents=True, exist_ok=True)  # with the first unit
            tmp = self.folder / f".{key}.{os.getpid()}.tmp.npz"
            np.savez(tmp, count=len(traces), **arrays)
            os.replace(tmp, self.folder / f"{key}.npz")

    def close(self, keep: bool) -> None:
        """No more saves (waiting for one in progress); the folder is removed unless
        ``keep``."""
        with held(), self._lock:  # a signal waits: never half a folder left
            self._closed = True
            if not keep:
                shutil.rmtree(self.folder, ignore_errors=True)
