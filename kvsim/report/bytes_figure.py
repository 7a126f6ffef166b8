"""Evict or quantise, at equal bytes: mass and output error against the cache's bytes,
one line per (experiment, policy), drawn when a scenario has a quantised experiment."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, NullFormatter

from kvsim.report.figures import CROWDED
from kvsim.report.palette import markers
from kvsim.report.plotting import FigureContext, Target, color_map, grid, log_axis, save
from kvsim.scenario.load import Experiment, Scenario

STYLES = ("-", "--", ":", "-.")


def storage_label(exp) -> str:
    """``16-bit`` or ``KIVI 2-bit`` (group, residual)."""
    q = exp.quantize
    return "16-bit" if q is None else f"KIVI {q.bits}-bit (G {q.group}, R {q.residual})"


def curves(rows: list[dict]) -> dict:
    """``{(experiment, policy): [(bytes, mass, error), ...]}`` by budget, each the mean over
    seeds, layers and heads; rows without bytes left out."""
    acc = defaultdict(list)
    for r in rows:
        if np.isfinite(r.get("bytes_mean", np.nan)):
            acc[r["experiment"], r["policy"], r["budget"]].append(
                (r["bytes_mean"], r["mass_mean"], r["error_mean"]))
    out = defaultdict(list)
    for (exp, policy, budget), values in acc.items():
        out[exp, policy].append(tuple(np.mean(values, axis=0)))
    return {k: sorted(set(v)) for k, v in out.items()}


def mass_vs_bytes(ctx: FigureContext, rows: list[dict], out: Target) -> list[Path]:
    """Two panels against the bytes of a KV head's cache (log axis): the mass kept (``1 -
    mass`` on a log axis when masses crowd near 1) and the output error (log)."""
    if not any(e.quantize for e in ctx.experiments):
        return []
    lines = curves(rows)
    if not lines:
        return []
    exps = [e for e in ctx.experiments if any(k[0] == e.name for k in lines)]
    style = {e.name: STYLES[i % len(STYLES)] for i, e in enumerate(exps)}
    policies = list(dict.fromkeys(k[1] for k in lines))
    colors = color_map(policies)
    marks = markers(policies)
    loss = any(m > CROWDED for (e, p), pts in lines.items() for _, m, _ in pts
               if not (p == "full" and e in _exact(ctx.experiments)))
    fig, axes, layout = grid(2, ctx, panel=(4.2, 3.0))
    bits = {e.name: e.quantize.bits for e in exps if e.quantize}
    for (exp, policy), pts in lines.items():
        b, m, err = (np.array(x) for x in zip(*pts))
        b = b / 1024
        exact_full = policy == "full" and exp in _exact(ctx.experiments)
        kw = dict(color=colors[policy], ls=style[exp], marker=marks[policy], lw=1.3, ms=4)
        if exact_full:  # 16-bit full: mass 1 and rounding-level error, named instead
            continue
        for ax, y in zip(axes, (1.0 - m if loss else m, err)):
            ax.plot(b, y, **kw)
            if len(b) == 1 and exp in bits:  # a single point (full): name its storage
                ax.annotate(f"{bits[exp]}-bit", (b[0], y[0]), xytext=(4, 3),
                            textcoords="offset points", fontsize=7)
    kib = [x / 1024 for pts in lines.values() for x, _, _ in pts]
    ticks = [2.0 ** k for k in range(int(np.floor(np.log2(min(kib)))),
                                      int(np.ceil(np.log2(max(kib)))) + 1)]
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("KiB of a KV head's keys and values (mean over steps, log2 axis)")
        ax.grid(True, alpha=0.3)
    if loss:
        log_axis(axes[0])
    else:
        axes[0].set_ylim(0, 1.03)
    # Not one measure: eviction keeps a share of the attention; under KIVI every key stays
    # and the "mass" is exp(-KL) of the quantised attention. The panel says so.
    what = "16-bit: mass kept; KIVI: exp(-KL), another measure"
    axes[0].set(title=what.replace("mass kept", "mass lost").replace("exp(-KL)",
                                                                      "1 - exp(-KL)")
                if loss else what,
                ylabel="1 - mass or 1 - exp(-KL) (log)" if loss else "mass or exp(-KL)")
    log_axis(axes[1])
    axes[1].set(title="relative output error (the measure both share)",
                ylabel="|o~ - o| / |o| (log)")
    handles = [Line2D([], [], color=colors[p], marker=marks[p], lw=1.3) for p in policies]
    labels = list(policies)
    handles += [Line2D([], [], color="0.3", ls=style[e.name]) for e in exps]
    labels += [f"{e.name}: {storage_label(e)}" for e in exps]
    exact = [e for e in exps if e.quantize is None]
    note = "; full at 16 bits (mass 1) not drawn" if exact else ""
    layout.finish(fig, f"{ctx.name}: evict or quantise, at equal bytes\nmean over "
                       f"steps, layers, heads and seeds; one point per budget{note}",
                  handles, labels)
    return save(fig, out, "mass_vs_bytes", ctx)


def _exact(experiments: tuple[Experiment, ...]) -> set[str]:
    return {e.name for e in experiments if e.quantize is None}


def summary_lines(scenario: Scenario, rows: list[dict]) -> list[str]:
    """For each quantised experiment's ``full`` run: its bytes and output error (the
    measure both storages share) beside the lowest output error any 16-bit evicting run
    reaches within those bytes; its exp(-KL) and the eviction's kept mass are given apart,
    named as the different measures they are."""
    lines = curves(rows)
    exact = _exact(scenario.experiments)
    out = []
    for exp in scenario.experiments:
        if exp.quantize is None or not exact:
            continue
        for (name, policy), pts in lines.items():
            if name != exp.name or policy != "full":
                continue
            b, m, err = pts[0]
            rivals = [(ee, e, p, bb, mm) for (e, p), ps in lines.items() if e in exact
                      and p != "full" for bb, mm, ee in ps if bb <= b and np.isfinite(ee)]
            text = (f"- `{exp.name}` ({storage_label(exp)}), every token kept: "
                    f"{b / 1024:.1f} KiB per KV head, output error {err:.3f}")
            if rivals:
                ee, e, p, bb, mm = min(rivals)
                verdict = "lower" if ee < err else "higher"
                text += (f"; the 16-bit eviction with the lowest output error within those "
                         f"bytes, `{p}` in `{e}` at {bb / 1024:.1f} KiB, has a {verdict} one: "
                         f"{ee:.3f}")
                text += (f". Mass is not comparable across the two: KIVI's {m:.4f} is "
                         f"exp(-KL) of its quantised attention, the eviction's {mm:.4f} the "
                         f"attention mass it keeps")
            out.append(text + ".")
    if out:
        out.insert(0, "**Evict or quantise at equal bytes** (output error |o~ - o| / |o|, "
                      "mean over steps, layers, heads and seeds; lower is better):")
    return out + [""] if out else []
