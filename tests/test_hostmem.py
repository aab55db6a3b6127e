"""mpccs.empty: host arrays on 2 MiB pages, 2 MiB aligned (hostmem.py)."""
import os

import numpy as np
import pytest

import mpccs
from mpccs import hostmem
from mpccs.transports import cma

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _vm_flags(address: int) -> list:
    """The VmFlags of this process's mapping that holds ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("shape, dtype", [((1000,), np.float32), ((3, 5, 7), np.int64), ((0,), np.float64),
                                          (((3 << 20) + 1,), np.uint8)])
def test_an_array_of_the_shape_and_dtype_asked_zeroed_aligned_and_writable(shape, dtype):
    a = mpccs.empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % hostmem.HUGE_PAGE_BYTES == 0
    assert not a.any()
    a[...] = 7
    assert (a == 7).all()


def test_a_negative_shape_is_refused():
    with pytest.raises(ValueError, match="negative"):
        mpccs.empty((-1,))


@pytest.mark.skipif(not os.path.exists(THP) or "[never]" in open(THP).read(),
                    reason="transparent huge pages are off on this kernel")
def test_the_buffer_is_advised_onto_huge_pages():
    a = mpccs.empty(4 << 20, np.uint8)
    assert "hg" in _vm_flags(a.ctypes.data)  # MADV_HUGEPAGE took
    b = np.ones(1 << 20, np.uint8)
    assert "hg" not in _vm_flags(b.ctypes.data)  # (what an ordinary numpy array of that size has not)


@pytest.mark.skipif(not cma.available(), reason="no process_vm_readv")
def test_a_cross_memory_read_of_it_gives_its_bytes():
    a = mpccs.empty(3 << 20, np.uint8)
    a[...] = np.arange(a.size, dtype=np.uint64).astype(np.uint8)
    got = np.empty_like(a)
    cma.read_into(got, os.getpid(), a.ctypes.data)
    assert np.array_equal(got, a)
