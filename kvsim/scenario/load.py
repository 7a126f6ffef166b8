"""Scenario files: TOML -> a validated, frozen :class:`Scenario`.

Validation is complete before any work starts; every problem becomes one line
``FILE: key.path: expected ..., got ...`` in a :class:`~kvsim.errors.ScenarioError`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvsim.attention.components import BOOST, COMPONENTS
from kvsim.attention.sources import FIELD_PARAMS, SOURCES, Field
from kvsim.errors import KvsimError, ScenarioError
from kvsim.numerics.kernels import GQA_MODES
from kvsim.scenario.overrides import Overrides, apply, expand_sweep
from kvsim.params import Param
from kvsim.policies import POLICIES
from kvsim.policies.run import budget_problem, did_you_mean, get_policy, resolve_params

FIGURES = ("pareto", "recall_vs_budget", "mass_vs_budget", "mass_over_time", "kept_raster",
           "allocation")
FORMATS = ("png", "svg", "pdf")

TOP_KEYS = ("name", "description", "seeds", "attention", "policies", "experiment", "output",
            "sweep")
EXPERIMENT_KEYS = ("name", "prompt_len", "budgets", "policies", "figures", "focus_budget",
                   "allocation", "floor_share", "beta")
ALLOCATIONS = ("uniform", "ada", "pyramid")  # the rules: kvsim.engine.allocation
ALLOCATION_PARAMS = {  # experiment keys of the budget allocation (kvsim.engine.allocation)
    "allocation": Param(str, "uniform", "how the budget is shared across KV heads and layers",
                        choices=ALLOCATIONS),
    "floor_share": Param(float, 0.2, "ada: share of its selectable slots a head keeps for "
                         "itself", check=lambda v: 0.0 < v <= 1.0, expect="a number in (0, 1]"),
    "beta": Param(float, 20.0, "pyramid: the last layer keeps fixed + (B - fixed) / beta",
                  check=lambda v: v >= 1.0, expect="a number >= 1"),
}
OUTPUT_KEYS = ("formats", "dpi")


@dataclass(frozen=True)
class PolicyConfig:
    """A policy as configured: its label in the scenario, registered kind, full params."""

    label: str
    kind: str
    params: dict


@dataclass(frozen=True)
class Experiment:
    """One prompt length, a list of budgets and the policies compared at them."""

    name: str
    prompt_len: int
    budgets: tuple[int, ...]
    budget_specs: tuple[int | float, ...]  # as written: tokens, or fractions of the prompt
    policies: tuple[PolicyConfig, ...]
    figures: tuple[str, ...]
    focus_budget: int  # the budget whose caches are recorded (rasters, overlaps)
    allocation: str = "uniform"  # budget allocation across KV heads and layers
    floor_share: float = 0.2  # ada
    beta: float = 20.0  # pyramid


@dataclass(frozen=True)
class Scenario:
    """A validated scenario: everything a run needs, nothing left to resolve."""

    path: Path
    name: str
    description: str
    seeds: tuple[int, ...]
    source: str
    attention: dict
    T: int
    heads: int
    kv_heads: int
    gqa: str
    has_truth: bool
    experiments: tuple[Experiment, ...]
    formats: tuple[str, ...]
    dpi: int
    variant: dict = field(default_factory=dict)  # sweep values that define this field variant
    layers: tuple[int, ...] = (0,)  # the source's layers, run jointly (a trace: model indices)

    @property
    def variant_label(self) -> str:
        """``path=value`` pairs of the sweep point, or an empty string."""
        return ",".join(f"{k}={v}" for k, v in self.variant.items())

    @property
    def gqa_mode(self) -> int:
        """The ``gqa`` combination as a kernel constant."""
        return GQA_MODES[self.gqa]

    def field(self, seed: int, layer: int | None = None) -> Field:
        """Build the attention of sequence ``seed`` (at ``layer``, one of :attr:`layers`)."""
        params = self.attention if layer is None else {**self.attention, "layer": layer}
        return SOURCES[self.source].build(params, seed, self.path.parent)


class _Checker:
    """Collects problems as (file, key path, message) while reading a TOML document."""

    def __init__(self, path: Path):
        self.file = str(path)
        self.problems: list[tuple[str, str, str]] = []

    def add(self, key: str, message: str) -> None:
        self.problems.append((self.file, key, message))

    def unknown_keys(self, table: dict, allowed, prefix: str) -> None:
        for key in table:
            if key not in allowed:
                self.add(f"{prefix}{key}", f"unknown key{did_you_mean(key, allowed)}; "
                                           f"expected one of {', '.join(allowed)}")

    def table(self, doc: dict, key: str, path: str) -> dict:
        value = doc.get(key, {})
        if not isinstance(value, dict):
            self.add(path, f"expected a table, got {type(value).__name__}")
            return {}
        return value

    def params(self, table: dict, spec: dict[str, Param], prefix: str,
               skip=()) -> dict:
        """Checked values for ``spec`` from ``table`` (defaults filled in)."""
        self.unknown_keys({k: v for k, v in table.items() if k not in skip},
                          list(spec), prefix)
        out = {}
        for key, param in spec.items():
            value = table.get(key, param.default)
            problem = param.problem(value)
            if problem:
                self.add(prefix + key, problem)
            else:
                out[key] = float(value) if param.type is float else value
        return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _read_policies(chk: _Checker, doc: dict) -> dict[str, PolicyConfig]:
    tables = chk.table(doc, "policies", "policies")
    if not tables:
        chk.add("policies", "expected at least one [policies.NAME] table")
    configs = {}
    for label, table in tables.items():
        where = f"policies.{label}"
        if not isinstance(table, dict):
            chk.add(where, f"expected a table, got {type(table).__name__}")
            continue
        kind = table.get("kind", label)
        if kind not in POLICIES:
            key = f"{where}.kind" if "kind" in table else where
            chk.add(key, f"expected a policy name{did_you_mean(str(kind), POLICIES)} "
                         f"({', '.join(POLICIES)}), got {kind!r}")
            continue
        policy = get_policy(kind)
        params = chk.params(table, policy.params, where + ".", skip=("kind",))
        if len(params) == len(policy.params):
            configs[label] = PolicyConfig(label, kind, resolve_params(policy, params))
    return configs


def _read_budgets(chk: _Checker, raw, where: str, prompt_len: int) -> tuple[list, list]:
    if not isinstance(raw, list) or not raw:
        chk.add(where, f"expected a non-empty list of token counts (integers) or prompt "
                       f"fractions (numbers in (0, 1]), got {raw!r}")
        return [], []
    budgets, specs = [], []
    for i, b in enumerate(raw):
        key = f"{where}[{i}]"
        if _is_int(b):
            resolved = b
        elif isinstance(b, float) and 0.0 < b <= 1.0:
            resolved = int(b * prompt_len + 0.5)
        else:
            chk.add(key, f"expected a token count (integer >= 1) or a prompt fraction "
                         f"(number in (0, 1]), got {b!r}")
            continue
        if resolved < 1:
            chk.add(key, f"expected a budget of at least 1 token, got {b!r} "
                         f"(resolves to {resolved} with prompt_len {prompt_len})")
            continue
        if resolved in budgets:
            chk.add(key, f"expected distinct budgets, got {b!r} again (= {resolved} tokens)")
            continue
        budgets.append(resolved)
        specs.append(b)
    return budgets, specs


def _read_allocation(chk: _Checker, table: dict, where: str, layers: int, prompt_len: int,
                     budgets: list[int], chosen: list[PolicyConfig]) -> dict:
    """Checked ``allocation``, ``floor_share`` and ``beta`` of an experiment."""
    given = {k: v for k, v in table.items() if k in ALLOCATION_PARAMS}
    values = chk.params(given, ALLOCATION_PARAMS, where + ".")
    rule = values.get("allocation", "uniform")
    for key, owner in (("floor_share", "ada"), ("beta", "pyramid")):
        if key in given and rule != owner:
            chk.add(f"{where}.{key}", f"expected only with allocation = {owner!r}, "
                                      f"got allocation = {rule!r}")
    if rule == "pyramid" and layers < 2:
        chk.add(f"{where}.allocation", f"expected a source with several layers run jointly "
                                       f"for 'pyramid' (attention.layers), got {layers}")
    for config in chosen if rule == "ada" and "floor_share" in values else ():
        policy = get_policy(config.kind)
        if not policy.budgeted:
            continue
        if policy.prefill_score is None:
            scored = ", ".join(n for n, p in POLICIES.items() if p.prefill_score is not None)
            chk.add(f"{where}.allocation", f"expected policies with a prefill score for 'ada' "
                                           f"({scored}), got {config.label!r} ({config.kind})")
            continue
        for budget in budgets:
            slots = budget - policy.fixed(budget, prompt_len, config.params)
            if budget_problem(policy, budget, config.params) is None \
                    and int(values["floor_share"] * slots) < 1:
                chk.add(f"{where}.floor_share", f"expected floor_share * (B - fixed) >= 1 so "
                        f"that every head keeps a selectable key (policy {config.label!r}, "
                        f"B = {budget}: {values['floor_share']:g} * {slots} < 1)")
    return values


def _read_experiment(chk: _Checker, table: dict, index: int, T: int, has_truth: bool,
                     configs: dict[str, PolicyConfig], names: set,
                     layers: int = 1) -> Experiment | None:
    where = f"experiment[{index}]"
    chk.unknown_keys(table, EXPERIMENT_KEYS, where + ".")
    before = len(chk.problems)
    name = table.get("name", f"experiment{index}")
    if not isinstance(name, str) or not name.isidentifier():
        chk.add(f"{where}.name", f"expected an identifier-like name, got {name!r}")
    elif name in names:
        chk.add(f"{where}.name", f"expected a unique name, got {name!r} again")
    names.add(name)
    prompt_len = table.get("prompt_len", T)
    if not _is_int(prompt_len) or not 0 <= prompt_len <= T:
        chk.add(f"{where}.prompt_len", f"expected an integer in [0, {T}], got {prompt_len!r}")
        prompt_len = T
    budgets, specs = _read_budgets(chk, table.get("budgets"), f"{where}.budgets", prompt_len)
    labels = table.get("policies", list(configs))
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
        chk.add(f"{where}.policies", f"expected a non-empty list of policy names, got {labels!r}")
        labels = []
    chosen = []
    for i, label in enumerate(labels):
        if label not in configs:
            chk.add(f"{where}.policies[{i}]", f"expected a [policies.NAME] defined in this "
                    f"file{did_you_mean(label, configs)}, got {label!r}")
            continue
        config = configs[label]
        policy = get_policy(config.kind)
        for j, budget in enumerate(budgets):
            problem = budget_problem(policy, budget, config.params)
            if problem:
                chk.add(f"{where}.budgets[{j}]", f"policy {label!r}: {problem}")
        problem = policy.check(T, prompt_len, config.params)
        if problem:
            key, _, message = problem.partition(": ")
            chk.add(f"policies.{label}.{key}", f"{message} in experiment {name!r}")
        chosen.append(config)
    allocation = _read_allocation(chk, table, where, layers, prompt_len, budgets, chosen)
    decodes = prompt_len < T
    default_figures = [f for f in FIGURES if (has_truth or "recall" not in f and f != "pareto")
                       and (decodes or not f.startswith(("mass", "kept", "allocation")))
                       and (f != "allocation" or allocation.get("allocation") != "uniform")]
    figures = table.get("figures", default_figures)
    if not isinstance(figures, list) or any(f not in FIGURES for f in figures):
        chk.add(f"{where}.figures", f"expected a list of {', '.join(FIGURES)}, got {figures!r}")
        figures = []
    for f in figures:
        if f.startswith(("mass", "kept", "allocation")) and not decodes:
            chk.add(f"{where}.figures", f"expected figures with data: {f!r} needs decode "
                                        f"steps (prompt_len < {T})")
        if ("recall" in f or f == "pareto") and not has_truth:
            chk.add(f"{where}.figures", f"expected figures with data: {f!r} needs ground-truth "
                                        f"important tokens, which this attention source lacks")
    focus = table.get("focus_budget", budgets[len(budgets) // 2] if budgets else 0)
    if budgets and focus not in budgets:
        chk.add(f"{where}.focus_budget", f"expected one of the resolved budgets "
                                         f"{budgets}, got {focus!r}")
    if len(chk.problems) > before:
        return None
    return Experiment(name, prompt_len, tuple(budgets), tuple(specs), tuple(chosen),
                      tuple(figures), focus, **allocation)


def _read_field(chk: _Checker, table: dict) -> dict:
    """Checked parameters of a composed field, with each head's components resolved."""
    chk.unknown_keys(table, ("source", *FIELD_PARAMS, *COMPONENTS, "boost", "head"), "attention.")
    params = chk.params({k: v for k, v in table.items() if k in FIELD_PARAMS}, FIELD_PARAMS,
                        "attention.")
    overrides = table.get("head", [])
    if not isinstance(overrides, list) or not all(isinstance(o, dict) for o in overrides):
        chk.add("attention.head", "expected [[attention.head]] tables, one per head")
        overrides = []
    heads = params.get("heads", 1) if "heads" in table or not overrides else len(overrides)
    params["heads"] = heads
    if overrides and len(overrides) != heads:
        chk.add("attention.head", f"expected one [[attention.head]] table per head ({heads}), "
                                  f"got {len(overrides)}")
    kv_heads = params.get("kv_heads") or heads
    params["kv_heads"] = kv_heads
    if heads % kv_heads:
        chk.add("attention.kv_heads", f"expected a divisor of heads ({heads}), got {kv_heads}")
    T = params.get("T", 1)

    def components(raw: dict, prefix: str) -> dict:
        chk.unknown_keys(raw, (*COMPONENTS, "boost"), prefix)
        out = {}
        for name, spec in COMPONENTS.items():
            if name in raw:
                sub = chk.table(raw, name, prefix + name)
                out[name] = (sub, chk.params(sub, spec, f"{prefix}{name}."))
        boosts = raw.get("boost", [])
        if not isinstance(boosts, list) or not all(isinstance(b, dict) for b in boosts):
            chk.add(prefix + "boost", "expected [[...boost]] tables")
            boosts = []
        out["boost"] = []
        for i, b in enumerate(boosts):
            where = f"{prefix}boost[{i}]"
            checked = chk.params(b, BOOST, where + ".")
            if "queries" not in b:
                chk.add(where + ".queries", "expected [lo, hi], got nothing")
            if ("keys" in b) == ("key_positions" in b):
                chk.add(where, "expected exactly one of keys = [lo, hi] or key_positions")
            elif not (checked.get("keys") or checked.get("key_positions")):
                given = "keys" if "keys" in b else "key_positions"
                chk.add(f"{where}.{given}", "expected at least one key, got none")
            for key in ("keys", "queries"):
                if key in checked and checked[key] and checked[key][1] > T:
                    chk.add(f"{where}.{key}", f"expected a range within [0, {T}], "
                                              f"got {checked[key]}")
            if max(checked.get("key_positions") or [-1]) >= T:
                chk.add(f"{where}.key_positions", f"expected positions below T = {T}, "
                                                  f"got {max(checked['key_positions'])}")
            out["boost"].append(checked)
        return out

    shared = components({k: v for k, v in table.items() if k in (*COMPONENTS, "boost")},
                        "attention.")
    per_head = []
    for h in range(heads):
        own = components(overrides[h], f"attention.head[{h}].") if h < len(overrides) else {}
        merged = {}
        for name in COMPONENTS:
            if name in shared or name in own:
                raw = {**shared.get(name, ({}, {}))[0], **own.get(name, ({}, {}))[0]}
                merged[name] = {k: raw.get(k, p.default) for k, p in COMPONENTS[name].items()}
                merged[name] = {k: float(v) if COMPONENTS[name][k].type is float else v
                                for k, v in merged[name].items()}
        merged["boost"] = shared["boost"] + own.get("boost", [])
        hh = merged.get("heavy_hitters")
        if hh and (max(hh["positions"], default=-1) >= T or hh["hi"] > T):
            chk.add(f"attention.head[{h}].heavy_hitters" if "heavy_hitters" in own
                    else "attention.heavy_hitters",
                    f"expected positions and hi within [0, {T}], got {hh['positions'] or hh['hi']}")
        per_head.append(merged)
    dims = {c["qk"]["dim"] for c in per_head if "qk" in c}
    if len(dims) > 1:
        chk.add("attention.qk.dim", f"expected one dimension for every head, got {sorted(dims)}")
    for kv in range(kv_heads if heads % kv_heads == 0 else 0):
        group = [per_head[h].get("qk") for h in range(kv * heads // kv_heads,
                                                      (kv + 1) * heads // kv_heads)]
        keyed = {(q["clusters"], q["spread"], q["values"]) for q in group if q}
        if len(keyed) > 1:
            chk.add("attention.head", f"expected the heads of KV head {kv} to share qk clusters, "
                                      f"spread and values (they share keys), got {len(keyed)} variants")
    params["per_head"] = per_head
    return params


def read_document(path: str | Path) -> dict:
    """Parse a scenario file's TOML; unreadable or invalid files raise :class:`ScenarioError`."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScenarioError([(str(path), "", "expected an existing scenario file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError([(str(path), "", f"expected a readable file ({exc})")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError([(str(path), "", f"expected valid TOML ({exc})")]) from None


def load_sweep(path: str | Path, overrides: Overrides | None = None) -> list[Scenario]:
    """Read a scenario file, apply command-line ``overrides`` and expand its ``[sweep]``.

    Returns one validated :class:`Scenario` per field variant of the sweep (one when the
    sweep varies no attention or experiment setting).
    """
    doc = read_document(path)
    if overrides is not None:
        try:
            doc = apply(doc, overrides)
        except KvsimError as exc:
            raise ScenarioError([(str(path), "", str(exc))]) from None
    try:
        points = expand_sweep(doc, str(path))
    except KvsimError as exc:
        raise ScenarioError([(str(path), "", str(exc).removeprefix(f"{path}: "))]) from None
    return [validate(point, path, variant) for point, variant in points]


def load_scenario(path: str | Path, overrides: Overrides | None = None) -> Scenario:
    """Read and validate a scenario file (with one field variant; see :func:`load_sweep`).

    Raises
    ------
    ScenarioError
        With one line per problem, naming the file and the key path.
    """
    variants = load_sweep(path, overrides)
    if len(variants) > 1:
        raise ScenarioError([(str(path), "sweep", f"expected a single field variant for "
                              f"load_scenario, got {len(variants)}; use load_sweep")])
    return variants[0]


def validate(doc: dict, path: str | Path, variant: dict | None = None) -> Scenario:
    """Validate a parsed scenario document (paths resolve relative to ``path``)."""
    path = Path(path)
    chk = _Checker(path)
    chk.unknown_keys(doc, TOP_KEYS, "")
    name = doc.get("name", path.stem)
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        chk.add("name", f"expected a non-empty string usable as a folder name, got {name!r}")
    description = doc.get("description", "")
    if not isinstance(description, str):
        chk.add("description", f"expected a string, got {description!r}")
    seeds = doc.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(_is_int(s) and s >= 0 for s in seeds) \
            or len(set(seeds)) != len(seeds):
        chk.add("seeds", f"expected a non-empty list of distinct integers >= 0, got {seeds!r}")
        seeds = [0]

    attention = chk.table(doc, "attention", "attention")
    source_name = attention.get("source")
    T, heads, kv_heads, has_truth, attn_params, layers = 0, 1, 1, False, {}, (0,)
    if source_name not in SOURCES:
        chk.add("attention.source", f"expected one of {', '.join(SOURCES)}"
                                    f"{did_you_mean(str(source_name), SOURCES)}, got {source_name!r}")
    else:
        source = SOURCES[source_name]
        for key in source.required:
            if key not in attention:
                chk.add(f"attention.{key}", f"expected a value ({source.params[key].help}), "
                                            f"got nothing")
        before = len(chk.problems)
        if source_name == "field":
            attn_params = _read_field(chk, attention)
        else:
            attn_params = chk.params(attention, source.params, "attention.", skip=("source",))
        if len(chk.problems) == before:
            try:
                T, heads, kv_heads, has_truth = source.describe(attn_params, path.parent)
                layers = source.layers(attn_params, path.parent)
            except KvsimError as exc:
                key, _, message = str(exc).partition(": ")
                chk.add(f"attention.{key}", message)

    configs = _read_policies(chk, doc)
    output = chk.table(doc, "output", "output")
    chk.unknown_keys(output, OUTPUT_KEYS, "output.")
    formats = output.get("formats", ["png", "svg"])
    if not isinstance(formats, list) or not formats or any(f not in FORMATS for f in formats):
        chk.add("output.formats", f"expected a list of {', '.join(FORMATS)}, got {formats!r}")
    dpi = output.get("dpi", 120)
    if not _is_int(dpi) or not 30 <= dpi <= 600:
        chk.add("output.dpi", f"expected an integer in [30, 600], got {dpi!r}")

    experiments = []
    raw = doc.get("experiment")
    if T:
        if not isinstance(raw, list) or not raw or not all(isinstance(e, dict) for e in raw):
            chk.add("experiment", "expected one or more [[experiment]] tables")
        else:
            names: set = set()
            for i, table in enumerate(raw):
                exp = _read_experiment(chk, table, i, T, has_truth, configs, names, len(layers))
                if exp is not None:
                    experiments.append(exp)
    if chk.problems:
        raise ScenarioError(chk.problems)
    return Scenario(path.resolve(), name, description, tuple(seeds), source_name, attn_params,
                    T, heads, kv_heads, attn_params.get("gqa", "mean"),
                    has_truth, tuple(experiments), tuple(formats), dpi, dict(variant or {}),
                    tuple(layers))

