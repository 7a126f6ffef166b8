"""``knorm``: keep the keys of lowest L2 norm (Devoto et al. 2024: low-norm keys draw attention).

The score ``-||k||`` is static, so the rule is ``h2o_offline``'s with other scores: keep the
``recent`` newest and the best-ranked others; evict the lowest score outside the newest.
"""

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.jit import jit
from kvsim.policies.base import Group, Param, Policy, Trace, run_decode
from kvsim.policies.h2o import _prefill, recent_count

PARAMS = {
    "recent_ratio": Param(float, 0.0, "share of the budget kept for the newest tokens",
                          check=lambda v: 0.0 <= v < 1.0, expect="a number in [0, 1)"),
}


@jit
def key_norms(keys):
    """L2 norm of every key, from keys stored by dimension (d, T); the squares summed over
    the dimensions in order."""
    d, T = keys.shape
    total = np.zeros(T)
    for i in range(d):
        dim = keys[i]
        for k in range(T):
            x = np.float64(dim[k])
            total[k] += x * x
    return np.sqrt(total)


def _run(group: Group, budget: int, params: dict) -> Trace:
    recent = recent_count(budget, params)
    score = -key_norms(group.field.keys[int(group.heads[0]) // group.field.group])
    kept = _prefill(group, budget, recent, score)
    return run_decode(group, budget, kept, score=score[kept], static_score=score,
                      evict_rule=kernels.EVICT_LOWEST, recent=recent)


POLICY = Policy("knorm", "recent newest + the keys of lowest L2 norm (static score -||k||)",
                PARAMS, _run, needs=("keys",))
