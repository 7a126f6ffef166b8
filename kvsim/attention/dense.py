"""Dense (T, T) attention matrices: validation and conversion to float64 probabilities."""

import numpy as np

from kvsim.numerics.jit import jit
from kvsim.errors import KvsimError
from kvsim.numerics.lanes import lane_sum

ROW_SUM_TOL = 1e-5


def _check_square(a: np.ndarray, what: str) -> None:
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 1:
        raise KvsimError(f"{what}: expected a square (T, T) matrix with T >= 1, "
                         f"got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.complexfloating):
        raise KvsimError(f"{what}: expected real numbers, got dtype {a.dtype}")


@jit
def _row_problems(a, tol, problems):
    """Fill ``problems[q]`` with row q's problem: 0 none, 1 non-finite, 2 negative, 3
    non-zero above the diagonal, 4 sum away from 1 (the first of these that applies).

    One pass, no copy; each row's checks are or-reductions and a lane sum, so they
    vectorise.
    """
    T = a.shape[0]
    for q in range(T):
        nonfinite = False
        negative = False
        above = False
        for k in range(T):
            x = float(a[q, k])
            nonfinite |= not (abs(x) < np.inf)
            negative |= x < 0.0
            above |= (k > q) & (x != 0.0)
        if nonfinite:
            problems[q] = 1
        elif negative:
            problems[q] = 2
        elif above:
            problems[q] = 3
        elif abs(lane_sum(a[q], T) - 1.0) > tol:
            problems[q] = 4
        else:
            problems[q] = 0


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
    problems = np.empty(a.shape[0], np.int8)
    _row_problems(np.ascontiguousarray(a), ROW_SUM_TOL, problems)
    if problems.any():
        row = int(np.flatnonzero(problems)[0])
        total = float(np.asarray(a[row], np.float64).sum())
        raise KvsimError(f"{what}: " + _PROBLEMS[int(problems[row])].format(
            row=row, tol=ROW_SUM_TOL, total=total))
    out = np.empty(a.shape)  # a copy, so the caller's matrix is never modified; copyto is
    np.copyto(out, a)        # exact like astype, and ten times faster here
    out /= out.sum(axis=1, keepdims=True)
    return out


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
