"""``streaming_llm``: attention sinks plus a ring of the newest tokens (Xiao et al. 2023)."""

import numpy as np

from kvsim.numerics import kernels
from kvsim.policies.base import Group, Param, Policy, Trace, run_decode

PARAMS = {
    "sinks": Param(int, 4, "number of first tokens always kept", check=lambda v: v >= 0,
                   expect="an integer >= 0"),
}


def _run(group: Group, budget: int, params: dict) -> Trace:
    P, sinks = group.prompt_len, params["sinks"]
    width = budget - sinks
    start = max(sinks, P - width)  # oldest position in the ring
    kept = np.concatenate((np.arange(min(sinks, P)), np.arange(start, P)))
    return run_decode(group, budget, kept, evict_rule=kernels.EVICT_RING,
                      ring=(sinks, start, width))


POLICY = Policy("streaming_llm", "sinks first tokens + last B - sinks tokens", PARAMS, _run,
                min_budget=lambda params: params["sinks"] + 1,
                fixed=lambda budget, prompt_len, params: params["sinks"])
