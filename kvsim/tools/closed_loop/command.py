"""``python -m kvsim closed-loop FILE.toml``: load, run, write the report, print its folder."""

from __future__ import annotations

from pathlib import Path

from kvsim.report.writer import check_study_out
from kvsim.tools.capture import load_model
from kvsim.tools.closed_loop.config import load_config
from kvsim.tools.closed_loop.report import write_report
from kvsim.tools.closed_loop.run import run
from kvsim.tools.study import write_study


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
    def work(cfg, out: Path, provenance) -> None:
        net, tokenizer = load_model(str(cfg.model), cfg.gguf_file)
        series, facts = run(cfg, net, tokenizer, progress, workers)
        facts["run_seconds"] = facts["wall_seconds"]
        facts.update(provenance())
        write_report(cfg, series, facts, out)

    return write_study(path, out, force, command or f"kvsim closed-loop {path}", workers,
                       load_config, _check_out, work)


def _check_out(out: Path, force: bool, name: str) -> str | None:
    """``out`` may receive the report (see :func:`~kvsim.report.writer.check_study_out`)."""
    return check_study_out(out, force, "closed_loop.json", name, "closed-loop")
