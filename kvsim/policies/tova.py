"""``tova``: evict the key the previous query attended to least (Oren et al. 2024)."""

import numpy as np

from kvsim.numerics import kernels
from kvsim.policies.base import Group, Policy, Trace, run_decode


def _last_attention(group: Group) -> np.ndarray:
    """The last prompt query's attention, combined over the group (zeros without a prompt)."""
    P = group.prompt_len
    return group.row_scores(P - 1, P) if P > 0 else np.zeros(group.T)


def _run(group: Group, budget: int, params: dict) -> Trace:
    P = group.prompt_len
    last = _last_attention(group)
    kept = kernels.top_ranked(last, 0, P, budget)
    return run_decode(group, budget, kept, score=last[kept], evict_rule=kernels.EVICT_LOWEST,
                      update_rule=kernels.UPDATE_SET_OBSERVED)


POLICY = Policy("tova", "evict the lowest attention of the previous query", {}, _run,
                prefill_score=lambda group, budget, params: _last_attention(group)[:group.prompt_len])
