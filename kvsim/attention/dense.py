"""Dense (T, T) attention matrices: validation and conversion to float64 probabilities."""

import numpy as np

from kvsim._numba import jit
from kvsim.errors import KvsimError

ROW_SUM_TOL = 1e-5


def _check_square(a: np.ndarray, what: str) -> None:
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 1:
        raise KvsimError(f"{what}: expected a square (T, T) matrix with T >= 1, "
                         f"got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.complexfloating):
        raise KvsimError(f"{what}: expected real numbers, got dtype {a.dtype}")


@jit
def _first_bad_row(a, tol):
    """(0, -1) when every row is valid, else (problem, first bad row): 1 non-finite,
    2 negative, 3 non-zero above the diagonal, 4 sum away from 1. One pass, no copy."""
    T = a.shape[0]
    for q in range(T):
        total = 0.0
        for k in range(T):
            x = float(a[q, k])
            if not np.isfinite(x):
                return 1, q
            if x < 0.0:
                return 2, q
            if k > q and x != 0.0:
                return 3, q
            total += x
        if abs(total - 1.0) > tol:
            return 4, q
    return 0, -1


_PROBLEMS = {1: "expected finite values, row {row} is not",
             2: "expected non-negative probabilities, row {row} has a negative entry",
             3: "expected a causal matrix (zero above the diagonal), row {row} attends to a "
                "later key",
             4: "expected rows summing to 1 (within {tol:g}), row {row} sums to {total:.6g}"}


def probabilities(a: np.ndarray, what: str = "attention") -> np.ndarray:
    """Check a causal probability matrix and return it in float64, rows summing to 1.

    The checks are one compiled pass; raises :class:`KvsimError` naming the first bad row.
    """
    a = np.asarray(a)
    _check_square(a, what)
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float64)
    problem, row = _first_bad_row(np.ascontiguousarray(a), ROW_SUM_TOL)
    if problem:
        total = float(np.asarray(a[row], np.float64).sum())
        raise KvsimError(f"{what}: " + _PROBLEMS[problem].format(row=row, tol=ROW_SUM_TOL,
                                                                  total=total))
    a = a.astype(np.float64)
    return a / a.sum(axis=1, keepdims=True)


def softmax_logits(a: np.ndarray, what: str = "attention") -> np.ndarray:
    """Causal float64 softmax of a logit matrix (entries above the diagonal are ignored)."""
    a = np.asarray(a)
    _check_square(a, what)
    logits = np.where(np.tri(a.shape[0], dtype=bool), a.astype(np.float64), -np.inf)
    finite = np.isfinite(np.diagonal(logits)) & ~np.isnan(logits).any(axis=1) \
        & ~np.isposinf(logits).any(axis=1)
    if not finite.all():
        row = int(np.argmin(finite))
        raise KvsimError(f"{what}: expected finite logits on and below the diagonal "
                         f"(-inf allowed off the diagonal), row {row} is not")
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)
