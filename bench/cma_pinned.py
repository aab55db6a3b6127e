"""process_vm_readv from another process's pinned (cudaHostAlloc, cupy's pinned
pool) memory against its pageable (numpy) memory, into pinned and pageable
destinations: what the direct path's reads cost when a call's arrays are the
pinned host mirrors of device arrays (a GPU machine, MPCCS_GPU_DIRECT=0 or
calls under 2 MiB).

    python bench/cma_pinned.py [--mib 4,16,64] [--iters 10]

Median time per read and GB/s, one line per (source, destination, size).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mpccs.transports import cma  # noqa: E402


def buffer(kind: str, nbytes: int):
    """(array, keep-alive) in pageable or pinned host memory."""
    if kind == "pageable":
        a = np.empty(nbytes, np.uint8)
        return a, a
    import cupy
    mem = cupy.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, np.uint8, nbytes), mem


def owner(kind: str, nbytes: int, reader: int, addresses, done) -> None:
    a, _keep = buffer(kind, nbytes)
    a[:] = 7
    cma.allow_reads_by(reader)
    addresses.put(a.ctypes.data)
    done.wait(300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="4,16,64")
    ap.add_argument("--iters", type=int, default=10)
    ns = ap.parse_args()
    ctx = mp.get_context("spawn")  # no CUDA state crosses a fork
    for src_kind in ("pageable", "pinned"):
        for mib in (int(m) for m in ns.mib.split(",")):
            nbytes = mib << 20
            q, done = ctx.Queue(), ctx.Event()
            p = ctx.Process(target=owner, args=(src_kind, nbytes, os.getpid(), q, done))
            p.start()
            address = q.get(timeout=120)
            for dst_kind in ("pageable", "pinned"):
                dst, _keep = buffer(dst_kind, nbytes)
                dst[:] = 0
                times = []
                for _ in range(ns.iters):
                    t = time.perf_counter()
                    cma.read_into(dst, p.pid, address)
                    times.append(time.perf_counter() - t)
                assert int(dst[0]) == 7 and int(dst[-1]) == 7
                med = float(np.median(times))
                print(f"src {src_kind:8s} dst {dst_kind:8s} {mib:4d} MiB  {med * 1e6:9.1f} us  "
                      f"{nbytes / med / 1e9:6.2f} GB/s  (min {min(times) * 1e6:.1f})", flush=True)
            done.set()
            p.join(30)


if __name__ == "__main__":
    main()
