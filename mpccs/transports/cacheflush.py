"""Write back and drop a byte range's cache lines from every cache (x86 CLFLUSHOPT).

Why: a cross-process read (cma.py) that lands in lines the peer's core read a
moment before (an in-place all_reduce's second half: the peer read this rank's
operand there) must take each line back from the peer's cache, one ownership
request per 64 bytes, as the copy's stores reach it. Where the two cores share
their last-level cache that costs little. On hosts where they do not (here: the
VM's two vCPUs in some launches, and two sockets of a real server), the 2 MiB
landing of a 4 MiB in-place all_reduce took 900-980 us against 80-150,
while a read of the same 2 MiB into a buffer the peer never saw took 160-250
(bench/results/landing_s49/). CLFLUSHOPT drops the lines everywhere without
that round trip per store, weakly ordered, so the flushes of a range overlap; the read
then lands in lines nobody holds. It costs a flush of the range where the
caches are shared, so control/landing.py decides, from the landings' own
times, whether to flush.

The kernel is numba's, compiled on first use and cached on disk; numba is
imported only then, so ranks that never flush never pay its import (~0.3 s).
"""
from __future__ import annotations

import importlib.util
import platform
from typing import Callable, Optional

import numpy as np

_kernel: Optional[Callable] = None
failure: Optional[str] = None  # why prepare() could not build the kernel (then nothing flushes)


def available() -> bool:
    """The CPU has CLFLUSHOPT (x86-64, Linux's cpuinfo flags), numba is installed
    (found, not imported: prepare() imports it) and no prepare() failed."""
    if failure is not None or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return False
    if "clflushopt" not in flags:
        return False
    return importlib.util.find_spec("numba") is not None


def prepare() -> bool:
    """Compile or load the kernel now (numba's import and cache: ~0.24 s, once per process);
    whether it is ready. A numba that is installed but does not import or compile (a
    mismatched numpy, no writable cache) leaves ``failure`` set instead of raising:
    a landing that cannot flush lands plain, as it would without the flush."""
    global _kernel, failure
    if _kernel is None and failure is None:
        try:
            kernel = _build_kernel()
            kernel(np.uintp(0), np.uintp(0))  # numba compiles (or loads its cache) at the first call, not at the def
        except Exception as exc:  # noqa: BLE001 - any failure of numba's means: no flush here
            failure = f"{type(exc).__name__}: {exc}"
            return False
        _kernel = kernel
    return _kernel is not None


def flush(region: np.ndarray) -> None:
    """Write back and invalidate every cache line ``region``'s bytes touch (a C-contiguous
    array); prepare() first, and True from it."""
    if region.nbytes:
        _kernel(np.uintp(region.ctypes.data), np.uintp(region.nbytes))


def _build_kernel() -> Callable:
    from ._flush_kernel import flush_lines

    return flush_lines
