"""Deferred prologue copies (mpccs/prologue.py) against the same copies made up front.

    mpccs-run -n 2 python bench/deferred_copy_ab.py [--iters 60]

Out-of-place float32 all_reduce on the 'up' plane, 2, 8 and 32 MiB; each iteration
runs one operation with the copies made eagerly (the pending set flushed at once:
the behaviour before) and one deferred, interleaved, and prints the medians and
the median of the paired ratios (first 10 iterations dropped as warm-up).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import mpccs
from mpccs import collective_op
from mpccs.prologue import DeferredCopies

MODE = {"eager": False}


class MaybeDeferred(DeferredCopies):
    def __init__(self, *args):
        super().__init__(*args)
        if MODE["eager"]:
            self.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=60)
    args = ap.parse_args()
    collective_op.DeferredCopies = MaybeDeferred
    comm = mpccs.init()
    comm.set_path_policy("up")
    for n in (1 << 19, 1 << 21, 1 << 23):
        x = np.ones(n, np.float32)
        y = np.empty_like(x)
        times = {True: [], False: []}
        for _ in range(args.iters):
            for eager in (True, False):
                MODE["eager"] = eager
                comm.barrier()
                t0 = time.perf_counter()
                comm.all_reduce(x, y)
                times[eager].append(time.perf_counter() - t0)
        if comm.rank == 0:
            e, d = np.array(times[True][10:]), np.array(times[False][10:])
            print(f"{n * 4 >> 20:4d} MiB  eager {1e6 * np.median(e):8.0f} us  deferred {1e6 * np.median(d):8.0f} us  "
                  f"speedup {np.median(e) / np.median(d):.2f} (paired {np.median(e / d):.2f})", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
