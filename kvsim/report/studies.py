"""Studies: a report section with its own figure, drawn for the experiments it applies to.

A study is registered here, as a figure is in :mod:`kvsim.report.plotting`; the writer and
``report.md`` go through :data:`STUDIES` and know none of them by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvsim.report import h2o_study, protocol_study
from kvsim.scenario.load import Experiment, Scenario


@dataclass(frozen=True)
class Study:
    """``applies(scenario, exp)``; ``draw(ctx, exp, rows, steps, target)`` returns the
    figure files (``ctx``: the scenario's :class:`~kvsim.report.plotting.FigureContext`);
    ``section(scenario, exp, rows, steps)`` the markdown lines before them."""

    name: str
    applies: Callable[[Scenario, Experiment], bool]
    draw: Callable[..., list[Path]]
    section: Callable[..., list[str]]


STUDIES: tuple[Study, ...] = (
    Study("h2o", h2o_study.applies, h2o_study.figures, h2o_study.section),
    Study("protocols", protocol_study.applies, protocol_study.figures, protocol_study.section),
)
