"""2-rank collectives on a pair that reads across processes against the same
pair without the reads (2 ranks, one host).

    mpccs-run -n 2 --no-prefix python bench/cma_ab.py --out bench/results/cma [--collective all_reduce]

Float32, out of place, policy 'adaptive' as shipped, default planes, at the
sizes where the reads apply: all_reduce from 2 MiB to the direct path's bound
on such a pair (direct_ops.DIRECT_CMA_MAX_BYTES, 256 MiB; above 16 MiB the
reads replace the DAG's ring; since the fifty-second session the pair's calls
up to 4 MiB go through the outboxes instead, so "with" there is the outboxes),
reduce_scatter, all_gather
and all_to_all blocks of 1-8 MiB, broadcast and reduce (root 0) of 1-8 MiB (the
reads go on to 128 MiB blocks)
(DIRECT_CMA_BLOCK_BYTES). Each iteration times a
block of back-to-back operations three ways, interleaved: without the reads
(the pair's ``cma`` off on both ranks between the same operations: the
two-step executor over UCX messages, or for all_to_all, broadcast and reduce
the DAG's schedules, what ran before), with them (the direct
path reading its blocks: cma_steps.py), and without them again (the A/A noise
floor). The communicator's cached path answers are dropped at each switch;
one call each way precedes every timed block. Per-op time = block time /
block length, max across ranks. Writes COLLECTIVE.json and appends a section
to report.md under --out.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import mpccs

sys.path.insert(0, os.path.dirname(__file__))
from stats import (ab_cells, ab_meta, ab_parser, ab_report_head, interleaved_modes, time_block,  # noqa: E402
                   write_ab_results)

MIB = 1 << 20
# nccl-tests' sizes: the whole buffer (all_gather: the output; the others: the input)
SIZES = {"all_reduce": tuple(k * MIB for k in (2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256)),
         "reduce_scatter": tuple(k * MIB for k in (2, 4, 8, 16)),
         "all_gather": tuple(k * MIB for k in (2, 4, 8, 16)),
         "all_to_all": tuple(k * MIB for k in (2, 4, 8, 16)),
         "broadcast": tuple(k * MIB for k in (1, 2, 4, 8)),
         "reduce": tuple(k * MIB for k in (1, 2, 4, 8))}
MODES = ("messages", "cma", "messages_again")


def make_call(comm, collective: str, nbytes: int):
    n = nbytes // 4
    if collective == "all_reduce":
        x, out = np.ones(n, np.float32), np.empty(n, np.float32)
        return lambda: comm.all_reduce(x, out)
    if collective == "reduce_scatter":
        x, out = np.ones(n, np.float32), np.empty(n // 2, np.float32)
        return lambda: comm.reduce_scatter(x, out)
    if collective == "all_to_all":
        x, out = np.ones(n, np.float32), np.empty(n, np.float32)
        return lambda: comm.all_to_all(x, out)
    if collective == "broadcast":
        x = np.ones(n, np.float32)
        return lambda: comm.broadcast(x, root=0)
    if collective == "reduce":
        x, out = np.ones(n, np.float32), np.empty(n, np.float32)
        return lambda: comm.reduce(x, out if comm.rank == 0 else None, root=0)
    x, out = np.ones(n // 2, np.float32), np.empty(n, np.float32)
    return lambda: comm.all_gather(x, out)


def time_mode(comm, pair, call, mode: str, block: int) -> float:
    pair.cma = mode == "cma"  # both ranks switch between the same operations
    comm._direct_answers.clear()  # (kept per call: asked again under the pair's new state)
    call()  # one call the mode's way first
    return time_block(comm, call, block)


def measure(comm, pair, collective: str, nbytes: int, iters: int, block: int, warmup: int) -> dict:
    call = make_call(comm, collective, nbytes)
    times, ran = interleaved_modes(comm, MODES, lambda mode: time_mode(comm, pair, call, mode, block), iters, warmup)
    pair.cma = True
    return {"size": nbytes, "algorithm": ran, "times_s": times}


def report_lines(collective: str, rows: list[dict], meta: dict) -> list[str]:
    lines = ab_report_head(f"2 ranks, float32 {collective}, policy 'adaptive', default planes", meta,
                           "| size | messages (us) | cma (us) | cma speedup [95% CI] | A/A floor | last call each way |",
                           "|---:|---:|---:|---:|---:|---|")
    for row in rows:
        paths = f"{row['algorithm']['messages']} / {row['algorithm']['cma']}"
        lines.append(f"| {row['size'] >> 20} MiB | {ab_cells(row['times_s'], 'messages', 'cma', 'messages_again')} "
                     f"| {paths} |")
    return lines + [""]


def main() -> None:
    parser = ab_parser(__doc__, block=5)
    parser.add_argument("--collective", choices=sorted(SIZES), default="all_reduce")
    parser.add_argument("--max", type=int, default=1 << 62, help="largest size, bytes")
    args = parser.parse_args()
    comm = mpccs.init()
    pair = comm._engine.shm
    if comm.size != 2 or pair is None or not pair.cma:
        raise SystemExit("needs 2 ranks on one host with the segments open and cross-memory reads allowed")
    rows = []
    sizes = [n for n in SIZES[args.collective] if n <= args.max]
    for k, nbytes in enumerate(sizes):
        rows.append(measure(comm, pair, args.collective, nbytes, args.iters, args.block, args.warmup))
        if comm.rank == 0:
            print(f"# progress: {k + 1}/{len(sizes)} sizes", flush=True)
    if comm.rank == 0:
        meta = ab_meta(comm, args, mpccs.__version__)
        write_ab_results(args.out, f"{args.collective}.json", meta, rows, report_lines(args.collective, rows, meta))
    comm.close()


if __name__ == "__main__":
    main()
