"""mpccs against MPICH in alternating rounds, for a machine whose speed drifts.

    python bench/peer_rounds.py --out bench/results/peer_rounds            # 6 rounds, 1-16 MiB (~3 min)
    python bench/peer_rounds.py --out /tmp/pr --rounds 2 --max 4M            # smoke

Target 3 of the benchmarks issue compares mpccs (2 ranks, default planes,
'adaptive' as shipped) with MPICH through mpi4py; the two cannot run in one
process, and on these VMs the same code ran 2-3x faster or slower from one
minute to the next (MPICH's 4 MiB all_reduce: 430 us to 2 ms). One run of
each compares two moments as much as two libraries. Here they alternate:
each round runs `mpccs-perf` then `bench/peers.py mpi` (or the other way
round, alternately) over the same sizes, back to back, and the round's ratio
is MPICH's median time over mpccs's (mpccs-perf runs the controller's start-up
before its sweep, --settle 40, as every sweep does: docs/benchmarks.md, Method).
The report gives, per size, the median of the rounds' ratios with their range
and the share of rounds at >= 1.0x, next to each library's median time. Writes
rounds.json and report.md.

Each round times both calls, each library against its own kind: out of place
(mpccs-perf's and nccl-tests' default; MPICH's Allreduce(send, recv)) and in
place (--in-place; MPI_IN_PLACE), the input put back outside the timed call in
both tools. Until the twenty-sixth session the MPICH side ran in place and
mpccs out of place: at 8 MiB MPICH's own two calls differ 1.6-1.9x, which that
comparison charged to mpccs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from landing_ab import flushing  # noqa: E402
from stats import host_text, write_results  # noqa: E402

BIN = os.path.dirname(sys.executable)


def run(cmd: list[str], timeout: float) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    subprocess.run(cmd, check=True, timeout=timeout, env=env, stdout=subprocess.DEVNULL)


def rows_of(path: str) -> list[dict]:
    with open(path) as fh:
        return json.load(fh)["rows"]


def times_us(rows: list[dict]) -> dict[int, float]:
    return {r["size"]: r["time_us"] for r in rows}


MODES = {"out": "out of place", "in": "in place"}


def one_round(k: int, lo: str, hi: str, iters: str, tmp: str, modes: list[str]) -> dict:
    """One round: per mode, mpccs-perf and MPICH back to back (the order alternating by round)."""
    result = {}
    for mode in modes:
        flag = ["--in-place"] if mode == "in" else []
        perf = [f"{BIN}/mpccs-run", "-n", "2", "--no-prefix", f"{BIN}/mpccs-perf", "all_reduce", "-b", lo, "-e", hi,
                "-f", "2", "-n", iters, "-w", "5", "--settle", "40", "--quiet", "-J", f"{tmp}/perf{k}{mode}.json",
                *flag]
        mpi = [f"{BIN}/mpiexec", "-n", "2", sys.executable, "bench/peers.py", "mpi", "-b", lo, "-e", hi, "-f", "2",
               "-n", iters, "-w", "5", "-J", f"{tmp}/mpi{k}{mode}.json", *flag]
        for cmd in ((perf, mpi) if k % 2 == 0 else (mpi, perf)):
            run(cmd, 600)
        ours = rows_of(f"{tmp}/perf{k}{mode}.json")
        result[mode] = {"mpccs_us": times_us(ours), "mpi_us": times_us(rows_of(f"{tmp}/mpi{k}{mode}.json")),
                        # whether mpccs's rank 0 flushed where it lands, at each size's end (control/landing.py)
                        "mpccs_flushing": {r["size"]: flushing(r) for r in ours},
                        # rank 0's median time per step where the pair reads across processes (cma_steps.py)
                        "mpccs_steps_us": {r["size"]: r.get("steps_us") for r in ours}}
    return result


def report(rounds: list[dict], meta: dict) -> str:
    lines = ["# mpccs ('adaptive', as shipped) against MPICH, alternating rounds", "",
             f"{meta['rounds']} rounds, 2 ranks, default planes, float32 all_reduce, {meta['iters']} iterations per "
             f"point (mpccs: the controller's start-up before the sweep, `--settle 40`); {meta['host']}; measured "
             f"{meta['time']}.", "",
             "Per round: MPICH's median time / mpccs's (> 1: mpccs faster), each library's out-of-place call against "
             "the other's and in-place against in-place. Per size: the median of the rounds' ratios, their range, "
             "the rounds at >= 1.0x, each library's median time over all rounds, and the rounds in which mpccs's rank 0 "
             "flushed the lines it lands in at that size (its outboxes to 8 MiB, its in-place landings above: "
             "docs/design.md; a launch does where those lines are slow to write). Where the pair reads across "
             "processes (above 8 MiB), mpccs's rank 0 per step, medians over the rounds of each round's median: its "
             "first step (reads and reduction), its landing (the second read), and its waits for the peer.", ""]
    for mode in meta["modes"]:
        lines += _mode_table(mode, [r[mode] for r in rounds])
    return "\n".join(lines)


def _mode_table(mode: str, rounds: list[dict]) -> list[str]:
    sizes = sorted(rounds[0]["mpccs_us"])
    lines = [f"## {MODES[mode]}", "",
             "| size | mpccs (us) | MPICH (us) | ratio, median of rounds | range | rounds >= 1.0x | mpccs flushed "
             "| mpccs first step / landing / waits (us) |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in sizes:
        ours = [r["mpccs_us"][s] for r in rounds]
        theirs = [r["mpi_us"][s] for r in rounds]
        ratios = [m / o for m, o in zip(theirs, ours)]
        wins = sum(x >= 1.0 for x in ratios)
        flushed = sum(bool(r.get("mpccs_flushing", {}).get(s)) for r in rounds)
        lines.append(f"| {s >> 20} MiB | {np.median(ours):.0f} | {np.median(theirs):.0f} | {np.median(ratios):.2f} | "
                     f"{min(ratios):.2f}-{max(ratios):.2f} | {wins}/{len(ratios)} | {flushed}/{len(ratios)} | "
                     f"{_steps_cell([r.get('mpccs_steps_us', {}).get(s) for r in rounds])} |")
    return lines + [""]


def _steps_cell(per_round: list) -> str:
    """Medians over the rounds of rank 0's first step, landing and waits (all waits summed); '-' without steps."""
    steps = [x for x in per_round if x]
    if not steps:
        return "-"
    first = np.median([x.get("first_step", 0.0) for x in steps])
    landing = np.median([x.get("landing", 0.0) for x in steps])
    waits = np.median([sum(v for k, v in x.items() if k.startswith("wait")) for x in steps])
    return f"{first:.0f} / {landing:.0f} / {waits:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--min", default="1M")
    ap.add_argument("--max", default="16M")
    ap.add_argument("--iters", default="20")
    ap.add_argument("--modes", default="out,in", help="out (of place), in (place), or both: out,in")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: a comma-separated list of {', '.join(MODES)}")
    os.makedirs(args.out, exist_ok=True)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            rounds.append(one_round(k, args.min, args.max, args.iters, tmp, modes))
            print(f"# progress: {k + 1}/{args.rounds} rounds", flush=True)
    meta = {"rounds": args.rounds, "iters": args.iters, "modes": modes, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": host_text()}
    payload = {"meta": meta, "rounds": [{mode: {key: {str(s): v for s, v in per_size.items()}
                                                for key, per_size in by_key.items()}
                                         for mode, by_key in r.items()} for r in rounds]}
    write_results(args.out, "rounds.json", payload, "report.md", report(rounds, meta))


if __name__ == "__main__":
    main()
