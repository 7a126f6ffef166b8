"""``report.md``: the ranking, provenance, what was run, per-head tables, figures, studies."""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim._version import __version__
from kvsim.engine.experiments import ScenarioResults, count_runs
from kvsim.policies import POLICIES
from kvsim.report import allocation_summary, bytes_figure, protocol_summary
from kvsim.report.plotting import figure_context, head_label
from kvsim.report.stats import estimate, plural
from kvsim.report.studies import STUDIES
from kvsim.scenario.load import Experiment, Scenario

HIDDEN_SOURCE_PARAMS = ("T", "heads", "kv_heads", "gqa", "per_head", "head_names", "layers")
INLINE_HEADS = 2
REFERENCES = ("full", "oracle")  # policy kinds that are references, not candidates  # more heads than this: the per-budget tables fold under <details>


@dataclass
class Provenance:
    """What produced a report: command line, commit, date, cores, wall time."""

    command: str
    workers: int
    started: float
    commit: str | None = None
    wall: float | None = None

    @classmethod
    def start(cls, command: str | None, workers: int) -> Provenance:
        return cls(command or "kvsim.run(...) from Python", workers, time.time())

    def finish(self) -> Provenance:
        self.wall = time.time() - self.started
        return self

    def lines(self) -> list[str]:
        """What report.md says: only what a rerun of the same sources on the same machine
        writes again, so that a committed report rerun leaves ``git status`` clean; the
        date, wall time and load go to ``run.json`` (:meth:`run_facts`)."""

        commit = f"sources of commit `{self.commit}`" if self.commit else "no git checkout"
        if self.commit and self.commit.endswith("+"):
            commit += " (+: with uncommitted changes)"
        return [f"- command: `{self.command}`",
                f"- kvsim {__version__}, {commit}; "
                f"{plural(os.cpu_count() or 1, 'core')}, {plural(self.workers, 'worker')}; "
                f"date, wall time and load average in `run.json`"]

    def run_facts(self) -> dict:
        """The facts of this run that a rerun changes: date, wall time, load average."""
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started)),
                "wall_time_s": round(self.wall, 1), "load_average_1_5_15_min": load,
                "commit": self.commit, "command": self.command}


@dataclass
class FigureNotes:
    """What report.md says of its figures: each file's purpose, the figures not drawn because
    their data repeats another's (``repeats[stem] = other stem``), and those left out past
    the limit of ``output.max_figures``."""

    purposes: dict = field(default_factory=dict)
    repeats: dict = field(default_factory=dict)
    left: list = field(default_factory=list)
    limit: int = 6

    def lines(self) -> list[str]:
        out = []
        if self.left:
            out.append(f"- figures: the {self.limit} that answer this report's question first "
                       f"(`output.max_figures` = {self.limit}; more with `--set "
                       f"output.max_figures=N`); not drawn: "
                       + ", ".join(f"`{s}`" for s in self.left))
        if self.repeats:
            out.append("- not drawn, their data repeating a drawn figure's: " + ", ".join(
                f"`{s}` (= `{o}`)" for s, o in self.repeats.items()))
        return out

    def images(self, paths: list[Path], folder: Path) -> list[str]:
        """Each PNG of ``paths``, after the question it answers."""
        out = []
        for p in (p for p in paths if p.suffix == ".png"):
            if p in self.purposes:
                out += [f"*`{p.stem}`: {self.purposes[p]}*", ""]
            out += [f"![{p.stem}]({p.relative_to(folder).as_posix()})", ""]
        return out


def _unit(scenario: Scenario, row: dict) -> int | tuple:
    """What a table's column holds: the row's head when one layer runs; with several layers
    its layer (``("layer", i)``, the mean over that layer's heads), since head i of one
    layer and head i of another are unlike heads and are never pooled."""
    return row["head"] if len(scenario.layers) <= 1 else ("layer", row["layer"])


def _unit_label(scenario: Scenario, unit: int | tuple) -> str:
    return f"layer {unit[1]}" if isinstance(unit, tuple) else \
        head_label(figure_context(scenario), unit)


def _units_text(scenario: Scenario) -> str:
    """What a table's columns are: "per head", or per layer with what it averages."""
    if len(scenario.layers) <= 1:
        return "per head"
    return f"per layer (each the mean over its {plural(scenario.heads, 'head')})"


def _groups(scenario: Scenario, rows: list[dict], metric: str) -> dict:
    """``{(policy, budget, unit): {seed: value}}`` of one metric (a unit: see
    :func:`_unit`), NaN left out."""
    values: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if not math.isnan(r[metric]):
            values[r["policy"], r["budget"], _unit(scenario, r)][r["seed"]].append(r[metric])
    return {key: {seed: float(np.mean(v)) for seed, v in per_seed.items()}
            for key, per_seed in values.items()}


def _over_units(groups: dict, policy: str, budget: int, units: list):
    """Estimate of the mean over units: per seed the units' mean, then over seeds."""
    per_seed: dict = defaultdict(list)
    for u in units:
        for seed, v in groups.get((policy, budget, u), {}).items():
            per_seed[seed].append(v)
    return estimate([np.mean(v) for v in per_seed.values() if len(v) == len(units)])


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
            *("| " + " | ".join(row) + " |" for row in body), ""]


MAX_COLUMNS = 9  # units past this: the table turns, a row per unit and a column per policy


def _unit_table(units: list[str], labels: list[str], cells: list[list[str]],
                pooled: str | None) -> list[str]:
    """A policy x unit table (``cells[policy][unit]``, a last column ``pooled`` when given),
    turned to unit x policy past :data:`MAX_COLUMNS` units."""
    if len(units) <= MAX_COLUMNS:
        return _table(["policy", *units, *([pooled] if pooled else [])],
                      [[f"`{label}`", *row] for label, row in zip(labels, cells)])
    names = [*units, *([pooled] if pooled else [])]
    return _table(["", *(f"`{label}`" for label in labels)],
                  [[name, *(row[i] for row in cells)] for i, name in enumerate(names)])


def _metric_tables(scenario: Scenario, exp: Experiment, rows: list[dict], metric: str,
                   what: str) -> list[str]:
    """At the focus budget a policy x unit table (heads, or layers: :func:`_unit`, with the
    mean over them), then per unit a policy x budget table."""
    groups = _groups(scenario, rows, metric)
    units = sorted({u for (_, _, u) in groups})
    if not units:
        return []
    labels = [p.label for p in exp.policies]
    seeds = len(scenario.seeds)
    how = (f"mean over {seeds} seeds ± 95 % Student-t interval" if seeds > 1
           else "one seed, so no interval")
    focus = exp.focus_budget
    names = [_unit_label(scenario, u) for u in units]
    pooled = None
    if len(units) > 1:
        pooled = "**mean over heads**" if len(scenario.layers) <= 1 else "**mean over layers**"
    cells = [[estimate(groups.get((label, focus, u), {}).values()).text() for u in units]
             + ([_over_units(groups, label, focus, units).text()] if pooled else [])
             for label in labels]
    lines = [f"**{what} at B = {focus}, {_units_text(scenario)}: {how}**", "",
             *_unit_table(names, labels, cells, pooled)]
    if len(exp.budgets) > 1:
        per_unit = []
        for u, name in zip(units, names):
            per_unit += [f"*{what}, {name}*", "", *_table(
                ["policy", *(f"B = {b}" for b in exp.budgets)],
                [[f"`{label}`", *(estimate(groups.get((label, b, u), {}).values()).text()
                                  for b in exp.budgets)] for label in labels])]
        if len(units) > INLINE_HEADS:
            lines += ["<details><summary>" + f"{what} at every budget, "
                      f"{_units_text(scenario)}</summary>", "", *per_unit, "</details>", ""]
        else:
            lines += per_unit
    return lines


def _minimum_mass(scenario: Scenario, exp: Experiment, rows: list[dict]) -> list[str]:
    units = sorted({_unit(scenario, r) for r in rows})
    low: dict = {}
    for r in rows:
        if r["budget"] == exp.focus_budget and not math.isnan(r["mass_min"]):
            key = r["policy"], _unit(scenario, r)
            low[key] = min(low.get(key, math.inf), r["mass_min"])
    cells = [[f"{low[p.label, u]:.3f}" if (p.label, u) in low else "n/a" for u in units]
             for p in exp.policies]
    where = "" if len(scenario.layers) <= 1 else ", of any of the layer's heads"
    return [f"**Lowest attention mass at any decode step{where}, B = {exp.focus_budget} "
            f"(over every seed)**", "",
            *_unit_table([_unit_label(scenario, u) for u in units],
                         [p.label for p in exp.policies], cells, None)]


def _flat(value, prefix: str = "") -> list[str]:
    """``key = value`` words for a sweep value, nested tables as dotted keys."""
    if isinstance(value, dict):
        return [w for k, v in value.items() for w in _flat(v, f"{prefix}{k}.")]
    if isinstance(value, list):
        value = ", ".join(map(str, value))
    return [f"{prefix[:-1]} = {value}" if prefix else str(value)]


def variant_text(scenario: Scenario) -> str:
    """The sweep point of a variant in words (no Python reprs): ``path: key = value, ...``."""
    return "; ".join(f"{path}: {', '.join(_flat(value))}" if isinstance(value, dict)
                     else f"{path} = {', '.join(_flat(value))}"
                     for path, value in scenario.variant.items())


def _order(rows: list[dict], exp: Experiment, metric: str,
           lowest: bool = False) -> tuple[list[str], dict]:
    """The policies of ``exp`` by their mean ``metric`` in ``rows`` (highest first, or
    ``lowest`` first)."""
    means = {p.label: float(np.mean([r[metric] for r in rows if r["policy"] == p.label]))
             for p in exp.policies if any(r["policy"] == p.label for r in rows)}
    return sorted(means, key=lambda label: means[label] if lowest else -means[label]), means


def _ranked(order: list[str], means: dict, sign: str = " > ") -> str:
    text = f"`{order[0]}` {means[order[0]]:.3f}"
    for a, b in zip(order, order[1:]):
        text += (" = " if f"{means[a]:.3f}" == f"{means[b]:.3f}" else sign) + \
            f"`{b}` {means[b]:.3f}"
    return text


ERROR_APART = 1.05  # output errors this many times apart rank two policies apart


def _error_disagreement(rows: list[dict], exp: Experiment, order: list[str],
                        means: dict) -> str:
    """Where ranking by mean relative output error (lowest first) puts a policy that keeps
    more mass behind one that keeps less: that order and the widest such pair; else ""."""
    rows = [r for r in rows if not math.isnan(r["error_mean"])]
    if not rows:
        return ""
    by_error, errors = _order(rows, exp, "error_mean", lowest=True)
    swapped = [(a, b) for i, a in enumerate(order) for b in order[i + 1:]
               if a in errors and b in errors and errors[a] > ERROR_APART * errors[b]]
    if not swapped:
        return ""
    a, b = max(swapped, key=lambda s: errors[s[0]] / errors[s[1]])
    return (f". By relative output error (lowest first) the order is another, in "
            f"{plural(len(swapped), 'pair')} (mass measures what the queries attend to, output "
            f"error what the cache's attention returns): {_ranked(by_error, errors, ' < ')}; "
            f"`{a}` keeps more mass than `{b}` ({means[a]:.3f} against {means[b]:.3f}) but its "
            f"output error is larger ({errors[a]:.3f} against {errors[b]:.3f})")


def _ranking(scenario: Scenario, res: ScenarioResults) -> str:
    """One sentence: the policies ranked by mean mass kept at the focus budget, and by final
    recall where the source plants important tokens, saying where the two orders disagree
    (or by final recall alone when no experiment decodes)."""
    source = f"On the `{scenario.source}` source" + (
        f" ({variant_text(scenario)})" if scenario.variant else "")
    for metric, what in (("mass_mean", "attention mass kept"), ("final_recall", "final recall")):
        for exp in scenario.experiments:
            rows = [r for r in res.rows if r["experiment"] == exp.name
                    and r["budget"] == exp.focus_budget and not math.isnan(r[metric])]
            if not rows:
                continue
            order, means = _order(rows, exp, metric)
            heads = plural(len({r["head"] for r in rows}), "head")
            layers = len(scenario.layers)
            heads += f" x {plural(layers, 'layer')}" if layers > 1 else ""
            text = (f"{source}, the policies rank by {what} at B = {exp.focus_budget} "
                    f"(experiment `{exp.name}`, mean over {heads} and "
                    f"{plural(len(scenario.seeds), 'seed')}): {_ranked(order, means)}")
            recall = [r for r in res.rows if r["experiment"] == exp.name
                      and r["budget"] == exp.focus_budget and not math.isnan(r["final_recall"])]
            if metric == "mass_mean" and recall:
                by_recall, recalls = _order(recall, exp, "final_recall")
                text += f"; by final important-token recall: {_ranked(by_recall, recalls)}"
                swapped = [(a, b) for i, a in enumerate(order) for b in order[i + 1:]
                           if a in recalls and b in recalls and recalls[a] < recalls[b] - 0.005]
                if swapped:
                    # the widest disagreement, between policies that are not references
                    kinds = {p.label: p.kind for p in exp.policies}
                    plain = [s for s in swapped if kinds[s[0]] not in REFERENCES] or swapped
                    a, b = max(plain, key=lambda s: recalls[s[1]] - recalls[s[0]])
                    text += (f". The two orders disagree in {plural(len(swapped), 'pair')} (mass "
                             f"measures what the queries attend to, recall the planted tokens): "
                             f"`{a}` keeps more mass than `{b}` ({means[a]:.3f} against "
                             f"{means[b]:.3f}) but fewer of the important tokens "
                             f"({recalls[a]:.3f} against {recalls[b]:.3f})")
            if metric == "mass_mean" and not recall:
                text += _error_disagreement(rows, exp, order, means)
            return text + "."
    return f"{source}, no experiment has decode steps or ground truth to rank the policies by."


def _reading(variants: list[Scenario], results: list[ScenarioResults]) -> list[str]:
    rows = [r for res in results for r in res.rows]
    has = {m: any(not math.isnan(r[m]) for r in rows)
           for m in ("mass_mean", "final_recall", "error_mean")}
    seeds = len(variants[0].seeds)
    text = ["**Reading this report.**"]
    if has["mass_mean"]:
        text.append("*Attention mass kept* is the share of each decode query's full attention "
                    "that falls on cached keys (1: nothing lost), averaged over the decode steps.")
        quantised = [e.name for e in variants[0].experiments if e.quantize is not None]
        if quantised:
            text.append(f"Under KIVI storage ({', '.join(f'`{n}`' for n in quantised)}) the "
                        "mass is exp(-KL(p~ || p)) of the attention p~ over the cache's "
                        "quantised keys against the exact full attention p: the share kept when "
                        "the keys are exact, below 1 for `full` too. It is not bounded by "
                        "`full`'s: an evicting cache drops some of the quantisation error with "
                        "its keys, and can score above it.")
    if has["final_recall"]:
        text.append("*Important-token recall* is the share of the scenario's planted important "
                    "tokens still cached after the last step.")
        if any(p.kind == "oracle" for v in variants for e in v.experiments for p in e.policies):
            text.append("The `oracle` keeps at each step the B keys the current query attends to "
                        "most: the best cache for that query's mass, not for recall. Its final "
                        "cache serves the last query only, so its final recall is low whenever "
                        "the planted tokens are not what the last query attends to.")
    if has["error_mean"]:
        text.append("*Relative output error* |o~ - o| / |o| compares the attention output of the "
                    "cache (attention renormalised over the kept keys) with the full output o. "
                    "It can exceed 1: the renormalised weights of a cache that holds little of "
                    "the mass can point far from o, and o itself is short when the value vectors "
                    "cancel out.")
    text.append(protocol_summary.CONVENTION)
    layers = len(variants[0].layers)
    text.append(("Tables are per head" if layers <= 1 else
                 f"Tables are per layer (head i of one layer and head i of another are unlike "
                 f"heads, never pooled; a layer's column is the mean over its "
                 f"{plural(variants[0].heads, 'head')})")
                + f": means over {plural(seeds, 'seed')}"
                + (" with a 95 % Student-t interval (± half-width), rounded to the interval's "
                   "second significant digit" if seeds > 1 else ", without an interval")
                + ("; a column pooling heads is labelled *mean over heads*." if layers <= 1
                   else "; a column pooling layers is labelled *mean over layers*.")
                + (" Figure bands show the range over seeds." if seeds > 1 else "")
                + " A curve drawn dashed, with hollow markers, cannot be told from another in "
                  "that panel: the legend says `(= other)` where it equals it, `(≈ other)` "
                  "where it stays within 0.01 of it (on a log axis, 0.01 decades for each "
                  "decade the panel spans, at least 0.01) at 95 % of its points, and at all of "
                  "them up to 20.")
    return [" ".join(text), ""]


def _policy_text(exp: Experiment) -> str:
    out = []
    for p in exp.policies:
        spec = POLICIES[p.kind].params if p.kind in POLICIES else {}
        changed = [f"{k} = {_value(v)}" for k, v in p.params.items()
                   if k in spec and v != spec[k].default]
        extra = ", ".join(([p.kind] if p.kind != p.label else []) + changed)
        out.append(f"`{p.label}`" + (f" ({extra})" if extra else ""))
    return ", ".join(out)


def _value(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v))
    return str(v)


def _what_was_run(scenario: Scenario) -> list[str]:
    params = [f"{k} {_value(v)}" for k, v in scenario.attention.items()
              if k not in HIDDEN_SOURCE_PARAMS and v not in ([], "", None)]
    grouped = "" if scenario.kv_heads == scenario.heads else \
        f" (each KV head's query heads combine scores by their {scenario.gqa})"
    lines = [f"- attention: the `{scenario.source}` source"
             + (f" ({', '.join(params)})" if params else "")
             + f"; T = {scenario.T:,} tokens, {plural(scenario.heads, 'query head')}, "
               f"{plural(scenario.kv_heads, 'KV head')}{grouped}",
             f"- seeds {', '.join(map(str, scenario.seeds))} "
             f"({plural(len(scenario.seeds), 'seed')}); {plural(count_runs(scenario), 'run')}"]
    if len(scenario.layers) > 1:
        lines.append(f"- layers run jointly: {', '.join(map(str, scenario.layers))}")
    per_head = scenario.attention.get("per_head", [])
    differ = _differing(per_head)
    for h, comps in enumerate(per_head):
        names = [n for n in comps if n != "boost" and comps[n]] + ["boost"] * len(comps["boost"])
        own = [f"{c}.{k} = {_value(comps[c][k])}" for c, k in differ
               if comps.get(c) and k in comps[c]]
        lines.append(f"  - {head_label(figure_context(scenario), h)}: "
                     f"{', '.join(names) or 'no components'}"
                     + (f" ({'; '.join(own)})" if own else ""))
    for exp in scenario.experiments:
        steps = scenario.T - exp.prompt_len
        lines.append(f"- experiment `{exp.name}`: prompt of {plural(exp.prompt_len, 'token')}, "
                     f"{plural(steps, 'decode step')}, budgets "
                     f"{', '.join(map(str, exp.budgets))}"
                     + (f" (focus {exp.focus_budget})" if len(exp.budgets) > 1 else "")
                     + f"; {_policy_text(exp)}" + _allocation_note(exp))
    return lines


def _differing(per_head: list[dict]) -> list[tuple[str, str]]:
    """The (component, parameter) pairs whose values differ between the heads that have
    the component: what tells heads with the same components apart."""
    keys = dict.fromkeys((c, k) for comps in per_head for c, params in comps.items()
                         if isinstance(params, dict) for k in params)
    return [(c, k) for c, k in keys
            if len({repr(comps[c].get(k)) for comps in per_head if comps.get(c)}) > 1]


def _allocation_note(exp: Experiment) -> str:
    if exp.allocation == "ada":
        return f"; allocation `ada` (floor_share {exp.floor_share:g}), B = mean cap per KV head"
    if exp.allocation == "pyramid":
        return f"; allocation `pyramid` (beta {exp.beta:g}), B = mean cap per KV head"
    if exp.allocation == "cake":
        return (f"; allocation `cake` (tau1 {exp.tau1:g}, tau2 {exp.tau2:g}), "
                f"B = mean cap per KV head")
    return ""


def _experiment(scenario: Scenario, exp: Experiment, rows: list[dict], steps, images,
                key: tuple, notes: list[str]) -> list[str]:
    lines = [f"### Experiment `{exp.name}`", ""]
    decodes = exp.prompt_len < scenario.T
    if decodes:
        lines += _metric_tables(scenario, exp, rows, "mass_mean", "Attention mass kept")
        lines += _minimum_mass(scenario, exp, rows)
    if scenario.has_truth:
        lines += _metric_tables(scenario, exp, rows, "final_recall",
                                "Important-token recall of the final cache")
    lines += _metric_tables(scenario, exp, rows, "error_mean", "Relative output error")
    lines += images(key) + [""]
    lines += [f"*{n}*" for n in notes] + ([""] if notes else [])
    for study in STUDIES:
        if study.applies(scenario, exp):
            lines += study.section(scenario, exp, rows, steps)
            lines += images((*key, study.name)) + [""]
    return lines


def write(folder: Path, variants: list[Scenario], results: list[ScenarioResults],
          figures: dict, notes: dict, provenance: Provenance,
          figure_notes: FigureNotes | None = None) -> Path:
    """Write ``report.md``; ``figures[(variant index, key)]`` lists the figure files,
    ``notes[(variant index, experiment)]`` the figures not drawn, with why, and
    ``figure_notes`` each figure's purpose and those left out."""
    figure_notes = figure_notes or FigureNotes()

    def images(key) -> list[str]:
        return figure_notes.images(figures.get(key, []), folder)

    first = variants[0]
    lines = [f"# {first.name}", ""]
    lines += allocation_summary.lines(first, results[0].rows)
    compared = images((0, "allocation_vs_uniform"))
    lines += compared + ([""] if compared else [])
    lines += protocol_summary.lines(results[0].rows)
    compared = images((0, "protocols_vs_per_step"))
    lines += compared + ([""] if compared else [])
    lines += bytes_figure.summary_lines(first, results[0].rows)
    at_bytes = images((0, "mass_vs_bytes"))
    lines += at_bytes + ([""] if at_bytes else [])
    rankings = [_ranking(v, r) for v, r in zip(variants, results)]
    lines += (rankings if len(rankings) == 1 else [f"- {r}" for r in rankings]) + [""]
    if first.description:
        lines += [first.description, ""]
    lines += [*provenance.lines(), "- files: numbers in `results.csv`, per-step series in "
              "`steps.npz`, the resolved scenario in `scenario.json`", *figure_notes.lines(),
              ""]
    lines += _reading(variants, results)
    for i, (scenario, res) in enumerate(zip(variants, results)):
        title = f"## Variant {i}: {variant_text(scenario)}" if scenario.variant else "## Run"
        lines += [title, "", *_what_was_run(scenario), ""]
        lines += images((i, "field")) + images((i, "column_sums")) + [""]
        for exp in scenario.experiments:
            rows = [r for r in res.rows if r["experiment"] == exp.name]
            lines += _experiment(scenario, exp, rows, res.steps[exp.name], images,
                                 (i, exp.name), notes.get((i, exp.name), []))
    path = folder / "report.md"
    text = "\n".join(lines).rstrip() + "\n"
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    path.write_text(text)
    return path
