"""The closed-loop report folder: report.md, results.csv, steps.csv, predictors.csv,
closed_loop.json and two figures, written atomically (a temporary folder renamed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError
from kvsim.report.lock import replace_folder
from kvsim.report.stats import COINCIDE_TOL, twins
from kvsim.tools.closed_loop import metrics
from kvsim.tools.closed_loop.metrics import gaps_from_best
from kvsim.tools.closed_loop.config import ClosedLoopConfig, saved_settings
from kvsim.tools.closed_loop.run import FULL, Series
from kvsim.tools.study.report import (cache_words, figure_lines, layer_words, machine_words,
                                      read_csv, redrawn_lines, version_lines,
                                      write_csv)

TARGETS = {"kl": "closed-loop KL", "delta_nll": "closed-loop ΔNLL"}
NAMES = {"mass_mean": "mean mass", "mass_min": "minimum mass (over steps)",
         "mass_p10": "10th-percentile mass (over steps)",
         "mass_layer_weighted": "mass weighted by layer", "output_error": "output error",
         "neg_log_mass": "KL of renormalised attention (-log mass)"}


def result_rows(series: list[Series]) -> list[dict]:
    """One row per policy and budget (the full-cache reference first)."""
    ref = series[0]
    has = np.isfinite(ref.nll)
    rows = []
    for s in series:
        rows.append({"policy": s.label, "kind": s.kind, "budget": s.budget,
                     "kl": float(s.kl.mean()),
                     "delta_nll": float(s.nll[has].mean() - ref.nll[has].mean()),
                     "nll": float(s.nll[has].mean()), **s.open})
    return rows


def within_budget_rho(rows: list[dict], predictor: str, target: str) -> float:
    """Mean over budgets of the Spearman rho across policies at that budget."""
    sign = metrics.PREDICTORS[predictor]
    rhos = []
    for b in sorted({r["budget"] for r in rows}):
        at = [r for r in rows if r["budget"] == b]
        if len(at) > 2:
            x = sign * np.array([r[predictor] for r in at])
            rhos.append(float(metrics._rowwise_spearman(x, np.array([r[target] for r in at]))))
    return float(np.nanmean(rhos)) if rhos else float("nan")


def _verdict(rho: float, within: float) -> str:
    """What ``rho`` over every run and ``within`` (the mean rho across policies at one
    budget) mean for trusting the simulator."""
    if rho >= 0.9 and within >= 0.9:
        return ("the simulator's open-loop numbers order what eviction costs this model almost "
                "exactly, across budgets and between policies at one budget alike")
    if rho >= 0.7:
        return (f"the simulator orders budgets and clearly different policies reliably, but "
                f"between policies at one budget ρ is only {within:.2f} on average, so close "
                f"calls deserve a closed-loop check")
    return ("the open-loop numbers are a weak guide to this model's loss: rank policies in "
            "the closed loop, not by mass alone")


def _interval(r: dict) -> str:
    return f"ρ = {r['rho']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"


def headline(gaps: list[dict], n: int, within: float) -> str:
    """The report's first sentence: the open-loop metrics that predict the model's KL best.
    ``gaps``: every metric against KL, best first, with its ρ's paired-bootstrap difference
    from the best's (:func:`~kvsim.tools.closed_loop.metrics.gaps_from_best`). Every metric
    whose difference is not clear of 0 is named beside the best; a single best only when
    it is clear of every other."""
    best = gaps[0]
    leading = [r for r in gaps if r["gap_low"] <= 0.0]
    if len(leading) == 1:
        text = (f"Across {n} policy × budget runs, the open-loop metric that best predicts the "
                f"model's own next-token KL is **{NAMES[best['predictor']]}** (Spearman "
                f"{_interval(best)}, 95% bootstrap CI; a paired bootstrap puts its ρ above "
                f"every other metric's)")
    else:
        text = (f"Across {n} policy × budget runs, {len(leading)} of the {len(gaps)} "
                f"open-loop metrics predict the model's own next-token KL about equally well "
                f"(Spearman ρ with 95% bootstrap CI; a paired bootstrap of each ρ's "
                f"difference from the highest reaches 0): "
                + "; ".join(f"**{NAMES[r['predictor']]}** {_interval(r)}" for r in leading))
    mean = next(r for r in gaps if r["predictor"] == "mass_mean")
    if mean not in leading:
        text += f"; plain mean mass has {_interval(mean)}"
    return f"{text}: {_verdict(best['rho'], within)}."


def _scatter_twins(labels: list[str], rows: list[dict]) -> dict[str, tuple[str, bool]]:
    """The policies of the mass-vs-KL scatter that cannot be told from an earlier one on its
    log axes (:func:`~kvsim.report.stats.twins` over each run's log missing mass and log
    KL, the tolerance grown with the decades the axes span)."""
    points = {lab: [(1.0 - r["mass_mean"], r["kl"]) for r in rows if r["policy"] == lab]
              for lab in labels}
    points = {lab: np.log10(np.maximum(np.array(p, float), 1e-300)).T  # (2, budgets)
              for lab, p in points.items() if p and all(x > 0.0 for x, _ in p)}
    if not points:
        return {}
    every = np.concatenate(list(points.values()), axis=1)
    decades = max(1.0, float((every.max(axis=1) - every.min(axis=1)).max()))
    return twins({lab: p.ravel() for lab, p in points.items()}, COINCIDE_TOL * decades)


def _figures(cfg: ClosedLoopConfig, series: list[Series], rows: list[dict], folder: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(s.label for s in series[1:]))
    from kvsim.report.plotting import color_map  # each policy's colour in every report
    colors = color_map(labels)
    paths = []
    budgets = sorted({r["budget"] for r in rows if r["mass_mean"] < 1.0})
    markers = dict(zip(budgets, "osD^vP*Xph<>"))
    columns = max(1, min(3, -(-len(labels) // 6)))  # the legend's, below the axes
    rows_below = -(-(len(labels) + 3) // columns) + 1  # policies, budgets and the title
    fig, (ax, below) = plt.subplots(2, 1, figsize=(7, 5 + 0.19 * rows_below),
                                    height_ratios=(5, 0.19 * rows_below))
    below.axis("off")
    twin = _scatter_twins(labels, rows)
    for lab in labels:
        pts = [r for r in rows if r["policy"] == lab]
        if all(r["mass_mean"] >= 1.0 for r in pts):  # every key kept (a KIVI full cache)
            for r in pts:
                ax.axhline(r["kl"], color=colors[lab], ls="--", lw=0.8,
                           label=f"{lab} (mass 1)")
            continue
        other, exact = twin.get(lab, (None, False))
        shown = lab if other is None else f"{lab} ({'=' if exact else '≈'} {other})"
        ax.plot([1.0 - r["mass_mean"] for r in pts], [r["kl"] for r in pts],
                "-" if other is None else "--", color=colors[lab], label=shown, lw=0.8)
        for r in pts:  # a twin's markers hollow, so that the one beneath shows
            ax.plot(1.0 - r["mass_mean"], r["kl"], markers.get(r["budget"], "o"),
                    color=colors[lab], ms=5, mec=colors[lab] if other else "white",
                    mew=1.0 if other else 0.5, mfc="none" if other else colors[lab])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("open-loop missing mass, 1 − mean mass (simulator, full-cache attention; "
                  "log scale)")
    ax.set_ylabel("closed-loop KL per step (nats, log scale)")
    ax.set_title(f"{cfg.name}: the simulator's missing mass vs the model's own KL", fontsize=9)
    # Below the axes, as every report figure's (the figure standard): none covers a point.
    from matplotlib.lines import Line2D
    handles, names = ax.get_legend_handles_labels()
    handles += [Line2D([], [], ls="", marker=markers[b], color="0.3") for b in budgets]
    names += [f"budget {b}" for b in budgets]
    below.legend(handles, names, fontsize=7, ncol=columns, loc="upper center",
                 title="policy (line) and budget (marker)", title_fontsize=7, frameon=False)
    ax.grid(alpha=0.3, which="both")
    paths += _save(fig, folder, "scatter_mass_vs_kl", cfg)
    steps = np.arange(cfg.prompt_len, cfg.tokens)
    window = 16
    at_focus = [s for s in series[1:] if s.budget == cfg.focus_budget]
    smooth = {s.label: np.maximum(moving_mean(s.kl, window), 1e-12) for s in at_focus}
    cols = min(3, len(at_focus))
    rows_n = -(-len(at_focus) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols, 2.3 * rows_n + 0.6),
                             sharex=True, sharey=True, squeeze=False)
    for ax, s in zip(axes.flat, at_focus):  # small multiples: one policy over the others
        for other in at_focus:
            if other.label != s.label:
                ax.plot(steps, smooth[other.label], color="0.8", lw=0.6)
        ax.plot(steps, smooth[s.label], color=colors[s.label], lw=1.2)
        ax.set_title(s.label, fontsize=9)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.tick_params(labelsize=7)
    for ax in axes.flat[len(at_focus):]:
        ax.axis("off")
    for c in range(cols):  # the lowest panel of each column carries the step axis
        ax = axes[(len(at_focus) - 1 - c) // cols, c]
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.set_xlabel("decode step t", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("KL per step", fontsize=8)
    fig.suptitle(f"{cfg.name}: closed-loop KL over decode steps at budget {cfg.focus_budget}\n"
                 f"(centred moving mean over {window} steps, log scale; grey: the other "
                 f"policies)", fontsize=9)
    paths += _save(fig, folder, "kl_over_steps", cfg)
    return paths


def moving_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Centred moving mean of ``x`` over ``window`` points, averaging only the points that
    exist (near the ends the window is cut, never padded with zeros)."""
    total = np.concatenate(([0.0], np.cumsum(x, dtype=np.float64)))
    i = np.arange(x.shape[0])
    lo = np.maximum(0, i - window // 2)
    hi = np.minimum(x.shape[0], i - window // 2 + window)
    return (total[hi] - total[lo]) / (hi - lo)


def _save(fig, folder: Path, stem: str, cfg: ClosedLoopConfig) -> list[str]:
    import matplotlib.pyplot as plt

    names = []
    fig.tight_layout()
    for fmt in cfg.formats:
        fig.savefig(folder / f"{stem}.{fmt}", dpi=cfg.dpi,
                    metadata={"Software": None} if fmt == "png" else None)
        names.append(f"{stem}.{fmt}")
    plt.close(fig)
    return names


def _fmt(x: float) -> str:
    return "n/a" if not np.isfinite(x) else (f"{x:.2e}" if 0 < abs(x) < 1e-3 else f"{x:.4f}")


def _markdown(cfg: ClosedLoopConfig, rows: list[dict], ranks: list[dict], facts: dict,
              figures: list[str]) -> str:
    policy_rows = [r for r in rows if r["policy"] != FULL]
    kl_ranks = gaps_from_best(policy_rows, [r for r in ranks if r["target"] == "kl"],
                              cfg.bootstrap, cfg.seed)
    best = kl_ranks[0]
    n = len(policy_rows)
    within = within_budget_rho(policy_rows, best["predictor"], "kl")
    lines = [f"# Closed loop: {cfg.name}", "", headline(kl_ranks, n, within)]
    lines += ["", f"{cfg.description}".strip(), ""] if cfg.description else [""]
    lines += [
        *version_lines(facts),
        *redrawn_lines(facts, "results.csv and steps.csv", "the runs"),
        f"- Model: `{cfg.model.name}`{f' (`{cfg.gguf_file}`)' if cfg.gguf_file else ''}, "
        f"{layer_words(facts)}, {facts['heads']} query heads sharing {facts['kv_heads']} "
        f"KV head{'s' if facts['kv_heads'] > 1 else ''}; text: `{cfg.text.name}` "
        f"(SHA-256 `{facts['text_sha256'][:16]}…`), first "
        f"T = {cfg.tokens} tokens, prompt P = {cfg.prompt_len}, {cfg.tokens - cfg.prompt_len} "
        f"decode steps teacher-forced."
        + (f" Weights licence: {facts['licence']}." if facts.get("licence")
           else ""),
        f"- {cache_words(facts)} (GQA `{cfg.gqa}`); prefill is full attention, then each policy "
        f"compresses and decodes.",
        f"- Full-cache reference decoded the same way: mean KL {_fmt(rows[0]['kl'])} per step "
        f"(numerical floor: float32 attention over the whole cache versus the full prefill "
        f"pass), NLL {rows[0]['nll']:.4f} nats per token.",
        f"- Wall time: "
        f"{machine_words(facts, f'model load, full run, open loop, {n} closed-loop runs')}.",
        "", "## Which open-loop metric predicts the model?", "",
        "Spearman ρ between each open-loop metric (oriented so that larger predicts more "
        "damage) and the closed-loop mean KL or ΔNLL, over every policy × budget run; 95% "
        f"percentile bootstrap interval from {cfg.bootstrap} resamples of the runs. "
        "*Below the best*: how far each metric's ρ vs KL falls below the highest, with the "
        "95% interval of a paired bootstrap (the same resamples for both; an interval "
        "reaching 0 cannot tell the two apart). "
        "*Within budgets*: the mean over budgets of ρ across policies at equal memory "
        "(budget alone drives much of the overall ρ).", "",
        "| open-loop metric | ρ vs KL [95% CI] | below the best [95% CI] | within budgets "
        "| ρ vs ΔNLL [95% CI] |",
        "| --- | --- | --- | --- | --- |"]
    by = {(r["predictor"], r["target"]): r for r in ranks}
    for r in kl_ranks:
        d = by[r["predictor"], "delta_nll"]
        gap = "—" if r is best else \
            f"{r['gap']:.3f} [{r['gap_low']:.3f}, {r['gap_high']:.3f}]"
        lines.append(
            f"| {NAMES[r['predictor']]} | {r['rho']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] "
            f"| {gap} | {_fmt(within_budget_rho(policy_rows, r['predictor'], 'kl'))} "
            f"| {d['rho']:.3f} [{d['ci_low']:.3f}, {d['ci_high']:.3f}] |")
    lines += ["", "## Policy × budget", "",
              "Open loop: the simulator on the full-cache run's attention (mean over the "
              "layers policies compress, "
              "query heads and decode steps). Closed loop: mean over decode steps of the KL of "
              "the next-token distribution from the full-cache one, and the change of mean NLL "
              "of the true next token (nats)." + (
                  " kvpress's presses, " + ", ".join(f"{p.label} (`{p.kind}`)"
                                                     for p in cfg.presses)
                  + ", run under kvpress's protocol: the prompt compressed once to the budget "
                  "in kvpress's own prefill, then no eviction, so at step t they hold B + t "
                  "- P + 1 keys, more than a policy at the same budget; their open loop is "
                  "that cache on the full-cache run's attention." if cfg.presses else ""), "",
              "| policy | budget | open-loop mass | min mass | output error | closed-loop KL "
              "| ΔNLL |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in policy_rows:
        lines.append(f"| {r['policy']} | {r['budget']} | {r['mass_mean']:.4f} | "
                     f"{r['mass_min']:.4f} | {r['output_error']:.4f} | {_fmt(r['kl'])} | "
                     f"{r['delta_nll']:+.4f} |")
    lines += figure_lines(figures)
    lines += ["", "Files: `results.csv` (this table, every metric), `steps.csv` (per decode "
              "step: KL, NLL, open-loop mass), `predictors.csv` (ρ and intervals), "
              "`closed_loop.json` (settings, layer weights, wall time).", ""]
    return "\n".join(lines)


# The numbers of the run, written before anything else (kept when the figures or text fail).
KEPT = ("results.csv", "steps.csv", "closed_loop.json")


def write_report(cfg: ClosedLoopConfig, series: list[Series], facts: dict, out: Path) -> Path:
    """Write the report folder ``out`` in one rename (the caller checked that it may); if
    the predictors, figures or text fail, ``out`` holds the files of :data:`KEPT` alone."""
    replace_folder(out, lambda tmp: _write_files(cfg, series, facts, tmp), keep=KEPT,
                   advice=f": draw the report from them with `python -m kvsim closed-loop "
                          f"{cfg.path} --out {out} --redraw`")
    return out


def read_series(folder: Path) -> list[Series]:
    """The runs of a closed-loop report folder, as its run gave them, from its results.csv
    (each run's open-loop metrics) and steps.csv (its closed-loop KL and NLL and open-loop
    mass per decode step): written again, they give the same files."""
    rows = read_csv(folder / "results.csv", {"policy": str, "kind": str, "budget": int}, float)
    steps = read_csv(folder / "steps.csv", {"policy": str, "budget": int, "t": int}, float)
    if not rows or list(rows[0])[:6] != ["policy", "kind", "budget", "kl", "delta_nll", "nll"] \
            or not steps or list(steps[0]) != ["policy", "budget", "t", "kl", "nll", "open_mass"]:
        raise ValueError("expected the columns of a closed-loop report")
    per_run: dict = {}
    for step in steps:
        per_run.setdefault((step["policy"], step["budget"]), []).append(step)
    series = []
    for r in rows:
        run = per_run[r["policy"], r["budget"]]
        series.append(Series(r["policy"], r["kind"], r["budget"],
                             np.array([s["kl"] for s in run]), np.array([s["nll"] for s in run]),
                             np.array([s["open_mass"] for s in run]),
                             {k: v for k, v in list(r.items())[6:]}))
    return series


def redraw(cfg: ClosedLoopConfig, out: Path, facts: dict, tmp: Path) -> None:
    """The report anew into ``tmp`` from the files of ``out``, without the model."""
    try:
        series = read_series(out)
    except (ValueError, KeyError) as exc:
        raise KvsimError(f"{out}: {exc}") from None
    _write_files(cfg, series, facts, tmp)


def _write_files(cfg: ClosedLoopConfig, series: list[Series], facts: dict, tmp: Path) -> None:
    rows = result_rows(series)
    write_csv(tmp / "results.csv", rows)
    steps = [{"policy": s.label, "budget": s.budget, "t": cfg.prompt_len + i,
              "kl": float(s.kl[i]), "nll": float(s.nll[i]), "open_mass": float(s.mass[i])}
             for s in series for i in range(s.kl.shape[0])]
    write_csv(tmp / "steps.csv", steps)
    info = {"settings": saved_settings(cfg), **{k: v for k, v in facts.items() if k != "token_ids"},
            "token_ids_sha256": facts["token_ids_sha256"]}
    (tmp / "closed_loop.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
    policy_rows = [r for r in rows if r["policy"] != FULL]
    ranks = [r for target in TARGETS for r in
             metrics.rank_predictors(policy_rows, target, cfg.bootstrap, cfg.seed)]
    write_csv(tmp / "predictors.csv", ranks)
    figures = _figures(cfg, series, rows, tmp)
    (tmp / "report.md").write_text(_markdown(cfg, rows, ranks, facts, figures))
