"""Protocols at equal memory: attention mass against the mean cache size each run held.

Under a threshold the cache size is an outcome, not a budget: runs compare by the mass
they keep against the keys they held on average. A series is a policy label across its
budgets (per-step top-k, batched, paged runs), or one policy kind under a threshold
across its threshold values (one label each), joined in order of mean size.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from kvsim.report.figures import _loss_scale
from matplotlib.lines import Line2D

from kvsim.report.palette import markers
from kvsim.report.plotting import (FigureContext, Target, color_map, figure_title, grid,
                                   head_label, log_axis, save)
from kvsim.report.stats import plural
from kvsim.scenario.load import Experiment, Scenario

THRESHOLD = "threshold"


def applies(scenario: Scenario, exp: Experiment) -> bool:
    """Whether the experiment runs a threshold (its size an outcome) with decode steps."""
    return exp.prompt_len < scenario.T and any(
        p.params.get(THRESHOLD) is not None for p in exp.policies)


def _series(row: dict) -> str:
    return f"{row['kind']} (threshold)" if row["protocol"].startswith(THRESHOLD) else row["policy"]


def points(rows: list[dict]) -> dict:
    """``{head: {series: (mean sizes, masses)}}``, each point a mean over seeds, ascending
    in size."""
    acc: dict = defaultdict(list)
    for r in rows:  # a threshold ignores the budget: one point per label
        budget = None if r["protocol"].startswith(THRESHOLD) else r["budget"]
        acc[r["head"], _series(r), r["policy"], budget].append((r["mean_size"], r["mass_mean"]))
    out: dict = defaultdict(lambda: defaultdict(list))
    for (head, series, _, _), values in acc.items():
        out[head][series].append(tuple(np.mean(values, axis=0)))
    return {h: {s: tuple(np.array(v) for v in zip(*sorted(pts))) for s, pts in per.items()}
            for h, per in out.items()}


def _differences(rows: list[dict]) -> dict:
    """``{kind: (differences, threshold points)}``: each threshold point's mass minus the
    kind's first per-step series interpolated at its mean size, for the points inside the
    sizes the top-k runs held (the others are left out), and how many points there were."""
    topk: dict = {}
    for r in rows:
        if r["protocol"] == "per_step":
            topk.setdefault(r["kind"], r["policy"])
    out: dict = defaultdict(lambda: ([], [0]))
    for per in points(rows).values():
        for kind, label in topk.items():
            if f"{kind} (threshold)" in per and label in per:
                (x, y), (bx, by) = per[f"{kind} (threshold)"], per[label]
                inside = (x >= bx.min()) & (x <= bx.max())
                out[kind][0].extend(y[inside] - np.interp(x[inside], bx, by))
                out[kind][1][0] += x.size
    return {k: (v, n[0]) for k, (v, n) in out.items()}


def gaps(rows: list[dict]) -> dict:
    """``{kind: mean over heads and threshold points of mass(threshold) - mass(top-k)}`` at
    equal mean size (see :func:`_differences`), for the kinds with a point inside."""
    return {k: float(np.mean(v)) for k, (v, _) in _differences(rows).items() if v}


def section(scenario: Scenario, exp: Experiment, rows: list[dict], steps) -> list[str]:
    """A sentence on thresholds against top-k at equal mean size, and how to read the figure."""
    found = gaps(rows)
    counted = _differences(rows)
    heads = len({r["head"] for r in rows})
    lines = [f"#### Thresholds against top-k at equal mean size (`{exp.name}`)", ""]
    if found:
        lines.append("At equal mean cache size (the per-step top-k mass interpolated at each "
                     "threshold run's mean size, mean over "
                     f"{plural(heads, 'head')}): " + "; ".join(
                         f"`{k}` under a threshold keeps {v:+.3f} of the attention mass against "
                         f"its top-k ({len(counted[k][0])} of {counted[k][1]} (head, threshold) "
                         f"points within the sizes its top-k runs held; the others left out)"
                         for k, v in sorted(found.items())) + ".")
    else:
        lines.append("No threshold run's mean size falls within the sizes its policy's top-k "
                     "runs held, so none is compared at equal size.")
    lines += ["", "Under a threshold the cache size is an outcome: each point is one run at its "
              "mean cache size per KV head (keys, the incoming one counted); a threshold "
              "series joins the thresholds of one policy, a top-k series its budgets. "
              "kvsim judges a key as it leaves the threshold window (DMSPress scores it "
              "when it arrives).", ""]
    return lines


def figures(ctx: FigureContext, exp: Experiment, rows: list[dict], steps, out: Target) -> list:
    """Mass (or mass lost) against mean cache size, one panel per head."""
    per_head = points(rows)
    heads = sorted(per_head)
    series = list(dict.fromkeys(s for h in heads for s in per_head[h]))
    colors = color_map(series)
    marks = markers(series)
    loss = _loss_scale(v for h in heads for _, y in per_head[h].values() for v in y)
    fig, axes, layout = grid(len(heads), ctx)
    for ax, h in zip(axes, heads):  # series differ in their x: drawn as they are
        for s, (x, y) in per_head[h].items():
            ax.plot(x, 1.0 - y if loss else y, color=colors[s], marker=marks[s], ms=4.5,
                    lw=1.3, ls="--" if s.endswith("(threshold)") else "-")
    handles = [Line2D([], [], color=colors[s], marker=marks[s], ms=4.5,
                      ls="--" if s.endswith("(threshold)") else "-") for s in series]
    labels = series
    for ax, h in zip(axes, heads):
        ax.set_title(head_label(ctx, h))
        ax.set_xlabel("mean cache size per KV head (keys)")
        ax.set_xscale("log", base=2)
        if loss:
            log_axis(ax)
            ax.set_ylabel("mass lost, 1 - mass (log)")
        else:
            ax.set_ylim(0, 1.03)
            ax.set_ylabel("attention mass kept")
        ax.grid(True, alpha=0.3)
    seeds = "one seed" if len(ctx.seeds) == 1 else f"mean over {plural(len(ctx.seeds), 'seed')}"
    layout.finish(fig, figure_title(ctx, exp, "mass against the mean cache size held\n"
                                    f"(per point: {seeds}; threshold series join thresholds, "
                                    "top-k series budgets)"), handles, labels)
    return save(fig, out, f"{exp.name}_mass_vs_mean_size", ctx)
