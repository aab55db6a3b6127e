"""UCX tcp segment size: 8 KiB (UCX's default) against 64 KiB (mpccs's), alternating launches.

    python bench/tcp_segments_ab.py --out DIR [--rounds 3] [--segments 8K,64K]

Each round runs, for every segment size in turn (UCX_TCP_TX_SEG_SIZE in the ranks'
environment, which the planes keep over their own setting):

- a 2-rank all_reduce on the default planes with every byte on `out` (tcp over loopback),
  64 KiB to 64 MiB (`mpccs-perf --path out`): busbw per size;
- 4 ranks as 2 domains of 2 on loopback (`up` shared memory in a domain, `out` tcp), rates stated
  (`bench/cpu_per_op.py`, 16 MiB, a fixed 0.75 and `adaptive`): process time and wall
  time per operation, the median over the ranks.

The segment sizes alternate inside each round so that the host's drift (these 2-core
machines move 30-40% within minutes) falls on all of them alike. Writes DIR/results.json
and DIR/README.md: per size the median over the rounds and the range.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

from stats import launched, launched_rows

BIN = os.path.dirname(sys.executable)  # the launcher and the perf tool of this interpreter's environment
PERF = [os.path.join(BIN, "mpccs-run"), "-n", "2", os.path.join(BIN, "mpccs-perf"), "all_reduce", "-b", "64K", "-e", "64M", "-f", "4",
        "-n", "10", "-w", "3", "--path", "out"]
CPU = [os.path.join(BIN, "mpccs-run"), "-n", "4", sys.executable, str(Path(__file__).with_name("cpu_per_op.py")), "16", "30"]
CPU_LINE = re.compile(r"rank (\d) +(\S+) 16 MiB \S+ cpu ([\d.]+) ms, wall ([\d.]+) ms")


def run(cmd: list[str], segment: str, extra_env: dict[str, str]) -> str:
    return launched(cmd, {**os.environ, "UCX_TCP_TX_SEG_SIZE": segment, **extra_env})


def perf_busbw(segment: str) -> dict[int, float]:
    return {r["size"]: r["busbw"] for r in launched_rows(PERF, {**os.environ, "UCX_TCP_TX_SEG_SIZE": segment})}


def cpu_per_op(segment: str) -> dict[str, dict[str, float]]:
    out = run(CPU, segment, {"MPCCS_PLANE_RATES": "up=1gbit,out=1gbit"})
    per_policy: dict[str, dict[str, list[float]]] = {}
    for _, policy, cpu, wall in CPU_LINE.findall(out):
        d = per_policy.setdefault(policy, {"cpu_ms": [], "wall_ms": []})
        d["cpu_ms"].append(float(cpu))
        d["wall_ms"].append(float(wall))
    return {p: {k: statistics.median(v) for k, v in d.items()} for p, d in per_policy.items()}


def summarise(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def report(results: dict, segments: list[str]) -> str:
    lines = ["# UCX tcp segment size (`bench/tcp_segments_ab.py`)", "",
             f"{len(results['rounds'])} rounds; in each the segment sizes alternate. "
             "Median over the rounds [min, max].", "",
             "## 2 ranks, default planes, every byte on `out` (tcp, loopback): all_reduce busbw (GB/s)", "",
             "| size | " + " | ".join(segments) + " | ratio of medians |",
             "|---|" + "---:|" * (len(segments) + 1)]
    sizes = sorted({int(s) for r in results["rounds"] for s in r[segments[0]]["busbw"]})
    for size in sizes:
        cells = [[r[seg]["busbw"][str(size)] for r in results["rounds"]] for seg in segments]
        ratio = statistics.median(cells[-1]) / statistics.median(cells[0])
        lines.append(f"| {size >> 10} KiB | " + " | ".join(summarise(c) for c in cells) + f" | {ratio:.2f} |")
    lines += ["", "## 4 ranks as 2 domains of 2 (`up` shared memory, `out` tcp on loopback), 16 MiB all_reduce: per operation "
              "(ms, median over ranks)", "",
              "| policy | measure | " + " | ".join(segments) + " | ratio of medians |",
              "|---|---|" + "---:|" * (len(segments) + 1)]
    for policy in results["rounds"][0][segments[0]]["cpu_per_op"]:
        for measure in ("cpu_ms", "wall_ms"):
            cells = [[r[seg]["cpu_per_op"][policy][measure] for r in results["rounds"]] for seg in segments]
            ratio = statistics.median(cells[-1]) / statistics.median(cells[0])
            lines.append(f"| {policy} | {measure} | " + " | ".join(summarise(c) for c in cells) + f" | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--segments", default="8K,64K")
    args = ap.parse_args()
    segments = args.segments.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"segments": segments, "rounds": []}
    for i in range(args.rounds):
        this_round = {}
        for segment in segments:
            print(f"round {i + 1}/{args.rounds}: segment {segment}", flush=True)
            this_round[segment] = {"busbw": {str(k): v for k, v in perf_busbw(segment).items()},
                                   "cpu_per_op": cpu_per_op(segment)}
        results["rounds"].append(this_round)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "README.md").write_text(report(results, segments))
    print(report(results, segments))


if __name__ == "__main__":
    main()
