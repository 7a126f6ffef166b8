"""``python -m kvsim closed-loop FILE.toml``: the closed loop's entry in the table of study
types (:data:`STUDY`): load, run, write the report, print its folder; or redraw it."""

from __future__ import annotations

from pathlib import Path

from kvsim.models.capture import load_model
from kvsim.tools.closed_loop.config import ClosedLoopConfig, load_config, saved_settings
from kvsim.models.preflight import NEEDS
from kvsim.tools.study.cluster import load_shared
from kvsim.tools.study.run import run_report
from kvsim.tools.study.types import StudyType


def _run(cfg: ClosedLoopConfig, out: Path, provenance, workers: int, progress: bool) -> None:
    """Load the model, run every policy and budget, write the report folder ``out``."""
    from kvsim.tools.closed_loop.report import write_report
    from kvsim.tools.closed_loop.run import run

    net, tokenizer = load_shared(load_model, str(cfg.model), cfg.gguf_file)
    series, facts = run(cfg, net, tokenizer, progress, workers)
    facts["run_seconds"] = facts["wall_seconds"]
    facts.update(provenance())
    write_report(cfg, series, facts, out)


def _redraw(cfg: ClosedLoopConfig, out: Path, facts: dict, tmp: Path) -> None:
    from kvsim.tools.closed_loop.report import redraw

    redraw(cfg, out, facts, tmp)


def _check_line(cfg: ClosedLoopConfig) -> str:
    return (f"closed-loop file: {len(cfg.policies)} policies x {len(cfg.budgets)} budgets, "
            f"tokens = {cfg.tokens}, prompt_len = {cfg.prompt_len}; model {cfg.model}"
            f"{', ' + cfg.gguf_file if cfg.gguf_file else ''}")


STUDY = StudyType(
    command="closed-loop", table="closed_loop", what="closed-loop", saved="closed_loop.json",
    summary="run each policy and budget inside a real model and report how well the open-loop "
            "mass predicts its KL and NLL (needs the capture extra)",
    description="Run every policy and budget of a closed-loop file inside a real model (each "
                "layer and KV head under its own cache), beside the simulator's open-loop mass "
                "on the same text, and report how well each open-loop metric predicts the "
                f"model's KL and NLL. {NEEDS}",
    workers_help="processes decoding the batches of runs (default 1; results do not depend "
                 "on it)",
    load_config=load_config, check_line=_check_line, run=_run, redraw=_redraw,
    settings=saved_settings)


def closed_loop_report(path: str | Path, out: Path | None = None, *, force: bool = False,
                       progress: bool = True, workers: int = 1,
                       command: str | None = None, dask: str | None = None) -> Path:
    """Run a closed-loop file and write its report (default ``reports/<name>/``), its
    closed-loop batches on ``workers`` forked processes, or with ``dask`` on the Dask
    cluster at that address (``tcp://HOST:PORT`` or ``local:N``); the numbers depend on
    neither.

    The wall time written in the report covers everything up to the report files:
    loading the model, the full run, the open loop and every closed-loop run; the
    machine's core count and load average at the end go beside it, with the command line
    (``command``), kvsim's version and commit and the date, as in a scenario report.
    """
    return run_report(STUDY, path, out, force=force, progress=progress, workers=workers,
                      command=command, dask=dask)

