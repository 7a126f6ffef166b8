"""``random``: a uniformly random prompt subset, then uniformly random evictions."""

import numpy as np

from kvsim.numerics import kernels
from kvsim.policies.base import Group, Policy, Trace, run_decode


def _run(group: Group, budget: int, params: dict) -> Trace:
    P = group.prompt_len
    rng = np.random.default_rng(group.seed)
    kept = np.sort(rng.choice(P, size=budget, replace=False)) if P > budget else np.arange(P)
    slots = rng.integers(0, budget, size=group.T - P).astype(np.int64)
    return run_decode(group, budget, kept.astype(np.int64), evict_rule=kernels.EVICT_SLOT,
                      evict_slots=slots)


POLICY = Policy("random", "random prompt subset, random evictions (seeded baseline)", {}, _run)
