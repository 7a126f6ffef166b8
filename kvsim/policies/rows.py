"""Single attention rows of a group's query heads, for prefill selections."""

import numpy as np

from kvsim.numerics.kernels import row_sums
from kvsim.policies.base import Group


def head_rows(group: Group, q: int) -> list[np.ndarray]:
    """The full attention row of query ``q`` (keys ``0 .. q``) of each head of the group."""
    return [row_sums(group.field, group.row_max, group.row_sum, int(h), q, q + 1)[:q + 1]
            for h in group.heads]
