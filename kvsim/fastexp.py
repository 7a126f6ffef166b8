"""A deterministic, vectorisable ``exp`` for the kernels.

libm's ``exp`` is a scalar call; this one is plain arithmetic (Cody-Waite reduction by
ln 2, a degree-12 Taylor polynomial, a power of two built from its bits), so LLVM can
vectorise loops that use it, and a vectorised lane gives exactly what a scalar call
gives. Accuracy: within 1.5 ulp of the true value for ``-708 <= x <= 0``; below -708 it
returns 0 (the probabilities kvsim computes never need more). Every probability of a
component field goes through it, in the full pass and in the policies alike.
"""

import numpy as np
from llvmlite import ir
from numba import config, types
from numba.extending import intrinsic

from kvsim._numba import jit

_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00


if config.DISABLE_JIT:  # plain Python (NUMBA_DISABLE_JIT=1): the same reinterpretation
    def _float_from_bits(bits):
        """Reinterpret an int64 as the float64 with the same bits."""
        return float(np.array(bits, np.int64).view(np.float64))
else:
    @intrinsic
    def _float_from_bits(typingctx, bits):
        """Reinterpret an int64 as the float64 with the same bits."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.DoubleType())
        return types.float64(types.int64), codegen


@jit
def exp_nonpositive(x):
    """``exp(x)`` for ``x <= 0`` (0 below -708)."""
    if x < -708.0:
        return 0.0
    n = np.floor(x * _INV_LN2 + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = 1.0 / 479001600.0
    p = 1.0 / 39916800.0 + r * p
    p = 1.0 / 3628800.0 + r * p
    p = 1.0 / 362880.0 + r * p
    p = 1.0 / 40320.0 + r * p
    p = 1.0 / 5040.0 + r * p
    p = 1.0 / 720.0 + r * p
    p = 1.0 / 120.0 + r * p
    p = 1.0 / 24.0 + r * p
    p = 1.0 / 6.0 + r * p
    p = 0.5 + r * p
    p = 1.0 + r * p
    p = 1.0 + r * p
    return p * _float_from_bits((np.int64(n) + 1023) << 52)
