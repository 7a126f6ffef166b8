"""Changes applied to a scenario document before validation: CLI overrides and sweeps.

Both work on the parsed TOML (plain dicts and lists), so the result is validated like
a file a user wrote by hand.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import tomllib
from dataclasses import dataclass, field

from kvsim.errors import KvsimError

_INDEX = re.compile(r"^(\w+)\[(\d+)\]$")


@dataclass(frozen=True)
class Overrides:
    """What the command line changes: ``None`` leaves the file's value."""

    budgets: list | None = None
    seeds: list[int] | None = None
    policies: list[str] | None = None
    settings: list[tuple[str, object]] = field(default_factory=list)


def parse_budgets(text: str) -> list:
    """``"64,128,0.5"`` -> ``[64, 128, 0.5]`` (integers: tokens; decimals: prompt fractions)."""
    out = []
    for part in text.split(","):
        try:
            out.append(int(part) if re.fullmatch(r"\s*\d+\s*", part) else float(part))
        except ValueError:
            raise KvsimError(f"expected comma-separated token counts or prompt fractions, "
                             f"got {text!r}", "--budgets") from None
    return out


def parse_policies(text: str) -> list[str]:
    """``"h2o,window"`` -> ``["h2o", "window"]``: distinct, non-empty labels."""
    labels = [p.strip() for p in text.split(",")]
    if not all(labels):
        raise KvsimError(f"expected comma-separated policy labels, got {text!r}", "--policies")
    repeated = [x for i, x in enumerate(labels) if x in labels[:i]]
    if repeated:
        raise KvsimError(f"expected distinct policy labels, got {repeated[0]!r} twice",
                         "--policies")
    return labels


def parse_seeds(text: str) -> list[int]:
    """``"0:8"`` (a range) or ``"0,3,5"`` -> a list of seeds."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if m and int(m[1]) < int(m[2]):
        return list(range(int(m[1]), int(m[2])))
    if re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", text):
        return [int(p) for p in text.split(",")]
    raise KvsimError(f"expected START:STOP or a comma-separated list, got {text!r}", "--seeds")


def parse_setting(text: str) -> tuple[str, object]:
    """``"attention.noise.scale=0.3"`` -> (path, value); the value is read as TOML."""
    path, sep, raw = text.partition("=")
    if not sep or not path.strip():
        raise KvsimError(f"expected KEY.PATH=VALUE, got {text!r}", "--set")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string
    return path.strip(), value


def _targets(doc: dict, path: str, where: str) -> list[tuple[dict, str]]:
    """The (table, key) pairs a dotted path names; ``experiment.x`` means every experiment."""
    parts = path.split(".")
    tables = [doc]
    for part in parts[:-1]:
        nxt = []
        m = _INDEX.match(part)
        for table in tables:
            if m:
                items = table.get(m[1])
                if not isinstance(items, list) or int(m[2]) >= len(items):
                    raise KvsimError(f"expected an existing {m[1]}[{m[2]}]", f"{where}{path}")
                nxt.append(items[int(m[2])])
            elif isinstance(table.get(part), list):
                nxt.extend(t for t in table[part] if isinstance(t, dict))
            else:
                value = table.setdefault(part, {})
                if not isinstance(value, dict):
                    raise KvsimError(f"expected {part} to be a table", f"{where}{path}")
                nxt.append(value)
        tables = nxt
    return [(t, parts[-1]) for t in tables]


def assign(doc: dict, path: str, value, where: str = "--set ") -> None:
    """Set ``path`` (dotted, ``name[i]`` for one array entry) to ``value`` in ``doc``."""
    for table, key in _targets(doc, path, where):
        table[key] = copy.deepcopy(value)


def apply(doc: dict, overrides: Overrides, notes: list[str] | None = None) -> dict:
    """A copy of ``doc`` with the command line's overrides applied.

    An override wins over the file's ``[sweep]``: a swept axis on the key it sets is
    dropped (one line about it is appended to ``notes``), so the run is about the value
    given. An override that only part of a swept axis would overwrite is refused.
    """
    doc = copy.deepcopy(doc)
    if isinstance(doc.get("sweep"), dict):
        doc["sweep"] = _yield_sweep(doc, overrides, notes if notes is not None else [])
    if overrides.seeds is not None:
        doc["seeds"] = overrides.seeds
    experiments = doc.get("experiment") if isinstance(doc.get("experiment"), list) else []
    if overrides.budgets is not None:
        for exp in experiments:
            exp["budgets"] = overrides.budgets
    if overrides.policies is not None:
        tables = doc.setdefault("policies", {})
        for name in overrides.policies:
            tables.setdefault(name, {})  # a registered kind not configured in the file
        for exp in experiments:
            exp["policies"] = overrides.policies
    for path, value in overrides.settings:
        assign(doc, path, value)
    return doc


def _plain(path: str) -> str:
    """``experiment[0].prompt_len`` -> ``experiment.prompt_len``."""
    return ".".join(_INDEX.sub(r"\1", part) for part in path.split("."))


def _yield_sweep(doc: dict, overrides: Overrides, notes: list[str]) -> dict:
    """The file's sweep (flattened to ``{path: values}``) without the axes that
    ``overrides`` set; a note for each axis dropped."""
    sweep = dict(_leaves(doc["sweep"]))
    sets = [(f"--set {path}={_toml(value)}", path) for path, value in overrides.settings]
    if overrides.budgets is not None:
        text = f"--budgets {','.join(map(str, overrides.budgets))}"
        sets += [(text, "budgets"), (text, "experiment.budgets")]
    if overrides.seeds is not None:
        sets.append((f"--seeds {','.join(map(str, overrides.seeds))}", "seeds"))
    if overrides.policies is not None:
        text = f"--policies {','.join(overrides.policies)}"
        sets.append((text, "experiment.policies"))
        for axis in list(sweep):
            parts = axis.split(".")
            if parts[0] == "policies" and len(parts) == 3 \
                    and parts[1] not in overrides.policies:
                notes.append(f"{text} does not run {parts[1]!r}: the file's sweep over "
                             f"{axis} is dropped")
                del sweep[axis]
    for text, path in sets:
        alias = {"experiment.budgets": "budgets", "budgets": "experiment.budgets"}
        for axis in list(sweep):
            same = {axis, alias.get(axis, axis)}
            if path in same or axis.startswith(path + "."):
                notes.append(f"{text} replaces the file's sweep over {axis} "
                             f"({_toml(sweep[axis])})")
                del sweep[axis]
            elif _plain(path) in same or path.startswith(axis + ".") \
                    or _plain(path).startswith(axis + "."):
                raise KvsimError(f"expected a key the file's [sweep] does not overwrite, got "
                                 f"{path} (the sweep varies {axis}; set {axis} itself to "
                                 f"replace that axis)", text.split(" ")[0])
    return sweep


def _toml(value) -> str:
    """A value as the command line would spell it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def _leaves(table: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in table.items():
        if isinstance(value, dict):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


MAX_SWEEP_POINTS = 10_000  # field variants, and configurations of one swept policy


def expand_sweep(doc: dict) -> list[tuple[dict, dict]]:
    """Expand ``[sweep]`` into (document, {path: value}) points, one per field variant.

    ``budgets`` and ``seeds`` replace the lists of the file; ``policies.LABEL.PARAM``
    axes become extra policy configurations ``LABEL[PARAM=value]`` within one run;
    every other path (attention or experiment settings) makes a separate variant of
    the attention field, the product of all such axes. A sweep of more than
    ``MAX_SWEEP_POINTS`` variants (or configurations of one policy) is refused before
    it is expanded.
    """
    doc = copy.deepcopy(doc)
    sweep = doc.pop("sweep", {})
    if not isinstance(sweep, dict):
        raise KvsimError("expected a table of KEY.PATH = [values]", "sweep")
    policy_axes: dict[str, list[tuple[str, list]]] = {}
    field_axes = []
    for path, values in _leaves(sweep):
        if not isinstance(values, list) or not values:
            raise KvsimError(f"expected a non-empty list of values, got {values!r}",
                             f"sweep.{path}")
        if path in ("budgets", "seeds"):
            apply_to = Overrides(budgets=values) if path == "budgets" else Overrides(seeds=values)
            doc = apply(doc, apply_to)
        elif path.startswith("policies."):
            parts = path.split(".")
            if len(parts) != 3 or parts[1] not in doc.get("policies", {}):
                raise KvsimError("expected policies.LABEL.PARAM with a [policies.LABEL] "
                                 "defined in the file", f"sweep.{path}")
            policy_axes.setdefault(parts[1], []).append((parts[2], values))
        else:
            field_axes.append((path, values))
    for axes, what in [(field_axes, "field variants")] + [
            (axes, f"configurations of policy {label!r}") for label, axes in policy_axes.items()]:
        count = math.prod(len(values) for _, values in axes)
        if count > MAX_SWEEP_POINTS:
            longest = max(axes, key=lambda axis: len(axis[1]))[0]
            raise KvsimError(f"expected at most {MAX_SWEEP_POINTS} {what}, got {count} "
                             f"(longest axis: {longest})", "sweep")
    for label, axes in policy_axes.items():
        _expand_policy(doc, label, axes)
    points = []
    for combo in itertools.product(*[[(p, v) for v in vals] for p, vals in field_axes]):
        point = copy.deepcopy(doc)
        for path, value in combo:
            assign(point, path, value, where="sweep.")
        points.append((point, dict(combo)))
    return points


def _expand_policy(doc: dict, label: str, axes: list[tuple[str, list]]) -> None:
    base = doc["policies"][label]
    expanded = {}
    for combo in itertools.product(*[[(k, v) for v in vals] for k, vals in axes]):
        name = f"{label}[{','.join(f'{k}={v}' for k, v in combo)}]"
        expanded[name] = {**base, "kind": base.get("kind", label), **dict(combo)}
    labels = list(expanded)
    # The expanded configurations take the place of the original, in file order.
    doc["policies"] = {k2: v2 for k, v in doc["policies"].items()
                       for k2, v2 in (expanded.items() if k == label else [(k, v)])}
    for exp in doc.get("experiment", []) if isinstance(doc.get("experiment"), list) else []:
        if isinstance(exp, dict) and label in exp.get("policies", [label]):
            chosen = exp.get("policies", None)
            if chosen is None:
                continue  # every policy of the file: the expanded labels are included
            i = chosen.index(label)
            exp["policies"] = chosen[:i] + labels + chosen[i + 1:]
