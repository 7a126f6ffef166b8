"""Draw the report's figures from :class:`~kvsim.api.results.Results`.

A thin adapter: it reads what the figure functions of :mod:`kvsim.report.figures` need (a
:class:`~kvsim.report.plotting.FigureContext` and the experiment's budgets and policies)
from the rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvsim.engine.records import ExperimentSteps
from kvsim.errors import KvsimError
from kvsim.report import figures
from kvsim.report.plotting import FigureContext, available, missing
from kvsim.scenario.load import FORMATS, Experiment, PolicyConfig


def results_context(name: str, rows: list[dict], exp: Experiment, formats: tuple[str, ...],
                    dpi: int) -> FigureContext:
    """The figures' view of one experiment's ``rows`` of results ``name``: what the rows
    hold, without head names (results do not keep them)."""
    return FigureContext(name, rows[0]["T"], tuple(dict.fromkeys(r["seed"] for r in rows)),
                         max(r["head"] for r in rows) + 1, max(r["kv_head"] for r in rows) + 1,
                         (), any(not np.isnan(r["final_recall"]) for r in rows),
                         len({r.get("layer") for r in rows}),  # simulate's rows: one layer
                         _layer_ids(rows), (exp,), formats, dpi)


def _layer_ids(rows: list[dict]) -> tuple[int, ...]:
    """The model layers of ``rows`` when they name several (one layer is not named: the
    rows do not say whether it is a model's)."""
    ids = sorted({r["layer"] for r in rows if r.get("layer") is not None})
    return tuple(ids) if len(ids) > 1 else ()


def draw(results, figure: str, out: Path | None, experiment: str, formats: tuple[str, ...],
         dpi: int):
    """Draw ``figure`` of ``experiment``: the Figure, or with ``out`` the files written."""
    if figure not in figures.FIGURES:
        raise KvsimError(f"figure: expected one of {', '.join(figures.FIGURES)}, "
                         f"got {figure!r}")
    if not formats or any(f not in FORMATS for f in formats):
        raise KvsimError(f"formats: expected some of {', '.join(FORMATS)}, got {formats!r}")
    rows, arrays, (snap_steps, snapshots), focus = results.part(experiment)
    first = rows[0]
    if figure == "allocation":
        raise KvsimError("figure: 'allocation' needs per-head caps from a scenario run "
                         "(allocation = \"ada\" or \"pyramid\"); simulate runs budget B")
    if figure == "kept_raster" and first["steps"] > 0 and not snapshots:
        raise KvsimError("figure: 'kept_raster' needs recorded caches: pass record=('kept',) "
                         "to kvsim.simulate")
    budgets = tuple(sorted({r["budget"] for r in rows}))
    labels = dict.fromkeys(r["policy"] for r in rows)
    kinds = {r["policy"]: r["kind"] for r in rows}
    exp = Experiment(experiment, first["prompt_len"], budgets, budgets,
                     tuple(PolicyConfig(label, kinds[label], {}) for label in labels),
                     (figure,), focus, (focus,))
    ctx = results_context(results.name, rows, exp, formats, dpi)
    units = arrays["mass"].shape[0]
    steps = ExperimentSteps(list(arrays["mass"]), list(arrays["cache_size"]),
                            list(arrays["recall"]), list(arrays["error"]),
                            [np.zeros(0, np.int64)] * units, snap_steps, snapshots)
    lacking = missing(figures.FIGURES[figure], available(ctx, exp, rows))
    if lacking:
        raise KvsimError(f"figure: {figure!r} needs {lacking[0].describe()}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    drawn = figures.FIGURES[figure].draw(ctx, exp, rows, steps, figures.policy_colors(ctx),
                                         figures.Target(out))
    if not drawn:
        raise KvsimError(f"figure: {figure!r} has nothing to draw in experiment {experiment!r}")
    return drawn if out is not None else drawn[0]
