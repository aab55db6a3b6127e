"""The two-step executor against the DAG engine and the floor, 2 ranks.

    mpccs-run -n 2 --no-prefix python bench/two_step_ab.py --out bench/results/two_step
    mpccs-run -n 2 --no-prefix python bench/two_step_ab.py --collective reduce_scatter --out ...

Float32 all_reduce, in place, under the path policy 'up' on the default planes
(what 'adaptive' runs between probes once 'out' is dropped). Each iteration
times a block of back-to-back operations four ways, interleaved: the two-step
executor (no algorithm asked: what a user gets), the DAG with the algorithm
the tuner picks (what a user got before), the DAG again (the A/A noise
floor), and the same two exchanges written against the planes by hand (the
floor for any executor: pre-posted receives, no fingerprints, no
bookkeeping). Per-op time = block time / block length, max across ranks.
reduce_scatter and all_gather (--collective; size = the call's whole buffer, as
nbytes in nccl-tests) run its one step: a single exchange of blocks.
Writes <collective>_2ranks.json and appends a section to report.md under --out.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import mpccs
from mpccs import wire

sys.path.insert(0, os.path.dirname(__file__))
from stats import (ab_meta, ab_parser, ab_report_head, noise_floor, ratio_ci, slowest_rank,  # noqa: E402
                   time_block, write_ab_results)

SIZES = tuple(m << 20 for m in (2, 4, 8, 16))
MODES = ("two_step", "dag", "dag_again", "by_hand")
HAND_TAG = wire.make_tag(wire.KIND_P2P, 0xFF, 0, 0)  # a comm id no communicator here uses


class ByHand:
    """The executor's exchanges on the 'up' plane with nothing around them."""

    def __init__(self, comm, collective: str, n: int):
        self.plane = comm._engine.planes["up"]
        self.peer = 1 - comm.rank
        self.collective = collective
        cut = n // 2
        self.mine, self.theirs = (slice(0, cut), slice(cut, n)) if comm.rank == 0 else (slice(cut, n), slice(0, cut))
        self.tmp = np.empty(n - cut + 1, np.float32)

    def _wait(self, reqs) -> None:
        while not all(r.completed for r in reqs):
            self.plane.progress()

    def __call__(self, x: np.ndarray, out: np.ndarray) -> None:
        """all_reduce: x in place; reduce_scatter: x's own half reduced into out;
        all_gather: x is this rank's block, out the whole."""
        p, peer, mine, theirs = self.plane, self.peer, self.mine, self.theirs
        if self.collective == "all_gather":
            out[mine] = x
            self._wait([p.recv(out[theirs], HAND_TAG | 2), p.send(peer, x, HAND_TAG | 2)])
            return
        incoming = self.tmp[:x[mine].size]
        self._wait([p.recv(incoming, HAND_TAG | 1), p.send(peer, x[theirs], HAND_TAG | 1)])
        if self.collective == "reduce_scatter":
            np.add(x[mine], incoming, out=out)
            return
        np.add(x[mine], incoming, out=x[mine])
        self._wait([p.recv(x[theirs], HAND_TAG | 2), p.send(peer, x[mine], HAND_TAG | 2)])


def buffers(collective: str, nbytes: int):
    """(x, out) of a call moving nbytes in all (nccl-tests' size)."""
    n = nbytes // 4
    if collective == "all_gather":
        return np.ones(n // 2, np.float32), np.empty(n, np.float32)
    if collective == "reduce_scatter":
        return np.ones(n, np.float32), np.empty(n // 2, np.float32)
    return np.ones(n, np.float32), None


def one_call(comm, collective: str, x, out, algorithm) -> None:
    if collective == "all_reduce":
        comm.all_reduce(x, algorithm=algorithm)
    else:
        getattr(comm, collective)(x, out, algorithm=algorithm)


def measure(comm, collective: str, nbytes: int, iters: int, block: int, warmup: int) -> dict:
    x, out = buffers(collective, nbytes)
    dag_algorithm = comm._choose(collective, nbytes).algorithm
    by_hand = ByHand(comm, collective, nbytes // 4)
    calls = {"two_step": lambda: one_call(comm, collective, x, out, None),
             "dag": lambda: one_call(comm, collective, x, out, dag_algorithm),
             "dag_again": lambda: one_call(comm, collective, x, out, dag_algorithm),
             "by_hand": lambda: by_hand(x, out)}
    times = {mode: [] for mode in MODES}
    for i in range(warmup + iters):
        for mode in (MODES if i % 2 else MODES[::-1]):
            x[:] = 1  # keep values bounded: every call doubles them
            t = time_block(comm, calls[mode], block)
            if i >= warmup:
                times[mode].append(t)
    path = {}
    for mode in ("two_step", "dag"):
        calls[mode]()
        path[mode] = comm.last_stats()["algorithm"]
    return {"size": nbytes, "algorithm": path, "times_s": slowest_rank(comm, times)}


def summarise(row: dict) -> dict:
    t = row["times_s"]
    return {
        "median_us": {m: 1e6 * float(np.median(t[m])) for m in MODES},
        "speedup": ratio_ci(t["two_step"], t["dag"], paired=True),  # time(dag) / time(two_step)
        "of_floor": ratio_ci(t["two_step"], t["by_hand"], paired=True),  # time(by hand) / time(two_step)
        "noise_floor": noise_floor(t["dag"], t["dag_again"]),
    }


def report_lines(rows: list[dict], meta: dict) -> list[str]:
    what = "all_reduce in place" if meta.get("collective", "all_reduce") == "all_reduce" else meta["collective"]
    lines = ab_report_head(f"2 ranks, float32 {what}, policy 'up', default planes", meta,
                           "| size | two-step (us) | DAG (us) | by hand (us) | DAG algorithm | two-step speedup [95% CI] | "
                           "A/A floor | by hand / two-step [95% CI] |",
                           "|---:|---:|---:|---:|:--|---:|---:|---:|")
    for row in rows:
        s = summarise(row)
        point, lo, hi = s["speedup"]
        fp, flo, fhi = s["of_floor"]
        m = s["median_us"]
        lines.append(f"| {row['size'] >> 20} MiB | {m['two_step']:.0f} | {m['dag']:.0f} | {m['by_hand']:.0f} | "
                     f"{row['algorithm']['dag']} | {point:.2f} [{lo:.2f}, {hi:.2f}] | {s['noise_floor']:.2f} | "
                     f"{fp:.2f} [{flo:.2f}, {fhi:.2f}] |")
    return lines + [""]


def main() -> None:
    ap = ab_parser(__doc__, block=5)
    ap.add_argument("--collective", choices=("all_reduce", "reduce_scatter", "all_gather"), default="all_reduce")
    args = ap.parse_args()
    comm = mpccs.init()
    if comm.size != 2:
        raise SystemExit("two_step_ab.py: run it on 2 ranks (the two-step executor is for 2)")
    comm.set_path_policy("up")
    rows = []
    for k, nbytes in enumerate(SIZES):
        rows.append(measure(comm, args.collective, nbytes, args.iters, args.block, args.warmup))
        if comm.rank == 0:
            print(f"# progress: {k + 1}/{len(SIZES)} sizes", flush=True)
    if comm.rank == 0:
        meta = ab_meta(comm, args, mpccs.__version__, collective=args.collective)
        write_ab_results(args.out, f"{args.collective}_2ranks.json", meta, rows, report_lines(rows, meta))
    comm.close()


if __name__ == "__main__":
    main()
