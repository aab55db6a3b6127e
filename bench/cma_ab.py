"""A 2-rank all_reduce on a pair that reads across processes against the same
pair without the reads (2 ranks, one host).

    mpccs-run -n 2 --no-prefix python bench/cma_ab.py --out bench/results/cma

Float32 all_reduce, out of place, policy 'adaptive' as shipped, default
planes, from 2 MiB to the direct path's bound on such a pair
(direct_ops.DIRECT_CMA_MAX_BYTES). Each iteration times a block of
back-to-back operations three ways, interleaved: without the reads (the
pair's ``cma`` off on both ranks between the same operations: the two-step
executor over UCX messages, what ran before), with them (the direct path
reading its halves: cma_steps.py), and without them again (the A/A noise
floor). The communicator's cached path answers are dropped at each switch;
one call each way precedes every timed block. Per-op time = block time /
block length, max across ranks. Writes all_reduce.json and appends a
section to report.md under --out.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import mpccs

sys.path.insert(0, os.path.dirname(__file__))
from stats import (ab_cells, ab_meta, ab_parser, ab_report_head, slowest_rank, time_block,  # noqa: E402
                   write_ab_results)

SIZES = tuple(k << 20 for k in (2, 3, 4, 6, 8, 12, 16))
MODES = ("messages", "cma", "messages_again")


def time_mode(comm, pair, x: np.ndarray, out: np.ndarray, mode: str, block: int) -> float:
    pair.cma = mode == "cma"  # both ranks switch between the same operations
    comm._direct_answers.clear()  # (kept per call: asked again under the pair's new state)
    comm.all_reduce(x, out)  # one call the mode's way first
    return time_block(comm, lambda: comm.all_reduce(x, out), block)


def measure(comm, pair, nbytes: int, iters: int, block: int, warmup: int) -> dict:
    x, out = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    times = {mode: [] for mode in MODES}
    moved = {}
    for i in range(warmup + iters):
        for mode in MODES:
            t = time_mode(comm, pair, x, out, mode, block)
            stats = comm.last_stats()
            moved[mode] = f"{stats['algorithm']}:{stats.get('moved_by', '-')}"
            if i >= warmup:
                times[mode].append(t)
    pair.cma = True
    return {"size": nbytes, "algorithm": moved, "times_s": slowest_rank(comm, times)}


def report_lines(rows: list[dict], meta: dict) -> list[str]:
    lines = ab_report_head("2 ranks, float32 all_reduce, policy 'adaptive', default planes", meta,
                           "| size | messages (us) | cma (us) | cma speedup [95% CI] | A/A floor | last call each way |",
                           "|---:|---:|---:|---:|---:|---|")
    for row in rows:
        paths = f"{row['algorithm']['messages']} / {row['algorithm']['cma']}"
        lines.append(f"| {row['size'] >> 20} MiB | {ab_cells(row['times_s'], 'messages', 'cma', 'messages_again')} "
                     f"| {paths} |")
    return lines + [""]


def main() -> None:
    args = ab_parser(__doc__, block=5).parse_args()
    comm = mpccs.init()
    pair = comm._engine.shm
    if comm.size != 2 or pair is None or not pair.cma:
        raise SystemExit("needs 2 ranks on one host with the segments open and cross-memory reads allowed")
    rows = []
    for k, nbytes in enumerate(SIZES):
        rows.append(measure(comm, pair, nbytes, args.iters, args.block, args.warmup))
        if comm.rank == 0:
            print(f"# progress: {k + 1}/{len(SIZES)} sizes", flush=True)
    if comm.rank == 0:
        meta = ab_meta(comm, args, mpccs.__version__)
        write_ab_results(args.out, "all_reduce.json", meta, rows, report_lines(rows, meta))
    comm.close()


if __name__ == "__main__":
    main()
