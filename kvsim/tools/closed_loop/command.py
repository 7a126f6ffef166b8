"""``python -m kvsim closed-loop FILE.toml``: load, run, write the report, print its folder."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from kvsim._version import __version__
from kvsim.errors import KvsimError
from kvsim.report.lock import ReportLock, clean_leftovers
from kvsim.report.writer import check_study_out
from kvsim.tools.capture import load_model
from kvsim.tools.closed_loop.config import load_config
from kvsim.tools.closed_loop.report import write_report
from kvsim.tools.closed_loop.run import run


def closed_loop_report(path: str | Path, out: Path | None = None, *, force: bool = False,
                       progress: bool = True, workers: int = 1,
                       command: str | None = None) -> Path:
    """Run a closed-loop file and write its report (default ``reports/<name>/``), its
    closed-loop batches on ``workers`` forked processes (the numbers do not depend on it).

    The wall time written in the report covers everything up to the report files:
    loading the model, the full run, the open loop and every closed-loop run; the
    machine's core count and load average at the end go beside it, with the command line
    (``command``), kvsim's version and commit and the date, as in a scenario report.
    """
    from kvsim.report.writer import git_commit

    start, started = time.perf_counter(), time.time()
    cfg = load_config(path)
    out = Path("reports") / cfg.name if out is None else Path(out)
    _check_out(out, force, cfg.name)
    with ReportLock(out):
        clean_leftovers(out, keep_units=False)
        note = _check_out(out, force, cfg.name)
        net, tokenizer = load_model(str(cfg.model), cfg.gguf_file)
        series, facts = run(cfg, net, tokenizer, progress, workers)
        facts["workers"] = workers
        facts["run_seconds"] = facts["wall_seconds"]
        facts["wall_seconds"] = time.perf_counter() - start
        facts["cores"] = os.cpu_count()
        facts["load_average"] = os.getloadavg()  # 1, 5 and 15 minutes, at the end
        facts["command"] = command or f"kvsim closed-loop {path}"
        facts["kvsim"] = __version__
        facts["commit"] = git_commit()
        facts["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
        write_report(cfg, series, facts, out)
    if note:
        print(note, file=sys.stderr)
    return out


def _check_out(out: Path, force: bool, name: str) -> str | None:
    """``out`` may receive the report (see :func:`~kvsim.report.writer.check_study_out`)."""
    return check_study_out(out, force, "closed_loop.json", name, "closed-loop")
