"""Online versus offline H2O: per-step mass, overlap of kept sets, and the age bias."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np

from kvsim.report.plotting import (FigureContext, Target, at_least_a_decade, figure_title,
                                   log_axis, policy_colors, save)
from kvsim.report.stats import plural
from kvsim.scenario.load import Experiment, Scenario

ONLINE, OFFLINE = "h2o", "h2o_offline"
AGE_BINS = 48


@dataclass
class Comparison:
    """Numbers the report quotes for one online H2O configuration against offline H2O."""

    online: str
    offline: str
    mass_online: float
    mass_offline: float
    final_jaccard: float
    online_only_position: float   # mean position of keys only online H2O keeps
    offline_only_position: float  # mean position of keys only offline H2O keeps


def applies(scenario: Scenario, exp: Experiment) -> bool:
    """Whether the experiment runs both online and offline H2O with decode steps."""
    kinds = {p.kind for p in exp.policies}
    return ONLINE in kinds and OFFLINE in kinds and exp.prompt_len < scenario.T


def _labels(exp: Experiment, kind: str) -> list[str]:
    return [p.label for p in exp.policies if p.kind == kind]


def _jaccard(a: np.ndarray, b: np.ndarray) -> float:
    a, b = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
    return len(a & b) / len(a | b) if a | b else 1.0


def _pairs(steps, online: str, offline: str, kv_head: int | None = None):
    """(online, offline) snapshot arrays over every seed and KV head recorded (or over the
    seeds of ``kv_head``)."""
    return [(snaps, steps.snapshots[offline, seed, kv])
            for (label, seed, kv), snaps in steps.snapshots.items()
            if label == online and (offline, seed, kv) in steps.snapshots
            and kv_head in (None, kv)]


def compare(scenario: Scenario, exp: Experiment, rows: list[dict], steps) -> list[Comparison]:
    """One :class:`Comparison` per online H2O configuration (against the first offline one)."""
    offline = _labels(exp, OFFLINE)[0]
    focus = [r for r in rows if r["budget"] == exp.focus_budget]
    mass = {label: float(np.mean([r["mass_mean"] for r in focus if r["policy"] == label]))
            for label in _labels(exp, ONLINE) + [offline]}
    out = []
    for online in _labels(exp, ONLINE):
        pairs = _pairs(steps, online, offline)
        jaccard = float(np.mean([_jaccard(a[-1], b[-1]) for a, b in pairs])) if pairs else np.nan
        only_on = [p for a, b in pairs for p in np.setdiff1d(a[-1][a[-1] >= 0], b[-1])]
        only_off = [p for a, b in pairs for p in np.setdiff1d(b[-1][b[-1] >= 0], a[-1])]
        out.append(Comparison(online, offline, mass[online], mass[offline], jaccard,
                              float(np.mean(only_on)) if only_on else np.nan,
                              float(np.mean(only_off)) if only_off else np.nan))
    return out


def _variant(exp: Experiment, label: str) -> str:
    """What distinguishes one online H2O configuration, in words."""
    params = next(p.params for p in exp.policies if p.label == label)
    words = ["full-attention scores" if params.get("accumulate") == "full"
             else "observed (renormalised) scores"]
    if params.get("normalize"):
        words.append("divided by the number of queries that saw the key")
    return ", ".join(words)


def section(scenario: Scenario, exp: Experiment, rows: list[dict], steps) -> list[str]:
    """The report's H2O section: a sentence computed from the results, what each variant
    that ran does, and a table."""
    comparisons = compare(scenario, exp, rows, steps)
    offline = comparisons[0].offline
    heads, seeds = len({r["head"] for r in rows}), len(scenario.seeds)
    sentence = (f"At B = {exp.focus_budget}, offline H2O (`{offline}`) keeps "
                f"{comparisons[0].mass_offline:.3f} of the attention mass (mean over "
                f"{plural(heads, 'head')} and {plural(seeds, 'seed')}); " + "; ".join(
                    f"online `{c.online}` keeps {c.mass_online:.3f}"
                    + ("" if np.isnan(c.final_jaccard) else
                       f", its final kept set overlapping offline's with a Jaccard index of "
                       f"{c.final_jaccard:.2f}") for c in comparisons) + ".")
    lines = [f"#### Online versus offline H2O (B = {exp.focus_budget})", "", sentence, "",
             f"Offline H2O (`{offline}`) ranks a key by its column sum over the whole attention "
             "matrix, future queries included, which no deployed system knows. The online "
             "variants that ran score a key by the attention it has received so far:", ""]
    lines += [f"- `{c.online}`: {_variant(exp, c.online)}." for c in comparisons]
    lines += ["", "The overlap panel shows how far each online cache drifts from the offline "
              "one; the last panel shows which positions each keeps that the other does not.", "",
              "| online | mass online | mass offline | final Jaccard | mean position only "
              "online | mean position only offline |",
              "| --- | --- | --- | --- | --- | --- |"]
    for c in comparisons:
        lines.append(f"| `{c.online}` | {c.mass_online:.3f} | {c.mass_offline:.3f} | "
                     f"{c.final_jaccard:.2f} | {_position(c.online_only_position)} | "
                     f"{_position(c.offline_only_position)} |")
    return lines + [""]


KV_STYLES = ("-", (0, (5, 2)), ":", "-.")  # one per KV head, up to four drawn apart


def _overlap_panel(ctx: FigureContext, exp: Experiment, steps, colors: dict, offline: str,
                   ax) -> None:
    """Jaccard overlap of each online cache with the offline one over decoding, one line per
    KV head (a line style each): the heads follow unlike patterns, and a mean over them
    would hide the one that drifts. Past four KV heads: their mean, with their range."""
    snap_t = exp.prompt_len + steps.snap_steps
    kvs = sorted({kv for (_, _, kv) in steps.snapshots})
    apart = len(kvs) <= len(KV_STYLES)
    for online in _labels(exp, ONLINE):
        per_kv = {}
        for kv in kvs:
            pairs = _pairs(steps, online, offline, kv)
            if pairs:
                per_kv[kv] = np.mean([[_jaccard(x, y) for x, y in zip(a, b)] for a, b in pairs],
                                     axis=0)
        if not per_kv:
            continue
        if apart:
            for kv, overlap in per_kv.items():
                ax.plot(snap_t, overlap, color=colors[online], ls=KV_STYLES[kvs.index(kv)],
                        lw=1.2)
        else:
            stack = np.array(list(per_kv.values()))
            ax.fill_between(snap_t, stack.min(axis=0), stack.max(axis=0), color=colors[online],
                            alpha=0.15, lw=0)
            ax.plot(snap_t, stack.mean(axis=0), color=colors[online], lw=1.2)
        ax.plot([], [], color=colors[online], label=f"{online} vs {offline}")
    if apart and len(kvs) > 1:
        per_query = ctx.heads // ctx.kv_heads
        for kv in kvs:
            name = ctx.head_names[kv] if per_query == 1 and kv < len(ctx.head_names) else ""
            ax.plot([], [], color="0.3", ls=KV_STYLES[kvs.index(kv)],
                    label=f"KV head {kv}" + (f" ({name})" if name else ""))
    how = ("per KV head, mean over seeds" if apart else
           f"mean over {plural(len(kvs), 'KV head')}, band: their range; mean over seeds")
    ax.set(xlabel="decode position t", ylabel="Jaccard overlap of kept sets", ylim=(0, 1.03),
           title=f"how far online H2O drifts from offline\n({how})")
    ax.legend(fontsize=7, loc="lower left")  # the overlaps run high, near 1


def _position(x: float) -> str:
    return "none" if np.isnan(x) else f"{x:,.0f}"


def figures(ctx: FigureContext, exp: Experiment, rows: list[dict], steps, out: Target) -> list:
    """Mass lost per head, kept-set overlap over time, and where the kept sets differ."""
    colors = policy_colors(ctx)
    offline = _labels(exp, OFFLINE)[0]
    labels = _labels(exp, ONLINE) + _labels(exp, OFFLINE)
    fig, axes = plt.subplots(1, 3, figsize=(10, 4.0))  # 1,200 px at 120 dpi
    ax = axes[0]  # per head: the heads pool unlike patterns, so a mean would hide which one
    heads = sorted({r["head"] for r in rows})
    for i, label in enumerate(labels):
        mine = [r for r in rows if r["policy"] == label and r["budget"] == exp.focus_budget]
        lost = [np.mean([1.0 - r["mass_mean"] for r in mine if r["head"] == h]) for h in heads]
        ax.plot(np.arange(len(heads)) + 0.12 * (i - (len(labels) - 1) / 2), lost, ls="none",
                marker="s" if label in _labels(exp, OFFLINE) else "o", ms=5,
                color=colors[label], label=label)
    log_axis(ax)
    at_least_a_decade(ax, top=1.0)
    names = ctx.head_names
    ax.set_xticks(range(len(heads)), [
        "\n".join([str(h), *textwrap.wrap(names[h], 10)]) if h < len(names) and names[h]
        else str(h) for h in heads], fontsize=7)
    ax.set(xlabel="query head", ylabel="mass lost, 1 - mass (log)",
           title=f"mass lost per head at B = {exp.focus_budget}\n"
                 f"(mean over decode steps and seeds)")
    ax.legend(fontsize=7)
    _overlap_panel(ctx, exp, steps, colors, offline, axes[1])
    ax = axes[2]
    edges = np.linspace(0, ctx.T, AGE_BINS + 1)
    for online in _labels(exp, ONLINE):
        pairs = _pairs(steps, online, offline)
        only_on = np.concatenate([np.setdiff1d(a[-1][a[-1] >= 0], b[-1]) for a, b in pairs]
                                 or [np.zeros(0)])
        ax.hist(only_on, bins=edges, histtype="step", color=colors[online], lw=1.2,
                label=f"held by {online}, not {offline}")
    pairs = _pairs(steps, _labels(exp, ONLINE)[0], offline)
    only_off = np.concatenate([np.setdiff1d(b[-1][b[-1] >= 0], a[-1]) for a, b in pairs]
                              or [np.zeros(0)])
    ax.hist(only_off, bins=edges, histtype="stepfilled", color=colors[offline], alpha=0.3,
            label=f"held by {offline}, not {_labels(exp, ONLINE)[0]}")
    ax.axvline(exp.prompt_len, color="black", ls=":", lw=0.8)
    ax.set(xlabel="key position", ylabel="keys (summed over seeds and KV heads)",
           title="where the final kept sets differ\n(dotted: end of the prompt)")
    entries = len(_labels(exp, ONLINE)) + 1
    ax.set_ylim(0, ax.get_ylim()[1] * (1.1 + 0.1 * entries))  # the legend sits above the bars
    ax.legend(fontsize=7, loc="upper left")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(figure_title(ctx, exp, f"online vs offline H2O at B = {exp.focus_budget}"))
    fig.tight_layout()
    return save(fig, out, f"{exp.name}_h2o_online_vs_offline", ctx)
