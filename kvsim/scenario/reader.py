"""What every file kvsim reads shares (scenario, closed-loop and task files): the TOML
document, a :class:`Checker` that collects one line per problem, and the readers of the
tables that all of them hold (``[policies.NAME]``, budgets, ``quantize``, the name).

Every problem becomes one line ``FILE: key.path: expected ..., got ...``; the caller raises
a :class:`~kvsim.errors.ScenarioError` with all of them once its file is read.
"""

from __future__ import annotations

import errno
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvsim.errors import ScenarioError
from kvsim.numerics.quantize import Quantize
from kvsim.params import INT64_MAX, Param
from kvsim.paths import read_text
from kvsim.policies import POLICIES
from kvsim.protocols.run import did_you_mean, get_policy, resolve_params
from kvsim.protocols.settings import PROTOCOL_PARAMS

FORMATS = ("png", "svg", "pdf")

QUANTIZE_PARAMS = {  # [experiment.quantize]: KIVI storage (kvsim.numerics.quantize)
    "bits": Param(int, 2, "bits per quantised key or value", low=1, high=8),
    "group": Param(int, 32, "elements per quantisation group (slots for keys, channels for "
                   "values)", low=1, high=65536),
    "residual": Param(int, 32, "newest tokens kept in full precision (a multiple of group)",
                      low=1, high=INT64_MAX),
}

@dataclass(frozen=True)
class PolicyConfig:
    """A policy as configured: its label in the scenario, registered kind, full params."""

    label: str
    kind: str
    params: dict


class Checker:
    """Collects problems as (file, key path, message) while reading a TOML document."""

    def __init__(self, path: Path):
        self.file = str(path)
        self.problems: list[tuple[str, str, str]] = []

    def add(self, key: str, message: str) -> None:
        if (self.file, key, message) not in self.problems:  # e.g. a shared table, per head
            self.problems.append((self.file, key, message))

    def unknown_keys(self, table: dict, allowed, prefix: str) -> None:
        for key in table:
            if key not in allowed:
                expected = f"expected one of {', '.join(allowed)}" if allowed \
                    else "expected no keys here"
                self.add(f"{prefix}{key}", f"unknown key{did_you_mean(key, allowed)}; {expected}")

    def table(self, doc: dict, key: str, path: str) -> dict | None:
        """``doc[key]`` ({} if absent), or None (a problem added) if it is not a table."""
        value = doc.get(key, {})
        if not isinstance(value, dict):
            self.add(path, f"expected a table, got {type(value).__name__}")
            return None
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


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_policies(chk: Checker, doc: dict) -> dict[str, PolicyConfig]:
    tables = chk.table(doc, "policies", "policies")
    if tables is None:
        return {}
    if not tables:
        chk.add("policies", "expected at least one [policies.NAME] table")
    configs = {}
    for label, table in tables.items():
        where = f"policies.{label}"
        if not isinstance(table, dict):
            chk.add(where, f"expected a table, got {type(table).__name__}")
            continue
        kind = table.get("kind", label)
        if not isinstance(kind, str) or kind not in POLICIES:
            key = f"{where}.kind" if "kind" in table else where
            chk.add(key, f"expected a policy name{did_you_mean(str(kind), POLICIES)} "
                         f"({', '.join(POLICIES)}), got {kind!r}")
            continue
        policy = get_policy(kind)
        given = {k: v for k, v in table.items() if k in PROTOCOL_PARAMS}
        params = chk.params(table, policy.params, where + ".", skip=("kind", *given))
        protocol = chk.params(given, {k: PROTOCOL_PARAMS[k] for k in given}, where + ".")
        if len(params) == len(policy.params) and len(protocol) == len(given):
            configs[label] = PolicyConfig(label, kind, resolve_params(policy,
                                                                      {**params, **protocol}))
    return configs


def read_budgets(chk: Checker, raw, where: str, prompt_len: int, T: int) -> tuple[list, list]:
    if not isinstance(raw, list) or not raw:
        chk.add(where, f"expected a non-empty list of token counts (integers) or prompt "
                       f"fractions (numbers in (0, 1]), got {raw!r}")
        return [], []
    budgets, specs = [], []
    for i, b in enumerate(raw):
        key = f"{where}[{i}]"
        if is_int(b):
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
        if resolved > T:
            chk.add(key, f"expected a budget of at most T = {T} tokens (a larger cache never "
                         f"evicts), got {b!r}")
            continue
        if resolved in budgets:
            chk.add(key, f"expected distinct budgets, got {b!r} again (= {resolved} tokens)")
            continue
        budgets.append(resolved)
        specs.append(b)
    return budgets, specs


def read_quantize(chk: Checker, table: dict, where: str,
                   source: tuple[str, frozenset]) -> Quantize | None:
    """The checked ``[experiment.quantize]`` table, or None."""
    if "quantize" not in table:
        return None
    raw = table["quantize"]
    if not isinstance(raw, dict):
        chk.add(f"{where}.quantize", f"expected a table (bits, group, residual), got {raw!r}")
        return None
    before = len(chk.problems)
    values = chk.params(raw, QUANTIZE_PARAMS, f"{where}.quantize.")
    if len(chk.problems) == before and values["residual"] % values["group"]:
        chk.add(f"{where}.quantize.residual", f"expected a multiple of group "
                f"({values['group']}), got {values['residual']}")
    if not {"keys", "values"} <= source[1]:
        chk.add(f"{where}.quantize", f"expected a source with key and value vectors, "
                                     f"which the {source[0]!r} attention source does not have")
    return Quantize(**values) if len(chk.problems) == before else None


def read_document(path: str | Path) -> dict:
    """Parse a scenario file's TOML; unreadable or invalid files raise :class:`ScenarioError`."""
    path = Path(path)
    try:
        text = read_text(path)
    except ValueError as exc:
        if str(exc) == os.strerror(errno.ENOENT):
            raise ScenarioError([(str(path), "", "expected an existing scenario file")]) \
                from None
        raise ScenarioError([(str(path), "", f"expected a readable UTF-8 text file "
                                             f"({exc})")]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError([(str(path), "", f"expected valid TOML ({exc})")]) from None


def read_name(chk: Checker, doc: dict, path: Path) -> tuple:
    """The document's ``name`` (a folder name; default the file's stem) and ``description``."""
    name = doc.get("name", path.stem)
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        chk.add("name", f"expected a non-empty string usable as a folder name, got {name!r}")
    description = doc.get("description", "")
    if not isinstance(description, str):
        chk.add("description", f"expected a string, got {description!r}")
    return name, description
