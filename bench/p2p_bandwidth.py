"""Point-to-point bandwidth on each plane alone and on both, 2 ranks.

    mpccs-run -n 2 bench/p2p_bandwidth.py --out bench/results/p2p

Rank 0 sends, rank 1 receives; each point is the median of --repeats timed
sends (barrier first, time = slowest rank), policies interleaved. Writes
<out>.json and <out>.md (a table next to the raw UCX numbers measured on
these machines, from shared/reference/environment.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import mpccs
from mpccs.config import parse_policy, parse_size

RAW_REFERENCE = "raw UCX, one 64 MiB transfer (environment.md): posix,cma ~4.7-7 GB/s; tcp on loopback ~0.6-0.8 GB/s"


def one_transfer(comm, buf, policy) -> tuple[float, dict]:
    comm.set_path_policy(policy)
    comm.barrier()
    t0 = time.perf_counter()
    if comm.rank == 0:
        comm.send(buf, 1)
    else:
        comm.recv(buf, 0)
    dt = np.array([time.perf_counter() - t0])
    stats = comm.last_stats() or {}
    comm.all_reduce(dt, op="max")
    return float(dt[0]), stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--min", default="1M")
    ap.add_argument("--max", default="256M")
    ap.add_argument("--policies", default="up,out,0.5,0.9,adaptive")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    ns = ap.parse_args()
    comm = mpccs.init()
    if comm.size != 2:
        raise SystemExit("p2p_bandwidth needs exactly 2 ranks")
    policies = [parse_policy(p) for p in ns.policies.split(",")]
    rows = []
    size = parse_size(ns.min)
    while size <= parse_size(ns.max):
        buf = np.ones(size, np.uint8)
        one_transfer(comm, buf, policies[0])  # warm-up (endpoints, pages)
        samples = {str(p): [] for p in policies}
        shares = {}
        for _ in range(ns.repeats):
            for p in policies:
                dt, stats = one_transfer(comm, buf, p)
                samples[str(p)].append(dt)
                shares[str(p)] = stats.get("bytes_per_plane", {})
        for p in policies:
            t = samples[str(p)]
            rows.append({
                "bytes": size, "policy": str(p), "median_s": float(np.median(t)),
                "GBps": size / float(np.median(t)) / 1e9,
                "GBps_p10": size / float(np.percentile(t, 90)) / 1e9,
                "GBps_p90": size / float(np.percentile(t, 10)) / 1e9,
                "bytes_per_plane": shares[str(p)], "samples_s": t,
            })
        if comm.rank == 0:
            print(f"# {size >> 20} MiB: " + "  ".join(f"{r['policy']}={r['GBps']:.2f}" for r in rows[-len(policies):]),
                  file=sys.stderr, flush=True)
        size *= 4
    if comm.rank == 0:
        text = render(rows, policies)
        print(text)
        if ns.out:
            meta = {"mpccs": mpccs.__version__, "planes": {n: p.tls for n, p in comm._planes.items()},
                    "repeats": ns.repeats, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            with open(ns.out + ".json", "w") as fh:
                json.dump({"meta": meta, "rows": rows}, fh, indent=1)
            with open(ns.out + ".md", "w") as fh:
                fh.write(text + "\n")
    comm.close()
    return 0


def render(rows, policies) -> str:
    sizes = sorted({r["bytes"] for r in rows})
    head = "| size | " + " | ".join(f"{p} GB/s (p10-p90)" for p in policies) + " | up share at 0.5 |"
    lines = ["Point-to-point bandwidth, 2 ranks, median of repeats (GB/s = 1e9 B/s)", "", head,
             "|" + "---|" * (len(policies) + 2)]
    for s in sizes:
        cells = []
        half = ""
        for p in policies:
            r = next(x for x in rows if x["bytes"] == s and x["policy"] == str(p))
            cells.append(f"{r['GBps']:.2f} ({r['GBps_p10']:.2f}-{r['GBps_p90']:.2f})")
            if str(p) == "0.5":
                bpp = r["bytes_per_plane"]
                half = f"{bpp.get('up', 0) / max(1, sum(bpp.values())):.2f}"
        lines.append(f"| {s >> 20} MiB | " + " | ".join(cells) + f" | {half} |")
    lines += ["", RAW_REFERENCE]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
