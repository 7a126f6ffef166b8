"""Dense (T, T) attention matrices: validation and conversion to float64 probabilities."""

import numpy as np

from kvsim.errors import KvsimError

ROW_SUM_TOL = 1e-5


def _check_square(a: np.ndarray, what: str) -> None:
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 1:
        raise KvsimError(f"{what}: expected a square (T, T) matrix with T >= 1, "
                         f"got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.complexfloating):
        raise KvsimError(f"{what}: expected real numbers, got dtype {a.dtype}")


def probabilities(a: np.ndarray, what: str = "attention") -> np.ndarray:
    """Check a causal probability matrix and return it in float64, rows summing to 1.

    Raises :class:`KvsimError` naming the first bad row.
    """
    a = np.asarray(a)
    _check_square(a, what)
    a = a.astype(np.float64)
    bad = ~np.isfinite(a).all(axis=1)
    if bad.any():
        raise KvsimError(f"{what}: expected finite values, row {int(np.argmax(bad))} is not")
    bad = (a < 0).any(axis=1)
    if bad.any():
        raise KvsimError(f"{what}: expected non-negative probabilities, "
                         f"row {int(np.argmax(bad))} has a negative entry")
    bad = np.triu(a, 1).any(axis=1)
    if bad.any():
        row = int(np.argmax(bad))
        raise KvsimError(f"{what}: expected a causal matrix (zero above the diagonal), "
                         f"row {row} attends to a later key")
    sums = a.sum(axis=1)
    bad = np.abs(sums - 1.0) > ROW_SUM_TOL
    if bad.any():
        row = int(np.argmax(bad))
        raise KvsimError(f"{what}: expected rows summing to 1 (within {ROW_SUM_TOL:g}), "
                         f"row {row} sums to {sums[row]:.6g}")
    return a / sums[:, None]


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
