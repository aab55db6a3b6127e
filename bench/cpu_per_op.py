"""CPU seconds per operation by path policy: what each policy costs the host, not the network.

Run under the launcher, 4 ranks as 2 domains of 2 on loopback, rates stated so the tuner
plans the pipelined hierarchical all_reduce multipath:

    MPCCS_PLANE_RATES=up=1gbit,out=1gbit mpccs-run -n 4 python bench/cpu_per_op.py [MiB] [iters]

Per rank and policy: the median over the iterations (the first two left out) of the process
time (every thread: progress, UCX) and of the wall time of one all_reduce, the policies
interleaved. On a host whose cores the ranks share, a policy's extra CPU is time the others
wait for."""
import os
import statistics
import sys
import time

os.environ.setdefault("MPCCS_DOMAIN", f"d{int(os.environ.get('RANK', '0')) // 2}")

import numpy as np  # noqa: E402

import mpccs  # noqa: E402

POLICIES = ("adaptive", 0.75)


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    comm = mpccs.init()
    x = np.ones((mib << 20) // 4, dtype=np.float32)
    y = np.empty_like(x)
    times = {p: [] for p in POLICIES}
    for _ in range(iters):
        for policy in POLICIES:
            comm.set_path_policy(policy)
            cpu, wall = time.process_time(), time.perf_counter()
            comm.all_reduce(x, y)
            times[policy].append((time.process_time() - cpu, time.perf_counter() - wall))
    algorithm = comm.last_stats()["algorithm"]
    for policy in POLICIES:
        kept = times[policy][2:]
        print(f"rank {comm.rank} {policy!s:>8} {mib} MiB {algorithm}: cpu "
              f"{statistics.median(c for c, _ in kept) * 1e3:.1f} ms, wall "
              f"{statistics.median(w for _, w in kept) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
