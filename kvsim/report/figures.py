"""Report figures, drawn from a run's tidy rows and per-step series (matplotlib, Agg).

Each experiment figure is registered with the data it needs (:class:`Needs`); the writer
draws the ones a scenario asks for, or every one whose needs the results meet. Figures read
the run through a :class:`FigureContext`, never the scenario itself. Statistics are per head
(never pooled over heads): lines are means over seeds, bands the range over seeds.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LogNorm, Normalize
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from kvsim.protocols.threshold import is_threshold
from kvsim.report import allocation_summary, ranking
from kvsim.report.palette import markers
from kvsim.report.plotting import (FIGURES, Curves, FigureContext, Needs, Target, budget_axis, check,
                                   color_map, draw_lines, figure, figure_context, figure_title, grid,
                                   head_label, log_axis, panel_label, panel_of, policy_colors,
                                   policy_markers, save, select)
from kvsim.report.stats import plural, rolling_mean
from kvsim.scenario.load import Experiment

__all__ = ["FIGURES", "FigureContext", "Needs", "Target", "check", "column_sums", "field_figure",
           "figure_context", "policy_colors", "select"]

RASTER_BINS = 256
SINK_STRIP = 0.05  # height of the enlarged first-bin strip of the kept raster, as a share of T
CROWDED = 0.9  # a mass above this crowds near 1 on a linear axis
MAX_RAW_POINTS = 4000  # faint per-step series longer than this are drawn every k-th step
FAINT_MAX = 3  # faint per-step series are drawn under at most this many curves (else a wash)


def _per_head(ctx: FigureContext, rows: list[dict], metric: str) -> dict:
    """``{panel: {policy: {budget: per-seed values}}}`` (panels: see
    :func:`~kvsim.report.plotting.panel_of`; a seed's value is the mean over the panel's
    heads), NaN values left out."""
    acc: dict = defaultdict(list)
    for r in rows:
        if not math.isnan(r[metric]):
            acc[panel_of(ctx, r), r["policy"], r["budget"], r["seed"]].append(r[metric])
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for (panel, policy, budget, _), values in acc.items():
        out[panel][policy][budget].append(float(np.mean(values)))
    return out


def _seeds_note(ctx: FigureContext) -> str:
    n = len(ctx.seeds)
    return "one seed" if n == 1 else f"lines: mean over {plural(n, 'seed')}; bands: their range"


def _loss(ctx: FigureContext, values) -> bool:
    """Whether masses are drawn as ``1 - mass`` (log): the report's choice when made (one
    scale for every figure of a report), else whether these crowd near 1."""
    return _loss_scale(values) if ctx.loss is None else ctx.loss


def _rounding_only(exp: Experiment) -> list[str]:
    """Policies whose output error is rounding (``full`` keeps every key): on a log axis they
    would stretch it over 16 decades, so error figures name them instead of drawing them.
    None under KIVI storage, where ``full``'s error is the quantisation's."""
    return _full_labels(exp)


def _not_drawn(handles: list, labels: list, skipped: list[str],
               why: str = "error at rounding level, ~1e-16") -> None:
    if skipped:
        handles.append(Line2D([], [], ls="none"))
        labels.append(f"not drawn: {', '.join(skipped)} ({why})")


def _threshold_note(rows: list[dict], what: str) -> str:
    """A title's last line when threshold runs are drawn beside budgeted ones."""
    if any(is_threshold(str(r.get("protocol", ""))) for r in rows):
        return f"\nthreshold runs keep no budget: {what}"
    return ""


def peak_note(rows: list[dict], budget: int) -> str:
    """" (peak 256)" after "B = 193" when the budgeted runs at ``budget`` held more keys
    at their peak than B (an interval, a ratio, a question kept), so that B is not read
    as their memory; "" when the peak is B."""
    peaks = {r["peak_size"] for r in rows if r["budget"] == budget and r.get("kind") != "full"
             and not is_threshold(str(r.get("protocol", "")))}
    if not peaks or peaks == {budget}:
        return ""
    low, high = min(peaks), max(peaks)
    return f" (peak {low})" if low == high else f" (peak {low} to {high})"


def _full_labels(exp: Experiment) -> list[str]:
    """The ``full`` policies of ``exp`` (mass 1), none under KIVI storage (mass below 1)."""
    return [p.label for p in exp.policies if p.kind == "full" and exp.quantize is None]


def _lost(exp: Experiment) -> str:
    """What ``1 - mass`` is: the mass lost, or under KIVI storage 1 - exp(-KL) of the
    quantised attention (every key is kept: not a mass lost)."""
    return "mass lost, 1 - mass" if exp.quantize is None else "KIVI: 1 - exp(-KL), not mass lost"


def _kept(exp: Experiment) -> str:
    return "attention mass kept" if exp.quantize is None else "KIVI: exp(-KL), not mass kept"


def _loss_scale(values) -> bool:
    """Whether masses crowd near 1 (any above ``CROWDED``): figures then draw the mass lost,
    ``1 - mass``, on a log axis, where differences near 1 show."""
    v = np.asarray(list(values), float)
    return bool(np.any(v[np.isfinite(v)] > CROWDED))


def _against_budget(ctx, exp, rows, colors, out, metric, ylabel, stem, log_y=False,
                    reference=None, skip=(), loss=False):
    """``loss``: the metric is a mass; drawn as ``1 - mass`` on a log axis when it crowds
    near 1 (``full``, mass 1, is then named instead of drawn). Threshold runs, which have
    no budget (their rows repeat at every one), are named instead of drawn."""
    budgetless = list(dict.fromkeys(r["policy"] for r in rows
                                    if is_threshold(str(r.get("protocol", "")))))
    rows = [r for r in rows if r["policy"] not in budgetless]
    if not rows:
        return []
    if loss and _loss(ctx, [r[metric] for r in rows if r["policy"] not in _full_labels(exp)]):
        skip, log_y = tuple(skip) + tuple(_full_labels(exp)), True
        rows = [dict(r, **{metric: 1.0 - r[metric]}) for r in rows]
        ylabel = f"{_lost(exp)} (log)"
    else:
        loss = False
    per_head = _per_head(ctx, [r for r in rows if r["policy"] not in skip], metric)
    heads = sorted(per_head)
    fig, axes, layout = grid(len(heads), ctx,
                             gap=(0.75, 1.0 if len(exp.budgets) > 5 else 0.8))
    # ``full`` keeps every key whatever the budget (its rows repeat at each): a flat line.
    unbudgeted = {p.label for p in exp.policies if p.kind == "full"}
    curves, bands, flat = Curves(), {}, {}
    for h, ax in zip(heads, axes):
        for policy, per_budget in per_head[h].items():
            if policy in unbudgeted:
                flat[policy] = ax.axhline(np.mean(np.concatenate(list(per_budget.values()))),
                                          color=colors[policy], ls="--", lw=1.2)
                continue
            budgets = sorted(per_budget)
            values = [np.array(per_budget[b]) for b in budgets]
            curves.add(h, policy, budgets, [v.mean() for v in values])
            if len(ctx.seeds) > 1:
                bands[h, policy] = ([v.min() for v in values], [v.max() for v in values])
    handles, labels = draw_lines(dict(zip(heads, axes)), curves, colors, policy_markers(exp),
                                 bands, log=log_y)
    for policy, line in flat.items():
        handles.append(line)
        labels.append(f"{policy} (every key kept: the budget does not apply)")
    for h, ax in zip(heads, axes):
        if reference:
            b = np.array(exp.budgets, float)
            line, = ax.plot(b, reference[1](b), color="0.45", ls=":", lw=1)
        budget_axis(ax, exp.budgets, log_y)
        ax.set(title=panel_label(ctx, h), xlabel="budget B (tokens, log2 axis)", ylabel=ylabel)
    if reference:
        handles.append(line)
        labels.append(reference[0])
    if loss:
        _not_drawn(handles, labels, list(skip), "mass 1")
    else:
        _not_drawn(handles, labels, list(skip))
    _not_drawn(handles, labels, budgetless, "thresholds, without a budget: see the figure "
                                            "against mean cache size")
    layout.finish(fig, figure_title(ctx, exp, f"{ylabel} against budget\n"
                              f"P = {exp.prompt_len}, T = {ctx.T}; {_seeds_note(ctx)}"),
                  handles, labels)
    return save(fig, out, f"{exp.name}_{stem}", ctx)


def _few(exp: Experiment) -> bool:
    """Whether per-head curves stay readable (else the ranking figures replace them)."""
    return not ranking.many(exp)


@figure(Needs.DECODE | Needs.BUDGETS, by_default=_few)
def mass_vs_budget(ctx, exp, rows, steps, colors, out):
    """Mean attention mass kept over the decode steps against budget, a panel per head."""
    return _against_budget(ctx, exp, rows, colors, out, "mass_mean",
                           _kept(exp), "mass_vs_budget", loss=True)


@figure(Needs.TRUTH | Needs.BUDGETS)
def recall_vs_budget(ctx, exp, rows, steps, colors, out):
    """Final important-token recall against budget, a panel per head with ground truth."""
    uniform = ("B / T: a uniformly random cache", lambda b: np.minimum(1, b / ctx.T))
    return _against_budget(ctx, exp, rows, colors, out, "final_recall",
                           "important-token recall of the final cache", "recall_vs_budget",
                           reference=uniform)


@figure(Needs.DECODE | Needs.VALUES | Needs.BUDGETS, by_default=_few)
def error_vs_budget(ctx, exp, rows, steps, colors, out):
    """Mean relative output error over the decode steps against budget, a panel per head."""
    return _against_budget(ctx, exp, rows, colors, out, "error_mean",
                           "relative output error |o~ - o| / |o| (log)", "error_vs_budget",
                           log_y=True,
                           skip=_rounding_only(exp))


@figure(Needs.TRUTH, by_default=lambda exp: False)
def pareto(ctx, exp, rows, steps, colors, out):
    """Compression (share of the sequence evicted) against final recall, a panel per head
    (only on request: where every policy holds B keys it repeats recall against budget)."""
    recall = _per_head(ctx, rows, "final_recall")
    compression = _per_head(ctx, rows, "compression")
    heads = sorted(recall)
    fig, axes, layout = grid(len(heads), ctx, panel=(3.6, 2.8))
    curves = Curves()
    full = [p.label for p in exp.policies if p.kind == "full"]  # at compression 0: off the axes
    for h in heads:
        for policy, per_budget in recall[h].items():
            if policy in full:
                continue
            budgets = sorted(per_budget)
            curves.add(h, policy, [np.mean(compression[h][policy][b]) for b in budgets],
                       [np.mean(per_budget[b]) for b in budgets])
    handles, labels = draw_lines(dict(zip(heads, axes)), curves, colors, policy_markers(exp))
    xs = np.concatenate([x for c in curves.panels.values() for x, _ in c.values()])
    lo, hi = float(xs.min()), float(xs.max())
    pad = max(0.05, 0.08 * (hi - lo))  # never a zoom that makes equal budgets look apart
    grid_x = np.linspace(max(0.0, lo - pad), min(1.0, hi + pad), 50)
    for h, ax in zip(heads, axes):
        base, = ax.plot(grid_x, 1 - grid_x, color="0.45", ls=":", lw=1)
        ax.set_xlim(grid_x[0], grid_x[-1])
        ax.set_ylim(0, 1.03)
        ax.set(title=panel_label(ctx, h), xlabel="compression (fraction of the T keys evicted)",
               ylabel="important-token recall")
        ax.grid(True, alpha=0.3)
    budgets = ", ".join(map(str, exp.budgets)) if len(exp.budgets) <= 4 else \
        f"{exp.budgets[0]} to {exp.budgets[-1]}"
    handles, labels = handles + [base], labels + ["1 - compression: a uniformly random cache"]
    if full:
        handles.append(Line2D([], [], ls="none"))
        labels.append(f"not drawn: {', '.join(full)} (compression 0, recall 1)")
    layout.finish(fig, figure_title(ctx, exp, f"compression against recall\nB = {budgets} of "
                              f"T = {ctx.T}; mean over {plural(len(ctx.seeds), 'seed')}"),
                  handles, labels)
    return save(fig, out, f"{exp.name}_pareto", ctx)


def _time_panels(ctx, exp, rows):
    """(budget, head) panels of the per-step figures: the experiment's time budgets x heads."""
    panels = sorted({panel_of(ctx, r) for r in rows})
    return [(b, h) for b in exp.time_budgets for h in panels]


def _over_time(ctx, exp, rows, steps, colors, out, series, ylabel, stem, log_y=False,
               smooth=True, heads_with=None, skip=(), loss=False):
    """``loss``: the series is a mass, drawn as ``1 - mass`` on a log axis when the
    experiment's mean masses crowd near 1 (as in the against-budget figures)."""
    data = steps.arrays()[series]
    if loss and _loss(ctx, [r["mass_mean"] for r in rows
                            if r["policy"] not in _full_labels(exp)]):
        data, log_y, ylabel = 1.0 - data, True, f"{_lost(exp)} (log)"
        skip = tuple(skip) + tuple(_full_labels(exp))
    else:
        loss = False
    panels = [(b, h) for b, h in _time_panels(ctx, exp, rows)
              if heads_with is None or h in heads_with]
    t = np.arange(exp.prompt_len, ctx.T)
    window = max(1, t.size // 50) if smooth else 1
    stride = max(1, -(-t.size // MAX_RAW_POINTS))
    fig, axes, layout = grid(len(panels), ctx, panel=(3.6, 2.5))
    faint = smooth and sum(p.label not in skip for p in exp.policies) <= FAINT_MAX
    curves, bands = Curves(), {}
    units = defaultdict(lambda: defaultdict(list))  # by seed: bands show their range
    for r in rows:
        units[r["budget"], panel_of(ctx, r), r["policy"]][r["seed"]].append(r["unit"])
    for (b, h), ax in zip(panels, axes):
        for p in exp.policies:
            per_seed = units[b, h, p.label]
            if p.label in skip or not per_seed:
                continue
            with warnings.catch_warnings():  # all-NaN steps (no important key yet) stay NaN
                warnings.simplefilter("ignore", RuntimeWarning)
                seeds = np.array([np.nanmean(data[u], axis=0) for u in per_seed.values()])
                mean = np.nanmean(seeds, axis=0)
            if np.isnan(mean).all():
                continue
            if faint:
                ax.plot(t[::stride], mean[::stride], color=colors[p.label], lw=0.4, alpha=0.18)
            if smooth:
                mean = rolling_mean(mean, window)
                seeds = np.array([rolling_mean(v, window) for v in seeds])
            curves.add((b, h), p.label, t, mean)
            if len(seeds) > 1:
                bands[(b, h), p.label] = (seeds.min(axis=0), seeds.max(axis=0))
    handles, labels = draw_lines(dict(zip(panels, axes)), curves, colors, policy_markers(exp),
                                 bands, marker_every=max(1, t.size // 8), lw=1.1, log=log_y)
    _not_drawn(handles, labels, list(skip), *(["mass 1"] if loss else []))
    for (b, h), ax in zip(panels, axes):
        # fitted to the curves (not to the faint per-step traces), so that policies close to
        # one another separate
        ys = np.concatenate([y for _, y in curves.panels[b, h].values()] or [np.zeros(1)])
        if log_y:
            log_axis(ax)
            positive = ys[np.isfinite(ys) & (ys > 0)]
            if positive.size:
                # headroom above the highest curve, even past a mass lost of 1: a curve
                # drawn on the frame would be hidden
                top = positive.max() * 1.3
                if loss:  # a mass lost never exceeds 1: headroom, no more
                    top = min(top, 1.1)
                ax.set_ylim(positive.min() / 1.3, top)
        else:
            lo, hi = np.nanmin(ys), np.nanmax(ys)
            pad = max(0.01, 0.06 * (hi - lo))
            ax.set_ylim(max(0.0, lo - pad), min(1.0, hi) + pad)
        ax.set(title=f"{panel_label(ctx, h)}, B = {b}", xlabel="decode position t",
               ylabel=ylabel)
        ax.grid(True, alpha=0.3)
    how = "per step"
    if faint:
        how = f"rolling mean over {window} steps (faint: per step" + (
            f", drawn every {stride} steps)" if stride > 1 else ")")
    elif smooth:
        how = f"rolling mean over {window} steps (per-step series not drawn: steps.npz)"
    others = [b for b in exp.budgets if b not in exp.time_budgets]
    shown = f"B = {', '.join(map(str, exp.time_budgets))}" + (
        peak_note(rows, exp.time_budgets[0]) if len(exp.time_budgets) == 1 else "") + (
        f" (of {', '.join(map(str, exp.budgets))})" if others else "")
    layout.finish(fig, figure_title(ctx, exp, f"{ylabel} over decoding, {shown}\n"
                              f"{how}; " + _seeds_note(ctx)
                              + _threshold_note(rows, "theirs are the same at every B")),
                  handles, labels)
    return save(fig, out, f"{exp.name}_{stem}", ctx)


@figure(Needs.DECODE, by_default=_few)
def mass_over_time(ctx, exp, rows, steps, colors, out):
    """Attention mass kept at each decode step, a panel per head (and time budget)."""
    return _over_time(ctx, exp, rows, steps, colors, out, "mass", _kept(exp),
                      "mass_over_time", loss=True)


@figure(Needs.DECODE | Needs.VALUES, by_default=_few)
def error_over_time(ctx, exp, rows, steps, colors, out):
    """Relative output error at each decode step, a panel per head (and time budget)."""
    return _over_time(ctx, exp, rows, steps, colors, out, "error",
                      "relative output error (log)", "error_over_time", log_y=True,
                      skip=_rounding_only(exp))


@figure(Needs.DECODE | Needs.TRUTH)
def recall_over_time(ctx, exp, rows, steps, colors, out):
    """Share of the important tokens arrived so far that the cache holds, per decode step."""
    heads = {panel_of(ctx, r) for r in rows if not math.isnan(r["final_recall"])}
    return _over_time(ctx, exp, rows, steps, colors, out, "recall",
                      "important-token recall", "recall_over_time", smooth=False,
                      heads_with=heads)


def _occupancy(snapshots: np.ndarray, T: int, bins: int) -> tuple[np.ndarray, int]:
    """(bins, snapshots) fraction of each position bin held in the cache, and the bin width."""
    width = -(-T // bins)
    image = np.zeros((-(-T // width), snapshots.shape[0]))
    for j, cached in enumerate(snapshots):
        cached = cached[cached >= 0]
        np.add.at(image[:, j], cached // width, 1.0)
    return image / width, width


def _raster_labels(ctx, exp, steps) -> list[str]:
    """The policies :func:`kept_raster` draws: those with snapshots of the first seed."""
    return [p.label for p in exp.policies if (p.label, ctx.seeds[0], 0) in steps.snapshots]


def raster_digest(ctx, exp, steps) -> str:
    """A digest of what :func:`kept_raster` would draw for ``exp`` (its policies, steps and
    cached positions): two experiments with the same digest have the same raster."""
    import hashlib

    digest = hashlib.sha256(f"{exp.prompt_len} {exp.focus_budget}".encode())
    digest.update(np.ascontiguousarray(steps.snap_steps).tobytes())
    for label in _raster_labels(ctx, exp, steps):
        digest.update(label.encode() + b"\0")
        digest.update(np.ascontiguousarray(steps.snapshots[label, ctx.seeds[0], 0]).tobytes())
    return digest.hexdigest()


@figure(Needs.DECODE)
def kept_raster(ctx, exp, rows, steps, colors, out):
    """Which positions are cached at each decode step: a panel per policy (focus budget)."""
    seed = ctx.seeds[0]
    labels = _raster_labels(ctx, exp, steps)
    if not labels:
        return []
    fig, axes, layout = grid(len(labels), ctx, panel=(3.4, 2.7), max_cols=3)
    t = exp.prompt_len + steps.snap_steps
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    for ax, label in zip(axes, labels):
        image, width = _occupancy(steps.snapshots[label, seed, 0], ctx.T, RASTER_BINS)
        # Log scale from one key per bin to a full bin: a scattered selection stays visible.
        norm = LogNorm(vmin=1 / width, vmax=1) if width > 8 else Normalize(0, 1)
        top = image.shape[0] * width
        masked = np.ma.masked_equal(image, 0)
        shown = ax.imshow(masked, origin="lower", aspect="auto", cmap=cmap, norm=norm,
                          extent=(t[0], t[-1] + 1, 0, top), interpolation="nearest")
        # The first bin (the sinks) is one pixel row at this scale: repeat it, enlarged, as a
        # strip below 0 so that a held sink is seen.
        ax.imshow(masked[:1], origin="lower", aspect="auto", cmap=cmap, norm=norm,
                  extent=(t[0], t[-1] + 1, -SINK_STRIP * top, 0), interpolation="nearest")
        ax.axhline(0, color="0.3", lw=0.5)
        ax.set_ylim(-SINK_STRIP * top, top)
        ax.plot([t[0], t[-1]], [t[0], t[-1]], color="tab:red", lw=0.8)
        ax.set_title(label)  # black, readable; the policy's colour in a swatch beside it
        ax.add_patch(Rectangle((0, 1.025), 0.05, 0.05, transform=ax.transAxes,
                               color=colors[label], clip_on=False))
        ax.set(xlabel="decode step t", ylabel="key position")
    layout.finish(fig, figure_title(ctx, exp, f"cached positions at B = {exp.focus_budget}"
                                    f"{peak_note(rows, exp.focus_budget)}\n"
                              f"seed {seed}, KV head 0; red line: the current token t;\n"
                              f"strip below 0: positions 0-{width - 1} enlarged"
                              + _threshold_note(rows, "B does not apply to their panels"),
                              first_layer=True),
                  colorbar=(shown, f"fraction of each bin of {width} positions cached"
                                   f"{' (log)' if width > 8 else ''}; white: none"))
    return save(fig, out, f"{exp.name}_kept_raster", ctx)


def allocation_grids(rows: list[dict], label: str, budget: int) -> tuple[list, list, np.ndarray,
                                                                       np.ndarray]:
    """(layers, KV heads, b_h grid, mass grid) of one policy at one budget: the cap and the
    mean mass kept of each (layer, KV head), averaged over seeds and the group's query heads."""
    mine = [r for r in rows if r["policy"] == label and r["budget"] == budget]
    layers = sorted({r["layer"] for r in mine})
    kvs = sorted({r["kv_head"] for r in mine})
    caps, mass = np.zeros((len(layers), len(kvs))), np.zeros((len(layers), len(kvs)))
    for i, layer in enumerate(layers):
        for j, kv in enumerate(kvs):
            cell = [r for r in mine if r["layer"] == layer and r["kv_head"] == kv]
            caps[i, j] = np.mean([r["b_h"] for r in cell])
            mass[i, j] = np.mean([r["mass_mean"] for r in cell])
    return layers, kvs, caps, mass


PYRAMID_NOTE = ("\ncaps differ by policy: the last layer's cap is the policy's fixed part\n"
                "(recent keys, window) + ceil((B - fixed) / beta)")


@figure(Needs.DECODE | Needs.ALLOCATION, by_default=lambda exp: exp.allocation != "uniform")
def allocation(ctx, exp, rows, steps, colors, out):
    """Per policy at the focus budget: each KV head's cap b_h (layer x KV head), beside the
    attention mass it keeps."""
    labels = [p.label for p in exp.policies]
    fig, axes = plt.subplots(len(labels), 2, squeeze=False, layout="constrained",
                             figsize=(7.5, 1.4 + 2.4 * len(labels)))
    grids = {label: allocation_grids(rows, label, exp.focus_budget) for label in labels}
    # One colour scale per column: the policies' caps (and masses) compare across rows.
    bounds = [(min(g[i].min() for g in grids.values()), max(g[i].max() for g in grids.values()))
              for i in (2, 3)]
    # A constant grid (uniform caps) gets a scale around its value, not a degenerate one.
    norms = [Normalize(lo - 0.5, hi + 0.5) if lo == hi else Normalize(lo, hi)
             for lo, hi in bounds]
    for row, label in enumerate(labels):
        layers, kvs, caps, mass = grids[label]
        for col, (values, title, cmap) in enumerate(((caps, "cap b_h (tokens)", "viridis"),
                                                     (mass, "mass kept (mean over steps)",
                                                      "magma"))):
            ax = axes[row][col]
            image = ax.imshow(values, aspect="auto", origin="lower", cmap=cmap,
                              interpolation="nearest", norm=norms[col])
            if row == 0:
                fig.colorbar(image, ax=axes[:, col], location="top", shrink=0.8, label=title)
            ax.set(title=f"{label}: {title}", xlabel="KV head", ylabel="layer",
                   xticks=range(len(kvs)), xticklabels=kvs)
            ticks = np.unique(np.linspace(0, len(layers) - 1, min(len(layers), 6)).astype(int))
            ax.set_yticks(ticks, [str(layers[t]) for t in ticks])
    fig.suptitle(f"{ctx.name}, {exp.name}: allocation '{exp.allocation}' at mean "
                 f"budget B = {exp.focus_budget}\none colour scale per column, shared by "
                 f"every policy" + PYRAMID_NOTE * (exp.allocation == "pyramid"), fontsize=10)
    return save(fig, out, f"{exp.name}_allocation", ctx)


def allocation_vs_uniform(ctx: FigureContext, rows: list[dict], out: Target) -> list[Path]:
    """At equal memory: the mass each allocation keeps minus the mass uniform allocation
    keeps, per policy against budget, a panel per allocation (one y scale), with its sign."""
    pairs = allocation_summary.compare(ctx.experiments, ctx.T, rows)
    if not pairs:
        return []
    rules = list(dict.fromkeys(p.rule for p in pairs))
    fig, axes, layout = grid(len(rules), ctx, panel=(3.4, 2.6))
    colors = color_map([p.policy for p in pairs])
    marks = markers(list(colors))
    lo = min(0.0, min(p.other - p.uniform for p in pairs))
    hi = max(0.0, max(p.other - p.uniform for p in pairs))
    pad = 0.08 * (hi - lo or 1e-3)
    for ax, rule in zip(axes, rules):
        for label in colors:
            mine = sorted((p.budget, p.other - p.uniform) for p in pairs
                          if p.rule == rule and p.policy == label)
            if mine:
                ax.plot(*zip(*mine), color=colors[label], marker=marks[label], lw=1.3,
                        label=label)
        ax.axhline(0, color="0.3", lw=0.8)
        budgets = sorted({p.budget for p in pairs})
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_ylim(lo - pad, hi + pad)  # one scale: panels compare
        ax.set(title=f"{allocation_summary.RULE_NAMES[rule]} minus uniform",
               xlabel="mean budget B per KV head (log2 axis)",
               ylabel="change in mass kept")
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    layout.finish(fig, f"{ctx.name}: allocations at equal memory\nmass kept (mean over "
                       f"steps, layers, heads, seeds) minus uniform's; above 0: better",
                  handles, labels)
    return save(fig, out, "allocation_vs_uniform", ctx)


def field_figure(ctx: FigureContext, samples, out: Target) -> list[Path]:
    """The attention field of the first seed: a heatmap per head (future masked)."""
    if not samples:
        return []
    n = len(samples)
    fig, axes, layout = grid(n, ctx, panel=(3.4, 2.8))
    cmap = matplotlib.colormaps["magma"].with_extremes(bad="white")
    positive = np.concatenate([s.heatmap[s.heatmap > 0] for s in samples])
    top = float(positive.max()) if positive.size else 1.0
    norm = LogNorm(vmin=max(float(np.quantile(positive, 0.01)) if positive.size else 1e-6,
                            top * 1e-8), vmax=top)
    for h, (ax, sample) in enumerate(zip(axes, samples)):
        last = int(sample.rows[-1]) + 1
        bins = -(-last // sample.bin_width)
        image = np.array(sample.heatmap[:, :bins], float)
        starts = np.arange(bins) * sample.bin_width
        image[starts[None, :] > sample.rows[:, None]] = np.nan  # keys after the query
        image = np.ma.masked_invalid(np.where(image > 0, np.maximum(image, norm.vmin), np.nan))
        x = np.append(starts, bins * sample.bin_width)
        y = np.append(sample.rows, last)
        shown = ax.pcolormesh(x, y, image, cmap=cmap, norm=norm, shading="flat",
                              rasterized=True)
        # Key positions on a symlog axis, linear over the first bins: the first bin (where
        # attention sinks sit) is as wide as a decade instead of 1/512 of the panel.
        ax.set_xscale("symlog", linthresh=4 * sample.bin_width, linscale=0.5)
        ax.set_xlim(0, x[-1])
        ax.set(title=head_label(ctx, h), xlabel="key position k (linear to "
               f"{4 * sample.bin_width}, then log)", ylabel="query q")
    layer = f", layer {ctx.layer_ids[0]}" if ctx.layer_ids else ""  # the first layer's
    layout.finish(fig, f"{ctx.name}: attention around the end of the prompt{layer}\n"
                       f"seed {ctx.seeds[0]}; future keys white",
                  colorbar=(shown, "p(q, k), max over "
                                   f"{plural(samples[0].bin_width, 'key')} per bin (log)"))
    return save(fig, out, "field", ctx)


def column_sums(ctx: FigureContext, samples, out: Target) -> list[Path]:
    """The column sums of every head of the first seed, ranked, on log-log axes."""
    if not samples:
        return []
    n = len(samples)
    layer = f", layer {ctx.layer_ids[0]}" if ctx.layer_ids else ""
    fig, ax = plt.subplots(figsize=(7.4, 4.0))
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    group = ctx.heads // ctx.kv_heads if ctx.kv_heads < ctx.heads else 1
    styles = ("-", "--", ":", "-.")
    for h, sample in enumerate(samples):
        # grouped query heads: a hue per KV head, a line style per query head in its group
        color, ls = cmap((h // group) % cmap.N), styles[(h % group) % len(styles)]
        ranked = np.sort(sample.colsum)[::-1]
        ranked = ranked[ranked > 0]
        # ~2,000 log-spaced ranks (first and last included): the same curve, not T points.
        at = np.unique(np.geomspace(1, max(ranked.size, 1), 2000).round().astype(np.int64))
        at = at[at <= ranked.size]
        ax.loglog(at, ranked[at - 1], color=color, ls=ls, lw=1.1, label=head_label(ctx, h))
    ax.set(xlabel="key rank", ylabel="column sum (attention the key receives)",
           title=f"{ctx.name}: attention received per key, ranked (seed {ctx.seeds[0]}{layer})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False, borderaxespad=0)
    fig.tight_layout()
    return save(fig, out, "column_sums", ctx)
