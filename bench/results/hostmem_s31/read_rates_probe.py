# The read rates behind mpccs/hostmem.py: process_vm_readv of 4 MiB from another process whose source
# is 4 KiB pages, 2 MiB pages (aligned, MADV_HUGEPAGE), numpy arrays of 4 and 16 MiB (numpy madvises
# them itself, unaligned) and a collapsed one, into three kinds of destination. Run: python read_rates_probe.py
import os, sys, time, mmap, ctypes, numpy as np
sys.path.insert(0, "/work/main")
from mpccs.transports import cma
libc = ctypes.CDLL(None, use_errno=True)
N = 4 << 20
def alloc(huge, n=N):
    m = mmap.mmap(-1, n + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    off = (-a.ctypes.data) % (2 << 20)
    b = a[off:off + n]
    libc.madvise(ctypes.c_void_p(b.ctypes.data), ctypes.c_size_t(n), 14 if huge else 15)
    b[:] = 1
    return m, b
def collapse(b):
    rc = libc.madvise(ctypes.c_void_p(b.ctypes.data - b.ctypes.data % 4096), ctypes.c_size_t(b.nbytes), 25)
    return rc, ctypes.get_errno()
r, w = os.pipe(); r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    np_arr = np.ones(N // 4, np.float32)  # numpy's own allocation
    np_big = np.ones(4 * N // 4, np.float32)  # 16 MiB: numpy madvises
    col = np.ones(N // 4, np.float32)
    t = time.perf_counter(); rc = collapse(col); tc = time.perf_counter() - t
    keep = [alloc(False), alloc(True)]
    os.write(w, f"{keep[0][1].ctypes.data} {keep[1][1].ctypes.data} {np_arr.ctypes.data} {np_big.ctypes.data} {col.ctypes.data} {rc} {tc}\n".encode())
    os.read(r2, 1); os._exit(0)
vals = os.read(r, 200).split()
small, huge, npa, npbig, col = map(int, vals[:5]); print("collapse rc", vals[5:])
print(open(f"/proc/{pid}/smaps_rollup").read().split("AnonHugePages:")[1].split("\n")[0])
for dname, dst in (("dst numpy", np.zeros(N, np.uint8)), ("dst huge", alloc(True)[1]), ("dst small", alloc(False)[1])):
    for name, addr in (("small", small), ("huge", huge), ("numpy 4MiB", npa), ("numpy 16MiB first 4", npbig), ("collapsed", col)):
        ts = []
        for i in range(30):
            t = time.perf_counter(); cma.read_into(dst, pid, addr); ts.append(time.perf_counter() - t)
        print(dname, name, "GB/s %.1f" % (N / np.median(ts) / 1e9))
os.write(w2, b"x")
