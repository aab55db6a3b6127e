"""Element-wise reduction kernels: ``dst = op(dst, src)``.

numpy's ufuncs serve every supported type. For float16 (numpy) and bfloat16
(ml_dtypes) their loops widen both operands to float32, combine, and round to
nearest even once: exactly "computed in float32, rounded once per hop" (the
tests check this bit for bit against an explicit float32 computation).
"""
from __future__ import annotations

import numpy as np

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

OPS = ("sum", "prod", "min", "max", "avg")
_UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}

SUPPORTED_DTYPES = tuple(
    np.dtype(t)
    for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "float16", "float32", "float64")
) + ((BFLOAT16,) if BFLOAT16 is not None else ())

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
