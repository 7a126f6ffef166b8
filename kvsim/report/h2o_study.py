"""Online versus offline H2O: per-step mass, overlap of kept sets, and the age bias."""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np

from kvsim.report.figures import Target, _save, policy_colors
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


def applies(exp: Experiment) -> bool:
    """Whether the experiment runs both online and offline H2O with decode steps."""
    kinds = {p.kind for p in exp.policies}
    return ONLINE in kinds and OFFLINE in kinds


def _labels(exp: Experiment, kind: str) -> list[str]:
    return [p.label for p in exp.policies if p.kind == kind]


def _jaccard(a: np.ndarray, b: np.ndarray) -> float:
    a, b = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
    return len(a & b) / len(a | b) if a | b else 1.0


def _pairs(steps, online: str, offline: str):
    """(online, offline) snapshot arrays over every seed and KV head recorded."""
    return [(snaps, steps.snapshots[offline, seed, kv])
            for (label, seed, kv), snaps in steps.snapshots.items()
            if label == online and (offline, seed, kv) in steps.snapshots]


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


def figures(scenario: Scenario, exp: Experiment, rows: list[dict], steps, out: Target) -> list:
    """Mass over time, kept-set overlap over time, and where the kept sets differ."""
    colors = policy_colors(scenario)
    offline = _labels(exp, OFFLINE)[0]
    labels = _labels(exp, ONLINE) + _labels(exp, OFFLINE)
    mass = steps.arrays()["mass"]
    t = np.arange(exp.prompt_len, scenario.T)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.0))
    ax = axes[0]
    for label in labels:
        units = [r["unit"] for r in rows if r["policy"] == label and r["budget"] == exp.focus_budget]
        ax.plot(t, mass[units].mean(axis=0), color=colors[label], lw=1, label=label)
    ax.set(xlabel="decode position t", ylabel="attention mass kept", ylim=(0, 1.05),
           title=f"mass at budget {exp.focus_budget}")
    ax.legend(fontsize=8)
    ax = axes[1]
    snap_t = exp.prompt_len + steps.snap_steps
    for online in _labels(exp, ONLINE):
        pairs = _pairs(steps, online, offline)
        if pairs:
            overlap = np.mean([[_jaccard(x, y) for x, y in zip(a, b)] for a, b in pairs], axis=0)
            ax.plot(snap_t, overlap, color=colors[online], label=f"{online} vs {offline}")
    ax.set(xlabel="decode position t", ylabel="Jaccard overlap of kept sets", ylim=(0, 1.05),
           title="how far online H2O drifts from offline")
    ax.legend(fontsize=8)
    ax = axes[2]
    edges = np.linspace(0, scenario.T, AGE_BINS + 1)
    for online in _labels(exp, ONLINE):
        pairs = _pairs(steps, online, offline)
        only_on = np.concatenate([np.setdiff1d(a[-1][a[-1] >= 0], b[-1]) for a, b in pairs]
                                 or [np.zeros(0)])
        ax.hist(only_on, bins=edges, histtype="step", color=colors[online], lw=1.2,
                label=f"held by {online}, not offline")
    pairs = _pairs(steps, _labels(exp, ONLINE)[0], offline)
    only_off = np.concatenate([np.setdiff1d(b[-1][b[-1] >= 0], a[-1]) for a, b in pairs]
                              or [np.zeros(0)])
    ax.hist(only_off, bins=edges, histtype="stepfilled", color=colors[offline], alpha=0.3,
            label=f"held by {offline}, not {_labels(exp, ONLINE)[0]}")
    ax.axvline(exp.prompt_len, color="black", ls=":", lw=0.8)
    ax.set(xlabel="key position", ylabel="keys (all seeds and KV heads)",
           title="where the final kept sets differ")
    ax.legend(fontsize=7)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{scenario.name}/{exp.name}: online vs offline H2O (budget {exp.focus_budget})",
                 fontsize=10)
    fig.tight_layout()
    return _save(fig, out, f"{exp.name}_h2o_online_vs_offline", scenario)
