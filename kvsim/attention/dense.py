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

import numba
import numpy as np

from kvsim.errors import KvsimError
from kvsim.numerics.jit import jit

ROW_SUM_TOL = 1e-5  # the float64 tolerance; lower precisions add their rounding bound
EXACT_TOL = 1e-12  # rows within this of 1 are used as given (no copy, no renormalisation)
DTYPES = (np.float16, np.float32, np.float64)
PARALLEL_ENTRIES = 1 << 22  # entries per thread below which one thread checks alone


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


@jit
def _row_problems(a, bits, lo, hi, base_tol, entry_tol, problems, deviation):
    """For rows ``lo .. hi-1``: ``problems[q]`` = row q's problem (0 none, 1 non-finite, 2
    negative, 3 non-zero above the diagonal, 4 sum away from 1: the first that applies)
    and ``deviation[q] = |row sum - 1|``.

    Each entry is read once. Below the diagonal, a sum and a minimum over 8 lanes (a NaN
    or infinity makes the sum non-finite); above it, an or of the bit patterns without
    their sign bit (``bits`` is ``a`` viewed as int64), so -0.0 counts as zero. These
    reductions vectorise.
    """
    T = a.shape[0]
    for q in range(lo, hi):
        row = a[q]
        n = q + 1
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
        m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = 0.0
        whole = n - n % 8
        for k in range(0, whole, 8):
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
        for k in range(whole, n):
            s0 += row[k]
            m0 = m0 if m0 <= row[k] else row[k]
        total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
        lowest = min(min(min(m0, m1), min(m2, m3)), min(min(m4, m5), min(m6, m7)))
        above = 0
        pattern = bits[q]
        for k in range(n, T):
            above |= pattern[k] << 1
        dev = abs(total - 1.0)
        deviation[q] = dev
        if not abs(total) < np.inf:
            problems[q] = 1
        elif lowest < 0.0:
            problems[q] = 2
        elif above != 0:
            problems[q] = 3
        elif not dev <= base_tol + n * entry_tol:
            problems[q] = 4
        else:
            problems[q] = 0


_PROBLEMS = {1: "expected finite values, row {row} is not",
             2: "expected non-negative probabilities, row {row} has a negative entry",
             3: "expected a causal matrix (zero above the diagonal), row {row} attends to a "
                "later key",
             4: "expected rows summing to 1 (within {tol}), row {row} sums to {total:.6g}"}


def _checked(a: np.ndarray, dtype, what: str) -> float:
    """Check a float64 C-contiguous (T, T) matrix; return the largest ``|row sum - 1|``.

    Large matrices are checked in row chunks on threads (the kernel releases the GIL).
    """
    T = a.shape[0]
    info = np.finfo(dtype if np.issubdtype(dtype, np.floating) else np.float64)
    base = ROW_SUM_TOL + float(info.eps)
    problems = np.empty(T, np.int8)
    deviation = np.empty(T)
    bits = a.view(np.int64)
    chunks = min(numba.get_num_threads(), max(1, T * T // PARALLEL_ENTRIES))
    bounds = [T * i // chunks for i in range(chunks + 1)]

    def check(i: int) -> None:
        _row_problems(a, bits, bounds[i], bounds[i + 1], base, float(info.smallest_subnormal),
                      problems, deviation)

    if chunks == 1:
        check(0)
    else:
        with ThreadPoolExecutor(chunks) as pool:
            list(pool.map(check, range(chunks)))
    if problems.any():
        row = int(np.flatnonzero(problems)[0])
        code = int(problems[row])
        if code == 1 and np.isfinite(a[row]).all():
            code = 4  # finite entries whose sum overflows
        raise KvsimError(f"{what}: " + _PROBLEMS[code].format(
            row=row, tol=f"{row_sum_tolerance(dtype, row + 1):.3g}" + (
                "" if dtype == np.float64 else f" for {np.dtype(dtype).name}"),
            total=float(a[row, :row + 1].sum())))
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
