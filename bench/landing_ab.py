"""In-place 2-rank all_reduce with the landing's lines flushed as measured ('auto') against never, and MPICH.

    python bench/landing_ab.py --out bench/results/landing_s49 --rounds 20   # ~3 min
    python bench/landing_ab.py --out /tmp/la --rounds 2                       # smoke

What it checks (control/landing.py, transports/cacheflush.py): in some launches
on this VM the second read of an in-place all_reduce on the direct path, which
lands in lines the peer read a moment before, runs 6x slower than in the
others; 'auto' flushes those lines first in such launches only. The state
comes and goes between launches, so each round launches `mpccs-perf
--in-place` with MPCCS_LANDING_FLUSH=never, then =auto, then MPICH in place
(bench/peers.py mpi --in-place), the order rotating by round. The report gives
each kind's times over the launches, the rounds' ratios, and the times by the
launch's state (a 'never' launch over twice the fastest one; an 'auto' launch
that flushed, from mpccs-perf's `landing` field). Writes rounds.json and
report.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from stats import host_text, launched_rows, write_results  # noqa: E402

from mpccs.control.landing import size_class_of  # noqa: E402

BIN = os.path.dirname(sys.executable)
KINDS = ("never", "auto", "mpich")


def one_round(k: int, lo: str, hi: str, iters: str) -> dict:
    """One launch of each kind, in an order that rotates by round: {kind: {size: time_us}}."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    sizes = ["-b", lo, "-e", hi, "-f", "2", "-n", iters, "-w", "5", "--in-place"]
    perf = [f"{BIN}/mpccs-run", "-n", "2", "--no-prefix", f"{BIN}/mpccs-perf", "all_reduce", *sizes, "--quiet"]
    mpi = [f"{BIN}/mpiexec", "-n", "2", sys.executable, "bench/peers.py", "mpi", *sizes]
    result = {}
    for kind in KINDS[k % 3:] + KINDS[:k % 3]:
        if kind == "mpich":
            rows = launched_rows(mpi, env)
        else:
            rows = launched_rows(perf, dict(env, MPCCS_LANDING_FLUSH=kind))
        result[kind] = {r["size"]: r["time_us"] for r in rows}
        if kind == "auto":  # whether rank 0 flushed at each size's end (its landing: half the call)
            result["auto_flushing"] = {r["size"]: size_class_of(r["size"] // 2) in (r.get("landing") or {}).get(
                "flushing", []) for r in rows}
    return result


def report(rounds: list[dict], meta: dict) -> str:
    sizes = sorted(rounds[0]["never"])
    first = sizes[0]
    fastest = min(r["never"][first] for r in rounds)
    never_slow = [r["never"][first] > 2 * fastest for r in rounds]
    lines = ["# In place: the landing flushed as measured ('auto') against never, and MPICH", "",
             f"{meta['rounds']} rounds, 2 ranks, default planes, float32 all_reduce in place, {meta['iters']} "
             f"iterations per point, one launch of each kind per round in rotating order; {meta['host']}; measured "
             f"{meta['time']}.", "",
             "Per size: each kind's median time over its launches [quartiles], then the median of the rounds' "
             "ratios (> 1: 'auto' faster) with their range, and the rounds where 'auto' was at least MPICH's speed.",
             "", "| size | never (us) | auto (us) | MPICH (us) | never / auto | MPICH / auto | rounds auto >= MPICH | "
             "MPICH / never |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in sizes:
        t = {kind: [r[kind][s] for r in rounds] for kind in KINDS}
        gain = [n / a for n, a in zip(t["never"], t["auto"])]
        peer = [m / a for m, a in zip(t["mpich"], t["auto"])]
        before = [m / n for m, n in zip(t["mpich"], t["never"])]
        lines.append(f"| {s >> 20} MiB | {_spread(t['never'])} | {_spread(t['auto'])} | {_spread(t['mpich'])} | "
                     f"{_ratio(gain)} | {_ratio(peer)} | {sum(x >= 1 for x in peer)}/{len(peer)} | "
                     f"{_ratio(before)} |")
    lines += ["", f"By the launch's state: a 'never' launch is slow where it took over twice the fastest one at "
              f"{first >> 20} MiB ({sum(never_slow)} of {len(rounds)}); an 'auto' launch flushed where rank 0 "
              "flushed its landings of that size at the size's end. Median time of those launches (how many), "
              "per size:", "",
              "| size | never, fast | never, slow | auto, plain | auto, flushing | MPICH, rounds of a slow 'never' |",
              "|---:|---:|---:|---:|---:|---:|"]
    for s in sizes:
        cells = [[r["never"][s] for r, slow in zip(rounds, never_slow) if not slow],
                 [r["never"][s] for r, slow in zip(rounds, never_slow) if slow],
                 [r["auto"][s] for r in rounds if not r["auto_flushing"][s]],
                 [r["auto"][s] for r in rounds if r["auto_flushing"][s]],
                 [r["mpich"][s] for r, slow in zip(rounds, never_slow) if slow]]
        lines.append(f"| {s >> 20} MiB | " + " | ".join(f"{np.median(c):.0f} ({len(c)})" if c else "-" for c in cells)
                     + " |")
    return "\n".join(lines + [""])


def _spread(values: list[float]) -> str:
    q1, q2, q3 = np.percentile(values, [25, 50, 75])
    return f"{q2:.0f} [{q1:.0f}-{q3:.0f}]"


def _ratio(values: list[float]) -> str:
    return f"{np.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--min", default="4M")
    ap.add_argument("--max", default="16M")
    ap.add_argument("--iters", default="40")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rounds = []
    for k in range(args.rounds):
        rounds.append(one_round(k, args.min, args.max, args.iters))
        print(f"# progress: {k + 1}/{args.rounds} rounds", flush=True)
    meta = {"rounds": args.rounds, "iters": args.iters, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": host_text()}
    payload = {"meta": meta, "rounds": [{kind: {str(s): t for s, t in times.items()} for kind, times in r.items()}
                                        for r in rounds]}
    write_results(args.out, "rounds.json", payload, "report.md", report(rounds, meta))


if __name__ == "__main__":
    main()
