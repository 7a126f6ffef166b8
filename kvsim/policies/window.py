"""``window``: the last ``budget`` tokens, as a ring buffer."""

import numpy as np

from kvsim.numerics import kernels
from kvsim.policies.base import Group, Policy, Trace, run_decode


def _run(group: Group, budget: int, params: dict) -> Trace:
    P = group.prompt_len
    start = max(0, P - budget)
    return run_decode(group, budget, np.arange(start, P),
                      evict_rule=kernels.EVICT_RING, ring=(0, start, budget))


POLICY = Policy("window", "last B tokens (sliding window)", {}, _run)
