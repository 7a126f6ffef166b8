"""The seed notebook's planted attention matrix, reproduced bit for bit.

The notebook draws 32 important positions, gives every causal entry weight 1 plus 8
on important keys, adds exponential noise, and row-normalises in float32. The numpy
calls below are the notebook's, in the notebook's order.
"""

import numpy as np


def planted_matrix(T: int = 512, important: int = 32, boost: float = 8.0,
                   noise: float = 0.1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(A, important_positions)``: the float32 (T, T) matrix and sorted positions."""
    rng = np.random.default_rng(seed)
    positions = np.array(sorted(rng.choice(T, size=important, replace=False).tolist()),
                         dtype=np.int64)
    A = np.tri(T, T, dtype=np.float32)
    # The notebook adds the boost per query for every important key k <= q, i.e. the
    # whole column below (and on) the diagonal.
    for k in positions:
        A[k:, k] += np.float32(boost)
    A += rng.exponential(noise, size=A.shape) * np.tri(T, T)
    A = A / (A.sum(axis=1, keepdims=True) + 1e-12)
    return A, positions
