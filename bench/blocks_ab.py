"""The direct path's reduce-scatter and all-gather of blocks against its one full exchange.

    mpccs-run -n 2 --no-prefix python bench/blocks_ab.py --out bench/results/direct_blocks
    mpccs-run -n 3 --no-prefix python bench/blocks_ab.py --out bench/results/direct_blocks

Float32 all_reduce, out of place, policy 'up' on the default planes (what
'adaptive' runs too below the size it would split). Each iteration times a
block of back-to-back operations three ways, interleaved: the full exchange
(DirectAllReduceOp: every rank sends its whole input to every other rank and
reduces all of them), the blocks (DirectBlocksAllReduceOp: on 2 ranks the two
exchanges of halves), and the full exchange again (the A/A noise floor). The
path is switched by the size from which comm takes blocks
(DIRECT_BLOCKS_MIN_BYTES), set per mode. Per-op time = block time / block
length, max across ranks. Sizes stop at the direct path's bound for the
world. The shared-memory segments stay closed (shm=False): on 2 ranks they
would carry both modes (bench/shm_ab.py measures them). Writes
all_reduce_<p>ranks.json and appends a section to report.md under --out.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import mpccs
import mpccs.comm as comm_module
from mpccs.direct_ops import DIRECT_MAX_BYTES

sys.path.insert(0, os.path.dirname(__file__))
from stats import (ab_cells, ab_meta, ab_parser, ab_report_head, interleaved_modes, time_block,  # noqa: E402
                   write_ab_results)

SIZES = tuple(k << 10 for k in (256, 384, 512, 768, 1024, 1536, 2000))  # bounded by the direct path's bound
MODES = ("full", "blocks", "full_again")
BLOCKS_FROM = {"full": 1 << 62, "blocks": DIRECT_MAX_BYTES + 1, "full_again": 1 << 62}


def time_mode(comm, x: np.ndarray, out: np.ndarray, mode: str, block: int) -> float:
    comm_module.DIRECT_BLOCKS_MIN_BYTES = BLOCKS_FROM[mode]
    comm.all_reduce(x, out)  # one call on the mode's path first
    return time_block(comm, lambda: comm.all_reduce(x, out), block)


def measure(comm, nbytes: int, iters: int, block: int, warmup: int) -> dict:
    x, out = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    times, path = interleaved_modes(comm, MODES, lambda mode: time_mode(comm, x, out, mode, block), iters, warmup)
    return {"size": nbytes, "algorithm": path, "times_s": times}


def report_lines(rows: list[dict], meta: dict) -> list[str]:
    lines = ab_report_head(f"{meta['world']} ranks, float32 all_reduce, policy 'up', default planes", meta,
                           "| size | full (us) | blocks (us) | blocks speedup [95% CI] | A/A floor |",
                           "|---:|---:|---:|---:|---:|")
    for row in rows:
        t = row["times_s"]
        lines.append(f"| {row['size'] >> 10} KiB | {ab_cells(t, 'full', 'blocks', 'full_again')} |")
    return lines + [""]


def main() -> None:
    args = ab_parser(__doc__, block=10).parse_args()
    comm = mpccs.init(shm=False)  # the messages' paths: on 2 ranks the segments would carry both (bench/shm_ab.py)
    comm.set_path_policy("up")
    rows = []
    for k, nbytes in enumerate(SIZES):
        if not comm._direct("all_reduce", nbytes // 4, 4, None, nbytes):
            break  # past the direct path's bound for this world
        rows.append(measure(comm, nbytes, args.iters, args.block, args.warmup))
        if comm.rank == 0:
            print(f"# progress: {k + 1}/{len(SIZES)} sizes", flush=True)
    if comm.rank == 0:
        meta = ab_meta(comm, args, mpccs.__version__)
        write_ab_results(args.out, f"all_reduce_{comm.size}ranks.json", meta, rows, report_lines(rows, meta))
    comm.close()


if __name__ == "__main__":
    main()
