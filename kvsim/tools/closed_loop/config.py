"""Closed-loop files: TOML -> a validated, frozen :class:`ClosedLoopConfig`.

A closed-loop file holds a ``[closed_loop]`` table (the model, the text, its length, the
prompt length and the budgets) and ``[policies.NAME]`` tables read exactly as in a
scenario, or, with a ``press`` key, kvpress's presses read as in a task file
(:mod:`kvsim.tools.study.presses`; run by :mod:`kvsim.tools.closed_loop.presses`). Every
problem is one line ``FILE: key.path: expected ..., got ...``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvsim.errors import ScenarioError
from kvsim.params import Param
from kvsim.texts import SHIPPED, shipped_text
from kvsim.models import catalog
from kvsim.models import preflight
from kvsim.numerics.quantize import Quantize
from kvsim.scenario.reader import PolicyConfig, read_budgets, read_quantize
from kvsim.tools.study.file import (BOOTSTRAP, GQA, MODEL_SETTINGS, check_context, read_focus,
                                    read_model, read_output, read_steppable_policies,
                                    read_study_file)
from kvsim.tools.study.presses import PROTOCOL, read_presses
from kvsim.tools.study.report import settings_of

TOP_KEYS = ("name", "description", "closed_loop", "policies", "output")


def _positive(v) -> bool:
    return v >= 1


SETTINGS = {
    **MODEL_SETTINGS,
    "text": Param(str, "", "text the model reads (teacher forcing): a file, relative to this "
                  "one, or the name of a text shipped with kvsim (kvsim.texts: gpl-3)"),
    "tokens": Param(int, 1024, "tokens of the text to run (T)", check=_positive,
                    expect="an integer >= 1"),
    "prompt_len": Param(int, 512, "prompt length P; decode steps P .. T-1", check=_positive,
                        expect="an integer >= 1"),
    "focus_budget": Param(int, 0, "budget whose KL over decode steps is drawn (0: the "
                          "second smallest)"),
    "gqa": GQA,
    "batch": Param(int, 0, "caches decoded together in one forward pass (0: all); only "
                   "memory and speed depend on it", check=lambda v: v >= 0,
                   expect="an integer >= 0"),
    "bootstrap": BOOTSTRAP,
    "seed": Param(int, 0, "seed of the bootstrap and of seeded policies",
                  check=lambda v: v >= 0, expect="an integer >= 0"),
}


@dataclass(frozen=True)
class ClosedLoopConfig:
    """A validated closed-loop file."""

    path: Path
    name: str
    description: str
    model: Path
    gguf_file: str | None
    text: Path
    tokens: int
    prompt_len: int
    budgets: tuple[int, ...]
    focus_budget: int
    policies: tuple[PolicyConfig, ...]
    gqa: str
    batch: int
    bootstrap: int
    seed: int
    formats: tuple[str, ...]
    dpi: int
    quantize: Quantize | None = None  # KIVI storage of every compressed cache
    presses: tuple[PolicyConfig, ...] = ()  # kvpress's, compressing the prompt once


def load_config(path: str | Path) -> ClosedLoopConfig:
    """Read and validate a closed-loop file; problems raise :class:`ScenarioError`."""
    path, doc, chk, name, description, table = read_study_file(path, "closed_loop", TOP_KEYS)
    s = chk.params(table, SETTINGS, "closed_loop.", skip=("budgets", "quantize"))
    quantize = read_quantize(chk, table, "closed_loop", ("model", frozenset({"keys", "values"})))
    model, gguf, text = None, None, None
    if len(s) == len(SETTINGS):
        model, gguf = read_model(chk, "closed_loop", s, path.parent)
        text = shipped_text(s["text"]) or (Path(os.path.realpath(path.parent / s["text"]))
                                           if s["text"] else None)
        if text is None or not text.exists():
            chk.add("closed_loop.text", f"expected an existing text file or a shipped text "
                                        f"({', '.join(SHIPPED)}), got {s['text']!r}")
        else:
            preflight.check_text(chk, "closed_loop.text", text, "closed_loop.tokens",
                                 s["tokens"])
        check_context(chk, "closed_loop.tokens", model, gguf, s["tokens"], "(tokens)")
        if s["prompt_len"] >= s["tokens"]:
            chk.add("closed_loop.prompt_len", f"expected an integer below tokens "
                                              f"({s['tokens']}), got {s['prompt_len']}")
    budgets, _ = read_budgets(chk, table.get("budgets"), "closed_loop.budgets",
                              s.get("prompt_len", 1), s.get("tokens", 1))
    tables = doc.get("policies")
    given = len(tables) if isinstance(tables, dict) else 0
    family = catalog.family(model, gguf) if model is not None else None
    presses = read_presses(chk, doc, [PROTOCOL], family if family in catalog.FAMILIES else None,
                           budgets=budgets, context=s.get("prompt_len", 0))
    configs = read_steppable_policies(chk, doc, budgets, s.get("tokens", 1),
                                      s.get("prompt_len", 0), len(s) == len(SETTINGS)) \
        if not given or doc["policies"] else {}  # {}: presses only
    focus = read_focus(chk, "closed_loop.focus_budget", s.get("focus_budget", 0), budgets)
    formats, dpi = read_output(chk, doc)
    if chk.problems:
        raise ScenarioError(chk.problems)
    return ClosedLoopConfig(path.resolve(), name, description, model, gguf, text, s["tokens"],
                            s["prompt_len"], tuple(budgets), focus, tuple(configs.values()),
                            s["gqa"], s["batch"], s["bootstrap"], s["seed"], tuple(formats), dpi,
                            quantize, tuple(presses.values()))


def saved_settings(cfg: ClosedLoopConfig) -> dict:
    """The settings a report saves in closed_loop.json: the text by its file name."""
    return {**settings_of(cfg), "text": cfg.text.name}
