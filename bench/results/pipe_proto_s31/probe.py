"""Prototype: a 2-rank all_gather of B bytes per rank through a shared ring of
C-byte chunks (copy in, copy out, pipelined) against a process_vm_readv of the
peer's block; both plus the own-block copy. Two processes, spin on flags."""
import ctypes, mmap, os, sys, time
import numpy as np
sys.path.insert(0, "/work/main")
from mpccs.transports import cma

B = int(sys.argv[1]) << 10
C = int(sys.argv[2]) << 10
SLOTS = 8
ITERS = 300
ring = mmap.mmap(-1, 2 * (4096 + SLOTS * C))      # one ring per writer
ctl = mmap.mmap(-1, 4096)                          # [rank0 addr, rank1 addr, ready flags, barrier]

def region(r):
    base = r * (4096 + SLOTS * C)
    flags = np.ndarray(8, np.int64, ring, base)    # 0: chunks written, 1: chunks the peer took
    data = np.ndarray((SLOTS, C), np.uint8, ring, base + 4096)
    return flags, data

def run(rank):
    ctlw = np.ndarray(16, np.int64, ctl, 0)
    src = np.full(B, rank + 1, np.uint8)
    out = np.zeros(2 * B, np.uint8)
    ctlw[rank] = src.ctypes.data
    ctlw[2 + rank] = os.getpid()
    my_f, my_d = region(rank)
    pe_f, pe_d = region(1 - rank)
    nchunks = -(-B // C)
    def barrier(k):
        ctlw[4 + rank] = k
        while ctlw[4 + 1 - rank] < k: pass
    barrier(1)
    peer_pid, peer_src = int(ctlw[2 + 1 - rank]), int(ctlw[1 - rank])
    res = {}
    for mode in ("pipe", "cma", "pipe", "cma"):
        times = []
        for it in range(ITERS):
            barrier(2 + len(times) + 1000 * list(res).__len__() + 10**6 * (mode == "cma") + (10**7 if (mode, 1) in res else 0))
            t0 = time.perf_counter()
            mine = out[rank * B:(rank + 1) * B]
            theirs = out[(1 - rank) * B:(2 - rank) * B]
            if mode == "cma":
                cma.read_into(theirs, peer_pid, peer_src)
                mine[...] = src
                # both must be done before the next iteration's barrier (the source stays)
            else:
                base_w, base_t = int(my_f[0]), int(pe_f[1])   # counts at start (cumulative)
                wrote = took = 0
                while took < nchunks or wrote < nchunks:
                    # write while the ring has room (the peer took up to pe_f[1]... mine: my_f[1] is peer's take of mine)
                    if wrote < nchunks and wrote - (int(my_f[1]) - base_w) < SLOTS:
                        lo = wrote * C
                        n = min(C, B - lo)
                        my_d[(base_w + wrote) % SLOTS, :n] = src[lo:lo + n]
                        wrote += 1
                        my_f[0] = base_w + wrote
                        continue
                    avail = int(pe_f[0]) - base_t - took if int(pe_f[0]) >= base_t else 0
                    if avail > 0:
                        lo = took * C
                        n = min(C, B - lo)
                        theirs[lo:lo + n] = pe_d[(base_t + took) % SLOTS, :n]
                        took += 1
                        pe_f[1] = base_t + took
                mine[...] = src
                while int(my_f[1]) - base_w < nchunks: pass   # the peer took all of mine
            times.append(time.perf_counter() - t0)
            assert theirs[0] == 2 - rank and theirs[-1] == 2 - rank
        res[(mode, 1 if mode in [m for m, _ in res] else 0)] = np.median(times) * 1e6
    if rank == 0:
        print(f"B={B>>10} KiB C={C>>10} KiB: " + ", ".join(f"{m}#{k} {v:.0f} us" for (m, k), v in res.items()))

pid = os.fork()
if pid == 0:
    run(1); os._exit(0)
run(0); os.waitpid(pid, 0)
