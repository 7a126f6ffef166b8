"""``streaming_llm``: attention sinks plus a ring of the newest tokens (Xiao et al. 2023)."""

import dataclasses

import numpy as np

from kvsim.numerics.decode import observe_nothing
from kvsim.policies import ring
from kvsim.policies.base import Group, Param, Policy, Presentation, Steps
from kvsim.policies.layout import RING

PARAMS = {
    "sinks": Param(int, 4, "number of first tokens always kept", check=lambda v: v >= 0,
                   expect="an integer >= 0"),
}


def _start(prompt: Group, budget: int, params: dict, T: int):
    P, sinks = prompt.prompt_len, params["sinks"]
    width = budget - sinks
    start = max(sinks, P - width)  # oldest position in the ring
    kept = np.concatenate((np.arange(min(sinks, P)), np.arange(start, P)))
    return kept, ring.Ring(sinks, start, width)


POLICY = Policy("streaming_llm", "sinks first tokens + last B - sinks tokens", PARAMS,
                Steps(_start, ring.admit, observe_nothing, ring.decode),
                min_budget=lambda params: params["sinks"] + 1,
                fixed=lambda budget, prompt_len, params: params["sinks"],
                presentation=Presentation(
                    family="recency", color="#17becf", marker="D",
                    reads="nothing",
                    rule="the first `sinks` tokens + the last `B - sinks` (Xiao et al. 2023)"),
                layout=dataclasses.replace(RING, sinks=lambda params: params["sinks"]))
