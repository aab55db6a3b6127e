"""glibc's `rep movsb` copies against its vector loop, alternating launches.

    python bench/rep_movsb_ab.py --out DIR [--rounds 8]

Each round launches, in turn, a 2-rank all_reduce on the default planes under
`up` (`mpccs-perf -b 256K -e 16M -f 2 --path up`) with GLIBC_TUNABLES as the
environment has it and with glibc.cpu.x86_rep_movsb_threshold raised past every
size (memcpy then takes the vector loop up to the non-temporal threshold), and
the same with MPICH (mpi4py, `bench/peers.py` under mpiexec). On the AMD EPYC
hosts here some launches ran `up` at 1-4 MiB 3-4x slower than the rest, with
memmove on top of their profile; glibc bug 30994 (`rep movsb` on AMD Zen 3/4
slow for some placements of source and destination) was the suspect this
tests. Writes DIR/results.json and DIR/README.md: busbw per size and launch,
for each environment.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from stats import launched_rows

BIN = os.path.dirname(sys.executable)
SIZES = ["-b", "256K", "-e", "16M", "-f", "2"]
PERF = [os.path.join(BIN, "mpccs-run"), "-n", "2", os.path.join(BIN, "mpccs-perf"), "all_reduce", *SIZES,
        "-n", "40", "-w", "5", "--path", "up"]
PEERS = [os.path.join(BIN, "mpiexec"), "-n", "2", sys.executable, str(Path(__file__).with_name("peers.py")), "mpi",
         *SIZES, "-n", "40", "-w", "5"]
VECTOR_LOOP = "glibc.cpu.x86_rep_movsb_threshold=0x10000000000"


def environment(kind: str) -> dict[str, str]:
    env = dict(os.environ)
    if kind == "vector loop":
        env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), VECTOR_LOOP) if t)
    return env


def busbw(command: list[str], kind: str) -> dict[int, float]:
    """Busbw per size of one launch of ``command`` (mpccs-perf or peers.py: the same JSON rows)."""
    return {r["size"]: r["busbw"] for r in launched_rows(command, environment(kind))}


def report(results: dict) -> str:
    lines = ["# `rep movsb` against the vector loop: 2-rank all_reduce busbw (GB/s) per launch", "",
             "`python bench/rep_movsb_ab.py` (alternating launches; see its docstring).", ""]
    for tool in ("mpccs up", "MPICH"):
        sizes = sorted({int(s) for kind in results for launch in results[kind][tool] for s in launch})
        lines += [f"## {tool}", "", "| size | environment | median | launches |", "|---|---|---:|---|"]
        for size in sizes:
            for kind in results:
                values = [launch[str(size)] for launch in results[kind][tool]]
                lines.append(f"| {size >> 10} KiB | {kind} | {statistics.median(values):.2f} | "
                             + " ".join(f"{v:.1f}" for v in values) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ns = ap.parse_args(argv)
    kinds = ("as set", "vector loop")
    results = {kind: {"mpccs up": [], "MPICH": []} for kind in kinds}
    for round_ in range(ns.rounds):
        for kind in (kinds if round_ % 2 == 0 else kinds[::-1]):
            results[kind]["mpccs up"].append({str(k): v for k, v in busbw(PERF, kind).items()})
            results[kind]["MPICH"].append({str(k): v for k, v in busbw(PEERS, kind).items()})
        print(f"round {round_ + 1}/{ns.rounds} done", flush=True)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"glibc_tunables_added": VECTOR_LOOP, "results": results}, indent=1))
    (out / "README.md").write_text(report(results))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
