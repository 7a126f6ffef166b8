"""kvpress presses as policies of a study (``kvsim task``, ``kvsim closed-loop``; the
optional extra ``kvpress``).

A ``[policies.NAME]`` table with a ``press`` key names a kvpress press class; its other keys
are the press's own keyword arguments (``window_size = 64``). Per budget ``B`` the press
compresses the context (a task's prompt minus its question, a closed loop's prompt) inside
the model exactly as kvpress does (:func:`kvsim.tools.study.press_prefill.kept`), at the
``compression_ratio`` that makes kvpress keep exactly ``B`` keys per layer and KV head
(:func:`ratio`); what follows joins the positions it kept with no eviction, in kvsim's
decoder, as kvpress's pipeline does. A press therefore runs under kvpress's own protocol,
``prefill_only``, only. On Gemma-3 kvsim reads the global layers' kept positions (the
sliding-window layers keep the model's window, as for kvsim's own policies).

Before any model loads, a press table is checked (:func:`read_presses`): its class and
keywords, the extra and its transformers, no press that fetches from the Hub (:data:`HUB`)
or shares the budget across layers (:data:`ACROSS_LAYERS`), and a rehearsal
(:func:`rehearsal_problem`) of the press at every budget on a tiny random model of the
file's family, which must run and keep exactly the budget.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import warnings
from importlib import metadata

import numpy as np

from kvsim.errors import KvsimError
from kvsim.scenario.load import PolicyConfig

KEY = "press"
PROTOCOL = "prefill_only"
INSTALL = ('pip install -e ".[capture,kvpress]" in a venv of its own (kvpress 0.5.5 pins '
           'transformers<5.3; see docs/tasks.md)')
TRANSFORMERS = ">=5.2,<5.3"  # the kvpress extra's pin (pyproject.toml): kvpress's, 5.2 tested
MATCH = 1e-3  # a kept key read back from the cache is its context key to this relative error
HUB = {  # kvpress 0.5.5's presses that fetch what they need for the model by its hub name
    "ExpectedAttentionStatsPress": "the model's query statistics",
    "FastKVzipPress": "gates trained for the model",
    "KVgradPress": "the model's tokenizer",
    "KVzapPress": "a scorer trained for the model",
    "KVzipPress": "the model's tokenizer",
    "LUKVPress": "a budget curve published for the model",
    "QFilterPress": "the model's Q-filters",
    "RestoreKVPress": "embeddings trained for the model",
}
ACROSS_LAYERS = {  # kvpress 0.5.5's presses that share the budget unevenly across layers
    "KVComposePress": "composite tokens whose number varies by layer",
    "PyramidKVPress": "a pyramid (more keys in the lower layers) once the budget exceeds 20 "
                      "windows, and round() instead of the ratio's count below it",
}
SDPA = {  # kvpress 0.5.5's presses that refuse the attention weights an eager prefill passes
    "ChunkKVPress": "asserts that no attention weights reach it",
}
QUESTION_ROOM = 32
"""Tokens left for the question when a press is rehearsed (:func:`rehearsal_problem`) on
the shortest length: more than any question of kvsim's prompts takes (11 raw, 17 chat on
SmolLM2), so the rehearsed context is never longer than a trial's."""


def presses_module():
    """``kvpress`` imported, or a one-line :class:`KvsimError` saying how to install it
    (the extra missing, a transformers outside :data:`TRANSFORMERS`, a failed import)."""
    if importlib.util.find_spec("kvpress") is None:
        raise KvsimError(f"expected the kvpress extra: {INSTALL}")
    problem = transformers_problem()
    if problem:
        raise KvsimError(problem)
    try:
        import kvpress
    except Exception as exc:  # kvpress 0.5.5 does not import on transformers >= 5.3
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KvsimError(f"expected kvpress to import ({first}): {INSTALL}") from None
    return kvpress


def transformers_problem() -> str | None:
    """Why the installed transformers cannot serve kvpress (none, or a version outside
    :data:`TRANSFORMERS`), read from its metadata without importing it; None if it can."""
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        version = None
    if version is not None:
        from packaging.specifiers import SpecifierSet  # a dependency of transformers

        if SpecifierSet(TRANSFORMERS).contains(version, prereleases=True):
            return None
    return f"expected transformers{TRANSFORMERS} for kvpress, got {version or 'none'}: {INSTALL}"


def press_class(name: str):
    """The press class ``name`` of kvpress, or None."""
    kvpress = presses_module()
    cls = getattr(kvpress, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, kvpress.BasePress) else None


def read_presses(chk, doc: dict, compress: list[str], family: str | None = None,
                 shortest: int = 0, budgets=(), context: int | None = None
                 ) -> dict[str, PolicyConfig]:
    """The ``[policies.NAME]`` tables with a ``press`` key, removed from ``doc`` (the rest
    are kvsim's policies), each a :class:`PolicyConfig` whose kind is the press's class
    name and whose params are its keyword arguments; every problem one line on ``chk``.
    With the model's ``family`` and the ``shortest`` length known, each press is rehearsed
    at every one of ``budgets`` (:func:`rehearsal_problem`) on the shortest length less
    :data:`QUESTION_ROOM`, or on ``context`` tokens where given (a closed loop's prompt)."""
    tables = doc.get("policies")
    if not isinstance(tables, dict):
        return {}
    named = {label: t for label, t in tables.items() if isinstance(t, dict) and KEY in t}
    for label in named:
        del tables[label]
    out = {}
    for label, table in named.items():
        where = f"policies.{label}"
        if PROTOCOL not in compress:
            chk.add(f"{where}.{KEY}", f"expected task.compress to include '{PROTOCOL}': a "
                                      f"press runs under kvpress's protocol only")
        try:
            problem = _check(table, family, shortest - QUESTION_ROOM, budgets) \
                if context is None else _check(table, family, context, budgets, "the prompt")
        except KvsimError as exc:
            chk.add(f"{where}.{KEY}", str(exc))
            continue
        if problem:
            chk.add(f"{where}.{problem[0]}" if problem[0] else where, problem[1])
            continue
        out[label] = PolicyConfig(label, table[KEY], _params(table))
    return out


def _params(table: dict) -> dict:
    return {k: v for k, v in table.items() if k != KEY}


def _check(table: dict, family: str | None, context: int, budgets,
           why: str = f"the shortest length less {QUESTION_ROOM}") -> tuple[str, str] | None:
    """(key, message) of the first problem of a press table, or None; its rehearsal
    (:func:`rehearsal_problem`) where the ``family`` and a ``context`` are known."""
    name = table[KEY]
    cls = press_class(name) if isinstance(name, str) else None
    if cls is None:
        return KEY, f"expected the name of a kvpress press (e.g. SnapKVPress), got {name!r}"
    if name in HUB:
        return KEY, (f"expected a press that needs nothing from the Hugging Face Hub (kvsim "
                     f"never downloads); {name} fetches {HUB[name]}")
    if name in ACROSS_LAYERS:
        return KEY, (f"expected a press that keeps the budget in every layer (kvsim's budget "
                     f"is per layer and KV head); {name} keeps {ACROSS_LAYERS[name]}")
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if "compression_ratio" not in fields:
        return KEY, (f"expected a press with a compression_ratio (kvsim sets it from each "
                     f"budget); {name} has none")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, value in table.items():
        if key == "compression_ratio":
            return key, "expected no compression_ratio: kvsim sets it from each budget"
        if key != KEY and key not in fields:
            return key, (f"expected a keyword argument of {name} "
                         f"({', '.join(sorted(fields - {'compression_ratio'}))}), got {key!r}")
        if key != KEY and not _like(value, defaults[key]):
            return key, (f"expected a {type(defaults[key]).__name__} like {name}'s default "
                         f"{defaults[key]!r}, got {value!r}")
    pc = PolicyConfig("", name, _params(table))
    try:
        make(pc, 0.5)
    except Exception as exc:  # the press's own check of its arguments
        return "", f"expected arguments {name} accepts: {type(exc).__name__}: {exc}".rstrip(": ")
    problem = rehearsal_problem(pc, family, context, budgets, why) \
        if family and context > 0 and budgets else None
    return ("", problem) if problem else None


def rehearsal_problem(pc: PolicyConfig, family: str, context: int, budgets,
                      why: str = f"the shortest length less {QUESTION_ROOM}") -> str | None:
    """Why the press of ``pc`` cannot run in a study on a model of ``family`` (one line),
    found by running it as :func:`~kvsim.tools.study.press_prefill.kept` does at every one
    of ``budgets`` on ``context`` tokens of a tiny random model of the family (its
    architecture, no weights): it must run and keep exactly ``min(B, context)`` keys in
    every global layer (``why``: what the context's length is, for the message). None if
    it can."""
    import torch
    from transformers import DynamicCache

    from kvsim.models.catalog import TINY, tiny_model

    net = tiny_model(family, context)
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, TINY["vocab_size"], context)[None])
    types = getattr(net.config, "layer_types", None) or ["full_attention"] * len(net.model.layers)
    where = f"rehearsed on a tiny random one at a context of {context} tokens, {why}"
    quiet = logging.getLogger("kvpress")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its notices ("not tested" on Gemma3ForCausalLM)
    try:
        for b in sorted(budgets):
            cache = DynamicCache()
            try:
                with warnings.catch_warnings(), torch.no_grad():
                    warnings.simplefilter("ignore")
                    with make(pc, ratio(context, b))(net):
                        net.model(input_ids=ids, past_key_values=cache)
            except Exception as exc:  # the press's own refusal, at run time
                first = (str(exc).strip().splitlines() or [""])[0]
                return (f"expected a press and arguments that run on a {family} model "
                        f"({where}): {type(exc).__name__}: {first}").rstrip(": ")
            held = sorted({cache.layers[i].keys.shape[2] for i, t in enumerate(types)
                           if t == "full_attention"})
            if held != [min(b, context)]:
                return (f"expected a press that keeps exactly the budget in every layer "
                        f"(kvsim's budget is per layer and KV head); {pc.kind} keeps {held} "
                        f"keys at budget {b} on a {family} model ({where})")
    finally:
        quiet.setLevel(level)
    return None


def _like(value, default) -> bool:
    """Whether ``value`` has the type of a field's ``default`` (an int passes for a float;
    a field without a plain default takes anything its press accepts)."""
    if default is dataclasses.MISSING or default is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def make(pc: PolicyConfig, compression_ratio: float):
    """The press of ``pc`` at ``compression_ratio``. A parameter that is a table with a
    ``press`` key is a nested press (``ChunkKVPress``'s ``press``), built with its keyword
    arguments; a press without a ``compression_ratio`` field (a wrapper) gets it set
    afterwards, which sets its nested press's."""
    cls = press_class(pc.kind)
    kwargs = {k: press_class(v[KEY])(**_params(v)) if isinstance(v, dict) and KEY in v else v
              for k, v in pc.params.items()}
    if "compression_ratio" in {f.name for f in dataclasses.fields(cls)}:
        return cls(**kwargs, compression_ratio=compression_ratio)
    press = cls(**kwargs)
    press.compression_ratio = compression_ratio
    return press


def press_text(kind: str, params: dict) -> str:
    """A press as its call reads, ``ChunkKVPress(press=SnapKVPress(window_size=32),
    chunk_length=20)``: a nested press's table (a ``press`` key) shown as its call."""
    args = ", ".join(f"{k}={press_text(v[KEY], _params(v))}" if isinstance(v, dict) and KEY in v
                     else f"{k}={v!r}" for k, v in params.items())
    return f"{kind}({args})"


def n_kept(k_len: int, compression_ratio: float) -> int:
    """How many of ``k_len`` keys kvpress keeps at ``compression_ratio`` (its
    ``compute_n_kept``: ``max(1, int(k_len * (1 - r)))``, none at ``r >= 1``)."""
    return 0 if compression_ratio >= 1.0 else max(1, int(k_len * (1 - compression_ratio)))


def ratio(k_len: int, budget: int) -> float:
    """The ``compression_ratio`` at which kvpress keeps exactly ``budget`` of ``k_len``
    keys (0: all of them, when ``budget >= k_len``): the middle of the interval of ratios
    that :func:`n_kept` rounds to ``budget``, so no float rounding moves it."""
    if budget >= k_len:
        return 0.0
    r = 1.0 - (budget + 0.5) / k_len
    if n_kept(k_len, r) != budget:
        raise AssertionError(f"compression_ratio {r} keeps {n_kept(k_len, r)} of {k_len}, "
                             f"not {budget}")
    return r
