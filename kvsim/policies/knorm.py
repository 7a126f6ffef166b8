"""``knorm``: keep the keys of lowest L2 norm (Devoto et al. 2024: low-norm keys draw attention).

A score-only rule (:mod:`kvsim.policies.scored`): the score ``-||k||`` is static.
"""

import numpy as np

from kvsim.numerics.jit import jit, jit_inline
from kvsim.policies.base import Presentation
from kvsim.policies.scored import score_policy


@jit_inline
def key_norm(keys, k):
    """L2 norm of key ``k`` (keys by dimension), the squares summed in order of dimension."""
    total = 0.0
    for i in range(keys.shape[0]):
        x = np.float64(keys[i, k])
        total += x * x
    return np.sqrt(total)


@jit
def key_norms(keys, lo, hi):
    """:func:`key_norm` of keys ``lo .. hi-1``."""
    out = np.empty(hi - lo)
    for k in range(lo, hi):
        out[k - lo] = key_norm(keys, k)
    return out


POLICY = score_policy("knorm", "recent newest + the keys of lowest L2 norm (static score -||k||)",
                      lambda group, lo, hi, params: -key_norms(group.keys, lo, hi),
                      needs=frozenset({"keys"}),
                      presentation=Presentation(
                          family="key geometry", color="#8c510a", marker="<",
                          reads="keys",
                          rule=("Knorm (Devoto et al. 2024): the newest + the keys of lowest L2 norm "
                                "(static score `-‖k‖`)")))
