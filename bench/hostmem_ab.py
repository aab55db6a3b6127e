"""Collectives of 2-4 ranks on one host with plain numpy buffers against
mpccs.empty's (2 MiB pages, 2 MiB aligned: mpccs/hostmem.py), under mpccs
and under MPICH through mpi4py, in alternating processes.

    python bench/hostmem_ab.py --rounds 4 --ranks 2,3,4 --sizes 2M,4M,16M --collective all_gather --out DIR

Each round runs, for each rank count, mpccs with numpy buffers, mpccs with
mpccs.empty's, MPICH with numpy's and MPICH with mpccs.empty's, back to back
(group_lane_ab.py's timing: float32 sum, out of place, 30 warm-up calls, 20
blocks of back-to-back calls after a barrier, the slowest rank's per-call time,
median over the blocks; a size is one rank's input). Writes report.md and
rounds.json under --out.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import group_lane_ab as ab  # noqa: E402
from stats import size_text, write_rounds  # noqa: E402

ARMS = (("mpccs", "numpy"), ("mpccs", "hugepages"), ("mpi", "numpy"), ("mpi", "hugepages"))


def run_arm(library: str, memory: str, n: int) -> dict:
    os.environ["GROUP_LANE_AB_MEMORY"] = memory
    return ab.run_mpccs(os.path.dirname(HERE), n) if library == "mpccs" else ab.run_mpi(n)


def report(rounds: list, worlds: tuple, name: str) -> list:
    lines = [f"# {name}: numpy buffers against mpccs.empty's (2 MiB pages), mpccs and MPICH", "",
             "Per-call time in us, float32 sum, out of place, slowest rank, median of 20 blocks of back-to-back "
             "calls (a size: one rank's input); per round mpccs numpy / mpccs hugepages / MPICH numpy / MPICH "
             "hugepages; then the medians of the rounds' ratios (time / time: above 1, the second is faster).", "",
             "| ranks | size | " + " | ".join(f"round {k + 1}" for k in range(len(rounds)))
             + " | mpccs numpy / hugepages | MPICH numpy / hugepages | mpccs / MPICH, numpy | mpccs / MPICH, hugepages |"
             " mpccs hugepages / MPICH numpy |",
             "|---|---|" + "---|" * len(rounds) + "---:|---:|---:|---:|---:|"]

    def med(n, key, a, b):
        return np.median([r[n][a][key] / r[n][b][key] for r in rounds])
    for n in worlds:
        for nbytes in ab._sizes():
            key = str(nbytes)
            cells = [" / ".join(f"{r[n][f'{lib}:{mem}'][key]:.0f}" for lib, mem in ARMS) for r in rounds]
            lines.append(f"| {n} | {size_text(nbytes)} | " + " | ".join(cells)
                         + f" | {med(n, key, 'mpccs:numpy', 'mpccs:hugepages'):.2f}"
                         f" | {med(n, key, 'mpi:numpy', 'mpi:hugepages'):.2f}"
                         f" | {med(n, key, 'mpccs:numpy', 'mpi:numpy'):.2f}"
                         f" | {med(n, key, 'mpccs:hugepages', 'mpi:hugepages'):.2f}"
                         f" | {med(n, key, 'mpccs:hugepages', 'mpi:numpy'):.2f} |")
    for n in worlds:
        first = rounds[0][n]
        lines.append(f"\n{n} ranks, mpccs's algorithm per size (numpy, hugepages): " + ", ".join(
            f"{size_text(b)} {first['mpccs:numpy'].get(f'algorithm_{b}')}, {first['mpccs:hugepages'].get(f'algorithm_{b}')}"
            for b in ab._sizes()))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--sizes", default="2M,4M,16M", help="bytes per call, comma-separated (K and M suffixes)")
    ap.add_argument("--collective", choices=ab.COLLECTIVES, default="all_reduce")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["GROUP_LANE_AB_COLLECTIVE"] = args.collective
    units = {"K": 1 << 10, "M": 1 << 20}
    os.environ["GROUP_LANE_AB_SIZES"] = ",".join(
        str(int(x[:-1]) * units[x[-1].upper()] if x[-1].upper() in units else int(x)) for x in args.sizes.split(","))
    worlds = tuple(int(n) for n in args.ranks.split(","))
    rounds = []
    for k in range(args.rounds):
        arms = ARMS if k % 2 == 0 else ARMS[::-1]  # neither allocation always runs first
        rounds.append({n: {f"{lib}:{mem}": run_arm(lib, mem, n) for lib, mem in arms} for n in worlds})
        print(f"# progress: {k + 1}/{args.rounds} rounds", flush=True)
    write_rounds(args.out, "numpy buffers", rounds, report(rounds, worlds, args.collective))


if __name__ == "__main__":
    main()
