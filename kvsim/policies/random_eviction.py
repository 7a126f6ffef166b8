"""``random``: a uniformly random prompt subset, then uniformly random evictions."""

import numpy as np

from kvsim import kernels
from kvsim.policies.base import Head, Policy, Trace, run_decode


def _run(head: Head, budget: int, params: dict) -> Trace:
    P = head.prompt_len
    rng = np.random.default_rng(head.seed)
    kept = np.sort(rng.choice(P, size=budget, replace=False)) if P > budget else np.arange(P)
    slots = rng.integers(0, budget, size=head.T - P).astype(np.int64)
    return run_decode(head, budget, kept.astype(np.int64), evict_rule=kernels.EVICT_SLOT,
                      evict_slots=slots)


POLICY = Policy("random", "random prompt subset, random evictions (seeded baseline)", {}, _run)
