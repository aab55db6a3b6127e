"""On a pair that reads across processes: a 2-rank reduce (or broadcast) above
the outbox's 2 MiB round the outbox in chunks (pipe_steps.py) or read across
processes (cma_steps.py)?

    mpccs-run -n 2 --no-prefix python bench/pipe_reads_ab.py --out bench/results/pipe_ring_s53 [--collective broadcast]

Float32, policy 'adaptive' as shipped, default planes, root 0, --sizes MiB,
out of place and in place (a broadcast: in place). Each iteration times a
block of back-to-back calls three ways, interleaved: by reads (the pipe's
bound pipe_steps.PIPE_MAX_BYTES set to the outbox's on both ranks between the
same calls), round the outbox (the bound at 256 MiB), and by reads again (the
A/A floor); one call each way precedes every timed block. Per-op time = block
time / block length, max across ranks. Writes pipe_reads_<collective>.json
and a section of report.md under --out.
"""
from __future__ import annotations

import os
import sys

import mpccs
from mpccs import pipe_steps
from mpccs.transports import shm

sys.path.insert(0, os.path.dirname(__file__))
from outbox_no_reads_ab import measure  # noqa: E402
from stats import ab_meta, ab_parser, ab_report_head, ab_size_row, size_sweep, write_ab_results  # noqa: E402

MIB = 1 << 20
WAYS = {"reads": shm.OUTBOX_BYTES, "pipe": 256 * MIB, "reads_again": shm.OUTBOX_BYTES}  # the pipe's bound


def main() -> None:
    parser = ab_parser(__doc__, block=5)
    parser.add_argument("--sizes", default="4,16,64,256", help="MiB, comma-separated")
    parser.add_argument("--collective", default="reduce", choices=["reduce", "broadcast"])
    args = parser.parse_args()
    sizes = [int(float(mib) * MIB) for mib in args.sizes.split(",")]
    shipped = dict(pipe_steps.PIPE_MAX_BYTES)
    comm = mpccs.init()
    if not (comm.size == 2 and comm._engine.shm is not None and comm._engine.shm.cma):
        sys.exit("needs 2 ranks on one host whose pair reads across processes")
    switch = lambda bound: pipe_steps.PIPE_MAX_BYTES.__setitem__(args.collective, bound)  # noqa: E731
    try:
        rows = size_sweep(comm, (False, True) if args.collective == "reduce" else (True,), sizes,
                          lambda nbytes, in_place: measure(comm, args.collective, nbytes, in_place, args, WAYS,
                                                           switch))
    finally:
        pipe_steps.PIPE_MAX_BYTES.update(shipped)
    if comm.rank == 0:
        meta = ab_meta(comm, args, mpccs.__version__)
        meta["collective"] = args.collective
        lines = ab_report_head(f"Round the outbox against reads across processes (2-rank {args.collective}, "
                               "float32)", meta,
                               "| size | in place | reads (us) | pipe (us) | reads / pipe | A/A floor |",
                               "|---:|---|---:|---:|---:|---:|")
        lines += [ab_size_row(row, "reads", "pipe", "reads_again") for row in rows]
        lines += ["", "reads / pipe: the reads' time over the pipe's (> 1: the pipe faster), paired 95% interval; "
                  "the floor: reads against reads again."]
        write_ab_results(args.out, f"pipe_reads_{args.collective}.json", meta, rows, lines)
    comm.close()


if __name__ == "__main__":
    main()
