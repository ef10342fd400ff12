"""Software prefetch of one embedding row, for the numba kernels that visit rows in random order.

Scoring a selected node reads its 1.5 KB row (d = 384, float32) from wherever the index lies in
memory. One row at a time, every dot product waits for its row; asking for the next row while
the current one is summed hides most of that wait over rows out of cache (measured through the
kernels that use it: benchmarks/RESULTS.md, *Retrieval throughput*).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

CACHE_LINE = 64


@intrinsic
def prefetch_row(typingctx, matrix, row):
    """Hint the CPU to load ``matrix[row, :]`` (a C-contiguous 2-D array) into its caches.

    A hint only: nothing is read, so an out-of-range row cannot fault; results never depend on it."""
    if not (isinstance(matrix, types.Array) and matrix.ndim == 2 and isinstance(row, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        start = builder.bitcast(array.data, ir.IntType(8).as_pointer())
        row_bytes = builder.extract_value(array.strides, 0)
        row_index = context.cast(builder, args[1], signature.args[1], types.intp)
        first = builder.gep(start, [builder.mul(row_index, row_bytes)])
        i32 = ir.IntType(32)
        hint = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [first.type, i32, i32, i32]), "llvm.prefetch.p0i8"
        )
        step = context.get_constant(types.intp, CACHE_LINE)
        with cgutils.for_range_slice(builder, context.get_constant(types.intp, 0), row_bytes, step) as (offset, _):
            # read (0), keep in all cache levels (3), data cache (1)
            builder.call(hint, [builder.gep(first, [offset]), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(matrix, row), codegen
