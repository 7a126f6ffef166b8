"""``window``: the last ``budget`` tokens, as a ring buffer."""

import numpy as np

from kvsim.numerics.decode import observe_nothing
from kvsim.policies import ring
from kvsim.policies.base import Group, Policy, Presentation, Steps
from kvsim.policies.layout import RING


def _start(prompt: Group, budget: int, params: dict, T: int):
    P = prompt.prompt_len
    start = max(0, P - budget)
    return np.arange(start, P), ring.Ring(0, start, budget)


POLICY = Policy("window", "last B tokens (sliding window)", {},
                Steps(_start, ring.admit, observe_nothing, ring.decode),
                presentation=Presentation(
                    family="recency", color="#1f77b4", marker="s",
                    reads="nothing",
                    rule="the last `B` tokens (ring buffer)"),
                layout=RING)
