"""``report.md``: what was run, the results table, the figures, the H2O section."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from kvsim.report import allocation_summary, h2o_study
from kvsim.engine.experiments import ScenarioResults, count_runs
from kvsim.scenario.load import Experiment, Scenario

H2O_TEXT = (
    "Online H2O scores a key by the attention it has *observed* so far, renormalised over "
    "the cache; offline H2O scores it by the column sum of the whole attention matrix, "
    "future queries included, which no deployed system knows. `accumulate = \"full\"` adds "
    "the full attention instead of the renormalised one (isolating renormalisation), and "
    "`normalize = true` divides a score by the number of queries that saw the key "
    "(correcting the bias towards old keys, which simply had more queries to collect "
    "attention from). The overlap panel shows how far the online cache drifts from the "
    "offline one; the last panel shows which positions each keeps that the other does not.")


def _fmt(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or np.isnan(x) else f"{x:.{digits}f}"


def _pivot(exp: Experiment, groups: dict, title: str, cell) -> list[str]:
    """A policy x budget table of one metric; ``cell(rows)`` formats a group of rows."""
    lines = [f"**{title}**", "", "| policy | " + " | ".join(f"B = {b}" for b in exp.budgets) + " |",
             "| --- |" + " --- |" * len(exp.budgets)]
    for p in exp.policies:
        lines.append(f"| `{p.label}` | " + " | ".join(cell(groups[p.label, b])
                                                   for b in exp.budgets) + " |")
    return lines + [""]


def _mean_of(key: str):
    def cell(rows: list[dict]) -> str:
        vals = [r[key] for r in rows if not np.isnan(r[key])]
        return _fmt(float(np.mean(vals))) if vals else "n/a"
    return cell


def _table(scenario: Scenario, exp: Experiment, rows: list[dict]) -> list[str]:
    groups: dict = defaultdict(list)
    for r in rows:
        groups[r["policy"], r["budget"]].append(r)
    spread = "over seeds and heads"
    lines = []
    if exp.prompt_len < scenario.T:
        def mass(rs):
            m = np.array([r["mass_mean"] for r in rs])
            return f"{m.mean():.3f} ± {m.std():.3f}"
        lines += _pivot(exp, groups, f"Attention mass kept, mean over decode steps (± sd {spread})",
                        mass)
        lines += _pivot(exp, groups, "Minimum mass at any decode step",
                        lambda rs: _fmt(min(r["mass_min"] for r in rs)))
    if scenario.has_truth:
        lines += _pivot(exp, groups, f"Important-token recall of the final cache (mean {spread})",
                        _mean_of("final_recall"))
    heads = sorted({r["head"] for r in rows})
    if exp.prompt_len < scenario.T and len(heads) > 1:
        focus = [r for r in rows if r["budget"] == exp.focus_budget]
        lines += [f"**Mass by head at budget {exp.focus_budget} (mean over seeds)**", "",
                  "| policy | " + " | ".join(f"head {h}" for h in heads) + " |",
                  "| --- |" + " --- |" * len(heads)]
        for p in exp.policies:
            lines.append(f"| `{p.label}` | " + " | ".join(
                _fmt(float(np.mean([r["mass_mean"] for r in focus
                                    if r["policy"] == p.label and r["head"] == h])))
                for h in heads) + " |")
        lines.append("")
    if any(not np.isnan(r["error_mean"]) for r in rows):
        lines += _pivot(exp, groups, "Relative output error |o~ - o| / |o|, mean over decode steps",
                        _mean_of("error_mean"))
    return lines


def _images(paths: list[Path], folder: Path) -> list[str]:
    return [f"![{p.stem}]({p.relative_to(folder).as_posix()})" for p in paths
            if p.suffix == ".png"]


def _allocation_note(exp: Experiment) -> str:
    if exp.allocation == "ada":
        return f"; allocation `ada` (floor_share {exp.floor_share:g}), B = mean cap per KV head"
    if exp.allocation == "pyramid":
        return f"; allocation `pyramid` (beta {exp.beta:g}), B = mean cap per KV head"
    return ""


def _what_was_run(scenario: Scenario) -> list[str]:
    attn = {k: v for k, v in scenario.attention.items() if k != "per_head"}
    lines = [f"- attention: `{scenario.source}` {attn}, T = {scenario.T}, "
             f"{scenario.heads} query heads, {scenario.kv_heads} KV heads (gqa {scenario.gqa})",
             f"- seeds: {list(scenario.seeds)}; {count_runs(scenario)} runs"]
    if len(scenario.layers) > 1:
        lines.append(f"- layers run jointly: {list(scenario.layers)}")
    if "per_head" in scenario.attention:
        for h, comps in enumerate(scenario.attention["per_head"]):
            names = [n for n in comps if n != "boost"] + (["boost"] * len(comps["boost"]))
            lines.append(f"  - head {h}: {', '.join(names) or 'no components'}")
    for exp in scenario.experiments:
        policies = ", ".join(f"`{p.label}`" + (f" ({p.kind})" if p.kind != p.label else "")
                             for p in exp.policies)
        lines.append(f"- experiment `{exp.name}`: prompt {exp.prompt_len}, "
                     f"{scenario.T - exp.prompt_len} decode steps, budgets {list(exp.budgets)}; "
                     f"{policies}" + _allocation_note(exp))
    return lines


def write(folder: Path, variants: list[Scenario], results: list[ScenarioResults],
          figures: dict) -> Path:
    """Write ``report.md``; ``figures[(variant index, key)]`` lists the figure files."""
    first = variants[0]
    lines = [f"# {first.name}", ""]
    lines += allocation_summary.lines(first, results[0].rows)
    if first.description:
        lines += [first.description, ""]
    lines += ["Generated by `python -m kvsim` (kvsim); numbers in `results.csv`, per-step "
              "series in `steps.npz`, the resolved scenario in `scenario.json`.", ""]
    for i, (scenario, res) in enumerate(zip(variants, results)):
        title = f"## Variant {i}: {scenario.variant_label}" if scenario.variant else "## Run"
        lines += [title, "", *_what_was_run(scenario), ""]
        lines += _images(figures.get((i, "field"), []), folder) + [""]
        for exp in scenario.experiments:
            rows = [r for r in res.rows if r["experiment"] == exp.name]
            lines += [f"### Experiment `{exp.name}`", "", *_table(scenario, exp, rows)]
            lines += _images(figures.get((i, exp.name), []), folder) + [""]
            if h2o_study.applies(exp) and exp.prompt_len < scenario.T:
                lines += [f"#### Online versus offline H2O (budget {exp.focus_budget})", "",
                          H2O_TEXT, ""]
                lines += ["| online | offline | mass online | mass offline | final Jaccard | "
                          "mean position only online | only offline |",
                          "| --- | --- | --- | --- | --- | --- | --- |"]
                for c in h2o_study.compare(scenario, exp, rows, res.steps[exp.name]):
                    lines.append(f"| `{c.online}` | `{c.offline}` | {_fmt(c.mass_online)} | "
                                 f"{_fmt(c.mass_offline)} | {_fmt(c.final_jaccard)} | "
                                 f"{_fmt(c.online_only_position, 0)} | "
                                 f"{_fmt(c.offline_only_position, 0)} |")
                lines += [""] + _images(figures.get((i, exp.name, "h2o"), []), folder) + [""]
    path = folder / "report.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
