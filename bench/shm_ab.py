"""Blocks through shared-memory segments against UCX messages (2 ranks, one host).

    mpccs-run -n 2 --no-prefix python bench/shm_ab.py --out bench/results/shm

Float32 all_reduce, out of place, policy 'adaptive' as shipped, default
planes. Each iteration times a block of back-to-back operations three ways,
interleaved: with the segments closed to the communicator (what runs without
them: the direct path's full exchange, or its blocks), with them (shm_steps.py:
DirectShmAllReduceOp), and without them again (the A/A noise floor). Sizes
stop at the direct path's bound (2 MiB on 2 ranks): above it the two-step
executor runs, whose blocks through the segments measured 1.04x at 2 MiB
[0.97, 1.10], 0.98x at 3 MiB and 0.90x at 4 MiB (two copies of a block that
no longer fits a core's cache cost more than UCX's one), so it keeps its
messages; a direct reduce_scatter or all_gather through them measured
0.67-0.91x at 256 KiB-2 MiB (one exchange straight into the output against
two copies), so those keep theirs too. Per-op time = block time / block length, max across
ranks. Writes all_reduce.json and appends a section to report.md under --out.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import mpccs

sys.path.insert(0, os.path.dirname(__file__))
from stats import (ab_cells, ab_meta, ab_parser, ab_report_head, interleaved_modes, time_block,  # noqa: E402
                   write_ab_results)

SIZES = tuple(k << 10 for k in (64, 128, 256, 384, 512, 768, 1024, 1536, 2000))  # the direct path's, 2 ranks
MODES = ("messages", "shm", "messages_again")


def time_mode(comm, pair, x: np.ndarray, out: np.ndarray, mode: str, block: int) -> float:
    comm._engine.shm = pair if mode == "shm" else None  # both ranks switch between the same operations
    comm.all_reduce(x, out)  # one call on the mode's path first
    return time_block(comm, lambda: comm.all_reduce(x, out), block)


def measure(comm, pair, nbytes: int, iters: int, block: int, warmup: int) -> dict:
    x, out = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    times, path = interleaved_modes(comm, MODES, lambda mode: time_mode(comm, pair, x, out, mode, block), iters,
                                    warmup)
    comm._engine.shm = pair
    return {"size": nbytes, "algorithm": path, "times_s": times}


def report_lines(rows: list[dict], meta: dict) -> list[str]:
    lines = ab_report_head("2 ranks, float32 all_reduce, policy 'adaptive', default planes", meta,
                           "| size | messages (us) | shm (us) | shm speedup [95% CI] | A/A floor | paths |",
                           "|---:|---:|---:|---:|---:|---|")
    for row in rows:
        t = row["times_s"]
        paths = f"{row['algorithm']['messages']} / {row['algorithm']['shm']}"
        lines.append(f"| {row['size'] >> 10} KiB | {ab_cells(t, 'messages', 'shm', 'messages_again')} | {paths} |")
    return lines + [""]


def main() -> None:
    args = ab_parser(__doc__, block=10).parse_args()
    comm = mpccs.init()
    pair = comm._engine.shm
    if comm.size != 2 or pair is None:
        raise SystemExit("needs 2 ranks on one host with the shared-memory segments open (MPCCS_SHM=1)")
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
