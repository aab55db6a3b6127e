"""The numba kernel behind cacheflush.flush (imported only when a rank first flushes:
numba's import costs ~0.2-0.4 s). Module-level, so numba caches it on disk."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

LINE_BYTES = 64
_BYTE_PTR = ir.PointerType(ir.IntType(8))


@intrinsic
def _clflushopt(typingctx, address):
    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.x86.clflushopt", fnty=ir.FunctionType(ir.VoidType(), [_BYTE_PTR]))
        builder.call(fn, [builder.inttoptr(args[0], _BYTE_PTR)])
        return context.get_dummy_value()
    return types.void(types.uintp), codegen


@intrinsic
def _sfence(typingctx):
    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(cache=True, nogil=True)
def flush_lines(address, nbytes):
    """CLFLUSHOPT every 64-byte line of [address, address + nbytes), then a fence."""
    line = np.uintp(LINE_BYTES)
    end = address + nbytes
    at = address - address % line
    while at < end:
        _clflushopt(at)
        at += line
    _sfence()  # CLFLUSHOPT is ordered only by a fence: the lines are gone before the read's stores
