"""Where a 2-rank all_reduce's halves fit the outboxes: through them, or read
across processes (direct_ops.DIRECT_CMA_FROM_BYTES)?

    mpccs-run -n 2 --no-prefix python bench/outbox_reads_ab.py --out bench/results/outbox_4m_s52
    mpccs-run -n 2 --no-prefix python bench/outbox_reads_ab.py --sizes 8,16,32 --out DIR

Float32, policy 'adaptive' as shipped, default planes, on a pair that reads
across processes, at --sizes MiB (default 3 and 4: halves of 1.5 and 2 MiB,
one outbox each; a larger half goes through the outbox in rounds), out of
place and in place. Each iteration times a block of back-to-back
calls three ways, interleaved: read across processes (cma_steps.py; the
shipped path above 4 MiB), through the outboxes (shm_steps.py; the shipped
path to 4 MiB) and read again (the A/A floor). The way is switched on both
ranks between the same calls by DIRECT_CMA_FROM_BYTES; one call each way
precedes every timed block. Per-op time = block time / block length, max
across ranks. Writes outbox_reads.json and a section of report.md under --out.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import mpccs
from mpccs import direct_ops

sys.path.insert(0, os.path.dirname(__file__))
from stats import ab_meta, ab_parser, ab_report_head, ab_size_row, interleaved_modes, size_sweep  # noqa: E402
from stats import time_block, write_ab_results  # noqa: E402

MIB = 1 << 20
# DIRECT_CMA_FROM_BYTES per way: below the size reads, at it the outboxes carry the call.
WAYS = {"reads": 2 * MIB, "outboxes": None, "reads_again": 2 * MIB}  # None: the call's size


def measure(comm, nbytes: int, in_place: bool, args) -> dict:
    x = (np.arange(nbytes // 4) % 7).astype(np.float32)
    out = np.empty_like(x)
    # In place "max" keeps the operand's values (a sum would double them into inf).
    call = (lambda: comm.all_reduce(x, op="max")) if in_place else (lambda: comm.all_reduce(x, out))

    def time_way(way: str) -> float:
        direct_ops.DIRECT_CMA_FROM_BYTES = WAYS[way] or nbytes
        call()
        return time_block(comm, call, args.block)

    times, ran = interleaved_modes(comm, list(WAYS), time_way, args.iters, args.warmup)
    return {"size": nbytes, "in_place": in_place, "algorithm": ran["reads"], "times_s": times}


def main() -> None:
    parser = ab_parser(__doc__, block=5)
    parser.add_argument("--sizes", default="3,4", help="MiB, comma-separated")
    args = parser.parse_args()
    sizes = [int(float(mib) * MIB) for mib in args.sizes.split(",")]
    shipped = direct_ops.DIRECT_CMA_FROM_BYTES
    comm = mpccs.init()
    if not (comm.size == 2 and comm._engine.shm is not None and comm._engine.shm.cma):
        sys.exit("needs 2 ranks on one host whose pair reads across processes")
    try:
        rows = size_sweep(comm, (False, True), sizes, lambda nbytes, in_place: measure(comm, nbytes, in_place, args))
    finally:
        direct_ops.DIRECT_CMA_FROM_BYTES = shipped
    if comm.rank == 0:
        meta = ab_meta(comm, args, mpccs.__version__)
        lines = ab_report_head("Outboxes against reads across processes (2-rank all_reduce, float32)", meta,
                               "| size | in place | reads (us) | outboxes (us) | reads / outboxes | A/A floor |",
                               "|---:|---|---:|---:|---:|---:|")
        lines += [ab_size_row(row, "reads", "outboxes", "reads_again") for row in rows]
        lines += ["", "reads / outboxes: the reads' time over the outboxes' (> 1: the outboxes faster), "
                  "paired 95% interval; the floor: reads against reads again."]
        write_ab_results(args.out, "outbox_reads.json", meta, rows, lines)
    comm.close()


if __name__ == "__main__":
    main()
