"""A study's run: its file read and its report folder checked and locked around the work
(:func:`write_study`), its provenance, and the two commands every study type has, built
from its :class:`~kvsim.tools.study.types.StudyType`: run the model and write the report
(:func:`run_report`), or redraw the report from its files without the model
(:func:`redraw_report`)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from kvsim._version import __version__
from kvsim.errors import KvsimError
from kvsim.report.lock import ReportLock, clean_leftovers, replace_folder


def write_study(path: str | Path, out: Path | None, force: bool, command: str, workers: int,
                load_config: Callable, check_out: Callable[[Path, bool, str], str | None],
                work: Callable[[object, Path, Callable[[], dict]], None],
                dask: str | None = None) -> Path:
    """Read a study file with ``load_config`` (every problem before a model loads), check its
    report folder ``out`` (default ``reports/<name>``) with ``check_out(out, force, name)``,
    connect to the Dask cluster at ``dask`` if given (its maps then run there:
    :func:`~kvsim.tools.study.cluster.on_cluster`), and, holding the folder's lock, call
    ``work(cfg, out, provenance)`` to run the study and write the folder; ``provenance()``
    gives the facts of :func:`provenance` at that moment (the wall time counts from the call
    of this function). The note of a replaced report goes to stderr at the end. Returns the
    folder."""
    from kvsim.tools.study.cluster import on_cluster, worker_count

    start, started = time.perf_counter(), time.time()
    cfg = load_config(path)
    out = Path("reports") / cfg.name if out is None else Path(out)
    check_out(out, force, cfg.name)
    with on_cluster(dask) as client, ReportLock(out):
        clean_leftovers(out, keep_units=False)
        note = check_out(out, force, cfg.name)  # again, under the lock
        if client is not None:
            workers = worker_count(client)
        work(cfg, out, lambda: provenance(command, workers, start, started, dask))
    if note:
        print(note, file=sys.stderr)
    return out


def provenance(command: str, workers: int, start: float, started: float,
               dask: str | None = None) -> dict:
    """The command line, kvsim's version and commit, the date of ``started``
    (``time.time()``), the wall time since ``start`` (``time.perf_counter()``), the
    machine's cores, the worker processes (with ``dask``: the cluster's, and its address)
    and the load average (1, 5 and 15 minutes) now."""
    from kvsim.report.writer import git_commit  # the report writer and its figures: on demand

    facts = {"command": command, "kvsim": __version__, "commit": git_commit(),
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
             "wall_seconds": time.perf_counter() - start, "cores": os.cpu_count(),
             "workers": workers, "load_average": os.getloadavg()}
    return {**facts, "dask": dask} if dask else facts


def check_out(study, out: Path, force: bool, name: str) -> str | None:
    """``out`` may receive a report of ``study`` (see
    :func:`~kvsim.report.writer.check_study_out`, its ``saved`` file the marker)."""
    from kvsim.report.writer import check_study_out  # the report writer and its figures

    return check_study_out(out, force, study.saved, name, study.what)


def run_report(study, path: str | Path, out: Path | None = None, *, force: bool = False,
               progress: bool = True, workers: int = 1, command: str | None = None,
               dask: str | None = None) -> Path:
    """Run the file ``path`` of ``study`` and write its report (default
    ``reports/<name>/``): ``study.run(cfg, out, provenance, workers, progress)`` does the
    work, on ``workers`` forked processes, or with ``dask`` on the Dask cluster at that
    address (``tcp://HOST:PORT`` or ``local:N``); the numbers depend on neither. Returns the
    folder."""
    return write_study(path, out, force, command or f"kvsim {study.command} {path}", workers,
                       study.load_config, lambda *a: check_out(study, *a),
                       lambda cfg, out, provenance: study.run(cfg, out, provenance, workers,
                                                              progress), dask)


def redraw_report(study, path: str | Path, out: Path | None = None, *,
                  command: str | None = None) -> Path:
    """Rewrite the figures and text of the report of ``path`` (default ``reports/<name>/``)
    from its files, without the model: the results stay those of the run that wrote it,
    which must have had the file's settings (apart from ``study.redrawable``).
    ``study.redraw(cfg, out, facts, tmp)`` writes the new folder ``tmp`` from the report's
    files in ``out``, ``facts`` those of the run with the redraw's own under ``redrawn``.
    Returns the folder."""

    def work(cfg, out: Path, provenance) -> None:
        saved = out / study.saved
        if not saved.is_file() or not (out / "results.csv").is_file():
            raise KvsimError(f"{out}: expected a {study.what} report to redraw "
                             f"({study.saved} and results.csv); run without --redraw to "
                             f"make one")
        info = json.loads(saved.read_text())
        info["settings"] = {**study.added, **info["settings"]}
        now = json.loads(json.dumps(study.settings(cfg), default=str))
        differ = sorted(k for k in {*now, *info["settings"]} - set(study.redrawable)
                        if now.get(k) != info["settings"].get(k))
        if differ:
            raise KvsimError(f"{path}: {', '.join(differ)} differ from the settings of the "
                             f"report in {out}; run without --redraw to run the model again")
        now_facts = provenance()
        # the run's facts: under "facts", or (the closed loop's) beside the settings
        facts = info["facts"] if "facts" in info else \
            {k: v for k, v in info.items() if k != "settings"}
        facts = {**facts, "redrawn": {k: now_facts[k]
                                      for k in ("command", "kvsim", "commit", "date")}}
        replace_folder(out, lambda tmp: study.redraw(cfg, out, facts, tmp), keep=())

    return write_study(path, out, False, command or f"kvsim {study.command} {path} --redraw",
                       1, study.load_config, lambda *a: check_out(study, *a), work)
