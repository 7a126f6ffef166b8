"""Numba options used by every kernel, kept in one place."""

from numba import njit

# No fastmath: kept sets must match the NumPy reference exactly, and reassociated or
# contracted arithmetic can turn an exact tie between two scores into a strict order.
jit = njit(cache=True, nogil=True)
"""Decorator for kvsim kernels: cached to disk, compiled once per signature."""

jit_parallel = njit(cache=True, nogil=True, parallel=True)
"""Decorator for kernels that run ``prange`` loops over independent blocks."""

