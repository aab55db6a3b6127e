"""One C library function through ctypes, typed, or None where the C library lacks it."""
from __future__ import annotations

import ctypes


def libc_function(name: str, restype, argtypes: list):
    """``name`` from the process's C library with errno kept (ctypes.get_errno), or None
    where it has no such function (not glibc on Linux)."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype = restype
    fn.argtypes = argtypes
    return fn
