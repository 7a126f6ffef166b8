"""The opening sentence of a report that compares protocols: how much attention mass each
protocol costs against per-step eviction at equal peak memory."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

CONVENTION = ("Memory is counted per KV head in keys, protected ones (recent tokens, sinks, "
              "windows, pinned keys) included: `peak_size` and `mean_size` in `results.csv` are "
              "the largest and mean cache over the decode steps, the incoming key counted, and "
              "`effective_ratio` is the peak over the T tokens seen.")


def lines(rows: list[dict]) -> list[str]:
    """One sentence (and a blank line) if ``rows`` hold a protocol other than per-step
    eviction and the same policy kind per step at the same peak; else nothing."""
    groups: dict = defaultdict(list)
    for r in rows:
        if "protocol" in r and not math.isnan(r["mass_mean"]):
            groups[r["kind"], r["protocol"], r["peak_size"]].append(r["mass_mean"])
    costs: dict = defaultdict(list)
    for (kind, protocol, peak), masses in groups.items():
        base = groups.get((kind, "per_step", peak))
        if protocol != "per_step" and base:
            costs[protocol, peak].append((np.mean(base) - np.mean(masses), kind))
    if not costs:
        return []
    parts = []
    for (protocol, peak), items in sorted(costs.items()):
        mean = -float(np.mean([c for c, _ in items]))
        each = ", ".join(f"{k} {-c:+.3f}" for c, k in sorted(items, key=lambda i: i[1]))
        parts.append(f"`{protocol}` changes the mass kept by {mean:+.3f} at a peak of {peak} "
                     f"keys ({each})")
    return ["**At equal peak memory, against per-step eviction:** " + "; ".join(parts)
            + " (attention mass, mean over heads).", ""]
