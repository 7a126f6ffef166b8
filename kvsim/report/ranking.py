"""Figures of an experiment with many policies: a ranked policy x budget heatmap, and the
policies against budget in family small multiples (each family's in colour, the rest
grey). The over-heads means are over the heads (and layers) of one run: a ranking, not a
per-head story, which the per-head tables of report.md keep."""

from __future__ import annotations

import math
from collections import defaultdict

import matplotlib
import numpy as np
from matplotlib.colors import LogNorm, Normalize

from kvsim.policies import POLICIES
from kvsim.report.plotting import (Curves, Needs, budget_axis, draw_lines, figure, figure_title,
                                   grid, policy_markers, save)
from kvsim.report.stats import plural

MANY_POLICIES = 10  # more policies than this: these figures replace the per-head curves


def many(exp) -> bool:
    """Whether ``exp`` runs so many policies that per-head curves would tangle."""
    return len(exp.policies) > MANY_POLICIES and len(exp.budgets) > 1


def _means(rows: list[dict], metric: str) -> dict:
    """``{(policy, budget): mean}`` over heads, layers and seeds; NaN left out."""
    acc = defaultdict(list)
    for r in rows:
        if not math.isnan(r[metric]):
            acc[r["policy"], r["budget"]].append(r[metric])
    return {k: float(np.mean(v)) for k, v in acc.items()}


def _budgeted(exp) -> list[str]:
    return [p.label for p in exp.policies if p.kind != "full"]


@figure(Needs.DECODE | Needs.BUDGETS, by_default=many)
def policy_ranking(ctx, exp, rows, steps, colors, out):
    """Every policy's mass kept (and output error) at every budget, rows ranked by the
    mass at the focus budget: a heatmap with the values written in."""
    mass = _means(rows, "mass_mean")
    error = _means(rows, "error_mean")
    labels = [p for p in _budgeted(exp) if (p, exp.focus_budget) in mass]
    if not labels:
        return []
    labels.sort(key=lambda p: -mass[p, exp.focus_budget])
    panels = [("attention mass kept", mass, Normalize(0, 1), "viridis", "{:.2f}")]
    errors = [error[p, b] for p in labels for b in exp.budgets if (p, b) in error]
    if errors and min(errors) > 0:
        panels.append(("relative output error (log colour)", error,
                       LogNorm(min(errors), max(errors)), "magma_r", "{:.2g}"))
    fig, axes, layout = grid(len(panels), ctx, panel=(4.6, 0.3 * len(labels) + 0.6),
                             gap=(1.0, 0.8))
    # room for the policy names on the left and the last colorbar's ticks on the right
    layout.LEFT = 0.2 + 0.075 * max(len(p) for p in labels)
    layout.RIGHT = 0.9
    for k, (ax, (title, values, norm, cmap, fmt)) in enumerate(zip(axes, panels)):
        grid_values = np.array([[values.get((p, b), np.nan) for b in exp.budgets]
                                for p in labels])
        shown = ax.imshow(np.ma.masked_invalid(grid_values), aspect="auto", norm=norm,
                          cmap=matplotlib.colormaps[cmap].with_extremes(bad="white"))
        for (i, j), v in np.ndenumerate(grid_values):
            if np.isfinite(v):
                dark = norm(v) < 0.5 if cmap == "viridis" else norm(v) > 0.5
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=6.5,
                        color="white" if dark else "black")
        ax.set_xticks(range(len(exp.budgets)), [str(b) for b in exp.budgets])
        ax.set_yticks(range(len(labels)), labels if k == 0 else [])  # rows as in the first
        ax.set(title=title, xlabel="budget B (tokens)")
        fig.colorbar(shown, ax=ax, fraction=0.05, pad=0.02)
    full = [p.label for p in exp.policies if p.kind == "full"]
    layout.finish(fig, figure_title(ctx, exp, f"policies ranked by mass kept at "
                                    f"B = {exp.focus_budget}\nmean over "
                                    f"{plural(ctx.heads, 'head')}"
                                    + (f" x {plural(ctx.layers, 'layer')}" if ctx.layers > 1
                                       else "") + f" and {plural(len(ctx.seeds), 'seed')}"
                                    + (f"; {', '.join(full)} (mass 1) not drawn" if full
                                       else "")))
    return save(fig, out, f"{exp.name}_policy_ranking", ctx)


def _family(label: str, kinds: dict) -> str:
    kind = kinds[label]
    return POLICIES[kind].presentation.family if kind in POLICIES else kind


@figure(Needs.DECODE | Needs.BUDGETS, by_default=many)
def policy_families(ctx, exp, rows, steps, colors, out):
    """Mass kept against budget, a panel per policy family: its policies in colour, every
    other policy grey (mean over heads, layers and seeds)."""
    mass = _means(rows, "mass_mean")
    kinds = {p.label: p.kind for p in exp.policies}
    labels = [p for p in _budgeted(exp) if any((p, b) in mass for b in exp.budgets)]
    families = list(dict.fromkeys(_family(p, kinds) for p in labels))
    if not labels:
        return []
    loss = ctx.loss if ctx.loss is not None else any(v > 0.9 for v in mass.values())
    fig, axes, layout = grid(len(families), ctx, panel=(3.3, 2.4))
    curves = Curves()
    for ax, family in zip(axes, families):
        for label in labels:
            budgets = [b for b in exp.budgets if (label, b) in mass]
            y = np.array([mass[label, b] for b in budgets])
            y = 1.0 - y if loss else y
            if _family(label, kinds) == family:
                curves.add(family, label, budgets, y)
            else:
                ax.plot(budgets, y, color="0.8", lw=0.8, zorder=1)
    # a family's curves that coincide are drawn dashed over each other, and say so
    handles, names = draw_lines(dict(zip(families, axes)), curves, colors,
                                policy_markers(exp), log=loss)
    for ax, family in zip(axes, families):
        budget_axis(ax, exp.budgets, loss)
        ax.set(title=family, xlabel="budget B (log2 axis)",
               ylabel="mass lost, 1 - mass (log)" if loss else "attention mass kept")
    layout.finish(fig, figure_title(ctx, exp, "policies against budget by family (grey: "
                                    "the other families)\nmean over heads"
                                    + (" and layers" if ctx.layers > 1 else "")
                                    + f" and {plural(len(ctx.seeds), 'seed')}"),
                  handles, names)
    return save(fig, out, f"{exp.name}_policy_families", ctx)
