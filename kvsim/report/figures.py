"""Report figures, drawn from a run's tidy rows (matplotlib, Agg backend)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvsim.scenario.load import Scenario  # noqa: E402

MAX_TIME_PANELS = 4
RASTER_BINS = 256


@dataclass(frozen=True)
class Target:
    """Where figures go: a folder and a file-name prefix (for sweep variants)."""

    folder: Path
    prefix: str = ""


def policy_colors(scenario: Scenario) -> dict[str, str]:
    """One colour per policy label, the same in every figure of the scenario."""
    labels = list(dict.fromkeys(p.label for e in scenario.experiments for p in e.policies))
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    return {label: matplotlib.colors.to_hex(cmap(i % cmap.N)) for i, label in enumerate(labels)}


def _by_policy_budget(rows: list[dict], metric: str) -> dict[str, dict[int, np.ndarray]]:
    """metric values over seeds and heads, grouped as {policy: {budget: values}}.

    NaN values (a head without ground truth, a run without decode steps) are left out.
    """
    groups: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if not np.isnan(r[metric]):
            groups[r["policy"]][r["budget"]].append(r[metric])
    return {p: {b: np.array(v, float) for b, v in sorted(d.items())} for p, d in groups.items()}


def _save(fig, out: Target, stem: str, scenario: Scenario) -> list[Path]:
    paths = []
    for fmt in scenario.formats:
        path = out.folder / f"{out.prefix}{stem}.{fmt}"
        fig.savefig(path, dpi=scenario.dpi)
        paths.append(path)
    plt.close(fig)
    return paths


MARKERS = "osD^vP*Xh<>"


def _line_with_band(ax, x, values: list[np.ndarray], color: str, label: str, i: int) -> None:
    mean = np.array([v.mean() for v in values])
    # Distinct markers keep overlapping curves (e.g. a policy on the oracle) visible.
    ax.plot(x, mean, marker=MARKERS[i % len(MARKERS)], ms=5, mfc="none", color=color,
            label=label)
    if max(v.size for v in values) > 1:
        ax.fill_between(x, [v.min() for v in values], [v.max() for v in values],
                        color=color, alpha=0.2, lw=0)


def pareto(scenario, exp, rows, steps, colors, out):
    """Compression (share of the sequence evicted) against important-token recall."""
    recall = _by_policy_budget(rows, "final_recall")
    compression = _by_policy_budget(rows, "compression")
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    for policy, per_budget in recall.items():
        x = [compression[policy][b].mean() for b in per_budget]
        y = [v.mean() for v in per_budget.values()]
        if len(exp.budgets) == 1:
            ax.scatter(x, y, s=220, color=colors[policy], edgecolor="black", lw=0.8,
                       zorder=5, label=policy)
            ax.annotate(policy, (x[0], y[0]), xytext=(8, 6), textcoords="offset points",
                        fontsize=10)
        else:
            ax.plot(x, y, marker="o", color=colors[policy], label=policy)
    if len(exp.budgets) == 1:
        base = exp.budgets[0] / scenario.T
        ax.axhline(base, color="tab:gray", ls="--", label=f"random baseline ({base:.1%})")
    else:
        grid = np.linspace(0, 1, 50)
        ax.plot(grid, 1 - grid, color="tab:gray", ls="--", label="random baseline (kept / T)")
    ax.axhline(1.0, color="black", ls=":", alpha=0.4, label="oracle")
    budgets = "/".join(str(b) for b in exp.budgets) if len(exp.budgets) <= 3 else \
        f"{exp.budgets[0]}..{exp.budgets[-1]}"
    ax.set(xlabel="compression ratio (fraction of KV evicted)", ylabel="important-token recall",
           xlim=(0, 1), ylim=(0, 1.05))
    ax.set_title(f"{scenario.name}/{exp.name}: KV compression Pareto @ budget={budgets}/{scenario.T}",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize=9)
    fig.tight_layout()
    return _save(fig, out, f"{exp.name}_pareto", scenario)


def _against_budget(scenario, exp, rows, colors, out, metric, ylabel, stem):
    values = _by_policy_budget(rows, metric)
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    for i, (policy, per_budget) in enumerate(values.items()):
        _line_with_band(ax, list(per_budget), list(per_budget.values()), colors[policy], policy, i)
    if metric == "final_recall" and exp.prompt_len == scenario.T:
        b = np.array(exp.budgets)
        ax.plot(b, np.minimum(1, b / scenario.T), color="tab:gray", ls="--",
                label="random expectation (B / T)")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="budget (tokens)", ylabel=ylabel, ylim=(0, 1.05))
    ax.set_title(f"{scenario.name}/{exp.name}: {ylabel} vs budget "
                 f"(P={exp.prompt_len}, T={scenario.T})", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out, f"{exp.name}_{stem}", scenario)


def recall_vs_budget(scenario, exp, rows, steps, colors, out):
    """Final important-token recall against budget, band = spread over seeds and heads."""
    return _against_budget(scenario, exp, rows, colors, out, "final_recall",
                           "important-token recall", "recall_vs_budget")


def mass_vs_budget(scenario, exp, rows, steps, colors, out):
    """Mean retained attention mass over decode steps against budget."""
    return _against_budget(scenario, exp, rows, colors, out, "mass_mean",
                           "mean attention mass kept", "mass_vs_budget")


def mass_over_time(scenario, exp, rows, steps, colors, out):
    """Attention mass kept at each decode step, a panel per budget (mean over seeds, heads)."""
    budgets = list(exp.budgets)
    if len(budgets) > MAX_TIME_PANELS:
        budgets = [budgets[i] for i in np.linspace(0, len(budgets) - 1, MAX_TIME_PANELS).astype(int)]
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 3.6), sharey=True,
                             squeeze=False)
    t = np.arange(exp.prompt_len, scenario.T)
    for ax, budget in zip(axes[0], budgets):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            units = [r["unit"] for r in rows if r["policy"] == policy and r["budget"] == budget]
            ax.plot(t, steps.arrays()["mass"][units].mean(axis=0), color=colors[policy], lw=1,
                    label=policy)
        ax.set(title=f"budget {budget}", xlabel="decode position t")
        ax.grid(True, alpha=0.3)
    axes[0][0].set(ylabel="attention mass kept", ylim=(0, 1.05))
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center right")
    fig.suptitle(f"{scenario.name}/{exp.name}: mass over decoding (P={exp.prompt_len})")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    return _save(fig, out, f"{exp.name}_mass_over_time", scenario)


def _occupancy(snapshots: np.ndarray, T: int, bins: int) -> np.ndarray:
    """(bins, snapshots) share of each position bin held in the cache at each snapshot."""
    width = -(-T // bins)
    image = np.zeros((-(-T // width), snapshots.shape[0]))
    for j, cached in enumerate(snapshots):
        cached = cached[cached >= 0]
        np.add.at(image[:, j], cached // width, 1.0)
    return image / width


def _visible(occupancy: np.ndarray) -> np.ndarray:
    """Grey level of a bin: any cached key shows (0.35), a full bin is black (1)."""
    return np.where(occupancy > 0, 0.35 + 0.65 * occupancy, 0.0)


def kept_raster(scenario, exp, rows, steps, colors, out):
    """Which positions are cached at each decode step: a panel per policy (focus budget)."""
    seed = scenario.seeds[0]
    labels = [p.label for p in exp.policies if (p.label, seed, 0) in steps.snapshots]
    if not labels:
        return []
    cols = min(3, len(labels))
    nrows = -(-len(labels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False,
                             sharex=True, sharey=True)
    t = exp.prompt_len + steps.snap_steps
    for ax, label in zip(axes.flat, labels):
        image = _visible(_occupancy(steps.snapshots[label, seed, 0], scenario.T, RASTER_BINS))
        ax.imshow(image, origin="lower", aspect="auto", cmap="Greys", vmin=0, vmax=1,
                  extent=(t[0], t[-1] + 1, 0, scenario.T), interpolation="nearest")
        ax.plot([t[0], t[-1]], [t[0], t[-1]], color="tab:red", lw=0.6, alpha=0.6)
        ax.set_title(label, color=colors[label], fontsize=10)
    for ax in axes.flat[len(labels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("decode step t")
    for ax in axes[:, 0]:
        ax.set_ylabel("key position")
    fig.suptitle(f"{scenario.name}/{exp.name}: cached positions at budget {exp.focus_budget} "
                 f"(seed {seed}, KV head 0; grey: some keys of a bin cached, black: all; red: t)",
                 fontsize=10)
    fig.tight_layout()
    return _save(fig, out, f"{exp.name}_kept_raster", scenario)


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


def allocation(scenario, exp, rows, steps, colors, out):
    """Per policy at the focus budget: each KV head's cap b_h (layer x KV head), beside the
    attention mass it keeps."""
    labels = [p.label for p in exp.policies]
    fig, axes = plt.subplots(len(labels), 2, squeeze=False,
                             figsize=(7.5, 0.8 + 2.6 * len(labels)))
    for row, label in enumerate(labels):
        layers, kvs, caps, mass = allocation_grids(rows, label, exp.focus_budget)
        for ax, grid, title, cmap in ((axes[row][0], caps, "cap b_h (tokens)", "viridis"),
                                      (axes[row][1], mass, "mass kept (mean over steps)",
                                       "magma")):
            image = ax.imshow(grid, aspect="auto", origin="lower", cmap=cmap,
                              interpolation="nearest")
            fig.colorbar(image, ax=ax)
            ax.set(title=f"{label}: {title}", xlabel="KV head", ylabel="layer",
                   xticks=range(len(kvs)), xticklabels=kvs)
            ticks = np.unique(np.linspace(0, len(layers) - 1, min(len(layers), 6)).astype(int))
            ax.set_yticks(ticks, [str(layers[t]) for t in ticks])
    fig.suptitle(f"{scenario.name}, {exp.name}: allocation '{exp.allocation}' at mean "
                 f"budget B = {exp.focus_budget}", fontsize=10)
    fig.tight_layout()
    return _save(fig, out, f"{exp.name}_allocation", scenario)


FIGURE_FUNCTIONS = {"pareto": pareto, "recall_vs_budget": recall_vs_budget,
                    "mass_vs_budget": mass_vs_budget, "mass_over_time": mass_over_time,
                    "kept_raster": kept_raster, "allocation": allocation}


def field_figures(scenario: Scenario, samples, out: Target) -> list[Path]:
    """Per head: a heatmap of a window of rows and the column-sum distribution (log-log)."""
    if not samples:
        return []
    n = len(samples)
    fig, axes = plt.subplots(2, n, figsize=(3.8 * n, 6.6), squeeze=False)
    for h, sample in enumerate(samples):
        ax = axes[0][h]
        image = np.log10(np.maximum(sample.heatmap, 1e-8))
        ax.imshow(image, origin="lower", aspect="auto", cmap="magma", vmin=-6, vmax=0,
                  extent=(0, sample.heatmap.shape[1] * sample.bin_width, sample.rows[0],
                          sample.rows[-1] + 1), interpolation="nearest")
        ax.set(title=f"head {h}: log10 p(q, k)", xlabel="key position k", ylabel="query q")
        ax = axes[1][h]
        ranked = np.sort(sample.colsum)[::-1]
        ranked = ranked[ranked > 0]
        # The curve at up to ~2,000 log-spaced ranks (first and last included): the same
        # picture on log-log axes, without drawing T points.
        at = np.unique(np.geomspace(1, max(ranked.size, 1), 2000).round().astype(np.int64))
        at = at[at <= ranked.size]
        ax.loglog(at, ranked[at - 1], color="tab:blue", lw=1)
        ax.set(xlabel="key rank", ylabel="column sum (attention received)",
               title=f"head {h}: column sums")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{scenario.name}: the attention field (seed {scenario.seeds[0]})", fontsize=10)
    fig.tight_layout()
    return _save(fig, out, "field", scenario)
