"""A software prefetch: ask the memory system for an array element needed soon.

The decode loop over a dense matrix reads the cached keys' entries of a new row at every
step, scattered over a matrix too large for the caches; each read waits on memory. Asking
for the next row's entries while the current step computes overlaps those waits. A
prefetch has no effect on any value: results are bit-identical with or without it.
"""

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _prefetch(typingctx, array, i, j, k):
    """Prefetch ``array[i, j, k]`` of a 3-D array for reading (``llvm.prefetch``)."""
    if not (isinstance(array, types.Array) and array.ndim == 3):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        indices = [context.cast(builder, v, t, types.intp)
                   for v, t in zip(args[1:], signature.args[1:])]
        pointer = cgutils.get_item_pointer2(context, builder, ary.data,
                                            cgutils.unpack_tuple(builder, ary.shape),
                                            cgutils.unpack_tuple(builder, ary.strides),
                                            signature.args[0].layout, indices)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        # read, high temporal locality (keep in every cache level), data cache
        builder.call(fn, [builder.bitcast(pointer, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(array, i, j, k), codegen


def _no_prefetch(array, i, j, k) -> None:
    """Without the JIT (``NUMBA_DISABLE_JIT=1``) there is nothing to prefetch."""


prefetch = _no_prefetch if numba.config.DISABLE_JIT else _prefetch
