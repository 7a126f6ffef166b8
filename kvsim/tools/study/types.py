"""The table of study types, from which the command line builds each study's subcommand,
its ``--help`` and its ``validate`` entry.

A study type is a package of ``kvsim/tools/`` whose ``command`` module declares ``STUDY``,
a :class:`StudyType`: the table finds it there (:data:`BUILT_IN`), and :func:`register`
adds one from outside kvsim at run time.
"""

from __future__ import annotations

import dataclasses

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvsim.tools.study.report import settings_of

BUILT_IN = tuple(sorted(p.parent.name for p in Path(__file__).resolve().parents[1].glob(
    "*/command.py")))
"""The study packages of ``kvsim/tools/``: those with a ``command`` module (found by its
file, imported only when the table is asked for), in the order the command line lists
them."""


@dataclass(frozen=True)
class StudyType:
    """What the base needs of a study type.

    - ``command``: its subcommand (``kvsim COMMAND FILE.toml``); ``table``: the top-level
      table that marks its files (``validate`` tells them apart by it); ``what``: its name in
      messages and report notes; ``saved``: the JSON file of its report folder that holds
      ``{"settings": ..., "facts": ...}`` and marks the folder as its report;
    - ``summary``: its line in ``kvsim --help``, under :attr:`usage`; ``description``,
      ``workers_help`` and ``epilog``: its own ``--help``;
    - ``load_config(path)``: the validated config (a frozen dataclass with ``name``), every
      problem found before a model loads; ``check_line(cfg)``: what ``validate`` prints
      after ``FILE: ok``;
    - ``run(cfg, out, provenance, workers, progress)``: run the model and write the report
      folder ``out`` (``provenance()``: the run's facts, :func:`~kvsim.tools.study.run.
      provenance`);
    - ``redraw(cfg, out, facts, tmp)``, optional: write the report anew into ``tmp`` from
      the files in ``out``, without the model; ``redrawable``: the settings a redraw may
      change; ``settings(cfg)``: the settings saved in ``saved``; ``added``: settings the
      study gained after reports were written, with the value such a report ran;
    - ``gate(path, workers=, progress=)``, optional: a check to print before a long run
      (``--gate``), writing nothing.
    """

    command: str
    table: str
    what: str
    saved: str
    summary: str
    description: str
    workers_help: str
    load_config: Callable
    check_line: Callable[[object], str]
    run: Callable
    redraw: Callable | None = None
    redrawable: tuple[str, ...] = ("description", "focus_budget", "bootstrap", "formats",
                                   "dpi")
    settings: Callable[[object], dict] = settings_of
    added: dict = dataclasses.field(default_factory=dict)
    gate: Callable | None = None
    epilog: str | None = None

    @property
    def usage(self) -> str:
        """Its line in ``kvsim --help``: the options the CLI gives every study, and
        ``--redraw`` and ``--gate`` where it has them."""
        extra = (" [--redraw]" if self.redraw else "") + (" [--gate]" if self.gate else "")
        return (f"kvsim {self.command} FILE.toml [--out DIR] [--force] [--quiet] "
                f"[--workers N | --dask ADDRESS]{extra}")


_REGISTERED: dict[str, StudyType] = {}


def register(study: StudyType) -> StudyType:
    """Add ``study`` to the table (by its command; a second of one command replaces the
    first). Returns it."""
    _REGISTERED[study.command] = study
    return study


def studies() -> dict[str, StudyType]:
    """Every study type by command: the built-in ones (:data:`BUILT_IN`), then those
    registered."""
    built = {}
    for name in BUILT_IN:
        study = getattr(importlib.import_module(f"kvsim.tools.{name}.command"), "STUDY", None)
        if study is not None:
            built[study.command] = study
    return {**built, **_REGISTERED}


def study_of_file(doc: dict) -> StudyType | None:
    """The study type whose table the TOML document ``doc`` holds, or None (a scenario)."""
    return next((s for s in studies().values() if isinstance(doc.get(s.table), dict)), None)


def describe(path: Path, study: StudyType) -> str:
    """``validate``'s line on a study file: every problem raises before it."""
    return f"{path}: ok ({study.check_line(study.load_config(path))})"
