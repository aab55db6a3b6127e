"""Inside one launch: an in-place 2-rank all_reduce's landing and its first reads, plain and flushed, interleaved.

    python bench/landing_phases.py --out bench/results/landing_s49 --launches 10   # ~1 min

Why (docs/design.md, "The landing of an in-place all_reduce"): whether a landing
pays for its lines' return from the peer's cache depends on the launch, so the
two ways are compared within each launch, call by call: even calls land plain,
odd ones flushed (every rank alike: the communicator's landing choices set to
'never' or 'always' before each call). Per call, rank 0 records the call's time
and what its landing choice was told, per byte: the landing's time (the
second read, with its flush) and the first reads' (the reference). Per launch, the medians per way; the launch counts as slow where
its plain landings took over the library's slow_ratio times the reference. Writes phases.json and
phases.md.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from stats import host_text, ways_in_launches, write_results  # noqa: E402

from mpccs.control.landing import LandingConfig  # noqa: E402



def rank_main(nbytes: int, calls: int, out: str) -> None:
    """One rank of a launch (mpccs-run runs this file with --rank-main)."""
    import mpccs
    from mpccs.control import landing

    told = []

    class Told(landing.LandingChoice):
        def record(self, flushed, landing_s_per_byte, reference_s_per_byte):
            told.append((landing_s_per_byte, reference_s_per_byte))
            super().record(flushed, landing_s_per_byte, reference_s_per_byte)

    comm = mpccs.init()
    ways = {}
    for way, mode in (("plain", "never"), ("flushed", "always")):
        ways[way] = landing.LandingChoices(mode)
        ways[way].for_bytes = lambda n, mode=mode: Told(mode)
    original = (np.arange(nbytes // 4) % 13).astype(np.float32)
    x = original.copy()
    rows = []
    for k in range(calls):
        way = ("plain", "flushed")[k % 2]
        comm._engine.landing = ways[way]
        x[...] = original  # the input put back outside the timed call, as mpccs-perf does
        comm.barrier()
        start = time.perf_counter()
        comm.all_reduce(x)
        rows.append((way, time.perf_counter() - start, *told[-1]))
    assert np.array_equal(x, 2 * original), "wrong result"
    if comm.rank == 0:
        with open(out, "w") as fh:
            json.dump(rows, fh)
    comm.close()


def summary(rows: list, nbytes: int, warmup: int) -> dict:
    half = nbytes // 2
    by_way = {}
    for way in ("plain", "flushed"):
        mine = [r for r in rows[warmup:] if r[0] == way]
        by_way[way] = {"call_us": float(np.median([r[1] for r in mine]) * 1e6),
                       "landing_us": float(np.median([r[2] for r in mine]) * half * 1e6),
                       "reference_us": float(np.median([r[3] for r in mine]) * half * 1e6)}
    plain = by_way["plain"]
    return {**by_way, "slow": plain["landing_us"] > LandingConfig().slow_ratio * plain["reference_us"]}


def report(launches: list[dict], meta: dict) -> str:
    lines = ["# In place: plain and flushed landings within each launch", "",
             f"{meta['launches']} launches, 2 ranks, default planes, float32 all_reduce in place of "
             f"{meta['nbytes'] >> 20} MiB, {meta['calls']} calls each (the first {meta['warmup']} left out), plain "
             f"and flushed alternating; {meta['host']}; measured {meta['time']}.", "",
             "Rank 0's medians per launch: the call, the landing (the second read, of half the buffer, into the "
             "peer's half, with its flush where flushed) and the reference (the first reads: the same bytes, into "
             "the kept buffer, which the peer never reads). A launch is slow where "
             f"its plain landings took over {LandingConfig().slow_ratio} times the reference (the library's "
             "`slow_ratio`).", "",
             "| launch | slow | call plain (us) | call flushed (us) | flushed / plain | landing plain | "
             "landing flushed | reference |", "|---:|:---:|---:|---:|---:|---:|---:|---:|"]
    for k, s in enumerate(launches):
        p, f = s["plain"], s["flushed"]
        lines.append(f"| {k + 1} | {'yes' if s['slow'] else 'no'} | {p['call_us']:.0f} | {f['call_us']:.0f} | "
                     f"{f['call_us'] / p['call_us']:.2f} | {p['landing_us']:.0f} | {f['landing_us']:.0f} | "
                     f"{p['reference_us']:.0f} |")
    for state in (True, False):
        group = [s for s in launches if s["slow"] == state]
        if group:
            ratio = [s["flushed"]["call_us"] / s["plain"]["call_us"] for s in group]
            lines.append("")
            lines.append(f"{'Slow' if state else 'Fast'} launches ({len(group)}): flushed / plain call time, "
                         f"median {np.median(ratio):.2f} (range {min(ratio):.2f}-{max(ratio):.2f}).")
    return "\n".join(lines + [""])


def main() -> None:
    # 16 MiB: read across processes (up to 8 MiB the outboxes carry the call, which lands no read)
    ran = ways_in_launches(__doc__, __file__, rank_main, launches=10, nbytes=16 << 20, calls=120)
    if ran is None:
        return
    args, per_launch = ran
    warmup = 20
    launches = [summary(rows, args.bytes, warmup) for rows in per_launch]
    meta = {"launches": args.launches, "nbytes": args.bytes, "calls": args.calls, "warmup": warmup,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": host_text()}
    write_results(args.out, "phases.json", {"meta": meta, "launches": launches}, "phases.md", report(launches, meta))


if __name__ == "__main__":
    main()
