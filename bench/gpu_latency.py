#!/usr/bin/env python
"""Where a small GPU-direct collective spends its time (2 ranks on one GPU; needs cupy).

    python -m mpccs -n 2 python bench/gpu_latency.py [--size 65536] [--reps 30] [--profile]

1. Ping-pong through the 'up' plane alone (no collective code): host buffers,
   then device buffers, so UCX's own cost for device memory shows apart from mpccs.
2. all_gather, all_to_all and all_reduce on device arrays (GPU-direct) and on
   host arrays, median over --reps calls (max over ranks).
3. --profile: cProfile of rank 0 over the device all_reduce calls (top functions).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np

import mpccs
from mpccs import wire


def ping_pong(comm, xp, nbytes: int, reps: int) -> float:
    """Median round trip (us) of one message each way on the up plane."""
    plane = comm._planes["up"]
    peer = 1 - comm.rank
    buf = xp.zeros(nbytes, xp.uint8)
    tag = wire.make_tag(wire.KIND_CTRL, 7, 1, 0, 0)  # a tag no operation of this communicator uses
    times = []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        if comm.rank == 0:
            req = plane.send(peer, buf, tag)
            while not req.completed:
                plane.progress()
            req = plane.recv(buf, tag)
            while not req.completed:
                plane.progress()
        else:
            req = plane.recv(buf, tag)
            while not req.completed:
                plane.progress()
            req = plane.send(peer, buf, tag)
            while not req.completed:
                plane.progress()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def collective_times(comm, xp, nbytes: int, reps: int, sync) -> dict:
    n = nbytes // 4
    x = xp.ones(n, xp.float32)
    gathered = xp.empty(n * comm.size, xp.float32)
    out = xp.empty(n, xp.float32)
    calls = {
        "all_gather": lambda: comm.all_gather(x, gathered),
        "all_to_all": lambda: comm.all_to_all(x, out),
        "all_reduce": lambda: comm.all_reduce(x, out),
    }
    result = {}
    for name, call in calls.items():
        times = []
        for i in range(reps + 3):
            comm.barrier()
            sync()
            t0 = time.perf_counter()
            call()
            sync()
            dt = np.array([time.perf_counter() - t0])
            comm.all_reduce(dt, op="max")
            if i >= 3:
                times.append(float(dt[0]))
        result[name] = 1e6 * statistics.median(times)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=65536, help="bytes per rank (65536)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    ns = ap.parse_args()
    import cupy

    comm = mpccs.init()
    sync = cupy.cuda.get_current_stream().synchronize
    say = (lambda *a: print(*a, flush=True)) if comm.rank == 0 else (lambda *a: None)
    say(f"# gpu_latency: 2 ranks, {ns.size} B, gpu_direct={comm.gpu_direct}, up={comm._planes['up'].tls}")
    for label, xp in (("host", np), ("device", cupy)):
        comm.barrier()
        say(f"ping-pong up plane, {label:6} buffers: {ping_pong(comm, xp, ns.size, ns.reps):9.1f} us round trip")
    for label, xp in (("host", np), ("device", cupy)):
        times = collective_times(comm, xp, ns.size, ns.reps, sync)
        say(f"collectives, {label:6} arrays: " + "  ".join(f"{k} {v:8.1f} us" for k, v in times.items()))
    if ns.profile:
        x, out = cupy.ones(ns.size // 4, cupy.float32), cupy.empty(ns.size // 4, cupy.float32)
        prof = cProfile.Profile()
        comm.barrier()
        prof.enable()
        for _ in range(ns.reps):
            comm.all_reduce(x, out)
        sync()
        prof.disable()
        comm.barrier()
        if comm.rank == 0:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
            print(text.getvalue(), flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
