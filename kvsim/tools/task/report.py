"""The task report folder: report.md, results.csv, task.json and figures.

The full-cache gate per (length, depth) cell (:mod:`~kvsim.tools.task.prediction`); accuracy
per policy x budget x protocol with Wilson 95% intervals over the gated cells; the
needle-in-a-haystack heatmaps (depth x length at the focus budget, one shared colour scale,
cells that fail the gate crossed out); accuracy against budget with interval bands; and how
well the simulator's predictors foretell the model's answers (AUC, balanced accuracy and
Brier score beside the base rate's).
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvsim.tools.study.report import (cache_words, figure_lines, layer_words, machine_words,
                                      read_csv, redrawn_lines, settings_of, version_lines,
                                      write_csv)
from kvsim.tools.task.config import TaskConfig
from kvsim.tools.task.kinds import KINDS, PASSKEY
from kvsim.tools.task.prediction import GATE, PREDICTORS, gate, gated, prediction_quality
from kvsim.tools.task.run import FULL

Z95 = 1.959963984540054
# The columns of results.csv and their types (what :func:`read_rows` parses back).
ROW_TYPES = {"length": int, "depth": float, "trial": int, "key": str, "needle_start": int,
             "actual_depth": float, "question_len": int, "policy": str, "kind": str,
             "budget": int, "protocol": str, "peak_cache": int, "retention": float,
             "digit_share": float, "kept_needle_mass": float, "late_needle_mass": float,
             "answer": str, "number": str,
             "success": int, "question_needle_mass": float}
HELD = "every digit token of one of the key's two occurrences"
KIND_HELD = "every span the answer needs: each asked value's digit tokens (vt: each assignment)"
SCORE_TYPES = {"score_all": float, "score_part": float}  # a RULER kind's, before the last
RECALL_TYPES = {"recall_retention": float, "echo": int}  # decode_recall's, after the scores
RETENTION_BINS = (0.25, 0.5, 0.75)  # inner edges of the run-level bins (0 and 1 exactly: bins of their own)
PROTOCOL_TEXT = {
    "after_question": "`after_question` compresses the whole prompt after a full prefill",
    "before_question": "`before_question` compresses the context before the question from its "
                       "own queries, then the question joins without eviction (decode budget "
                       "B + Q)",
    "prefill_only": "`prefill_only` (kvpress's protocol) compresses the context before the "
                    "question as `before_question`, then the question and the answer join "
                    "without eviction (peak B + Q + answer)",
}
LOOKS = {  # per protocol: marker face and line style in the retention figure
    "before_question": ("none", ":"), "after_question": ("full", "-"),
    "prefill_only": ("half", "--")}


def read_rows(path: Path) -> list[dict]:
    """The rows of a task's ``results.csv``, with the types the run gave them (written back,
    they give the same file)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        scored = [*list(ROW_TYPES)[:-1], *SCORE_TYPES, "question_needle_mass"]
        recall = [*scored[:-1], *RECALL_TYPES, scored[-1]]
        if reader.fieldnames not in (list(ROW_TYPES), scored, recall):
            raise ValueError(f"expected the columns {', '.join(ROW_TYPES)} (a RULER kind's: "
                             f"{', '.join(SCORE_TYPES)} before the last; decode_recall's "
                             f"then {', '.join(RECALL_TYPES)})")
        types = {**ROW_TYPES, **SCORE_TYPES, **RECALL_TYPES}
        return [{k: types[k](v) for k, v in r.items()} for r in reader]


def retention_bins(rows: list[dict], protocol: str) -> list[dict]:
    """The compressed runs of ``protocol`` grouped by their needle retention: exactly 0, the
    intervals between 0, :data:`RETENTION_BINS` and 1, and exactly 1. Per non-empty bin: its
    runs, their mean retention, the share answered and its Wilson interval."""
    edges = (0.0, *RETENTION_BINS, 1.0)
    groups: dict = defaultdict(list)
    for r in rows:
        if r["policy"] != FULL and r["protocol"] == protocol:
            x = r["retention"]
            b = 0 if x <= 0 else len(edges) if x >= 1 else \
                next(i for i in range(1, len(edges)) if x < edges[i])
            groups[b].append(r)
    out = []
    for b in sorted(groups):
        share = answered(groups[b])
        out.append({"runs": share.pop("trials"), **share})
    return out


def answered(rows: list[dict]) -> dict:
    """Of ``rows`` (runs): trials, successes, accuracy, its Wilson interval and the mean
    retention."""
    k, n = sum(r["success"] for r in rows), len(rows)
    lo, hi = wilson(k, n)
    return {"trials": n, "successes": k, "accuracy": k / n, "ci_low": lo, "ci_high": hi,
            "retention": float(np.mean([r["retention"] for r in rows]))}


def wilson(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (``(nan, nan)`` without trials).

    It holds ``successes / trials`` by construction: rounding would otherwise leave a bound
    ~1e-17 on the wrong side of it at 0 or all successes (a negative error bar)."""
    if trials == 0:
        return math.nan, math.nan
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials ** 2))
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def accuracy_rows(rows: list[dict]) -> list[dict]:
    """Per (protocol, policy, budget): trials, successes, accuracy, Wilson interval, mean
    retention (the full cache: one line, budget "all")."""
    groups: dict = defaultdict(list)
    for r in rows:
        budget = "all" if r["policy"] == FULL else r["budget"]
        groups[r["protocol"], r["policy"], budget].append(r)
    return [{"protocol": protocol, "policy": policy, "budget": budget, **answered(rs)}
            for (protocol, policy, budget), rs in groups.items()]


def _label(protocol: str) -> str:
    return {"before_question": "before question (query-agnostic)",
            "after_question": "after question (query-aware)",
            "prefill_only": "prefill only (kvpress's protocol)", FULL: "full cache"}[protocol]


def _labels(cfg: TaskConfig, protocol: str) -> list[str]:
    """The policies that run under ``protocol``: kvsim's, and kvpress's presses under
    ``prefill_only``."""
    return [p.label for p in (*cfg.policies, *(cfg.presses if protocol == "prefill_only"
                                               else ()))]


def _hidden_markers(acc: list[dict], labels: list[str], protocols) -> dict[str, str]:
    """``{policy: " (= other, protocol)"}`` for a policy every marker of which, in a protocol,
    sits on a marker of an earlier policy: drawn over, it would vanish unnamed (``" (=
    other)"`` when it does under every protocol, on the same policy)."""
    notes: dict = {}
    protocols = list(protocols)
    for protocol in protocols:
        points = {lab: {(a["retention"], a["accuracy"]) for a in acc
                        if a["policy"] == lab and a["protocol"] == protocol} for lab in labels}
        for i, lab in enumerate(labels):
            under = next((other for other in labels[:i]
                          if points[lab] and points[lab] <= points[other]), None)
            if under:
                notes.setdefault(lab, []).append((under, _label(protocol).split(' (')[0]))
    return {lab: f" (= {n[0][0]})" if len(n) == len(protocols) and len({u for u, _ in n}) == 1
            else f" ({'; '.join(f'= {u}, {p}' for u, p in n)})" for lab, n in notes.items()}


def _figures(cfg: TaskConfig, rows: list[dict], cells: dict, acc: list[dict],
             folder: Path) -> list[str]:
    """The heatmaps over every cell (those that fail the gate crossed out), then, from the
    gated runs (``acc``, none without a gated cell), accuracy against budget and retention
    against accuracy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvsim.report import palette  # the figure standard's colours and markers
    from kvsim.report.plotting import color_map

    labels = [p.label for p in (*cfg.policies, *cfg.presses)]
    colors = color_map([FULL, *labels])
    markers = palette.markers(labels)
    names = []
    full = [r for r in rows if r["policy"] == FULL]
    for protocol in cfg.compress:
        panels = [(FULL, full)] + [(lab, [r for r in rows if r["policy"] == lab
                                          and r["protocol"] == protocol
                                          and r["budget"] == cfg.focus_budget])
                                   for lab in _labels(cfg, protocol)]
        ncols = 3
        nrows = math.ceil(len(panels) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(10, 2.3 * nrows + 0.8), squeeze=False,
                                 sharex=True, sharey=True)
        image = None
        for ax, (lab, rs) in zip(axes.flat, panels):
            grid = np.full((len(cfg.depths), len(cfg.lengths)), np.nan)
            for i, d in enumerate(cfg.depths):
                for j, n in enumerate(cfg.lengths):
                    hits = [r["success"] for r in rs if r["depth"] == d and r["length"] == n]
                    if hits:
                        grid[i, j] = np.mean(hits)
                    if not cells.get((n, d), {"passes": True})["passes"]:
                        ax.text(j, i, "×", ha="center", va="center", color="red", fontsize=13)
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto",
                              origin="upper")
            ax.set_title(lab if lab != FULL else "full cache", fontsize=9)
            ax.set_xticks(range(len(cfg.lengths)), [str(n) for n in cfg.lengths], fontsize=8)
            ax.set_yticks(range(len(cfg.depths)), [f"{d:.2g}" for d in cfg.depths], fontsize=8)
        for ax in axes.flat[len(panels):]:
            ax.axis("off")
        for ax in axes[-1]:
            ax.set_xlabel("context length (tokens)", fontsize=8)
        for ax in axes[:, 0]:
            ax.set_ylabel("needle depth", fontsize=8)
        fig.suptitle(f"{cfg.name}: {cfg.kind} accuracy, {_label(protocol)}, budget "
                     f"{cfg.focus_budget} (mean of {_count(cfg.trials, 'trial')} per cell)\n"
                     f"red ×: a cell where the full cache answers under {GATE:.0%} of its "
                     f"trials (left out of every claim)", fontsize=10)
        fig.tight_layout(rect=(0, 0, 0.9, 1))
        bar = fig.add_axes((0.92, 0.15, 0.02, 0.7))
        fig.colorbar(image, cax=bar, label="accuracy")
        names += _save(fig, folder, f"heatmap_{protocol}", cfg)
    if not acc:
        return names
    rows = gated(rows, cells)
    fig, axes = plt.subplots(1, len(cfg.compress), figsize=(5 * len(cfg.compress), 5.2),
                             squeeze=False, sharey=True)
    full_acc = next(a for a in acc if a["policy"] == FULL)
    def full_cache(ax, label: str) -> None:  # its accuracy, with its interval as a band
        ax.axhspan(full_acc["ci_low"], full_acc["ci_high"], color="0.85", zorder=0)
        ax.axhline(full_acc["accuracy"], color=colors[FULL], ls="--", lw=1, label=label)

    for ax, protocol in zip(axes[0], cfg.compress):
        full_cache(ax, "full cache (band: its Wilson 95% interval)")
        for k, lab in enumerate(labels):
            pts = sorted((a for a in acc if a["policy"] == lab and a["protocol"] == protocol),
                         key=lambda a: a["budget"])
            x = np.array([a["budget"] for a in pts], float) * (1 + 0.02 * (k - len(labels) / 2))
            ax.fill_between(x, [a["ci_low"] for a in pts], [a["ci_high"] for a in pts],
                            color=colors[lab], alpha=0.08, lw=0)
            ax.plot(x, [a["accuracy"] for a in pts], marker=markers[lab], color=colors[lab],
                    lw=1.2, ms=5, label=lab)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cfg.budgets, [str(b) for b in cfg.budgets])
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("budget (keys per layer and KV head)")
        ax.set_title(_label(protocol), fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(f"{cfg.kind} accuracy (Wilson 95% bands)")
    handles, texts = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, texts, loc="lower center", fontsize=8, ncol=4, frameon=False)
    per_point = _count(len(cells_of(rows)), "trial")
    fig.suptitle(f"{cfg.name}: accuracy against budget ({per_point} per point: the cells "
                 f"that pass the full-cache gate)", fontsize=10)
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    names += _save(fig, folder, "accuracy_vs_budget", cfg)
    entries = len(labels) + 2 * len(cfg.compress) + 1  # policies, bins, protocols, full
    legend_in = 0.6 + 0.15 * math.ceil(entries / 2)  # two columns under the axes
    fig, ax = plt.subplots(figsize=(7.5, 4.6 + legend_in))
    full_cache(ax, f"full cache: {_pct(full_acc)} (band: Wilson 95%)")
    hidden = _hidden_markers(acc, labels, cfg.compress)
    from matplotlib.colors import to_rgba

    def face(protocol: str, color) -> object:
        return {"none": "none", "full": color, "half": to_rgba(color, 0.35)}[
            LOOKS[protocol][0]]
    for protocol in cfg.compress:
        for lab in labels:
            pts = [a for a in acc if a["policy"] == lab and a["protocol"] == protocol]
            ax.scatter([a["retention"] for a in pts], [a["accuracy"] for a in pts], s=36,
                       marker=markers[lab], edgecolors=colors[lab],
                       facecolors=face(protocol, colors[lab]), alpha=0.8,
                       label=lab + hidden.get(lab, "") if protocol == next(
                           p for p in cfg.compress if lab in _labels(cfg, p)) else None)
    for protocol in cfg.compress:
        style = LOOKS[protocol][1]
        bins = retention_bins(rows, protocol)
        x = np.array([b["retention"] for b in bins])
        y = np.array([b["accuracy"] for b in bins])
        err = np.array([y - [b["ci_low"] for b in bins], [b["ci_high"] for b in bins] - y])
        ax.errorbar(x, y, yerr=err, color="0.15", ls=style, lw=1.3, marker="s", ms=4,
                    mfc=face(protocol, "0.15") if LOOKS[protocol][0] != "none" else "white",
                    capsize=2, zorder=3,
                    label=f"runs binned by retention, {_label(protocol).split(' (')[0]}")
    ax.set_xlabel("simulator: needle retention (share of layer × KV head caches holding " + (
        "the key)" if cfg.kind == PASSKEY else "the spans the answer needs)"))
    ax.set_ylabel(f"model: {cfg.kind} accuracy")
    ax.set_xlim(-0.03, 1.03)
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    styles = [plt.Line2D([], [], ls="", marker="o", mfc=face(p, "0.3"), mec="0.3",
                         label=_label(p)) for p in cfg.compress]
    handles, texts = ax.get_legend_handles_labels()
    fig.legend([*handles, *styles], [*texts, *(h.get_label() for h in styles)], fontsize=7,
               ncol=2, loc="lower center", frameon=False,
               title="markers: a policy at one budget (mean over trials)\nblack: the share "
                     "of single runs answered, pooled by retention bin\n(0, (0, ¼), [¼, ½), "
                     "[½, ¾), [¾, 1), 1), Wilson 95% bars",
               title_fontsize=7)
    ax.set_title(f"{cfg.name}: predicted retention against the model's accuracy\n(the "
                 f"cells that pass the full-cache gate)", fontsize=10)
    fig.tight_layout(rect=(0, legend_in / (4.6 + legend_in), 1, 1))
    names += _save(fig, folder, "retention_vs_accuracy", cfg)
    return names


def cells_of(rows: list[dict]) -> set:
    return {(r["length"], r["depth"], r["trial"]) for r in rows}


def _save(fig, folder: Path, stem: str, cfg: TaskConfig) -> list[str]:
    """Save ``fig`` in every format of ``cfg`` as laid out (no second tight layout)."""
    import matplotlib.pyplot as plt

    for fmt in cfg.formats:
        fig.savefig(folder / f"{stem}.{fmt}", dpi=cfg.dpi,
                    metadata={"Software": None} if fmt == "png" else None)
    plt.close(fig)
    return [f"{stem}.{fmt}" for fmt in cfg.formats]


def _percent(x: float) -> str:
    """``x`` in per cent, rounded half up as the docs round (32.5 % of 40 trials is 33%,
    where Python's ``:.0f`` rounds half to even)."""
    return f"{math.floor(100 * x + 0.5 + 1e-9):d}"


def _pct(a: dict) -> str:
    return f"{_percent(a['accuracy'])}% [{_percent(a['ci_low'])}, {_percent(a['ci_high'])}]"


def gate_lines(cfg: TaskConfig, cells: dict) -> list[str]:
    """The gate table: the full cache's successes of trials per depth (rows) and length
    (columns), ✗ on a flagged cell."""
    lines = ["| depth | " + " | ".join(f"{n} tokens" for n in cfg.lengths) + " |",
             "| --- |" + " ---: |" * len(cfg.lengths)]
    for d in cfg.depths:
        row = [cells.get((n, d)) for n in cfg.lengths]
        lines.append(f"| {d:g} | " + " | ".join(
            "n/a" if c is None else f"{c['successes']}/{c['trials']}"
            f"{'' if c['passes'] else ' ✗'}" for c in row) + " |")
    return lines


def _cell_list(cells: dict) -> str:
    return ", ".join(f"{n} tokens at depth {d:g} ({c['successes']}/{c['trials']})"
                     for (n, d), c in cells.items() if not c["passes"])


def _opening(cfg: TaskConfig, cells: dict, acc: list[dict], quality: list[dict]) -> str:
    passing = sum(c["passes"] for c in cells.values())
    gate_words = (f"The full cache answers at least {GATE:.0%} of the trials in {passing} of "
                  f"{len(cells)} (length, depth) cells")
    if passing < len(cells):
        gate_words += (f"; the other {len(cells) - passing} are flagged and left out of every "
                       f"claim below: {_cell_list(cells)}")
    if not acc:
        return gate_words + ". No cell passes the gate: this report makes no claim."
    full_acc = next(a for a in acc if a["policy"] == FULL)
    parts = []
    for protocol in cfg.compress:
        at = [a for a in acc if a["protocol"] == protocol and a["budget"] == cfg.focus_budget]
        keep = [f"{a['policy']} ({_percent(a['accuracy'])}%)"
                for a in sorted(at, key=lambda a: -a["accuracy"])
                if a["accuracy"] >= 0.8 * full_acc["accuracy"] and a["accuracy"] > 0]
        parts.append(f"{_label(protocol)}, " + (", ".join(keep) if keep else "none"))
    q = next(q for q in quality if q["protocol"] == "all")
    aucs = ", ".join(f"{name.replace('_', ' ')} {_interval(q[name]['auc'])}"
                     for name in PREDICTORS)
    return (f"{gate_words}. On those cells, policies that keep the needle at budget "
            f"{cfg.focus_budget} (at least 80% of the full cache's accuracy, which is "
            f"{_pct(full_acc)} over {_count(full_acc['trials'], 'trial')}): "
            f"{'; '.join(parts)}. Predicting the answer from the full-cache attention alone, "
            f"over {q['runs']} compressed runs of which {100 * q['base_rate']:.1f}% succeed, "
            f"the ROC AUC (0.5: no better than the base rate) is {aucs}; a lost needle "
            f"(retention < 1/2) fails in {_share(q['failed_if_lost'])} of runs, a retained "
            f"one is answered in {_share(q['answered_if_retained'])}.")


def _interval(t) -> str:
    return "n/a" if math.isnan(t[0]) else f"{t[0]:.2f} [{t[1]:.2f}, {t[2]:.2f}]"


def _number(x: float, digits: int) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def _share(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{_percent(x)}%"


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one (``1 KV head``, ``3 KV heads``)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def markdown(cfg: TaskConfig, rows: list[dict], cells: dict, acc: list[dict],
             quality: list[dict], facts: dict, figures: list[str]) -> str:
    """The report's text."""
    n_cells = len(cells_of(rows))
    lines = [f"# {'Passkey' if cfg.kind == PASSKEY else cfg.kind} task: {cfg.name}", "", _opening(cfg, cells, acc, quality), ""]
    if cfg.description:
        lines += [cfg.description, ""]
    lines += [
        *version_lines(facts),
        *redrawn_lines(facts, "results.csv", "the trials"),
        f"- wall time {machine_words(facts)}",
        f"- model: `{cfg.model.name}`{f' (`{cfg.gguf_file}`)' if cfg.gguf_file else ''}, "
        f"{layer_words(facts)}, {facts['heads']} query heads sharing "
        f"{_count(facts['kv_heads'], 'KV head')}. {cache_words(facts)} (GQA `{cfg.gqa}`)."
        + (f" Weights licence: {facts['licence']}." if facts.get("licence") else ""),
        f"- grid: lengths {list(cfg.lengths)} tokens (the whole prompt in the model's "
        f"`{cfg.prompt}` format: its special tokens, the task description, filler, needle and "
        f"the {facts['question_len']}-token question), depths {list(cfg.depths)}, "
        f"{_count(cfg.trials, 'trial')} per cell ({_count(n_cells, 'trial')}, seed "
        f"{cfg.seed}); filler `{cfg.filler}`; budgets {list(cfg.budgets)}; answers of "
        f"{cfg.answer_tokens} greedy tokens; success: " + (
            "the first 5-digit number of the answer is the key" if cfg.kind == PASSKEY else
            f"RULER's {KINDS[cfg.kind].metric} is 1 (each expected value is in the answer; "
            f"`score_all`, `score_part`: RULER's two metrics per run in results.csv)"),
        *([f"- decode_recall: the prompt ends with a first, unrelated task (the protocols' "
           f"{facts['question_len']}-token question); each cache generates "
           f"{cfg.generate_tokens} tokens of its own, each joining under its policy as at "
           f"decode, then the recall question comes and the answer is scored. Per run, "
           f"`recall_retention` (results.csv) is the share of layer × KV head caches that "
           f"still hold the needle as the question starts (measured in the model, not "
           f"predicted) and `echo` whether the generated text repeats the value; the "
           f"prediction below is the prefill's selection only and cannot see an eviction "
           f"during the generation"] if cfg.generate_tokens else []),
        "- protocols: " + "; ".join(PROTOCOL_TEXT[p] for p in cfg.compress),
        "", "## The full-cache gate", "",
        f"The full cache's answers per cell (successes of trials). A cell where it answers "
        f"under {GATE:.0%} of its trials is no reference for a policy: it is flagged (✗) and "
        f"left out of the accuracy tables, the headline and the prediction metrics.", "",
        *gate_lines(cfg, cells), "", "## Accuracy", ""]
    if not acc:
        lines += ["No cell passes the gate: no accuracy is reported.", ""]
        return _closing(lines, figures)
    lines += ["Over the cells that pass the gate: accuracy over trials with its Wilson 95% "
              "interval, and the simulator's mean needle retention (share of layer × KV head "
              f"caches holding {HELD if cfg.kind == PASSKEY else KIND_HELD} when the answer "
              f"starts).", ""]
    full_acc = next(a for a in acc if a["policy"] == FULL)
    lines += [f"Full cache (the reference; a compressed cache may do better): {_pct(full_acc)} "
              f"of {_count(full_acc['trials'], 'trial')}.", ""]
    for protocol in cfg.compress:
        lines += [f"### {_label(protocol)}", "",
                  "| policy | " + " | ".join(f"B = {b}" for b in cfg.budgets) + " |",
                  "| --- |" + " ---: |" * len(cfg.budgets)]
        for label in _labels(cfg, protocol):
            cells = []
            for b in cfg.budgets:
                a = next(a for a in acc if a["policy"] == label and a["budget"] == b
                         and a["protocol"] == protocol)
                cells.append(f"{_pct(a)}, ret. {a['retention']:.2f}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Does the simulator predict the answer?", "",
              "Over the compressed runs (trial × policy × budget) of the gated cells, each "
              "predictor is computed from the full-cache attention without running the "
              "compressed model: " + "; ".join(f"`{k}`: {v}" for k, v in PREDICTORS.items())
              + f". AUC: the chance that a run that succeeds scores above one that fails "
              f"(0.5: no better than the base rate), with a 95% bootstrap interval over trials "
              f"({cfg.bootstrap} resamples); n/a where every run fails or every run succeeds. "
              f"Balanced accuracy (the base rate's: 0.50; n/a as the AUC) and "
              f"Brier score (lower is better; beside it the base rate's) are cross-validated "
              f"over trials in 5 folds: the threshold and a logistic calibration are fitted "
              f"on the other folds.", ""]
    head = "| protocol | runs | base rate | base Brier | " + " | ".join(
        f"{k} AUC | bal. acc. | Brier" for k in PREDICTORS) + " | lost ⇒ fails | retained ⇒ answered |"
    lines += [head, "| --- |" + " ---: |" * (head.count("|") - 2)]
    for q in quality:
        if not q["runs"]:
            continue
        lines.append(
            f"| {q['protocol']} | {q['runs']} | {100 * q['base_rate']:.1f}% | "
            f"{_number(q[next(iter(PREDICTORS))]['base_brier'], 3)} | "
            + " | ".join(f"{_interval(q[k]['auc'])} | {_number(q[k]['balanced_accuracy'], 2)} | "
                         f"{_number(q[k]['brier'], 3)}" for k in PREDICTORS)
            + f" | {_share(q['failed_if_lost'])} | {_share(q['answered_if_retained'])} |")
    return _closing(lines, figures)


def _closing(lines: list[str], figures: list[str]) -> str:
    lines = [*lines, *figure_lines(figures)]
    lines += ["", "Files: `results.csv` (one row per trial × policy × budget × protocol, with "
              "the answer and the prediction columns), `accuracy.csv` (the tables above), "
              "`task.json` (settings and facts).", ""]
    return "\n".join(lines)


# What a redraw needs, written before anything else (kept when the figures or text fail).
KEPT = ("results.csv", "accuracy.csv", "task.json")


def write_files(cfg: TaskConfig, rows: list[dict], facts: dict, folder: Path) -> None:
    """Every file of the report into ``folder`` (an empty temporary folder): first those of
    :data:`KEPT` (task.json then without the prediction), then the figures and text."""
    cells = gate(rows)
    kept = gated(rows, cells)
    acc = accuracy_rows(kept)
    write_csv(folder / "results.csv", rows)
    if acc:
        write_csv(folder / "accuracy.csv", acc)
    else:  # no cell passes the gate: the columns alone
        (folder / "accuracy.csv").write_text("protocol,policy,budget,trials,successes,accuracy,"
                                             "ci_low,ci_high,retention\n")
    info = {"settings": settings_of(cfg), "facts": facts,
            "gate": [{"length": n, "depth": d, **c} for (n, d), c in cells.items()]}
    task_json = folder / "task.json"
    task_json.write_text(json.dumps(info, indent=1, default=str) + "\n")
    quality = prediction_quality(kept, cfg.bootstrap, cfg.seed)
    figures = _figures(cfg, rows, cells, acc, folder)
    info["prediction"] = quality
    task_json.write_text(json.dumps(info, indent=1, default=str) + "\n")
    (folder / "report.md").write_text(markdown(cfg, rows, cells, acc, quality, facts,
                                               figures))
