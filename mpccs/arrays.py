"""Array backend: validation and flat views for numpy (and cupy on GPUs).

Every public call checks its arrays here before any byte moves, so bad input
fails with a message that names the argument instead of corrupting memory.
"""
from __future__ import annotations

import numpy as np

from .reduce import OPS, SUPPORTED_DTYPE_NAMES, is_supported_dtype
from .staging import is_device_array, sync_current_stream


def check_array(arr, name: str, *, writable: bool = False) -> np.ndarray:
    """A 1-D view of a C-contiguous numpy array of a supported dtype."""
    if not isinstance(arr, np.ndarray):
        if is_device_array(arr):  # the Communicator's calls stage them before this check
            raise TypeError(f"{name}: a device array here; pass it to a Communicator call (mpccs.staging)")
        raise TypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if not is_supported_dtype(arr.dtype):
        names = ", ".join(SUPPORTED_DTYPE_NAMES)
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


def address(a) -> int:
    """Where a contiguous array's first element lives: a host address for numpy,
    a device address for cupy (GPU-direct planes hand the engine device views)."""
    return a.ctypes.data if type(a) is np.ndarray else a.data.ptr


def may_share_memory(a, b) -> bool:
    """Whether two contiguous arrays' byte ranges overlap (numpy's bounds test;
    cupy arrays compare their device ranges)."""
    if type(a) is np.ndarray and type(b) is np.ndarray:
        return np.may_share_memory(a, b)
    if type(a) is np.ndarray or type(b) is np.ndarray:
        return False  # host and device memory never overlap
    lo_a, lo_b = address(a), address(b)
    return a.nbytes > 0 and b.nbytes > 0 and lo_a < lo_b + b.nbytes and lo_b < lo_a + a.nbytes


def same_start(a, b) -> bool:
    """Two non-empty contiguous views that begin at the same element: an in-place copy."""
    return may_share_memory(a, b) and address(a) == address(b)


def copy_into(dst, src) -> None:
    """``dst[...] = src``, finished when this returns. A device copy is a kernel
    queued on cupy's stream, and the planes (UCX's own streams) may read ``dst``
    next: wait for it."""
    dst[...] = src
    if type(dst) is not np.ndarray:
        sync_current_stream()


def empty_like_memory(ref, count: int, dtype):
    """A new 1-D array in the same kind of memory as ``ref`` (host or device)."""
    if type(ref) is np.ndarray:
        return np.empty(count, dtype=dtype)
    import cupy  # a device array was passed: cupy is there

    return cupy.empty(count, dtype=dtype)


def check_separate(send: np.ndarray, recv: np.ndarray, *, block_at: int | None = None) -> bool:
    """Send and receive buffers that overlap are refused (the schedule reads one
    while it writes the other), except the in-place forms: ``recv`` the very
    same elements as ``send`` (True: an in-place call), or the smaller of the two
    exactly the block of the larger at element ``block_at`` (all_gather: send is
    this rank's block of recv; reduce_scatter: recv is this rank's block of send).
    Both are 1-D C-contiguous views here, so overlap is a bounds test."""
    if not may_share_memory(send, recv):
        return False
    start, sstart = address(recv), address(send)
    if sstart == start and send.nbytes == recv.nbytes:
        return True
    small, large = (send, recv) if send.nbytes < recv.nbytes else (recv, send)
    if block_at is not None and address(small) == address(large) + block_at * large.itemsize:
        return False  # this rank's own block
    raise ValueError("send and recv overlap; pass the same array (or recv=None where the call allows it) "
                     "for an in-place call, or separate arrays")


def check_size(actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{what} has {actual} elements, expected {expected}")
