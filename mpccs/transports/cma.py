"""Cross-memory attach: one copy straight between two processes' memory
(Linux's process_vm_readv, 3.2 and later), as UCX's cma transport does for
its shared-memory rendezvous, without a request, a rendezvous message or an
acknowledgement per block. The direct path's 2-rank collectives read their
peer's blocks this way where the shared-memory segments are open (cma_steps.py).

The kernel allows it where the caller may ptrace the target (same user and
no Yama or container rule against it): transports/shm.open_pair tries one
read at start-up and uses it only where both ranks' tries succeeded.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load_readv():
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):  # not glibc on Linux
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.c_ulong]
    return fn


_readv = _load_readv()


def available() -> bool:
    return _readv is not None


def read_into(dst: np.ndarray, pid: int, remote_address: int) -> None:
    """Copy dst.nbytes bytes from ``remote_address`` in process ``pid`` into the
    contiguous array ``dst``; OSError (ESRCH: the process is gone, EFAULT: the
    range is not mapped there, EPERM: not allowed) when the copy fails."""
    local_address, nbytes, done = dst.ctypes.data, dst.nbytes, 0
    while done < nbytes:  # the kernel may stop short (a fault part-way); go on from there
        local = _IoVec(local_address + done, nbytes - done)
        remote = _IoVec(remote_address + done, nbytes - done)
        n = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            err = ctypes.get_errno() or 5  # EIO: a zero-byte read where bytes were asked for
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        done += n
