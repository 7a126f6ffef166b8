"""Ownership of a report target: one run at a time, leftovers of killed runs cleaned.

A run owns ``DIR`` while it holds an exclusive ``flock`` on ``.DIR.lock`` beside it (the
file holds the owner's pid). The kernel releases the lock when its process dies, even by
SIGKILL, so a later run can tell leftovers of dead runs (``.DIR.tmp-PID``,
``.DIR.old-PID``, ``.DIR.units``) from those of a live one, and clean or reuse them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

from kvsim.errors import KvsimError
from kvsim.interrupts import held


def sibling(out: Path, suffix: str) -> Path:
    """``out.parent / ".NAME<suffix>"``: the hidden files of a report target."""
    return out.parent / f".{out.name}{suffix}"


def replace_folder(out: Path, write: Callable[[Path], None],
                   keep: tuple[str, ...] | None = None, advice: str = "") -> None:
    """``write`` the folder's files into ``.NAME.tmp-PID``, then put it at ``out`` in one
    rename (a previous ``out`` moves aside to ``.NAME.old-PID`` first): a reader sees the
    old folder or the new one, never half of one.

    With ``keep`` (file names), a failure of ``write`` loses no results: the files of
    ``keep`` it had written (it writes them first) go to ``out`` alone, and the failure
    becomes one :class:`KvsimError` line naming them, then ``advice`` (how to finish the
    report); when it had written none of them, any earlier ``out`` stays as it was."""
    tmp, old = sibling(out, f".tmp-{os.getpid()}"), sibling(out, f".old-{os.getpid()}")
    failure, kept = None, []
    try:
        with held():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        try:
            write(tmp)
        except Exception as exc:
            if keep is None:
                raise
            failure, kept = exc, [name for name in keep if (tmp / name).is_file()]
            for path in tmp.iterdir():
                if path.name not in kept:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        if failure is None or kept:
            with held():  # a signal between the two renames would lose both reports
                if out.exists():
                    out.rename(old)
                try:
                    tmp.rename(out)
                except OSError:
                    if old.exists():
                        old.rename(out)
                    raise
    finally:
        with held():
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
    if failure is not None:
        cause = " ".join(f"{type(failure).__name__}: {failure}".split())[:300]
        saved = (f"its results are kept ({', '.join(kept)}){advice}" if kept else
                 f"no report written{' (the earlier one is unchanged)' if out.exists() else ''}")
        raise KvsimError(f"writing the report failed ({cause}); {saved}", str(out)) from None


class ReportLock:
    """Exclusive ownership of the report target ``out`` (a context manager)."""

    def __init__(self, out: Path):
        self.out = out
        self.path = sibling(out, ".lock")
        self.fd: int | None = None

    def __enter__(self) -> "ReportLock":
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            try:
                with held():  # the lock file is created and owned, or neither
                    self._take()
            except BaseException:  # a signal held during _take arrives as it ends: no
                if self.fd is not None:  # __exit__ will run, so give the lock back here
                    self.__exit__(None, None, None)
                raise
        except OSError as exc:
            raise KvsimError(f"expected a report folder that can be written "
                             f"({exc.strerror or exc})", str(self.out)) from None
        return self

    def _take(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise KvsimError(f"expected no other kvsim run on this report, but process "
                                 f"{owner} is writing it", str(self.out)) from None
            try:  # the previous owner may have removed the file between open and flock
                current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def __exit__(self, *exc) -> None:
        with held():
            try:
                os.unlink(self.path)  # while still holding the lock: see the inode check above
            except FileNotFoundError:
                pass
            os.close(self.fd)
            self.fd = None


def clean_leftovers(out: Path, keep_units: bool) -> None:
    """Remove what killed runs left beside ``out`` (call while owning it).

    A report moved aside (``.old-PID``) with no report in its place is put back: the
    run died between the two renames of its atomic replace.
    """
    for old in sorted(out.parent.glob(f".{out.name}.old-*")):
        if not out.exists():
            old.rename(out)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    if not keep_units:
        shutil.rmtree(sibling(out, ".units"), ignore_errors=True)
