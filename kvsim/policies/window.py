"""``window``: the last ``budget`` tokens, as a ring buffer."""

import numpy as np

from kvsim import kernels
from kvsim.policies.base import Head, Policy, Trace, run_decode


def _run(head: Head, budget: int, params: dict) -> Trace:
    P = head.prompt_len
    start = max(0, P - budget)
    return run_decode(head, budget, np.arange(start, P),
                      evict_rule=kernels.EVICT_RING, ring=(0, start, budget))


POLICY = Policy("window", "last B tokens (sliding window)", {}, _run)
