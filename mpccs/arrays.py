"""Array backend: validation and flat views for numpy (and cupy on GPUs).

Every public call checks its arrays here before any byte moves, so bad input
fails with a message that names the argument instead of corrupting memory.
"""
from __future__ import annotations

import numpy as np

from .reduce import OPS, SUPPORTED_DTYPES
from .staging import is_device_array


_SUPPORTED = frozenset(SUPPORTED_DTYPES)  # a hash lookup, not a dozen dtype comparisons per call


def check_array(arr, name: str, *, writable: bool = False) -> np.ndarray:
    """A 1-D view of a C-contiguous numpy array of a supported dtype."""
    if not isinstance(arr, np.ndarray):
        if is_device_array(arr):  # the Communicator's calls stage them before this check
            raise TypeError(f"{name}: a device array here; pass it to a Communicator call (mpccs.staging)")
        raise TypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype not in _SUPPORTED:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name}: dtype {arr.dtype} is not supported; supported: {names}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} is read-only but receives data")
    return arr if arr.ndim == 1 else arr.reshape(-1)


def check_bytes(arr, name: str, *, writable: bool = False) -> np.ndarray:
    """Point-to-point: any contiguous array, as a flat uint8 view."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} is read-only but receives data")
    return arr.reshape(-1).view(np.uint8)


def check_op(op: str, dtype: np.dtype) -> str:
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")
    if op == "avg" and dtype.kind not in "fV" and "bfloat16" not in str(dtype):
        raise TypeError(f"op 'avg' needs a floating dtype, got {dtype}")
    return op


def same_dtype(a: np.ndarray, b: np.ndarray, names=("send", "recv")) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{names[0]} has dtype {a.dtype} but {names[1]} has {b.dtype}")


def check_separate(send: np.ndarray, recv: np.ndarray, *, block_at: int | None = None) -> bool:
    """Send and receive buffers that overlap are refused (the schedule reads one
    while it writes the other), except the in-place forms: ``recv`` the very
    same elements as ``send`` (True: an in-place call), or the smaller of the two
    exactly the block of the larger at element ``block_at`` (all_gather: send is
    this rank's block of recv; reduce_scatter: recv is this rank's block of send).
    Both are 1-D C-contiguous views here, so overlap is a bounds test."""
    if not np.may_share_memory(send, recv):
        return False
    start, sstart = recv.ctypes.data, send.ctypes.data
    if sstart == start and send.nbytes == recv.nbytes:
        return True
    small, large = (send, recv) if send.nbytes < recv.nbytes else (recv, send)
    if block_at is not None and small.ctypes.data == large.ctypes.data + block_at * large.itemsize:
        return False  # this rank's own block
    raise ValueError("send and recv overlap; pass the same array (or recv=None where the call allows it) "
                     "for an in-place call, or separate arrays")


def check_size(actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{what} has {actual} elements, expected {expected}")
