"""What the direct path's fingerprint messages cost a 2-rank all_reduce on the
shared-memory segments (an experiment, not a mode: without the messages a
mismatched peer on another path is not caught).

    mpccs-run -n 2 --no-prefix python bench/fingerprint_cost.py [--sizes 1,2,4,8] [--reads]

DirectShmAllReduceOp posts a fingerprint message to its peer over UCX and
receives the peer's, beside the steps in the segments (shm_steps.py, or
cma_steps.py above 2 MiB; --reads: at every size). Here both ranks replace
the posting with nothing between blocks of 50 calls, interleaved with blocks
as shipped, 12 rounds; per size the median time each way, the median of the
rounds' differences and ratios with their range (rank 0's clock).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import mpccs
from mpccs import direct_ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,2,4,8", help="MiB, comma-separated")
    ap.add_argument("--reads", action="store_true", help="cross-memory reads at every size (DIRECT_CMA_FROM_BYTES = 0)")
    ap.add_argument("--rounds", type=int, default=12)
    ns = ap.parse_args()
    comm = mpccs.init()
    shipped = direct_ops.DirectAllReduceOp._post_medium
    if ns.reads:
        direct_ops.DIRECT_CMA_FROM_BYTES = 0
    sizes = [int(float(s) * (1 << 20)) for s in ns.sizes.split(",")]
    times: dict = {}
    for k in range(ns.rounds):
        for nbytes in sizes:
            x = np.ones(nbytes // 4, np.float32)
            y = np.empty_like(x)
            for mode in (("messages", "none") if k % 2 == 0 else ("none", "messages")):
                direct_ops.DirectAllReduceOp._post_medium = shipped if mode == "messages" else (lambda self, *a: None)
                for _ in range(5):
                    comm.all_reduce(x, y)
                assert comm.last_stats()["algorithm"] == "direct_shm"
                t = time.perf_counter()
                for _ in range(50):
                    comm.all_reduce(x, y)
                times.setdefault((nbytes, mode), []).append((time.perf_counter() - t) / 50)
    direct_ops.DirectAllReduceOp._post_medium = shipped
    if comm.rank == 0:
        print(f"# 2 ranks, float32 all_reduce, {'reads at every size' if ns.reads else 'as shipped'}, "
              f"{ns.rounds} rounds of 50 calls each way")
        for nbytes in sizes:
            m, n = np.array(times[(nbytes, "messages")]), np.array(times[(nbytes, "none")])
            print(f"{nbytes >> 10:7d} KiB  messages {np.median(m) * 1e6:7.1f} us  none {np.median(n) * 1e6:7.1f} us  "
                  f"cost {np.median(m - n) * 1e6:5.1f} us  ratio {np.median(m / n):.3f} [{np.min(m / n):.2f}, {np.max(m / n):.2f}]")
    comm.close()


if __name__ == "__main__":
    main()
