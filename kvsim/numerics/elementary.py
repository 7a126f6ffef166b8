"""Deterministic, vectorisable ``exp`` and ``log`` for the kernels.

libm's functions are scalar calls; these are plain arithmetic (argument reduction, a
polynomial, exponent bits set or read directly), so LLVM can vectorise the loops that
use them, and a vectorised lane gives exactly what a scalar call gives, on any machine.
Accuracy: ``exp_nonpositive`` within 1.5 ulp of the true value for ``-708 <= x <= 0``
(0 below -708); ``log_positive`` within 2 ulp.
"""

import math
from fractions import Fraction

import numpy as np
from llvmlite import ir
from numba import config, types
from numba.extending import intrinsic

from kvsim.numerics.jit import jit

_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00
_SQRT2 = 1.4142135623730951
_MANTISSA = np.int64(0x000FFFFFFFFFFFFF)
_ONE_BITS = np.int64(0x3FF0000000000000)
# Polynomial coefficients, highest power first.
_EXP_TAYLOR = tuple(1.0 / math.factorial(i) for i in range(12, -1, -1))  # exp(r), |r| <= ln2/2
_ATANH_SERIES = tuple(1.0 / (2 * i + 1) for i in range(9, -1, -1))  # atanh(s)/s in z = s^2


if config.DISABLE_JIT:  # plain Python (NUMBA_DISABLE_JIT=1): the same reinterpretations
    def _float_from_bits(bits):
        """Reinterpret an int64 as the float64 with the same bits."""
        return float(np.array(bits, np.int64).view(np.float64))

    def _bits_from_float(x):
        """Reinterpret a float64 as the int64 with the same bits."""
        return int(np.array(x, np.float64).view(np.int64))

    def fma(a, b, c):
        """``a * b + c`` rounded once (exact rational arithmetic, then one rounding)."""
        return float(Fraction(a) * Fraction(b) + Fraction(c))
else:
    @intrinsic
    def _float_from_bits(typingctx, bits):
        """Reinterpret an int64 as the float64 with the same bits."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.DoubleType())
        return types.float64(types.int64), codegen

    @intrinsic
    def _bits_from_float(typingctx, x):
        """Reinterpret a float64 as the int64 with the same bits."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(64))
        return types.int64(types.float64), codegen

    @intrinsic
    def fma(typingctx, a, b, c):
        """``a * b + c`` rounded once (IEEE fused multiply-add: the same on every machine)."""
        def codegen(context, builder, signature, args):
            double = ir.DoubleType()
            fn = builder.module.declare_intrinsic("llvm.fma", [double],
                                                  ir.FunctionType(double, [double] * 3))
            return builder.call(fn, args)
        return types.float64(types.float64, types.float64, types.float64), codegen


@jit
def _horner(x, coefficients):
    """The polynomial with ``coefficients`` (highest power first) at ``x``, by Horner's rule."""
    p = coefficients[0]
    for c in coefficients[1:]:
        p = fma(x, p, c)
    return p


@jit
def exp_nonpositive(x):
    """``exp(x)`` for ``x <= 0`` (0 below -708)."""
    if x < -708.0:
        return 0.0
    n = np.floor(x * _INV_LN2 + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _horner(r, _EXP_TAYLOR)
    return p * _float_from_bits((np.int64(n) + 1023) << 52)


@jit
def log_positive(x):
    """``log(x)`` for a positive, normal float64 ``x``.

    ``x = 2^e m`` with ``m`` in [sqrt(1/2), sqrt(2)); ``log m = 2 atanh(s)`` with
    ``s = (m - 1) / (m + 1)``, ``|s| < 0.172``, summed to ``s^19``.
    """
    bits = _bits_from_float(x)
    e = (bits >> 52) - 1023
    m = _float_from_bits((bits & _MANTISSA) | _ONE_BITS)
    if m > _SQRT2:
        m *= 0.5
        e += 1
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    p = _horner(z, _ATANH_SERIES)
    fe = float(e)
    return fe * _LN2_HI + (2.0 * s * p + fe * _LN2_LO)
