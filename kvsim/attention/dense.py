"""Dense attention matrices: validation and conversion to float64 probabilities.

Probabilities may be float16, float32 or float64 (or integers). Row ``q`` (``n = q + 1``
entries on and below the diagonal) must sum to 1 within :func:`row_sum_tolerance`:
``1e-5 + eps + n * tiny``, with ``eps`` the dtype's machine epsilon and ``tiny`` its
smallest subnormal, which bounds the error of rounding a row that summed to 1 into that
dtype (relative rounding of every entry, plus the absolute rounding of entries that
underflow to subnormals), with room for the producer's own arithmetic.
"""

from __future__ import annotations

import numpy as np

from kvsim.errors import KvsimError
from kvsim.numerics.jit import jit, jit_inline

ROW_SUM_TOL = 1e-5  # the float64 tolerance; lower precisions add their rounding bound
EXACT_TOL = 1e-12  # rows within this of 1 are used as given (no copy, no renormalisation)
DTYPES = (np.float16, np.float32, np.float64)


def row_sum_tolerance(dtype, n: int) -> float:
    """How far from 1 a row of ``n`` probabilities stored as ``dtype`` may sum."""
    info = np.finfo(dtype if np.issubdtype(dtype, np.floating) else np.float64)
    return ROW_SUM_TOL + float(info.eps) + n * float(info.smallest_subnormal)


def _check_square(a: np.ndarray, what: str) -> None:
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 1:
        raise KvsimError(f"{what}: expected a square (T, T) matrix with T >= 1, "
                         f"got shape {a.shape}")
    _check_dtype(a, what)


def _check_dtype(a: np.ndarray, what: str) -> None:
    ok = a.dtype in DTYPES or (np.issubdtype(a.dtype, np.integer) and a.dtype != bool)
    if not ok:
        raise KvsimError(f"{what}: expected float16, float32 or float64 numbers, "
                         f"got dtype {a.dtype}")


@jit_inline
def _sum_and_min(row, lo, hi):
    """Sum (over 8 lanes) and minimum of ``row[lo:hi]``: vectorised reductions."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = 0.0
    whole = hi - (hi - lo) % 8
    for k in range(lo, whole, 8):
        x0, x1, x2, x3 = row[k], row[k + 1], row[k + 2], row[k + 3]
        x4, x5, x6, x7 = row[k + 4], row[k + 5], row[k + 6], row[k + 7]
        s0 += x0
        s1 += x1
        s2 += x2
        s3 += x3
        s4 += x4
        s5 += x5
        s6 += x6
        s7 += x7
        m0 = m0 if m0 <= x0 else x0
        m1 = m1 if m1 <= x1 else x1
        m2 = m2 if m2 <= x2 else x2
        m3 = m3 if m3 <= x3 else x3
        m4 = m4 if m4 <= x4 else x4
        m5 = m5 if m5 <= x5 else x5
        m6 = m6 if m6 <= x6 else x6
        m7 = m7 if m7 <= x7 else x7
    for k in range(whole, hi):
        s0 += row[k]
        m0 = m0 if m0 <= row[k] else row[k]
    total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    return total, min(min(min(m0, m1), min(m2, m3)), min(min(m4, m5), min(m6, m7)))


@jit
def _bad_rows(a, base_tol, entry_tol, bad, deviation):
    """For every row q: ``bad[q]`` whether it is invalid, ``deviation[q] = |row sum - 1|``.

    Each entry is read once: a sum and a minimum below the diagonal, and above it. A NaN
    or an infinity makes a sum non-finite; with every entry >= 0, the entries above the
    diagonal are all zero exactly when their sum is.
    """
    T = a.shape[0]
    for q in range(T):
        row = a[q]
        n = q + 1
        total, lowest = _sum_and_min(row, 0, n)
        later, later_lowest = _sum_and_min(row, n, T)
        dev = abs(total - 1.0)
        deviation[q] = dev
        bad[q] = not (abs(total) < np.inf and abs(later) < np.inf and lowest >= 0.0
                      and later_lowest >= 0.0 and later == 0.0
                      and dev <= base_tol + n * entry_tol)


def _row_problem(row: np.ndarray, q: int) -> int:
    """Which check row ``q`` fails (a key of ``_PROBLEMS``), read with NumPy."""
    if not np.isfinite(row).all():
        return 1
    if (row[:q + 1] < 0).any():
        return 2
    if row[q + 1:].any():
        return 3
    return 4


_PROBLEMS = {1: "expected finite values, row {row} is not",
             2: "expected non-negative probabilities, row {row} has a negative entry",
             3: "expected a causal matrix (zero above the diagonal), row {row} attends to a "
                "later key",
             4: "expected rows summing to 1 (within {tol}), row {row} sums to {total:.6g}"}


def _checked(a: np.ndarray, dtype, what: str) -> float:
    """Check a float64 C-contiguous (T, T) matrix; return the largest ``|row sum - 1|``.

    On one thread: the check is bound by memory bandwidth, and two threads were slower
    on the busy machine it was measured on.
    """
    T = a.shape[0]
    info = np.finfo(dtype if np.issubdtype(dtype, np.floating) else np.float64)
    bad = np.empty(T, np.bool_)
    deviation = np.empty(T)
    _bad_rows(a, ROW_SUM_TOL + float(info.eps), float(info.smallest_subnormal), bad, deviation)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        tol = f"{row_sum_tolerance(dtype, row + 1):.3g}"
        if dtype != np.float64:
            tol += f" for {np.dtype(dtype).name}"
        raise KvsimError(f"{what}: " + _PROBLEMS[_row_problem(a[row], row)].format(
            row=row, tol=tol, total=float(a[row, :row + 1].sum())))
    return float(deviation.max())


def probability_stack(a, what: str = "attention", check: bool = True) -> np.ndarray:
    """Causal probabilities ``(T, T)`` or ``(H, T, T)`` as a float64 ``(H, T, T)`` array.

    A float64 C-contiguous input whose rows sum to 1 within ``EXACT_TOL`` is returned as
    a view, never copied; other dtypes are converted (exactly), and rows off by more than
    ``EXACT_TOL`` (within the tolerance) are renormalised in a copy. ``check=False`` skips
    the checks (and the renormalisation) for trusted float64 data. Raises
    :class:`KvsimError` naming the first bad row.
    """
    a = np.asarray(a)
    if a.ndim not in (2, 3) or a.shape[-1] != a.shape[-2] or a.shape[-1] < 1 or a.size == 0:
        raise KvsimError(f"{what}: expected a square (T, T) or (H, T, T) matrix with T >= 1, "
                         f"got shape {a.shape}")
    _check_dtype(a, what)
    dtype = a.dtype
    stack = a[None] if a.ndim == 2 else a
    out = np.ascontiguousarray(stack, dtype=np.float64)  # a view when already float64 C
    if not check:
        return out
    for h in range(out.shape[0]):
        where = what if a.ndim == 2 else f"{what}: head {h}"
        if _checked(out[h], dtype, where) > EXACT_TOL:
            if np.shares_memory(out, a):
                out = out.copy()  # never modify the caller's matrix
            out[h] /= out[h].sum(axis=1, keepdims=True)
    return out


def probabilities(a: np.ndarray, what: str = "attention") -> np.ndarray:
    """Check a causal (T, T) probability matrix and return it in float64 (see
    :func:`probability_stack`)."""
    a = np.asarray(a)
    _check_square(a, what)
    return probability_stack(a, what)[0]


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
