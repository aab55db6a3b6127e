"""Element-wise reduction kernels: ``dst = op(dst, src)``.

numpy's ufuncs serve every supported type. For float16 (numpy) and bfloat16
(ml_dtypes) their loops widen both operands to float32, combine, and round to
nearest even once: exactly "computed in float32, rounded once per hop" (the
tests check this bit for bit against an explicit float32 computation).
"""
from __future__ import annotations

import functools
import sys

import numpy as np

OPS = ("sum", "prod", "min", "max", "avg")
_UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}

_NUMPY_DTYPE_NAMES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                      "float16", "float32", "float64")
_NUMPY_DTYPES = frozenset(map(np.dtype, _NUMPY_DTYPE_NAMES))
SUPPORTED_DTYPE_NAMES = _NUMPY_DTYPE_NAMES + ("bfloat16",)  # the order gives fingerprint codes


@functools.lru_cache(maxsize=1)
def bfloat16_dtype() -> np.dtype:
    """ml_dtypes' bfloat16, imported on first use: its extension takes ~0.6 s to
    load, half of ``import mpccs``, and most programs never touch it."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def supported_dtypes() -> tuple:
    """Every dtype the reductions take, bfloat16 included (this loads ml_dtypes)."""
    return tuple(map(np.dtype, _NUMPY_DTYPE_NAMES)) + (bfloat16_dtype(),)


def is_supported_dtype(dtype: np.dtype) -> bool:
    """A hash lookup for numpy's own types. A bfloat16 array exists only once
    its owner imported ml_dtypes, so where ml_dtypes is not loaded the answer
    is no without importing it."""
    if dtype in _NUMPY_DTYPES:
        return True
    ml_dtypes = sys.modules.get("ml_dtypes")
    return ml_dtypes is not None and dtype == ml_dtypes.bfloat16


def reduce_into(dst: np.ndarray, src: np.ndarray, op: str) -> None:
    """dst = op(dst, src), in place; both 1-D, same dtype and length."""
    _UFUNC[op](dst, src, out=dst)


def reduce_to(dst: np.ndarray, a: np.ndarray, b: np.ndarray, op: str) -> None:
    """dst = op(a, b): a reduction whose left operand is not yet in dst (engine: deferred prologue copies)."""
    _UFUNC[op](a, b, out=dst)


def finish_avg(buf: np.ndarray, world: int) -> None:
    """avg = sum / world, computed in float32 (or wider) and rounded once."""
    if buf.dtype.itemsize < 4:
        buf[...] = (buf.astype(np.float32) / world).astype(buf.dtype)
    else:
        np.divide(buf, world, out=buf)
