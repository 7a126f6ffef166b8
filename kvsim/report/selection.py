"""Which figures a report draws: the most telling first, at most ``output.max_figures``,
none repeating another's data, each with the question it answers (said in report.md)."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import numpy as np

# Drawn in this order (then in report order) until the report holds max_figures: the
# comparison a report exists for first, the input field and time series last.
RANKS = {"allocation_vs_uniform": 0, "mass_vs_bytes": 0, "protocols_vs_per_step": 0,
         "policy_ranking": 1, "policy_families": 1, "allocation": 1, "mass_vs_budget": 2,
         "recall_vs_budget": 2, "error_vs_budget": 3, "study": 4, "kept_raster": 5, "field": 6,
         "mass_over_time": 7, "recall_over_time": 8, "error_over_time": 8, "pareto": 8,
         "column_sums": 9}

PURPOSES = {
    "allocation_vs_uniform": "does AdaKV or PyramidKV keep more attention mass than uniform "
                             "allocation at equal memory? (the sign per policy and budget)",
    "mass_vs_bytes": "evict or quantise: at equal bytes, which cache keeps its attention "
                     "output closer to the full one? (each storage's own mass measure on the "
                     "left, the output error every storage shares on the right)",
    "protocols_vs_per_step": "what does each protocol cost against per-step eviction of the "
                             "same policy at equal peak memory? (small points: each head and "
                             "seed)",
    "policy_ranking": "which policies keep the most attention mass (and the least output "
                      "error), at every budget? (ranked rows)",
    "policy_families": "how do the policies of one family differ from one another across "
                       "budgets? (the other policies grey)",
    "mass_vs_budget": "how much attention mass does each policy keep as the budget grows, "
                      "per head?",
    "recall_vs_budget": "which policies keep the planted important tokens, per budget and "
                        "head?",
    "error_vs_budget": "how far is each cache's attention output from the full cache's, per "
                       "budget and head?",
    "pareto": "recall against the share of keys evicted (requested in the scenario)",
    "mass_over_time": "when during decoding does each policy lose attention mass?",
    "error_over_time": "when during decoding does each policy's output error grow?",
    "recall_over_time": "when do the important tokens leave each cache?",
    "kept_raster": "which positions does each policy hold at each step? (what it keeps, not "
                   "how much)",
    "allocation": "how does the allocation spread the budget over layers and KV heads, and "
                  "what mass does each keep?",
    "field": "what does the attention look like around the end of the prompt? (the input, "
             "before any policy)",
    "column_sums": "how concentrated is the attention the keys receive? (the heavy "
                   "hitters' share, per head)",
    "h2o": "how does online H2O's kept set differ from offline (clairvoyant) H2O's?",
    "protocols": "do thresholds keep more mass than top-k at equal mean cache size?",
}


@dataclass
class Job:
    """A figure the report may draw: ``key`` places it in report.md, ``name`` its rank and
    purpose, ``stem`` its file (for notes); ``draw(*args)`` returns the files written."""

    key: tuple
    name: str
    stem: str
    draw: Callable
    args: tuple
    rank: int = 0

    @property
    def purpose(self) -> str:
        return PURPOSES[self.name]


def order(jobs: list[Job]) -> list[Job]:
    """``jobs`` in drawing order: by rank, then in report order."""
    return sorted(jobs, key=lambda j: j.rank)  # stable: report order within a rank


def draw(jobs: list[Job], limit: int) -> tuple[dict, dict, list[Job]]:
    """Draw ``jobs`` in :func:`order` until ``limit`` figures are written: returns the
    files by key, each file's purpose, and the jobs left undrawn."""
    drawn: dict = defaultdict(list)
    purposes: dict = {}
    count, left = 0, []
    for job in order(jobs):
        if count >= limit:
            left.append(job)
            continue
        paths = job.draw(*job.args)
        if paths:
            count += 1
            drawn[job.key].extend(paths)
            purposes.update({p: job.purpose for p in paths})
    return drawn, purposes, left


def experiment_digests(exp, rows: list[dict], steps) -> dict[str, str]:
    """``{policy label: digest}`` of everything a figure of ``exp`` draws of that policy
    (budgets, heads, seeds, per-step series, cached positions): an experiment whose every
    label's digest appears in an earlier one repeats that one's figures."""
    arrays = steps.arrays()
    out = {}
    for p in exp.policies:
        mine = sorted((r for r in rows if r["policy"] == p.label),
                      key=lambda r: (r["budget"], r["seed"], r["layer"], r["head"]))
        digest = hashlib.sha256(f"{exp.prompt_len} {p.label}".encode())
        for r in mine:
            digest.update(f"{r['budget']} {r['seed']} {r['layer']} {r['head']}".encode())
            for name in ("mass", "recall", "error"):
                digest.update(np.ascontiguousarray(arrays[name][r["unit"]]).tobytes())
        for key, snaps in sorted(steps.snapshots.items(), key=str):
            if key[0] == p.label:
                digest.update(np.ascontiguousarray(snaps).tobytes())
        out[p.label] = digest.hexdigest()
    return out


def repeats(digests: dict[str, str], earlier: dict[str, dict[str, str]]) -> str | None:
    """The earlier experiment whose results hold every one of ``digests``, or None."""
    for name, theirs in earlier.items():
        if digests and set(digests.values()) <= set(theirs.values()):
            return name
    return None
