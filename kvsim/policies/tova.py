"""``tova``: evict the key the previous query attended to least (Oren et al. 2024)."""

import numpy as np

from kvsim import kernels
from kvsim.policies.base import Head, Policy, Trace, run_decode


def _run(head: Head, budget: int, params: dict) -> Trace:
    P = head.prompt_len
    last = head.attn[P - 1] if P > 0 else np.zeros(head.T)
    kept = kernels.top_ranked(last, 0, P, budget)
    return run_decode(head, budget, kept, score=last[kept], evict_rule=kernels.EVICT_LOWEST,
                      update_rule=kernels.UPDATE_SET_OBSERVED)


POLICY = Policy("tova", "evict the lowest attention of the previous query", {}, _run)
