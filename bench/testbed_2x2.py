"""Testbed target 4: 4 ranks as 2 scale-up domains of 2, all_reduce >= 16 MiB.

    python bench/testbed_2x2.py --out bench/results/testbed_2x2        (root; ~2 min)

Both planes shaped tcp (scale-up inside each domain, scale-out between all
ranks) at 2:1. mpccs-perf runs up, up#2 (A/A), out and adaptive interleaved;
the tuner picks the algorithm (hierarchical across domains). The report gives
adaptive against the best single-plane policy with a paired bootstrap
interval and the noise floor, next to the target (>= 1.15x), and the ceiling
the links allow (mpccs.sim.bounds: the single-plane policy's bound over the
multipath bound; 1.00x at 2:1, where the target cannot hold, 1.33x at 1:1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from stats import holds, noise_floor, ratio_ci  # noqa: E402

from mpccs.sim.bounds import all_reduce_bounds  # noqa: E402
from mpccs.testbed import Cluster  # noqa: E402
from mpccs.testbed.netns import parse_rate  # noqa: E402

TARGET = 1.15


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--up-rate", default="1gbit")
    ap.add_argument("--out-rate", default="500mbit")
    ap.add_argument("--iters", type=int, default=10)  # the method's minimum (docs/benchmarks.md)
    ns = ap.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    path = os.path.join(ns.out, "perf.json")
    with Cluster(n=4, domains="0,0,1,1", up="tcp", up_rate=ns.up_rate, out_rate=ns.out_rate,
                 log=lambda m: None) as cluster:
        argv = [sys.executable, "-m", "mpccs.perf", "all_reduce", "-b", "16M", "-e", "64M", "-f", "4",
                "-n", str(ns.iters), "-w", "2", "--policies", "up,up,out,adaptive", "--quiet", "-J", path]
        run = cluster.run(argv, timeout=3000, stream=open(os.devnull, "w"))
        if run.exit_code != 0:
            raise SystemExit("\n".join(run.output[0][-30:]))
    with open(path) as fh:
        data = json.load(fh)
    rows = {(r["policy"], r["size"]): r for r in data["rows"]}
    lines = ["# Testbed, 4 ranks as 2 domains of 2 (up within a domain, out between all), all_reduce", "",
             f"Rates: up {ns.up_rate}, out {ns.out_rate}; {ns.iters} iterations per point, interleaved; "
             f"measured {time.strftime('%Y-%m-%dT%H:%M:%S')}. Target: adaptive >= {TARGET}x the best single plane.",
             "", "| size | algorithm (adaptive) | busbw up | busbw out | busbw adaptive | adaptive / best single [95% CI] "
             "| A/A floor | ceiling | busbw bound (multipath) | verdict |", "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    up_Bps, out_Bps = parse_rate(ns.up_rate) / 8, parse_rate(ns.out_rate) / 8
    verdicts = []
    for size in sorted({r["size"] for r in data["rows"]}):
        up, up2, out, ad = (rows[(p, size)] for p in ("up", "up#2", "out", "adaptive"))
        best = up if up["busbw"] >= out["busbw"] else out
        ratio = ratio_ci(ad["times_us"], best["times_us"], paired=True)
        floor = noise_floor(up["times_us"], up2["times_us"])
        ok = holds(ratio, TARGET, floor)
        bounds = all_reduce_bounds(size, [0, 0, 1, 1], up_Bps, out_Bps)
        bound_busbw = 1.5 * size / bounds.multipath_s / 1e9  # nccl-tests' all_reduce factor 2(p-1)/p at p = 4
        verdicts.append({"size": size, "ratio": ratio, "floor": floor, "holds": ok, "ceiling": bounds.ceiling,
                         "bound_busbw": bound_busbw})
        algorithm = f"{ad.get('algorithm', '?')}, {ad.get('channels') or 1} channel(s)"
        lines.append(f"| {size >> 20} MiB | {algorithm} | {up['busbw']:.3f} | {out['busbw']:.3f} | "
                     f"{ad['busbw']:.3f} | {ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}] | {floor:.3f} | "
                     f"{bounds.ceiling:.2f} | {bound_busbw:.3f} | {'holds' if ok else 'NOT MET'} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(ns.out, "report.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(ns.out, "verdicts.json"), "w") as fh:
        json.dump(verdicts, fh, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
