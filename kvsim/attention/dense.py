"""Dense attention matrices: validation and conversion to float64 probabilities.

Probabilities may be float16, float32 or float64 (or integers). Row ``q`` (``n = q + 1``
entries on and below the diagonal) must sum to 1 within :func:`row_sum_tolerance`:
``1e-5 + eps + n * tiny``, with ``eps`` the dtype's machine epsilon and ``tiny`` its
smallest subnormal, which bounds the error of rounding a row that summed to 1 into that
dtype (relative rounding of every entry, plus the absolute rounding of entries that
underflow to subnormals), with room for the producer's own arithmetic.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvsim.errors import KvsimError
from kvsim.numerics.jit import jit, jit_inline, threads
from kvsim.numerics.lanes import lane_sum

ROW_SUM_TOL = 1e-5  # the float64 tolerance; lower precisions add their rounding bound
EXACT_TOL = 1e-12  # rows within this of 1 are used as given (no copy, no renormalisation)
DTYPES = (np.float16, np.float32, np.float64)
PARALLEL_ENTRIES = 1 << 22  # a matrix this large is checked on two threads


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


# Bit patterns of float64 entries, read as uint64: the non-negative finite numbers are
# 0 .. 0x7FEF...; adding 2^52 sets bit 63 for every other pattern except the negative
# infinity and NaNs, which make the row's sum non-finite anyway.
_SIGN = np.uint64(63)
_PAST_FINITE = np.uint64(1 << 52)


@jit_inline
def _flags(bits, n):
    """The OR of ``bits[:n] + 2^52``: bit 63 of it is clear when every entry is a finite
    number with a clear sign bit (``bits``: the row read as uint64). Integer adds and ORs,
    so the loop vectorises."""
    flags = np.uint64(0)
    for k in range(n):
        flags |= bits[k] + _PAST_FINITE
    return flags


@jit_inline
def _any_bits(bits, lo, hi):
    """Whether any of ``bits[lo:hi]`` is non-zero (an entry other than +0.0)."""
    flags = np.uint64(0)
    for k in range(lo, hi):
        flags |= bits[k]
    return flags != 0


@jit
def _suspect_rows(a, bits, lo, hi, base_tol, entry_tol, suspect, deviation):
    """For every row ``lo <= q < hi``: ``suspect[q]`` whether it may be invalid,
    ``deviation[q] = |row sum - 1|``; ``bits`` is ``a`` read as uint64.

    Each entry is read once. A row is suspect if its sum is non-finite or off by more
    than the tolerance, an entry on or below the diagonal is negative, infinite or NaN
    (or -0.0), or an entry above it is not +0.0; :func:`_row_problem` then decides
    exactly (a row of -0.0 entries is valid).
    """
    T = a.shape[0]
    for q in range(lo, hi):
        n = q + 1
        total = lane_sum(a[q], n)  # the row, just read, is still in cache
        flags = _flags(bits[q], n)
        dev = abs(total - 1.0)
        deviation[q] = dev
        suspect[q] = (not abs(total) < np.inf or (flags >> _SIGN) != 0
                      or _any_bits(bits[q], n, T) or not dev <= base_tol + n * entry_tol)


def _row_problem(row: np.ndarray, q: int, deviation: float, tol: float) -> int:
    """Which check row ``q`` fails (a key of ``_PROBLEMS``), read with NumPy; 0 if none."""
    if not np.isfinite(row).all():
        return 1
    if (row[:q + 1] < 0).any():
        return 2
    if row[q + 1:].any():
        return 3
    return 4 if not deviation <= tol else 0


_PROBLEMS = {1: "expected finite values, row {row} is not",
             2: "expected non-negative probabilities, row {row} has a negative entry",
             3: "expected a causal matrix (zero above the diagonal), row {row} attends to a "
                "later key",
             4: "expected rows summing to 1 (within {tol}), row {row} sums to {total:.6g}"}


def _checked(a: np.ndarray, dtype, what: str) -> float:
    """Check a float64 C-contiguous (T, T) matrix; return the largest ``|row sum - 1|``.

    One pass over the matrix, bound by memory bandwidth: a large matrix is read in two
    halves on two threads (when Numba may use two), which one core's bandwidth cannot
    match. The few suspect rows are then examined exactly with NumPy.
    """
    T = a.shape[0]
    info = np.finfo(dtype if np.issubdtype(dtype, np.floating) else np.float64)
    suspect = np.empty(T, np.bool_)
    deviation = np.empty(T)
    bits = a.view(np.uint64)

    def rows(lo: int, hi: int) -> None:
        _suspect_rows(a, bits, lo, hi, ROW_SUM_TOL + float(info.eps),
                      float(info.smallest_subnormal), suspect, deviation)

    if T * T >= PARALLEL_ENTRIES and threads() > 1:
        with ThreadPoolExecutor(2) as pool:  # the kernel releases the GIL
            list(pool.map(rows, (0, T // 2), (T // 2, T)))
    else:
        rows(0, T)
    for row in np.flatnonzero(suspect):
        row = int(row)
        problem = _row_problem(a[row], row, deviation[row], row_sum_tolerance(dtype, row + 1))
        if problem:
            tol = f"{row_sum_tolerance(dtype, row + 1):.3g}"
            if dtype != np.float64:
                tol += f" for {np.dtype(dtype).name}"
            raise KvsimError(f"{what}: " + _PROBLEMS[problem].format(
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
