"""The opening sentence of a report that compares protocols: how much attention mass each
protocol costs against per-step eviction at equal peak memory."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
from matplotlib.lines import Line2D

from kvsim.report.palette import markers
from kvsim.report.plotting import color_map, grid, save

CONVENTION = ("Memory is counted per KV head in keys, protected ones (recent tokens, sinks, "
              "windows, pinned keys) included: `peak_size` and `mean_size` in `results.csv` are "
              "the largest and mean cache over the decode steps, the incoming key counted, and "
              "`effective_ratio` is the peak over the T tokens seen.")


def deltas(rows: list[dict]) -> dict:
    """``{(protocol, peak): {kind: {(head, seed): mass(protocol) - mass(per-step)}}}`` at
    equal peak memory: each head's and seed's mass under a protocol other than per-step
    eviction against the same policy kind per step at the same peak (means over layers).
    Per seed: an outcome that differs between seeds (a needle kept or lost) stays apart."""
    acc: dict = defaultdict(list)
    for r in rows:
        if "protocol" in r and not math.isnan(r["mass_mean"]):
            acc[r["kind"], r["protocol"], r["peak_size"], (r["head"], r["seed"])].append(
                r["mass_mean"])
    out: dict = defaultdict(lambda: defaultdict(dict))
    for (kind, protocol, peak, unit), masses in sorted(acc.items()):
        base = acc.get((kind, "per_step", peak, unit))
        if protocol != "per_step" and base:
            out[protocol, peak][kind][unit] = float(np.mean(masses) - np.mean(base))
    return out


def unmatched(rows: list[dict]) -> dict:
    """``{protocol: sorted peaks}`` of the protocols (thresholds aside: their size is an
    outcome) that :func:`deltas` cannot compare: no per-step run of the same policy holds
    their peak memory."""
    base = {(r["kind"], r["peak_size"]) for r in rows if r.get("protocol") == "per_step"}
    out: dict = defaultdict(set)
    for r in rows:
        protocol = r.get("protocol")
        if protocol and protocol != "per_step" and not protocol.startswith("threshold") \
                and (r["kind"], r["peak_size"]) not in base:
            out[protocol].add(r["peak_size"])
    return {p: sorted(peaks) for p, peaks in sorted(out.items())}


def lines(rows: list[dict]) -> list[str]:
    """A table of the mass each protocol changes against per-step eviction of the same
    policy at the same peak, a column per protocol and a row per policy (the mean over
    heads and seeds, and in how many of them it is negative), if ``rows`` hold such pairs; else
    nothing. Per policy, never averaged over policies whose changes differ in sign."""
    found = deltas(rows)
    if not found:
        return []
    columns = sorted(found)
    kinds = sorted({k for per in found.values() for k in per})
    body, losses, pairs = [], 0, 0
    for kind in kinds:
        cells = []
        for col in columns:
            per_head = found[col].get(kind)
            if not per_head:
                cells.append("")
                continue
            mean = float(np.mean(list(per_head.values())))
            below = sum(v < 0 for v in per_head.values())
            cells.append(f"{mean:+.3f} ({below} of {len(per_head)} below 0, "
                         f"{min(per_head.values()):+.3f} to {max(per_head.values()):+.3f})")
            pairs += 1
            losses += mean < 0
        body.append([f"`{kind}`", *cells])
    header = ["policy", *(f"`{p}`, peak {peak}" for p, peak in columns)]
    seeds = len({u[1] for per in found.values() for d in per.values() for u in d})
    what = "heads" + (" and seeds" if seeds > 1 else "")
    table = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
             *("| " + " | ".join(row) + " |" for row in body)]
    return [f"**At equal peak memory, against per-step eviction of the same policy:** the "
            f"protocol costs attention mass in {losses} of {pairs} (policy, protocol) pairs; "
            f"each cell is the change in mass kept (mean over {what}, one per policy: "
            f"not averaged over policies), in how many of the {what} it is negative, and its "
            f"range.", "",
            *table, "", *_unmatched_note(rows)]


def _unmatched_note(rows: list[dict]) -> list[str]:
    left = unmatched(rows)
    if not left:
        return []
    return ["Not in the table, no per-step run of the same policy holding their peak: "
            + "; ".join(f"`{p}` (peak {', '.join(map(str, peaks))})"
                        for p, peaks in left.items())
            + ". They differ from per-step eviction in memory as well as in protocol.", ""]


SPREAD = 0.12  # half-width of a policy's per-head points about its tick (ticks 1 apart)


def figure(ctx, rows: list[dict], out) -> list:
    """Change in mass kept against per-step eviction at equal peak memory: a panel per
    protocol (one y scale), a tick per policy with its points at it (small: each head, spread
    by at most :data:`SPREAD`; large: their mean)."""
    found = deltas(rows)
    if not found:
        return []
    columns = sorted(found)
    kinds = sorted({k for per in found.values() for k in per})
    colors = color_map(kinds)
    marks = markers(kinds)
    fig, axes, layout = grid(len(columns), ctx, panel=(max(2.2, 0.75 * len(kinds) + 0.8), 2.8))
    every = [v for per in found.values() for d in per.values() for v in d.values()]
    low, high = min(0.0, *every), max(0.0, *every)
    pad = 0.06 * (high - low or 1.0)
    for ax, col in zip(axes, columns):
        shown = [k for k in kinds if found[col].get(k)]
        for x, kind in enumerate(shown):
            values = np.array(list(found[col][kind].values()))
            spread = np.linspace(-SPREAD, SPREAD, values.size) if values.size > 1 else [0.0]
            ax.plot(x + np.asarray(spread), values, ls="none", marker=marks[kind], ms=3.5,
                    alpha=0.55, color=colors[kind])
            ax.plot([x], [values.mean()], ls="none", marker=marks[kind], ms=9,
                    color=colors[kind], mec="black", mew=0.6)
        ax.axhline(0, color="0.3", lw=0.8)
        ax.set_xticks(range(len(shown)), shown, rotation=30 if len(shown) > 3 else 0)
        ax.set_xlim(-0.5, len(shown) - 0.5)
        ax.set_ylim(low - pad, high + pad)
        ax.set(title=f"{col[0]}, peak {col[1]}", ylabel="mass kept: protocol minus per-step")
        ax.grid(True, axis="y", alpha=0.3)
    handles = [Line2D([], [], ls="none", marker=marks[k], ms=7, color=colors[k]) for k in kinds]
    layout.finish(fig, f"{ctx.name}: protocols against per-step eviction at equal peak "
                       f"memory (keys)\nabove 0: the protocol keeps more; small points: each "
                       f"head" + (" and seed" if len(ctx.seeds) > 1 else "")
                  + "; large: their mean", handles, kinds)
    return save(fig, out, "protocols_vs_per_step", ctx)
