"""One thread for a model study's numbers: torch's and NumPy's BLAS.

The studies run a model and NumPy side by side, one job per process (:mod:`kvsim.forked`,
``--dask``). On one thread each, their numbers do not depend on the machine's core count,
and no BLAS or OpenMP thread spins waiting for a core that the next small op needs (at
load 6 on two cores a float64 prompt-attention product took 14 ms on OpenBLAS's two
threads against 3 ms on one).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with torch and NumPy's BLAS on one thread each; both are restored
    after."""
    import torch
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(threads)
