"""What the direct path's fingerprint messages cost a 2-rank all_reduce on the
shared-memory segments (an experiment, not a mode: without the messages a
mismatched peer on another path is not caught).

    mpccs-run -n 2 --no-prefix python bench/fingerprint_cost.py --out bench/results/fingerprint_cost [--reads]

DirectShmAllReduceOp posts a fingerprint message to its peer over UCX and
receives the peer's, beside the steps in the segments (shm_steps.py, or
cma_steps.py above 2 MiB; --reads: at every size). Each iteration times a
block of back-to-back operations three ways, interleaved: as shipped, with
both ranks posting nothing instead (between the same operations), and as
shipped again (the A/A noise floor). Per-op time = block time / block length,
max across ranks. Writes all_reduce.json (all_reduce_reads.json) and appends a
section to report.md under --out.
"""
from __future__ import annotations

import os
import sys

import mpccs
from mpccs import direct_ops

sys.path.insert(0, os.path.dirname(__file__))
from cma_ab import make_call  # noqa: E402
from stats import (ab_cells, ab_meta, ab_parser, ab_report_head, interleaved_modes, time_block,  # noqa: E402
                   write_ab_results)

MIB = 1 << 20
SIZES = (1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB)
MODES = ("messages", "none", "messages_again")
SHIPPED = direct_ops.DirectAllReduceOp._post_medium


def time_mode(comm, call, mode: str, block: int) -> float:
    # both ranks switch between the same operations
    direct_ops.DirectAllReduceOp._post_medium = (lambda self, *a: None) if mode == "none" else SHIPPED
    call()  # one call the mode's way first
    return time_block(comm, call, block)


def report_lines(rows: list[dict], meta: dict, reads: bool) -> list[str]:
    how = "reads at every size" if reads else "as shipped"
    lines = ab_report_head(f"2 ranks, float32 all_reduce on the segments, {how}, policy 'adaptive'", meta,
                           "| size | messages (us) | none (us) | speedup without [95% CI] | A/A floor | path |",
                           "|---:|---:|---:|---:|---:|---|")
    for row in rows:
        lines.append(f"| {row['size'] >> 20} MiB | {ab_cells(row['times_s'], 'messages', 'none', 'messages_again')} "
                     f"| {row['algorithm']['none']} |")
    return lines + [""]


def main() -> None:
    parser = ab_parser(__doc__, block=20)
    parser.add_argument("--reads", action="store_true",
                        help="cross-memory reads at every size (DIRECT_CMA_FROM_BYTES = 0)")
    args = parser.parse_args()
    comm = mpccs.init()
    if args.reads:
        direct_ops.DIRECT_CMA_FROM_BYTES = 0
    rows = []
    for nbytes in SIZES[:2] if args.reads else SIZES:
        call = make_call(comm, "all_reduce", nbytes)
        times, ran = interleaved_modes(comm, MODES, lambda mode: time_mode(comm, call, mode, args.block),
                                       args.iters, args.warmup)
        rows.append({"size": nbytes, "algorithm": ran, "times_s": times})
    direct_ops.DirectAllReduceOp._post_medium = SHIPPED
    if comm.rank == 0:
        meta = ab_meta(comm, args, mpccs.__version__, reads=args.reads)
        write_ab_results(args.out, "all_reduce_reads.json" if args.reads else "all_reduce.json", meta, rows,
                         report_lines(rows, meta, args.reads))
    comm.close()


if __name__ == "__main__":
    main()
