"""Host arrays that other ranks on the host read fast: ``mpccs.empty``, the
MPI_Alloc_mem / ncclMemAlloc of this library.

Why: above the shared-memory lanes' bounds, ranks on one host read each
other's buffers with process_vm_readv (cma_steps.py, group_read_steps.py).
The kernel pins the source's pages one by one for each read, and that costs
more than the copy where the pages are 4 KiB: on this VM an 8 MiB read ran at
8.8-9.8 GB/s from 4 KiB pages and 24-36 GB/s from 2 MiB pages (a memcpy: 31-36).
numpy asks for huge pages itself only from 4 MiB and without aligning the
buffer to 2 MiB, so a 4 MiB array read at 14-15 GB/s. Converting a user's
buffer after the fact (MADV_COLLAPSE) cost 2-3 ms per 2 MiB here: a library
cannot do that behind a call. So, as MPI and NCCL do, it offers the memory
instead: an array whose buffer starts on a 2 MiB boundary of an anonymous
private mapping advised MADV_HUGEPAGE (granted where the kernel's
transparent_hugepage setting is ``madvise`` or ``always``; elsewhere it is an
ordinary page-aligned array).
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

from .transports.libc import libc_function

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


_madvise = libc_function("madvise", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def empty(shape, dtype=np.float32) -> np.ndarray:
    """A zero-filled (anonymous pages come zeroed) C-contiguous array on 2 MiB pages where
    the kernel grants them, its buffer 2 MiB aligned; freed with the array.
    Pass it to any collective as a numpy array: peers on this host read it
    across processes up to ~3x faster than a 4 KiB-page buffer."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count < 0:
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    nbytes = count * dtype.itemsize
    # Whole huge pages after an aligned start: the last one is not shared with other data.
    span = -(-max(nbytes, 1) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    region = mmap.mmap(-1, span + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, np.uint8)  # holds the mapping: unmapped when the last view goes
    start = -raw.ctypes.data % HUGE_PAGE_BYTES
    if _madvise is not None:
        _madvise(raw.ctypes.data + start, span, MADV_HUGEPAGE)  # advice: a refusal leaves 4 KiB pages
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def huge_pages_setting() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``: ``empty``'s
    pages are granted; ``never``: they are not), or None where it does not say."""
    try:
        with open(THP_SETTING) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None
