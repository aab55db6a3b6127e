"""Cross-memory attach: one copy straight between two processes' memory
(Linux's process_vm_readv, 3.2 and later), as UCX's cma transport does for
its shared-memory rendezvous, without a request, a rendezvous message or an
acknowledgement per block. The direct path's 2-rank collectives read their
peer's blocks this way where the shared-memory segments are open (cma_steps.py).

The kernel allows it where the caller may ptrace the target: the same user,
and no Yama or container rule against it. Under Yama's ptrace_scope 1 (the
default of Ubuntu and others) only a process's ancestors may, and two ranks
are siblings: each rank names its peer as the one process allowed
(allow_reads_by, prctl PR_SET_PTRACER), which is what UCX's own cma transport
leaves to the administrator (ptrace_scope 0). transports/shm.open_pair does
that, tries one read at start-up and uses reads only where both ranks' tries
succeeded.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from .libc import libc_function

PR_SET_PTRACER = 0x59616D61  # Yama's prctl: the one process, besides ancestors, that may trace this one
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value  # ... or any process (of the same user, as ptrace asks anyway)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv = libc_function("process_vm_readv", ctypes.c_ssize_t,
                       [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                        ctypes.c_ulong, ctypes.c_ulong])
_prctl = libc_function("prctl", ctypes.c_int,
                       [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong])


def available() -> bool:
    return _readv is not None


def allow_reads_by(pid: int) -> bool:
    """Let process ``pid`` read this one's memory under Yama's ptrace_scope 1
    (the peer rank, a sibling, not an ancestor). Only that process: it replaces
    any earlier choice. False where there is no Yama (EINVAL; nothing to allow)
    or it refuses (scope 2 and 3 need privileges, which the set-up's try then
    finds)."""
    return _prctl is not None and _prctl(PR_SET_PTRACER, pid, 0, 0, 0) == 0


def allow_reads_by_any() -> bool:
    """Let any process of this user read this one's memory under Yama's
    ptrace_scope 1 (PR_SET_PTRACER_ANY): a group of 3 or more ranks on one host
    reads each other's (transports/shm_group.py) and Yama keeps one allowed
    process. What Open MPI's shared-memory transport does for its reads, and
    what ptrace_scope 0 allows everywhere; MPCCS_CMA=0 leaves it alone."""
    return _prctl is not None and _prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0


def read_into(dst: np.ndarray, pid: int, remote_address: int) -> None:
    """Copy dst.nbytes bytes from ``remote_address`` in process ``pid`` into the
    contiguous array ``dst``; OSError (ESRCH: the process is gone, EFAULT: the
    range is not mapped there, EPERM: not allowed) when the copy fails."""
    read_at(dst.ctypes.data, dst.nbytes, pid, remote_address)


def read_at(local_address: int, nbytes: int, pid: int, remote_address: int) -> None:
    """read_into by address: ``nbytes`` bytes to ``local_address`` in this process.
    For a caller that reads many parts of one array: it adds offsets to one
    address instead of asking numpy for each part's (``ndarray.ctypes`` builds
    an object per call, 8-10 us each right after a large copy has evicted the
    interpreter's caches: cma_steps.CmaSteps._read_and_reduce)."""
    done = 0
    while done < nbytes:  # the kernel may stop short (a fault part-way); go on from there
        local = _IoVec(local_address + done, nbytes - done)
        remote = _IoVec(remote_address + done, nbytes - done)
        n = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            err = ctypes.get_errno() or 5  # EIO: a zero-byte read where bytes were asked for
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        done += n
