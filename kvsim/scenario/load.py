"""Scenario files: TOML -> a validated, frozen :class:`Scenario`.

Validation is complete before any work starts; every problem becomes one line
``FILE: key.path: expected ..., got ...`` in a :class:`~kvsim.errors.ScenarioError`.
"""

from __future__ import annotations

import glob
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvsim.attention.components import BOOST, COMPONENTS
from kvsim.attention.sources import FIELD_PARAMS, SOURCES, Field
from kvsim.errors import KvsimError, ScenarioError
from kvsim.numerics.kernels import GQA_MODES
from kvsim.numerics.quantize import Quantize
from kvsim.params import INT64_MAX, Param
from kvsim.policies import POLICIES
from kvsim.protocols.run import budget_problem, did_you_mean, get_policy, missing_needs, run_problems
from kvsim.protocols.settings import layer_wide
from kvsim.scenario.overrides import Overrides, apply, expand_sweep
from kvsim.scenario.reader import (FORMATS, Checker, PolicyConfig, is_int, read_budgets,
                                   read_document, read_name, read_policies, read_quantize)

TOP_KEYS = ("name", "description", "seeds", "attention", "policies", "experiment", "output",
            "sweep")
EXPERIMENT_KEYS = ("name", "prompt_len", "budgets", "policies", "figures", "focus_budget",
                   "time_budgets", "allocation", "floor_share", "beta", "tau1", "tau2",
                   "quantize")
ALLOCATIONS = ("uniform", "ada", "pyramid", "cake")  # the rules: kvsim.engine.allocation
ALLOCATION_PARAMS = {  # experiment keys of the budget allocation (kvsim.engine.allocation)
    "allocation": Param(str, "uniform", "how the budget is shared across KV heads and layers",
                        choices=ALLOCATIONS),
    "floor_share": Param(float, 0.2, "ada: share of its selectable slots a head keeps for "
                         "itself", low=0.0, high=1.0, check=lambda v: v > 0.0,
                         expect="a number in (0, 1]"),
    "beta": Param(float, 20.0, "pyramid: the last layer keeps fixed + (B - fixed) / beta",
                  low=1.0, high=1e6),
    "tau1": Param(float, 1.0, "cake: a layer's preference is entropy^(1/tau1) * "
                  "variance^(1/tau2)", low=0.01, high=100.0),
    "tau2": Param(float, 1.0, "cake: see tau1", low=0.01, high=100.0),
}
OUTPUT_KEYS = ("formats", "dpi", "max_figures")


@dataclass(frozen=True)
class Experiment:
    """One prompt length, a list of budgets and the policies compared at them."""

    name: str
    prompt_len: int
    budgets: tuple[int, ...]
    budget_specs: tuple[int | float, ...]  # as written: tokens, or fractions of the prompt
    policies: tuple[PolicyConfig, ...]
    figures: tuple[str, ...] | None  # figure names; None: every figure the data supports
    focus_budget: int  # the budget whose caches are recorded (rasters, overlaps)
    time_budgets: tuple[int, ...]  # budgets the per-step figures show (default: the focus)
    allocation: str = "uniform"  # budget allocation across KV heads and layers
    floor_share: float = 0.2  # ada
    beta: float = 20.0  # pyramid
    tau1: float = 1.0  # cake
    tau2: float = 1.0  # cake
    quantize: Quantize | None = None  # KIVI storage of keys and values (None: 16-bit)


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
    max_figures: int = 6  # figures a report draws at most (the most telling first)

    @property
    def variant_label(self) -> str:
        """``path=value`` pairs of the sweep point, or an empty string."""
        return ",".join(f"{k}={v}" for k, v in self.variant.items())

    @property
    def gqa_mode(self) -> int:
        """The ``gqa`` combination as a kernel constant."""
        return GQA_MODES[self.gqa]

    def field(self, seed: int, layer: int | None = None) -> Field:
        """Build the attention of sequence ``seed`` at ``layer``, one of :attr:`layers`
        (default: the first)."""
        params = {**self.attention, "layer": self.layers[0] if layer is None else layer}
        return SOURCES[self.source].build(params, seed, self.path.parent)


def _read_allocation(chk: Checker, table: dict, where: str, layers: int, prompt_len: int,
                     budgets: list[int], chosen: list[PolicyConfig]) -> dict:
    """Checked ``allocation``, ``floor_share``, ``beta``, ``tau1`` and ``tau2`` of an
    experiment."""
    given = {k: v for k, v in table.items() if k in ALLOCATION_PARAMS}
    values = chk.params(given, ALLOCATION_PARAMS, where + ".")
    rule = values.get("allocation", "uniform")
    for key, owner in (("floor_share", "ada"), ("beta", "pyramid"), ("tau1", "cake"),
                       ("tau2", "cake")):
        if key in given and rule != owner:
            chk.add(f"{where}.{key}", f"expected only with allocation = {owner!r}, "
                                      f"got allocation = {rule!r}")
    if rule == "pyramid" and layers < 2:
        chk.add(f"{where}.allocation", f"expected a source with several layers run jointly "
                                       f"for 'pyramid' (attention.layers), got {layers}")
    for config in chosen if rule == "ada" else ():
        if layer_wide(config.params):
            chk.add(f"{where}.allocation", f"expected one cap for every KV head of a layer "
                                           f"with heads = \"uniform\" or filtering = "
                                           f"\"majority\" (not 'ada'), got {config.label!r}")
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


def _check_head_dims(chk: Checker, scenario: "Scenario") -> None:
    """Every quantising experiment's group divides the head dimensions (first layer)."""
    quantised = [(i, e) for i, e in enumerate(scenario.experiments) if e.quantize]
    if not quantised:
        return
    data = scenario.field(scenario.seeds[0]).data
    dims = {"key": data.keys.shape[1], "value": data.values.shape[2]}
    for i, exp in quantised:
        for what, d in dims.items():
            if d % exp.quantize.group:
                chk.add(f"experiment[{i}].quantize.group", f"expected a divisor of the "
                        f"{what} dimension {d}, got {exp.quantize.group}")


def _read_experiment(chk: Checker, table: dict, index: int, T: int,
                     configs: dict[str, PolicyConfig], defined: list, names: set,
                     source: tuple[str, frozenset], layers: int = 1) -> Experiment | None:
    where = f"experiment[{index}]"
    chk.unknown_keys(table, EXPERIMENT_KEYS, where + ".")
    before = len(chk.problems)
    name = table.get("name", f"experiment{index}")
    if not isinstance(name, str) or not name.isidentifier():
        chk.add(f"{where}.name", f"expected an identifier-like name, got {name!r}")
    elif name in names:
        chk.add(f"{where}.name", f"expected a unique name, got {name!r} again")
    else:
        names.add(name)
    prompt_len = table.get("prompt_len", T)
    if not is_int(prompt_len) or not 0 <= prompt_len <= T:
        chk.add(f"{where}.prompt_len", f"expected an integer in [0, {T}], got {prompt_len!r}")
        prompt_len = T
    budgets, specs = read_budgets(chk, table.get("budgets"), f"{where}.budgets", prompt_len, T)
    labels = table.get("policies", list(defined))
    if "policies" not in table and not defined:
        labels = []  # no policy tables: already reported
    elif not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
        chk.add(f"{where}.policies", f"expected a non-empty list of policy names, got {labels!r}")
        labels = []
    chosen = []
    for i, label in enumerate(labels):
        if label in labels[:i]:
            chk.add(f"{where}.policies[{i}]", f"expected distinct policy labels, got {label!r} "
                                              f"again")
            continue
        if label not in configs:
            if label not in defined:  # else its table's problems are reported already
                chk.add(f"{where}.policies[{i}]", f"expected a [policies.NAME] defined in this "
                        f"file{did_you_mean(label, configs)}, got {label!r}")
            continue
        config = configs[label]
        policy = get_policy(config.kind)
        for problem in run_problems(policy, config.params, budgets, T, prompt_len):
            if problem.kind == "budget":
                chk.add(f"{where}.budgets[{problem.budget}]",
                        f"policy {label!r}: {problem.message}")
            elif problem.kind == "protocol":
                chk.add(f"policies.{label}.{problem.key}", f"{problem.message} (experiment "
                                                           f"{name!r}, budget "
                                                           f"{budgets[problem.budget]})")
            else:
                chk.add(f"policies.{label}.{problem.key}",
                        f"{problem.message} in experiment {name!r}")
        missing = missing_needs(policy, source[1])
        if missing:
            note = source[2] if "rope" in policy.needs - source[1] else ""
            chk.add(f"{where}.policies[{i}]", f"policy {label!r}: {policy.name} needs {missing}, "
                                              f"which the {source[0]!r} attention source does not "
                                              f"have{note}")
        chosen.append(config)
    allocation = _read_allocation(chk, table, where, layers, prompt_len, budgets, chosen)
    quantize = read_quantize(chk, table, where, source)
    # Figure names and what each needs are the report's to check (kvsim.report.plotting).
    figures = table.get("figures")
    if figures is not None and (not isinstance(figures, list)
                                or not all(isinstance(f, str) for f in figures)):
        chk.add(f"{where}.figures", f"expected a list of figure names, got {figures!r}")
    focus = table.get("focus_budget", budgets[len(budgets) // 2] if budgets else 0)
    if budgets and focus not in budgets:
        chk.add(f"{where}.focus_budget", f"expected one of the resolved budgets "
                                         f"{budgets}, got {focus!r}")
    over_time = table.get("time_budgets", [focus])
    if over_time == "all":
        over_time = list(budgets)
    if budgets and (not isinstance(over_time, list) or not over_time
                    or any(b not in budgets for b in over_time)):
        chk.add(f"{where}.time_budgets", f"expected \"all\" or a non-empty list of the resolved "
                                         f"budgets {budgets}, got {over_time!r}")
    if len(chk.problems) > before:
        return None
    return Experiment(name, prompt_len, tuple(budgets), tuple(specs), tuple(chosen),
                      None if figures is None else tuple(figures), focus,
                      tuple(sorted(set(over_time))), **allocation, quantize=quantize)


def _read_field(chk: Checker, table: dict) -> dict:
    """Checked parameters of a composed field, with each head's components resolved."""
    chk.unknown_keys(table, ("source", *FIELD_PARAMS, *COMPONENTS, "boost", "head"), "attention.")
    params = chk.params({k: v for k, v in table.items() if k in FIELD_PARAMS}, FIELD_PARAMS,
                        "attention.")
    overrides = table.get("head", [])
    if not isinstance(overrides, list) or not all(isinstance(o, dict) for o in overrides):
        chk.add("attention.head", "expected [[attention.head]] tables, one per head")
        overrides = []
    heads_known = "heads" in params  # else invalid: checks that need it are skipped
    heads = params.get("heads", 1) if "heads" in table or not overrides else len(overrides)
    params["heads"] = heads
    if overrides and heads_known and len(overrides) != heads:
        chk.add("attention.head", f"expected one [[attention.head]] table per head ({heads}), "
                                  f"got {len(overrides)}")
    kv_heads = params.get("kv_heads") or heads
    params["kv_heads"] = kv_heads
    if heads_known and heads % kv_heads:
        chk.add("attention.kv_heads", f"expected a divisor of heads ({heads}), got {kv_heads}")
    T = params.get("T", INT64_MAX)  # an invalid T is reported once: no range checks on it

    def components(raw: dict, prefix: str) -> dict:
        chk.unknown_keys(raw, (*COMPONENTS, "boost"), prefix)
        out = {}
        for name, spec in COMPONENTS.items():
            if name in raw:
                sub = chk.table(raw, name, prefix + name)
                if sub is None:
                    continue
                before = len(chk.problems)
                out[name] = (sub, chk.params(sub, spec, f"{prefix}{name}."),
                             len(chk.problems) == before)
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
            else:
                given = "keys" if "keys" in b else "key_positions"
                if given in checked and not checked[given]:
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
    per_head, names = [], []
    for h in range(heads):
        raw = dict(overrides[h]) if h < len(overrides) else {}
        name = raw.pop("name", "")
        if not isinstance(name, str):
            chk.add(f"attention.head[{h}].name", f"expected a string, got {name!r}")
        names.append(str(name))
        own = components(raw, f"attention.head[{h}].") if raw else {}
        merged = {}
        for name in COMPONENTS:
            if name in shared or name in own:
                if not all(part[name][2] for part in (shared, own) if name in part):
                    continue  # already reported: nothing to merge
                raw = {**shared.get(name, ({}, {}, True))[0], **own.get(name, ({}, {}, True))[0]}
                merged[name] = {k: raw.get(k, p.default) for k, p in COMPONENTS[name].items()}
                merged[name] = {k: float(v) if COMPONENTS[name][k].type is float else v
                                for k, v in merged[name].items()}
        merged["boost"] = shared["boost"] + own.get("boost", [])
        hh = merged.get("heavy_hitters")
        if hh and (max(hh["positions"], default=-1) >= T or (hh["hi"] or 0) > T):
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
    if any(names):
        params["head_names"] = names  # labels of the report's per-head tables and panels
    return params


def load_sweep(path: str | Path, overrides: Overrides | None = None) -> list[Scenario]:
    """Read a scenario file, apply command-line ``overrides`` and expand its ``[sweep]``.

    Returns one validated :class:`Scenario` per field variant of the sweep (one when the
    sweep varies no attention or experiment setting).
    """
    doc = read_document(path)
    notes: list[str] = []
    try:
        if overrides is not None:
            doc = apply(doc, overrides, notes)
        points = expand_sweep(doc)
    except KvsimError as exc:
        raise ScenarioError([(str(path), exc.key, exc.message)]) from None
    for note in notes:
        print(f"kvsim: {path}: {note}", file=sys.stderr)
    points = [p for point in points for p in _trace_files(*point, Path(path))]
    return [validate(point, path, variant) for point, variant in points]


def _trace_files(doc: dict, variant: dict, path: Path) -> list[tuple[dict, dict]]:
    """One sweep point per file when a trace source's ``path`` is a glob, else the point."""
    attention = doc.get("attention")
    pattern = attention.get("path") if isinstance(attention, dict) \
        and attention.get("source") == "trace" else None
    if not isinstance(pattern, str) or not re.search(r"[*?[]", pattern):
        return [(doc, variant)]
    base = path.parent
    files = sorted(Path(f).as_posix() for f in glob.glob(pattern, root_dir=base)
                   if (base / f).is_file())
    if not files:
        raise ScenarioError([(str(path), "attention.path", f"expected at least one trace file "
                              f"matching {pattern!r} (relative to the scenario file), got none")])
    return [({**doc, "attention": {**attention, "path": f}}, {**variant, "attention.path": f})
            for f in files]


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
    chk = Checker(path)
    chk.unknown_keys(doc, TOP_KEYS, "")
    name, description = read_name(chk, doc, path)
    seeds = doc.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(is_int(s) and s >= 0 for s in seeds) \
            or len(set(seeds)) != len(seeds):
        chk.add("seeds", f"expected a non-empty list of distinct integers >= 0, got {seeds!r}")
        seeds = [0]

    attention = chk.table(doc, "attention", "attention")
    source_name = attention.get("source") if attention is not None else None
    T, heads, kv_heads, has_truth, attn_params, layers = 0, 1, 1, False, {}, (0,)
    provides = (str(source_name), frozenset(), "")
    if attention is None:
        pass
    elif not isinstance(source_name, str) or source_name not in SOURCES:
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
                provides = (source_name, source.provides(attn_params, path.parent),
                            source.note(attn_params, path.parent))
                layers = source.layers(attn_params, path.parent)
            except KvsimError as exc:
                chk.add(f"attention.{exc.key}" if exc.key else "attention", exc.message)

    configs = read_policies(chk, doc)
    defined = list(doc["policies"]) if isinstance(doc.get("policies"), dict) else []
    output = chk.table(doc, "output", "output") or {}
    chk.unknown_keys(output, OUTPUT_KEYS, "output.")
    formats = output.get("formats", ["png", "svg"])
    if not isinstance(formats, list) or not formats or any(f not in FORMATS for f in formats):
        chk.add("output.formats", f"expected a list of {', '.join(FORMATS)}, got {formats!r}")
    dpi = output.get("dpi", 120)
    if not is_int(dpi) or not 30 <= dpi <= 600:
        chk.add("output.dpi", f"expected an integer in [30, 600], got {dpi!r}")
    max_figures = output.get("max_figures", 6)
    if not is_int(max_figures) or not 1 <= max_figures <= 200:
        chk.add("output.max_figures", f"expected an integer in [1, 200], got {max_figures!r}")

    experiments = []
    raw = doc.get("experiment")
    if T:
        if not isinstance(raw, list) or not raw or not all(isinstance(e, dict) for e in raw):
            chk.add("experiment", "expected one or more [[experiment]] tables")
        else:
            names: set = set()
            for i, table in enumerate(raw):
                exp = _read_experiment(chk, table, i, T, configs, defined, names, provides,
                                       len(layers))
                if exp is not None:
                    experiments.append(exp)
    if chk.problems:
        raise ScenarioError(chk.problems)
    scenario = Scenario(path.resolve(), name, description, tuple(seeds), source_name,
                        attn_params, T, heads, kv_heads, attn_params.get("gqa", "mean"),
                        has_truth, tuple(experiments), tuple(formats), dpi,
                        dict(variant or {}), tuple(layers), max_figures)
    _check_head_dims(chk, scenario)
    if chk.problems:
        raise ScenarioError(chk.problems)
    return scenario

