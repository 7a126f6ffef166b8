"""What every report figure shares: the run facts figures read (:class:`FigureContext`), the
figure registry (each figure declares the data it needs), page-width sizing, policy colours
and markers, head grids, and twin curves."""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from dataclasses import dataclass, field
import textwrap
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.collections  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import LogFormatterSciNotation  # noqa: E402

from kvsim.errors import ScenarioError  # noqa: E402
from kvsim.policies import POLICIES  # noqa: E402
from kvsim.report.palette import cielab, declared_color, markers, policy_color, spread  # noqa: E402
from kvsim.report.stats import COINCIDE_TOL, plural, twins  # noqa: E402
from kvsim.scenario.load import Experiment, Scenario  # noqa: E402

MAX_WIDTH_PX = 1200  # a figure is never wider: read at 800 px, its 8 pt text stays >= 7 px
MAX_COLS = 3  # panels a row at most; more wrap into rows
TWIN_STYLE = (0, (4, 3))  # dashes of a curve drawn over its identical twin

plt.rcParams.update({"font.size": 9, "axes.titlesize": 9, "axes.labelsize": 9,
                     "legend.fontsize": 8, "xtick.labelsize": 8, "ytick.labelsize": 8,
                     "figure.titlesize": 10})


@dataclass(frozen=True)
class FigureContext:
    """What figures read of a run besides its rows and step series: built from a scenario
    by :func:`figure_context`, and from results by the Python API."""

    name: str
    T: int
    seeds: tuple[int, ...]
    heads: int  # query heads
    kv_heads: int
    head_names: tuple[str, ...]  # names given to the query heads, by head (may be fewer)
    has_truth: bool  # the source plants ground-truth important tokens
    layers: int  # layers run jointly
    layer_ids: tuple[int, ...]  # the model layers figures name (none for a field without them)
    experiments: tuple[Experiment, ...]  # all of the run's: colours, comparisons across them
    formats: tuple[str, ...]
    dpi: int
    loss: bool | None = None  # masses drawn as 1 - mass (log) in every figure; None: per figure


def figure_context(scenario: Scenario) -> FigureContext:
    """What the figures of ``scenario``'s report read of it."""
    chosen = len(scenario.layers) > 1 or scenario.attention.get("layer") is not None
    layer_ids = tuple(scenario.layers) if chosen else ()
    return FigureContext(scenario.name, scenario.T, scenario.seeds, scenario.heads,
                         scenario.kv_heads, tuple(scenario.attention.get("head_names") or ()),
                         scenario.has_truth, len(scenario.layers), layer_ids,
                         scenario.experiments, scenario.formats, scenario.dpi)


class Needs(enum.Flag):
    """Data a figure needs from an experiment."""

    NOTHING = 0
    DECODE = enum.auto()   # decode steps (mass and every per-step series)
    TRUTH = enum.auto()    # ground-truth important tokens
    VALUES = enum.auto()   # value vectors (output error)
    BUDGETS = enum.auto()  # more than one budget
    ALLOCATION = enum.auto()  # a layer x KV head grid: allocated caps, or several layers

    def describe(self) -> str:
        return {Needs.DECODE: "decode steps (prompt_len < T)",
                Needs.TRUTH: "ground-truth important tokens, which this attention source lacks",
                Needs.VALUES: "value vectors, which this attention source lacks",
                Needs.BUDGETS: "more than one budget",
                Needs.ALLOCATION: "allocation \"ada\", \"pyramid\" or \"cake\", or several "
                                  "layers run jointly (attention.layers)"}[self]


@dataclass
class Ledger:
    """The data of a report's saved figures, by file stem, and the figures not saved
    because their data repeats an earlier one's (``repeats[stem] = earlier stem``)."""

    data: dict = field(default_factory=dict)
    repeats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    """Where figures go: a folder and a file-name prefix (for sweep variants); with a
    ledger, a figure whose data repeats one already saved there is not saved."""

    folder: Path | None  # None: the figure is returned, not saved
    prefix: str = ""
    ledger: Ledger | None = field(default=None, compare=False)


REPEAT_SHARE = 0.8  # a figure sharing this share of its curves with another repeats it


def figure_data(fig) -> frozenset[bytes]:
    """What ``fig`` shows: each non-constant line's y values and each image's values,
    rounded to 6 decimals (the same numbers under another x axis or title are the same
    data)."""
    out = set()
    for ax in fig.axes:
        for line in ax.get_lines():
            y = np.asarray(line.get_ydata(), float)
            finite = y[np.isfinite(y)]
            if finite.size >= 2 and np.ptp(finite) > 0:
                out.add(np.round(np.nan_to_num(y, nan=-9.0), 6).tobytes())
        for image in ax.get_images() + [c for c in ax.collections
                                         if isinstance(c, matplotlib.collections.QuadMesh)]:
            values = np.ma.filled(np.ma.asarray(image.get_array(), float), -9.0)
            out.add(np.round(values, 6).tobytes())
    return frozenset(out)


def repeated(data: frozenset, earlier: dict) -> str | None:
    """The stem of a figure in ``earlier`` (stem: data) that ``data`` repeats: at least
    :data:`REPEAT_SHARE` of its curves and images drawn there."""
    for stem, other in earlier.items():
        if data and len(data & other) >= REPEAT_SHARE * len(data):
            return stem
    return None


@dataclass(frozen=True)
class Figure:
    """A registered experiment figure: its name (the file stem and the scenario's
    ``figures`` entry), what it needs, the function that draws it, and whether an
    experiment that names no figures gets it (``by_default(exp)``, given its needs)."""

    name: str
    needs: Needs
    draw: Callable[..., list[Path]]
    by_default: Callable[[Experiment], bool] = lambda exp: True


FIGURES: dict[str, Figure] = {}


def figure(needs: Needs, by_default: Callable[[Experiment], bool] = lambda exp: True
           ) -> Callable:
    """Register a drawing function ``f(ctx, exp, rows, steps, colors, out)`` under its name."""
    def register(draw):
        FIGURES[draw.__name__] = Figure(draw.__name__, needs, draw, by_default)
        return draw
    return register


def available(ctx: FigureContext, exp: Experiment, rows: list[dict] | None = None) -> Needs:
    """What ``exp`` provides; VALUES is known from the results (``rows``) only."""
    have = Needs.NOTHING
    if exp.prompt_len < ctx.T:
        have |= Needs.DECODE
    if ctx.has_truth:
        have |= Needs.TRUTH
    if len(exp.budgets) > 1:
        have |= Needs.BUDGETS
    if exp.allocation != "uniform" or ctx.layers > 1:
        have |= Needs.ALLOCATION
    if rows is None or any(not math.isnan(r["error_mean"]) for r in rows):
        have |= Needs.VALUES
    return have


def missing(fig: Figure, have: Needs) -> list[Needs]:
    return [n for n in Needs if n and n in fig.needs and n not in have]


def check(variants: list[Scenario]) -> None:
    """Raise :class:`ScenarioError` for a requested figure that is unknown or lacks its data."""
    problems = []
    for scenario in variants[:1]:  # variants share their experiments' figure lists
        for i, exp in enumerate(scenario.experiments):
            where = f"experiment[{i}].figures"
            unknown = [f for f in exp.figures or () if f not in FIGURES]
            if unknown:
                problems.append((str(scenario.path), where, f"expected a list of "
                                 f"{', '.join(FIGURES)}, got {list(exp.figures)!r}"))
                continue
            have = available(figure_context(scenario), exp)
            for name in exp.figures or ():
                for need in missing(FIGURES[name], have):
                    problems.append((str(scenario.path), where, f"expected figures with data: "
                                     f"{name!r} needs {need.describe()}"))
    if problems:
        raise ScenarioError(problems)


def select(ctx: FigureContext, exp: Experiment, rows: list[dict]
           ) -> tuple[list[Figure], list[str]]:
    """The figures to draw (the requested ones, or every one whose needs are met) and, for a
    requested figure the results cannot support, why it is not drawn."""
    have = available(ctx, exp, rows)
    if exp.figures is None:
        return [f for f in FIGURES.values() if not missing(f, have) and f.by_default(exp)], []
    chosen, notes = [], []
    for name in exp.figures:
        lacking = missing(FIGURES[name], have)
        if lacking:
            notes.append(f"`{name}` is not drawn: it needs {lacking[0].describe()}.")
        else:
            chosen.append(FIGURES[name])
    return chosen, notes


# For labels that are not a policy name (a second configuration, a sweep point), in order;
# the first two are at least 30 apart in CIELAB from every declared policy colour.
SPARE_COLORS = ("#00ddaa", "#8855ff", "#00e6e6", "#996633", "#80ff00", "#b3b3ff")


def color_map(labels: list[str], kinds: dict[str, str] | None = None) -> dict[str, str]:
    """``{label: colour}``: a policy name's colour (:func:`~kvsim.report.palette.policy_color`),
    or that of its policy (``kinds[label]``) when given; other labels take the spare colours
    not already used, in order (past them, tab20's). A colour not declared by a policy (one
    drawn from a policy's family, or a spare) moves where another of the figure is too close
    to it (:func:`~kvsim.report.palette.spread`)."""
    labels = list(dict.fromkeys(labels))
    policy = {label: label if label in POLICIES else (kinds or {}).get(label) for label in labels}
    policy = {label: name for label, name in policy.items() if name in POLICIES}
    colors = {label: policy_color(name) for label, name in policy.items()}
    free = [c for c in SPARE_COLORS if c not in colors.values()]
    free += [matplotlib.colors.to_hex(c) for c in plt.get_cmap("tab20").colors]
    for label in labels:
        if label not in colors:
            colors[label] = free.pop(0) if free else "#555555"
    colors = {label: colors[label] for label in labels}
    return spread(colors, [label for label in labels
                           if label not in policy or not declared_color(policy[label])])


SHADE_APART = 20  # a variant's shade is this far (CIELAB) from every other colour drawn


def _shades(color: str) -> list[str]:
    """Shades of ``color`` for variants drawn beside it: mixed 40 % with black, then 40 %
    with white, each only while its CIELAB lightness stays in [30, 80] (neither near black
    nor pastel)."""
    rgb = np.array(matplotlib.colors.to_rgb(color))
    mixes = [matplotlib.colors.to_hex(c) for c in (rgb * 0.6, rgb + (1 - rgb) * 0.4)]
    return [c for c in mixes if 30 <= cielab(c)[0] <= 80]


def policy_colors(ctx: FigureContext) -> dict[str, str]:
    """One colour per policy label, the same in every figure (see :func:`color_map`): a label
    such as ``h2o_i16`` takes its policy's colour when it is the only label of that policy in
    every experiment that has it, so that a protocol's figure reads like the per-step one;
    beside its policy, it takes a shade of that colour (see :func:`_shades`), so that one
    policy's variants read as a family, unless the shade is within :data:`SHADE_APART` of
    another colour of the scenario (then, as past two variants, a spare colour)."""
    shared = set()  # labels beside another of their policy in some experiment
    for e in ctx.experiments:
        by_kind = defaultdict(list)
        for p in e.policies:
            by_kind[p.kind].append(p.label)
        shared.update(label for group in by_kind.values() if len(group) > 1 for label in group)
    labels = [p.label for e in ctx.experiments for p in e.policies]
    kinds = {p.label: p.kind for e in ctx.experiments for p in e.policies}
    colors = color_map(labels, {k: v for k, v in kinds.items() if k not in shared})
    for label in dict.fromkeys(labels):
        kind = kinds[label]
        if label not in shared or label in POLICIES:
            continue
        others = [cielab(c) for other, c in colors.items() if other != label]
        for shade in _shades(policy_color(kind)):
            if all(np.linalg.norm(cielab(shade) - o) >= SHADE_APART for o in others):
                colors[label] = shade
                break
    return colors


class _DecimalLogFormatter(LogFormatterSciNotation):
    """The ticks matplotlib labels on a log axis, written short: 0.34 (not 3.4 x 10^-1, whose
    width crowds the next panel's label), 0.001, 1e-4."""

    def __call__(self, x, pos=None):
        if not super().__call__(x, pos):
            return ""
        return f"{x:.3g}" if x >= 1e-3 else f"{x:.0e}".replace("e-0", "e-")


def log_axis(ax) -> None:
    """Make ``ax``'s y axis logarithmic: zeros left out (never clipped), ticks in decimals."""
    ax.set_yscale("log", nonpositive="mask")
    ax.yaxis.set_major_formatter(_DecimalLogFormatter())
    ax.yaxis.set_minor_formatter(_DecimalLogFormatter())


def at_least_a_decade(ax, top: float | None = None) -> None:
    """Widen a log y axis spanning less than a decade to one decade about its geometric
    middle (kept at or below ``top``, a bound the values cannot pass, such as 1 for a mass
    lost): an axis zoomed to 0.596-0.608 draws a difference of 0.01 as a large gap."""
    low, high = ax.get_ylim()
    if 0 < low and high < 10 * low:
        upper = math.sqrt(low * high * 10)
        if top is not None and high <= top:
            upper = min(upper, top)
        ax.set_ylim(upper / 10, upper)


def budget_axis(ax, budgets, log_y: bool) -> None:
    """A budget x axis (log2, a tick at each budget, slanted past five) over a y axis of
    mass: logarithmic loss (:func:`log_axis`) if ``log_y``, else mass kept in [0, 1.03]."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets], rotation=45 if len(budgets) > 5 else 0)
    ax.minorticks_off()
    if log_y:
        log_axis(ax)
    else:
        ax.set_ylim(0, 1.03)
    ax.grid(True, alpha=0.3)


def policy_markers(exp: Experiment) -> dict[str, str]:
    """Each policy label's marker in ``exp``'s figures (see :func:`~kvsim.report.palette.markers`)."""
    return markers([p.label for p in exp.policies], {p.label: p.kind for p in exp.policies})


def layers_note(ctx: FigureContext, first_only: bool = False) -> str:
    """Which model layers a figure shows: "layer 15", "layers 0, 15, 29" (a panel each,
    see :func:`panel_of`), "30 layers", or "" when the field has none; ``first_only``: a
    figure of the first layer's caches only."""
    ids = ctx.layer_ids
    if len(ids) == 1 or (ids and first_only):
        return f"layer {ids[0]}"
    if not ids:
        return ""
    return "layers " + ", ".join(map(str, ids)) if len(ids) <= 4 else plural(len(ids), "layer")


def figure_title(ctx: FigureContext, exp: Experiment, what: str,
                 first_layer: bool = False) -> str:
    """``scenario/experiment (layers): what``, the start of every figure's title."""
    layers = layers_note(ctx, first_layer)
    return f"{ctx.name}/{exp.name}{f' ({layers})' if layers else ''}: {what}"


MAX_LAYER_PANELS = 9  # layers run jointly drawn a panel each; past this, one panel of all


def panel_of(ctx: FigureContext, row: dict) -> int | tuple:
    """The panel of a row's value: its head when one layer runs. Head i of one layer and
    head i of another are unlike heads, never averaged: with several layers a panel is a
    layer (the mean over its heads), or past :data:`MAX_LAYER_PANELS` layers one panel, the
    mean over every head of every layer (the whole model's)."""
    if ctx.layers <= 1:
        return row["head"]
    if ctx.layers <= MAX_LAYER_PANELS:
        return ("layer", row["layer"])
    return ("all", 0)


def panel_label(ctx: FigureContext, panel: int | tuple) -> str:
    """A panel's title: the head (see :func:`head_label`), or what a layer panel averages."""
    if not isinstance(panel, tuple):
        return head_label(ctx, panel)
    if panel[0] == "layer":
        return f"layer {panel[1]} (mean over its {plural(ctx.heads, 'head')})"
    return f"mean over {plural(ctx.heads, 'head')} x {plural(ctx.layers, 'layer')}"


def head_label(ctx: FigureContext, head: int) -> str:
    names = ctx.head_names
    name = f"head {head}" + (f" ({names[head]})" if head < len(names) and names[head] else "")
    if ctx.kv_heads < ctx.heads:
        name += f", KV head {head // (ctx.heads // ctx.kv_heads)}"
    return name


@dataclass
class Layout:
    """A grid of panels laid out in inches (matplotlib's constrained layout would cost more
    than drawing): margins for tick labels, titles, a legend row block and a colorbar."""

    rows: int
    cols: int
    panel: tuple[float, float]
    gap: tuple[float, float]  # inches between panels: y labels, x labels + next title
    max_width: float
    grid: object = None

    LEFT, RIGHT, TOP, BOTTOM = 0.75, 0.25, 0.72, 0.55
    COLORBAR = 1.15

    def finish(self, fig, title: str, handles: list | None = None, labels: list | None = None,
               colorbar: tuple | None = None) -> None:
        """Size the figure, then place the title, the legend below the panels (clear of the
        data) and the colorbar to their right."""
        right = self.RIGHT + (self.COLORBAR if colorbar else 0)
        chrome = self.LEFT + right + (self.cols - 1) * self.gap[0]
        panel_w = min(self.panel[0], (self.max_width - chrome) / self.cols)
        width = max(7.0, chrome + self.cols * panel_w)  # room for a two-line title
        panel_w = (width - chrome) / self.cols
        legend_rows, ncols = 0, 1
        if labels:
            longest = max(len(label) for label in labels)
            ncols = max(1, min(len(labels), 5, int((width - 0.4) / (0.068 * longest + 0.55))))
            legend_rows = math.ceil(len(labels) / ncols)
        bottom = self.BOTTOM + (0.12 + 0.2 * legend_rows if legend_rows else 0)
        top = self.TOP + 0.19 * max(0, title.count("\n") - 1)  # TOP holds two title lines
        height = (top + bottom + self.rows * self.panel[1]
                  + (self.rows - 1) * self.gap[1])
        fig.set_size_inches(width, height)
        self.grid.update(left=self.LEFT / width, right=1 - right / width,
                         bottom=bottom / height, top=1 - top / height,
                         wspace=self.gap[0] / panel_w, hspace=self.gap[1] / self.panel[1])
        fig.suptitle(title, y=1 - 0.06 / height, va="top")
        if labels:
            fig.legend(handles, labels, loc="lower center", ncols=ncols, frameon=False,
                       bbox_to_anchor=(0.5, 0.04 / height), borderaxespad=0)
        if colorbar:
            mappable, label = colorbar
            span = 1 - (self.TOP + bottom) / height
            cax = fig.add_axes((1 - (right - 0.3) / width, bottom / height + 0.15 * span,
                                0.16 / width, 0.7 * span))
            fig.colorbar(mappable, cax=cax, label=label)


def grid(n: int, ctx: FigureContext, panel: tuple[float, float] = (3.4, 2.6),
         max_cols: int = MAX_COLS, gap: tuple[float, float] = (0.75, 0.8)):
    """A figure of ``n`` panels wrapped in rows (at most ``max_cols`` a row, at most page
    width once :meth:`Layout.finish` sizes it); returns (figure, the ``n`` axes, layout)."""
    max_cols = min(max_cols, MAX_COLS)
    rows = max(1, math.ceil(n / max_cols))
    cols = max(1, math.ceil(n / rows))
    layout = Layout(rows, cols, panel, gap, MAX_WIDTH_PX / ctx.dpi)
    fig = plt.figure()
    layout.grid = fig.add_gridspec(rows, cols)
    axes = [fig.add_subplot(layout.grid[i // cols, i % cols]) for i in range(n)]
    return fig, axes, layout


class Curves:
    """Curves of one figure: ``panels[panel][policy] = (x, y)``; finds twins in each panel."""

    def __init__(self):
        self.panels: dict = defaultdict(dict)

    def add(self, panel, policy: str, x, y) -> None:
        self.panels[panel][policy] = (np.asarray(x, float), np.asarray(y, float))

    def order(self) -> list[str]:
        return list(dict.fromkeys(p for curves in self.panels.values() for p in curves))

    def twins(self, log: bool = False) -> dict:
        """``{panel: {policy: (earlier policy, exactly equal)}}``: curves that cannot be told
        apart in that panel. On a log axis they are compared as log10, and the tolerance
        grows with the decades the panel spans (past one): what it covers on the page stays
        the same however many decades the panel squeezes into its height."""
        out = {}
        for panel, curves in self.panels.items():
            if not log:
                out[panel] = twins({p: y for p, (x, y) in curves.items()})
                continue
            shown = np.concatenate([y[np.isfinite(y) & (y > 0)] for _, y in curves.values()])
            decades = float(np.log10(shown.max() / shown.min())) if shown.size else 0.0
            out[panel] = twins({p: np.log10(np.maximum(y, 1e-300)) for p, (x, y) in curves.items()},
                               COINCIDE_TOL * max(1.0, decades))
        return out


def _twin_label(policy: str, per_panel: list, panels: int) -> str:
    """``h2o (= window)`` when equal in every panel, ``(≈ window)`` when within the
    tolerance in every panel, ``(≈ window where dashed)`` when only in some."""
    if not per_panel:
        return policy
    others = list(dict.fromkeys(q for q, _ in per_panel))
    if len(per_panel) == panels and len(others) == 1:
        return f"{policy} ({'=' if all(e for _, e in per_panel) else '≈'} {others[0]})"
    return f"{policy} (≈ {', '.join(others)} where dashed)"


CROWD = 3  # curves of a panel on one line from this many: named in the panel


def crowds(twin: dict, order: list[str]) -> list[list[str]]:
    """Groups of at least :data:`CROWD` curves of one panel that lie on one line, each in
    the drawing ``order``: ``twin`` maps a curve to the earlier one it cannot be told from
    (:meth:`Curves.twins`), and the groups are those links joined."""
    root: dict[str, str] = {}

    def find(p: str) -> str:
        while root.get(p, p) != p:
            p = root[p]
        return p

    for policy, (earlier, _) in twin.items():
        root[find(policy)] = find(earlier)
    groups: dict[str, list[str]] = defaultdict(list)
    for p in order:
        groups[find(p)].append(p)
    return [g for g in groups.values() if len(g) >= CROWD]


def _name_crowds(ax, groups: list[list[str]]) -> None:
    """Write in the panel the names of the curves of each group, which lie on one line, in
    a box where it covers the fewest drawn points (matplotlib's ``loc="best"``)."""
    notes = [textwrap.fill(f"on one line: {', '.join(group)}", 42) for group in groups]
    ax.legend([Line2D([], [], ls="none")] * len(notes), notes, loc="best", fontsize=7,
              handlelength=0, handletextpad=0, borderpad=0.3, framealpha=0.85)


def draw_lines(axes: dict, curves: Curves, colors: dict, markers: dict, bands: dict | None = None,
               marker_every: int | None = None, lw: float = 1.3,
               log: bool = False) -> tuple[list, list]:
    """Draw ``curves`` on ``axes[panel]``. In a panel where a curve cannot be told from an
    earlier one it is dashed, with a larger hollow marker, on top; returns the legend's
    (handles, labels), which say which curve equals which."""
    twin = curves.twins(log)
    found: dict[str, list] = defaultdict(list)
    present: dict[str, int] = defaultdict(int)
    for panel, per_policy in curves.panels.items():
        ax = axes[panel]
        for policy, (x, y) in per_policy.items():
            present[policy] += 1
            is_twin = policy in twin[panel]
            if is_twin:
                found[policy].append(twin[panel][policy])
            ax.plot(x, y, color=colors[policy], marker=markers[policy], lw=lw,
                    ms=7 if is_twin else 4.5, mfc="none" if is_twin else colors[policy],
                    ls=TWIN_STYLE if is_twin else "-", zorder=3 if is_twin else 2,
                    markevery=marker_every)
            if bands and (panel, policy) in bands:
                lo, hi = bands[panel, policy]
                ax.fill_between(x, lo, hi, color=colors[policy], alpha=0.15, lw=0)
        groups = crowds(twin[panel], list(per_policy))
        if groups:
            _name_crowds(ax, groups)
    handles, labels = [], []
    for policy in curves.order():
        everywhere = len(found[policy]) == present[policy]
        handles.append(Line2D([], [], color=colors[policy], marker=markers[policy],
                              ms=7 if everywhere else 4.5,
                              mfc="none" if everywhere else colors[policy],
                              ls=TWIN_STYLE if everywhere else "-"))
        labels.append(_twin_label(policy, found[policy], present[policy]))
    return handles, labels


def save(fig, out: Target, stem: str, ctx: FigureContext) -> list:
    """Save ``fig`` in every format and close it; returns the paths. A target without a
    folder (the Python API's ``Results.plot()``) gets ``[fig]`` back, open."""
    if out.folder is None:
        return [fig]
    if out.ledger is not None:
        data = figure_data(fig)
        earlier = repeated(data, out.ledger.data)
        if earlier:
            out.ledger.repeats[f"{out.prefix}{stem}"] = earlier
            plt.close(fig)
            return []
        out.ledger.data[f"{out.prefix}{stem}"] = data
    paths = []
    for fmt in ctx.formats:
        path = out.folder / f"{out.prefix}{stem}.{fmt}"
        fig.savefig(path, dpi=ctx.dpi)
        paths.append(path)
    plt.close(fig)
    return paths

