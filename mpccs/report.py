"""``mpccs-report TRACE...``: summarise MPCCS_TRACE files, export a Chrome
trace, plot each plane's share over time.

    MPCCS_TRACE=/tmp/t.jsonl mpccs-run -n 2 train.py
    mpccs-report /tmp/t.jsonl.rank* --chrome /tmp/t.json --plot /tmp/share.png
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from .telemetry import chrome_trace, read_trace, share_timeline


def summarise(records: list[dict]) -> str:
    by_op = defaultdict(lambda: {"n": 0, "time": 0.0, "up": 0, "out": 0, "errors": 0})
    for r in records:
        row = by_op[(r.get("rank"), r.get("op"), r.get("policy"))]
        row["n"] += 1
        row["time"] += r.get("duration_s", 0.0)
        row["errors"] += 1 if "error" in r else 0
        for plane, nbytes in (r.get("bytes_per_plane") or {}).items():
            row[plane] = row.get(plane, 0) + nbytes
    lines = [f"{'rank':>4} {'op':<15} {'policy':<9} {'count':>7} {'time (s)':>9} {'up (MB)':>10} {'out (MB)':>10} {'up %':>6} {'errors':>6}"]
    for (rank, op, policy), row in sorted(by_op.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        total = row["up"] + row["out"]
        share = f"{100 * row['up'] / total:5.1f}" if total else "    -"
        lines.append(f"{rank!s:>4} {op!s:<15} {policy!s:<9} {row['n']:7d} {row['time']:9.3f} "
                     f"{row['up'] / 1e6:10.1f} {row['out'] / 1e6:10.1f} {share:>6} {row['errors']:6d}")
    return "\n".join(lines)


def plot_share(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for rank in sorted({r.get("rank") for r in records}):
        points = share_timeline([r for r in records if r.get("rank") == rank])
        if points:
            t0 = points[0][0]
            ax.plot([t - t0 for t, _, _ in points], [100 * s for _, s, _ in points], ".-", ms=3, label=f"rank {rank}")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("bytes on 'up' (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mpccs-report", description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--chrome", help="write a Chrome-trace/Perfetto JSON file")
    ap.add_argument("--plot", help="write a PNG of each rank's share on 'up' over time")
    ns = ap.parse_args(argv)
    records = read_trace(ns.traces)
    print(summarise(records))
    if ns.chrome:
        with open(ns.chrome, "w") as fh:
            json.dump(chrome_trace(records), fh)
    if ns.plot:
        plot_share(records, ns.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
