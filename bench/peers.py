"""The peers a Python user already has, timed exactly like mpccs-perf.

    mpiexec -n 2 python bench/peers.py mpi  -b 8 -e 256M -f 4 -J mpi.json
    mpccs-run -n 2 bench/peers.py gloo -b 8 -e 8M -f 4 -J gloo.json

float32 sum all_reduce. Per point: barrier, then the operation, per-op time =
the slowest rank, median over -n iterations after -w warm-up iterations; rows
share mpccs-perf's JSON schema (policy = "mpi" or "gloo"). No mpccs code runs
in these processes, so no mpccs progress competes with the peer being timed.

Out of place by default, like mpccs-perf and nccl-tests' first columns: MPI's
Allreduce(send, recv); torch.distributed has no out-of-place all_reduce, so
gloo's copies the input into the output and reduces that in place (what a torch
user writes), the copy timed with it. ``--in-place`` times MPI_IN_PLACE and
gloo's own call, the input put back before the barrier (as mpccs-perf
--in-place does). The two differ by far more than noise at large sizes
(2 ranks, 8 MiB: MPICH's out-of-place call 1.6-1.9x its in-place one, as it
copies the input first), so a ratio is only read between runs of one mode.
``#wrong``: elements of the last result that differ from the expected sum.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def sizes(begin: int, end: int, factor: float) -> list[int]:
    out, s = [], begin
    while s <= end:
        out.append(s)
        s = int(s * factor)
    return out


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


class MpiPeer:
    name = "mpi"

    def __init__(self):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self):
        self.comm.Barrier()

    def all_reduce(self, x, out=None):
        if out is None:
            self.comm.Allreduce(self.MPI.IN_PLACE, x, op=self.MPI.SUM)
        else:
            self.comm.Allreduce(x, out, op=self.MPI.SUM)

    def max_across(self, values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        self.comm.Allreduce(values, out, op=self.MPI.MAX)
        return out

    def close(self):
        pass

    def version(self) -> str:
        import mpi4py

        return f"mpi4py {mpi4py.__version__}, {self.MPI.Get_library_version().splitlines()[0]}"


class GlooPeer:
    name = "gloo"

    def __init__(self):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def barrier(self):
        self.dist.barrier()

    def all_reduce(self, x, out=None):
        if out is not None:  # no out-of-place all_reduce in torch.distributed: copy, then in place
            np.copyto(out, x)
            x = out
        self.dist.all_reduce(self.torch.from_numpy(x))

    def max_across(self, values: np.ndarray) -> np.ndarray:
        t = self.torch.from_numpy(values.copy())
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.numpy()

    def version(self) -> str:
        return f"torch {self.torch.__version__} gloo"

    def close(self):
        # Without an explicit teardown gloo aborts at interpreter exit
        # ("terminate called without an active exception").
        self.dist.barrier()
        self.dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("peer", choices=("mpi", "gloo"))
    ap.add_argument("-b", default="8")
    ap.add_argument("-e", default="64M")
    ap.add_argument("-f", type=float, default=4.0)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("-w", type=int, default=5)
    ap.add_argument("-J", default=None)
    ap.add_argument("--in-place", action="store_true", help="time the in-place call (default: out of place)")
    ns = ap.parse_args()
    peer = MpiPeer() if ns.peer == "mpi" else GlooPeer()
    rows = []
    for nbytes in sizes(parse_size(ns.b), parse_size(ns.e), ns.f):
        count = max(1, nbytes // 4)
        original = np.ones(count, np.float32)
        x = original.copy()
        out = None if ns.in_place else np.empty_like(x)

        def one_op():
            if ns.in_place:
                np.copyto(x, original)  # the input put back, outside the timed call
            peer.barrier()
            t0 = time.perf_counter()
            peer.all_reduce(x, out)
            return time.perf_counter() - t0

        for _ in range(ns.w):
            one_op()
        times = peer.max_across(np.array([one_op() for _ in range(ns.n)]))
        result = x if ns.in_place else out
        wrong = int(np.count_nonzero(result != peer.size)) if ns.n or ns.w else 0
        wrong = int(peer.max_across(np.array([wrong], np.float64))[0])  # the worst rank's
        t = float(np.median(times))
        algbw = count * 4 / t / 1e9
        factor = 2 * (peer.size - 1) / peer.size
        rows.append({"collective": "all_reduce", "size": count * 4, "count": count, "type": "float", "redop": "sum",
                     "root": -1, "policy": peer.name, "time_us": t * 1e6, "algbw": algbw, "busbw": algbw * factor,
                     "wrong": wrong, "in_place": ns.in_place, "times_us": [v * 1e6 for v in times],
                     "nranks": peer.size})
        if peer.rank == 0:
            print(f"{count * 4:12d} {peer.name:>6s} {t * 1e6:10.1f} us  algbw {algbw:8.3f} GB/s  #wrong {wrong}",
                  flush=True)
    if peer.rank == 0 and ns.J:
        with open(ns.J, "w") as fh:
            json.dump({"meta": {"peer": peer.version(), "nranks": peer.size, "pid": os.getpid(), "in_place": ns.in_place},
                       "rows": rows}, fh, indent=1)
    peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
