"""2-rank all_reduce with the lines it lands in flushed as measured ('auto') against never, and MPICH.

    python bench/landing_ab.py --out bench/results/landing_s49 --rounds 20   # in place, 4-16 MiB, ~3 min
    python bench/landing_ab.py --out bench/results/outbox_s49 --min 512K --max 2M [--out-of-place]
    python bench/landing_ab.py --out /tmp/la --rounds 2                       # smoke

What it checks (control/landing.py, transports/cacheflush.py): in some launches
on this VM the second read of an in-place all_reduce on the direct path, which
lands in lines the peer read a moment before, runs 6x slower than in the
others; 'auto' flushes those lines first in such launches only. The state
comes and goes between launches, so each round launches `mpccs-perf
--in-place` with MPCCS_LANDING_FLUSH=never, then =auto, then MPICH in place
(bench/peers.py mpi --in-place), the order rotating by round. Up to 8 MiB the
call goes through the outboxes (shm_steps.py), flushed around step 1's copy
where 'auto' chooses it, in place or out of place (--out-of-place: every
launch out of place). The report gives
each kind's times over the launches, the rounds' ratios, and the times by the
launch's state (a 'never' launch over twice the fastest one; an 'auto' launch
that flushed, from mpccs-perf's `landing` field). Writes rounds.json and
report.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from stats import host_text, launched_rows, write_results  # noqa: E402

from mpccs.control.landing import size_class_of  # noqa: E402
from mpccs.direct_ops import DIRECT_CMA_FROM_BYTES  # noqa: E402
from mpccs.shm_steps import rounds_for  # noqa: E402

BIN = os.path.dirname(sys.executable)
KINDS = ("never", "auto", "mpich")


def one_round(k: int, lo: str, hi: str, iters: str, in_place: bool) -> dict:
    """One launch of each kind, in an order that rotates by round: {kind: {size: time_us}}."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    sizes = ["-b", lo, "-e", hi, "-f", "2", "-n", iters, "-w", "5", *(["--in-place"] if in_place else [])]
    perf = [f"{BIN}/mpccs-run", "-n", "2", "--no-prefix", f"{BIN}/mpccs-perf", "all_reduce", *sizes, "--quiet"]
    mpi = [f"{BIN}/mpiexec", "-n", "2", sys.executable, "bench/peers.py", "mpi", *sizes]
    result = {}
    for kind in KINDS[k % 3:] + KINDS[:k % 3]:
        if kind == "mpich":
            rows = launched_rows(mpi, env)
        else:
            rows = launched_rows(perf, dict(env, MPCCS_LANDING_FLUSH=kind))
        result[kind] = {r["size"]: r["time_us"] for r in rows}
        if kind == "auto":  # whether rank 0 flushed at each size's end
            result["auto_flushing"] = {r["size"]: flushing(r) for r in rows}
    return result


def flushing(row: dict) -> bool:
    """Whether rank 0 flushed at the end of this row's size: its outboxes up to where the pair reads
    across processes (shm_steps.py: the choice of the size class of a round's share of a half),
    its in-place landings above (of the size class of half the call)."""
    landing = row.get("landing") or {}
    half = row["size"] // 2
    if row["size"] <= DIRECT_CMA_FROM_BYTES:
        return size_class_of(half // rounds_for(half)) in landing.get("outbox_flushing", [])
    return size_class_of(half) in landing.get("flushing", [])


def report(rounds: list[dict], meta: dict) -> str:
    sizes = sorted(rounds[0]["never"])
    fastest = {s: min(r["never"][s] for r in rounds) for s in sizes}
    never_slow = [any(r["never"][s] > 2 * fastest[s] for s in sizes) for r in rounds]
    call = "in place" if meta.get("in_place", True) else "out of place"
    lines = [f"# {call.capitalize()}: the landing flushed as measured ('auto') against never, and MPICH", "",
             f"{meta['rounds']} rounds, 2 ranks, default planes, float32 all_reduce {call}, {meta['iters']} "
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
        lines.append(f"| {_size(s)} | {_spread(t['never'])} | {_spread(t['auto'])} | {_spread(t['mpich'])} | "
                     f"{_ratio(gain)} | {_ratio(peer)} | {sum(x >= 1 for x in peer)}/{len(peer)} | "
                     f"{_ratio(before)} |")
    lines += ["", f"By the launch's state: a 'never' launch is slow where it took over twice the fastest one at "
              f"some size ({sum(never_slow)} of {len(rounds)}); an 'auto' launch flushed where rank 0 "
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
        lines.append(f"| {_size(s)} | " + " | ".join(f"{np.median(c):.0f} ({len(c)})" if c else "-" for c in cells)
                     + " |")
    return "\n".join(lines + [""])


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _spread(values: list[float]) -> str:
    q1, q2, q3 = np.percentile(values, [25, 50, 75])
    return f"{q2:.0f} [{q1:.0f}-{q3:.0f}]"


def _ratio(values: list[float]) -> str:
    return f"{np.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def rereport(out_dir: str) -> None:
    """The report again from a run's rounds.json (the report's rules changed, not the data)."""
    with open(os.path.join(out_dir, "rounds.json")) as fh:
        data = json.load(fh)
    rounds = [{kind: {int(s): t for s, t in times.items()} for kind, times in r.items()} for r in data["rounds"]]
    with open(os.path.join(out_dir, "report.md"), "w") as fh:
        fh.write(report(rounds, data["meta"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--min", default="4M")
    ap.add_argument("--max", default="16M")
    ap.add_argument("--iters", default="40")
    ap.add_argument("--out-of-place", action="store_true", help="every launch out of place (default: in place)")
    ap.add_argument("--rereport", action="store_true", help="only write report.md again from --out's rounds.json")
    args = ap.parse_args()
    if args.rereport:
        rereport(args.out)
        return
    os.makedirs(args.out, exist_ok=True)
    rounds = []
    for k in range(args.rounds):
        rounds.append(one_round(k, args.min, args.max, args.iters, not args.out_of_place))
        print(f"# progress: {k + 1}/{args.rounds} rounds", flush=True)
    meta = {"rounds": args.rounds, "iters": args.iters, "in_place": not args.out_of_place, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": host_text()}
    payload = {"meta": meta, "rounds": [{kind: {str(s): t for s, t in times.items()} for kind, times in r.items()}
                                        for r in rounds]}
    write_results(args.out, "rounds.json", payload, "report.md", report(rounds, meta))


if __name__ == "__main__":
    main()
