"""How much of the peer's operand a read across processes takes at a time
before reducing it (cma_steps.READ_PART_BYTES, READ_PARTS_MAX_OUT_BYTES).

    mpccs-run -n 2 --no-prefix python bench/read_parts.py --out bench/results/read_parts

2 ranks, float32 all_reduce on a pair that reads across processes, in place
(through the kept buffer) and out of place (into the output), 4-64 MiB. Each
iteration times a block of back-to-back calls per part size, the sizes
interleaved (both ranks switch between the same operations); the reference is
512 KiB (as shipped), against 2 MiB, 8 MiB and whole blocks (out of place:
what it read above READ_PARTS_MAX_OUT_BYTES; in place the kept buffer's old
8 MiB bound), with an A/A floor of 512 KiB against itself. Writes
read_parts.json and a section of report.md under --out.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import mpccs
from mpccs import cma_steps

sys.path.insert(0, os.path.dirname(__file__))
from stats import ab_meta, ab_parser, ab_report_head, interleaved_modes, ratio_ci, time_block  # noqa: E402
from stats import noise_floor, write_ab_results  # noqa: E402

MIB = 1 << 20
SIZES = (4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, 64 * MIB)
PARTS = {"512K": 512 << 10, "512K_again": 512 << 10, "2M": 2 * MIB, "8M": 8 * MIB, "whole": 1 << 40}


def measure(comm, nbytes: int, in_place: bool, args) -> dict:
    x = np.ones(nbytes // 4, np.float32)
    out = None if in_place else np.empty_like(x)
    call = (lambda: comm.all_reduce(x)) if in_place else (lambda: comm.all_reduce(x, out))
    modes = [m for m in PARTS if not (in_place and m == "whole")]  # in place, parts are the kept buffer's size

    def time_mode(mode: str) -> float:
        cma_steps.READ_PART_BYTES = PARTS[mode]
        cma_steps.READ_PARTS_MAX_OUT_BYTES = 1 << 40  # every block in parts: the bound is what this measures
        call()
        return time_block(comm, call, args.block)

    times, ran = interleaved_modes(comm, modes, time_mode, args.iters, args.warmup)
    return {"size": nbytes, "in_place": in_place, "algorithm": ran["512K"], "times_s": times}


def main() -> None:
    args = ab_parser(__doc__, block=3).parse_args()
    shipped = cma_steps.READ_PART_BYTES, cma_steps.READ_PARTS_MAX_OUT_BYTES
    comm = mpccs.init()
    rows = []
    for in_place in (True, False):
        for nbytes in SIZES:
            rows.append(measure(comm, nbytes, in_place, args))
            if comm.rank == 0:
                print(f"# progress: {'in place' if in_place else 'out of place'} {nbytes >> 20} MiB", flush=True)
    cma_steps.READ_PART_BYTES, cma_steps.READ_PARTS_MAX_OUT_BYTES = shipped
    if comm.rank == 0:
        meta = ab_meta(comm, args, mpccs.__version__)
        lines = ab_report_head("Read part size (2-rank all_reduce read across processes)", meta,
                               "| size | in place | 512 KiB (us) | 2 MiB / 512 KiB | 8 MiB / 512 KiB | whole / 512 KiB "
                               "| A/A floor |", "|---:|---|---:|---:|---:|---:|---:|")
        for row in rows:
            t = row["times_s"]
            cells = []
            for other in ("2M", "8M", "whole"):
                if other not in t:
                    cells.append("-")
                    continue
                point, lo, hi = ratio_ci(t["512K"], t[other], paired=True)
                cells.append(f"{point:.2f} [{lo:.2f}, {hi:.2f}]")
            lines.append(f"| {row['size'] >> 20} MiB | {'yes' if row['in_place'] else 'no'} | "
                         f"{1e6 * np.median(t['512K']):.0f} | " + " | ".join(cells)
                         + f" | {noise_floor(t['512K'], t['512K_again']):.2f} |")
        lines.append("")
        lines.append("Ratios: the other part size's time over 512 KiB's (> 1: 512 KiB faster), paired 95% interval.")
        write_ab_results(args.out, "read_parts.json", meta, rows, lines)
    comm.close()


if __name__ == "__main__":
    main()
