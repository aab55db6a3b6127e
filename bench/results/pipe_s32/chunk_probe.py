"""Both ranks' pipe steps in this one process, on two segments mapped into each
other, taking turns: the copies' cost per chunk size, without a peer process.

    python bench/results/pipe_s32/chunk_probe.py BLOCK_BYTES [COLLECTIVE] [CHUNK_BYTES]
"""
import mmap
import sys
import time

import numpy as np

from mpccs import pipe_steps
from mpccs.direct_ops import peer_part
from mpccs.pipe_steps import PipeSteps
from mpccs.transports.shm import SEGMENT_BYTES, ShmPair


def main() -> None:
    a, b = (mmap.mmap(-1, SEGMENT_BYTES) for _ in range(2))
    pairs = ShmPair(a, b), ShmPair(b, a)
    n = int(sys.argv[1]) // 4
    collective = sys.argv[2] if len(sys.argv) > 2 else "all_gather"
    if len(sys.argv) > 3:
        pipe_steps.PIPE_CHUNK_BYTES = int(sys.argv[3])
    srcs = [np.full(n if collective == "all_gather" else 2 * n, r, np.float32) for r in range(2)]
    outs = [np.empty(n if collective == "reduce_scatter" else 2 * n, np.float32) for _ in range(2)]
    times = []
    for seq in range(1, 301):
        t0 = time.perf_counter()
        steps = [PipeSteps(pairs[r], seq, r, collective, srcs[r], outs[r], "sum", *peer_part(collective, srcs[r], r, 0),
                           lambda message, step: RuntimeError(message)) for r in range(2)]
        while not all(s.done for s in steps):
            for s in steps:
                s.advance()
        times.append(time.perf_counter() - t0)
    print(f"{collective} {n * 4 >> 10} KiB, chunks of {pipe_steps.PIPE_CHUNK_BYTES >> 10} KiB: both ranks' steps "
          f"{np.median(times) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
