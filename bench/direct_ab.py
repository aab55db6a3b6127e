"""The direct path against the DAG engine at small and medium sizes.

    mpccs-run -n 2 --no-prefix python bench/direct_ab.py --out bench/results/direct_medium
    mpccs-run -n 3 --no-prefix python bench/direct_ab.py --out bench/results/direct_medium
    mpccs-run -n 2 --no-prefix python bench/direct_ab.py --collective all_gather --out ...

Float32 all_reduce, broadcast from or reduce to rank 0 (or all_gather, reduce_scatter,
all_to_all: sizes = one block, what each rank sends each peer) under the path
policy 'up' (what 'adaptive' does where no stage is large enough to split) on
the default planes. Each iteration times a block of
back-to-back operations three ways, interleaved: the direct path (no algorithm
asked: what a user gets), the DAG with the algorithm the tuner picks for that
size (what a user got before medium sizes went direct), and the DAG again (the
A/A noise floor). Per-op time = block time / block length, max across ranks.
Writes <collective>_<p>ranks.json and appends a section to report.md under --out.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import mpccs

sys.path.insert(0, os.path.dirname(__file__))
from stats import (ab_meta, ab_parser, ab_report_head, noise_floor, ratio_ci, slowest_rank,  # noqa: E402
                   time_block, write_ab_results)

SIZES = (8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 3 << 19)  # the larger ones go direct on 2 ranks only
MODES = ("direct", "dag", "dag_again")


def buffers(comm, collective: str, nbytes: int):
    """(send, recv) of a call in which each rank sends nbytes to each peer (all_reduce: the input)."""
    n, p = nbytes // 4, comm.size
    if collective in ("reduce_scatter", "all_to_all"):
        return np.ones(n * p, np.float32), np.empty(n if collective == "reduce_scatter" else n * p, np.float32)
    return np.ones(n, np.float32), np.empty(n * p if collective == "all_gather" else n, np.float32)


def one_call(comm, collective: str, x, out, algorithm) -> None:
    if collective == "all_reduce":
        comm.all_reduce(x, algorithm=algorithm)
    elif collective == "broadcast":
        comm.broadcast(x, root=0, algorithm=algorithm)
    elif collective == "reduce":
        comm.reduce(x, out if comm.rank == 0 else None, root=0, algorithm=algorithm)
    else:
        getattr(comm, collective)(x, out, algorithm=algorithm)


def measure(comm, collective: str, nbytes: int, iters: int, block: int, warmup: int) -> dict:
    x, out = buffers(comm, collective, nbytes)
    call_bytes = nbytes * (1 if collective in ("all_reduce", "broadcast", "reduce") else comm.size)
    dag_algorithm = comm._choose(collective, call_bytes).algorithm  # the tuner's pick: the DAG path as before
    algorithms = {"direct": None, "dag": dag_algorithm, "dag_again": dag_algorithm}
    times = {mode: [] for mode in MODES}
    for i in range(warmup + iters):
        for mode in MODES:
            t = time_block(comm, lambda: one_call(comm, collective, x, out, algorithms[mode]), block)
            if i >= warmup:
                times[mode].append(t)
    path = {mode: None for mode in MODES}
    for mode in MODES:
        one_call(comm, collective, x, out, algorithms[mode])
        path[mode] = comm.last_stats()["algorithm"]
    return {"size": nbytes, "algorithm": path, "times_s": slowest_rank(comm, times)}


def summarise(row: dict) -> dict:
    t = row["times_s"]
    return {
        "median_us": {m: 1e6 * float(np.median(t[m])) for m in MODES},
        "speedup": ratio_ci(t["direct"], t["dag"], paired=True),  # time(dag) / time(direct)
        "noise_floor": noise_floor(t["dag"], t["dag_again"]),
    }


def report_lines(world: int, rows: list[dict], meta: dict) -> list[str]:
    what = (meta["collective"] if meta["collective"] in ("all_reduce", "broadcast", "reduce")
            else f"{meta['collective']} (size = a block)")
    lines = ab_report_head(f"{world} ranks, float32 {what}, policy 'up', default planes", meta,
                           "| size | direct (us) | DAG (us) | DAG algorithm | direct speedup [95% CI] | A/A floor |",
                           "|---:|---:|---:|:--|---:|---:|")
    for row in rows:
        s = summarise(row)
        point, lo, hi = s["speedup"]
        lines.append(f"| {row['size'] >> 10} KiB | {s['median_us']['direct']:.0f} | {s['median_us']['dag']:.0f} | "
                     f"{row['algorithm']['dag']} | {point:.2f} [{lo:.2f}, {hi:.2f}] | {s['noise_floor']:.2f} |")
    return lines + [""]


def main() -> None:
    ap = ab_parser(__doc__, block=10)
    ap.add_argument("--collective", choices=("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                                             "reduce"),
                    default="all_reduce")
    args = ap.parse_args()
    comm = mpccs.init()
    comm.set_path_policy("up")
    rows = []
    for k, nbytes in enumerate(SIZES):
        one_call(comm, args.collective, *buffers(comm, args.collective, nbytes), None)
        if not comm.last_stats()["algorithm"].startswith("direct"):
            break  # past the direct path's bound for this world
        rows.append(measure(comm, args.collective, nbytes, args.iters, args.block, args.warmup))
        if comm.rank == 0:
            print(f"# progress: {k + 1}/{len(SIZES)} sizes", flush=True)
    if comm.rank == 0:
        meta = ab_meta(comm, args, mpccs.__version__, collective=args.collective)
        write_ab_results(args.out, f"{args.collective}_{comm.size}ranks.json", meta, rows,
                         report_lines(comm.size, rows, meta))
    comm.close()


if __name__ == "__main__":
    main()
