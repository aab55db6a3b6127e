"""Testbed target 4: 4 ranks as 2 scale-up domains of 2, all_reduce >= 16 MiB.

    python bench/testbed_2x2.py --out bench/results/testbed_2x2        (root; ~2 min)

Both planes shaped tcp (scale-up inside each domain, scale-out between all
ranks) at 2:1. mpccs-perf runs up, up#2 (A/A), out and adaptive interleaved;
the tuner picks the algorithm (hierarchical across domains). The report gives
adaptive against the best single-plane policy with a paired bootstrap
interval and the noise floor, next to the target (>= 1.15x), and the ceiling
the links allow (mpccs.sim.bounds: the single-plane policy's bound over the
multipath bound; 1.00x at 2:1, where the target cannot hold, 1.33x at 1:1).
The controller's start-up (its first probes and the ranks' first agreements on
the plan rates) runs before the sweep (--settle, its own adaptive / up ratio in
the report), as in testbed_targets.py, so the points are steady state.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from stats import holds, noise_floor, ratio_ci  # noqa: E402

from mpccs.control import ControlConfig  # noqa: E402
from mpccs.sim.bounds import all_reduce_bounds  # noqa: E402
from mpccs.testbed import Cluster  # noqa: E402
from mpccs.testbed.netns import parse_rate  # noqa: E402

TARGET = 1.15
# The start-up: probes at the controller's 4th, 16th and 32nd operations; the ranks agree on plan rates at
# their 4th measured call and every 4 until every rank has measured both planes, then every 32
# (docs/controller.md). 40 operations take it past the first complete agreement and the one after.
SETTLE_OPS = 40


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--up-rate", default="1gbit")
    ap.add_argument("--out-rate", default="500mbit")
    ap.add_argument("--iters", type=int, default=10)  # the method's minimum (docs/benchmarks.md)
    ap.add_argument("--fixed", default="", help="fixed fractions on up to time beside the policies "
                    "(e.g. 0.75,0.7): the best of them is the oracle split adaptive is read against")
    ap.add_argument("--plane-rates", action="store_true",
                    help="state the shaped rates to mpccs (MPCCS_PLANE_RATES), as a user who knows the links would")
    ap.add_argument("--collective", default="all_reduce", choices=["all_reduce", "reduce_scatter", "all_gather"],
                    help="target 4 names all_reduce; the other hierarchical collectives run the same way, "
                    "without the all_reduce bound's columns")
    ap.add_argument("--tune", default=None, help="MPCCS_TUNE for the ranks, every policy alike "
                    "(e.g. all_reduce:*:hierarchical:channels=8)")
    ap.add_argument("--settle", type=int, default=SETTLE_OPS,
                    help="adaptive operations run before the sweep, timed apart against as many under up "
                    "(0: the start-up runs inside the 16 MiB point, as before the forty-seventh session)")
    ap.add_argument("--trace", default=None, help="MPCCS_TRACE path for the ranks (JSON lines per operation)")
    ns = ap.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    path = os.path.join(ns.out, "perf.json")
    fixed = [f"{float(f):g}" for f in ns.fixed.split(",") if f]  # as mpccs-perf labels them
    with Cluster(n=4, domains="0,0,1,1", up="tcp", up_rate=ns.up_rate, out_rate=ns.out_rate,
                 log=lambda m: None) as cluster:
        policies = ",".join(["up", "up", "out", *fixed, "adaptive"])
        argv = [sys.executable, "-m", "mpccs.perf", ns.collective, "-b", "16M", "-e", "64M", "-f", "4",
                "-n", str(ns.iters), "-w", "2", "--policies", policies, "--quiet", "-J", path,
                "--settle", str(ns.settle)]
        env = {"MPCCS_PLANE_RATES": f"up={ns.up_rate},out={ns.out_rate}"} if ns.plane_rates else {}
        if ns.trace:
            env["MPCCS_TRACE"] = ns.trace
        if ns.tune:
            env["MPCCS_TUNE"] = ns.tune
        run = cluster.run(argv, env=env, timeout=3000, stream=open(os.devnull, "w"))
        if run.exit_code != 0:
            raise SystemExit("\n".join(run.output[0][-30:]))
    with open(path) as fh:
        data = json.load(fh)
    text, verdicts = report(data, ns.up_rate, ns.out_rate, ns.iters, fixed, env.get("MPCCS_PLANE_RATES"))
    with open(os.path.join(ns.out, "report.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(ns.out, "verdicts.json"), "w") as fh:
        json.dump(verdicts, fh, indent=1)
    print(text)
    return 0


def report(data: dict, up_rate: str, out_rate: str, iters: int, fixed: list, stated) -> tuple[str, list]:
    """The markdown report and the verdicts of one mpccs-perf run (its -J data):
    adaptive against the best single plane, and, where ``fixed`` fractions were
    timed, the best of them (an oracle: can the target hold on these links at all?)."""
    rows = {(r["policy"], r["size"]): r for r in data["rows"]}
    collective = data["rows"][0].get("collective", "all_reduce") if data["rows"] else "all_reduce"
    lines = [f"# Testbed, 4 ranks as 2 domains of 2 (up within a domain, out between all), {collective}", "",
             f"Rates: up {up_rate}, out {out_rate}; {iters} iterations per point, interleaved; "
             f"measured {time.strftime('%Y-%m-%dT%H:%M:%S')}. Target: adaptive >= {TARGET}x the best single plane.",
             "", "Rates stated to mpccs (MPCCS_PLANE_RATES): " + (stated or _priors_text()) + ".",
             "", _settle_text(data.get("meta", {}).get("settle")),
             "", _plan_rates_text(data["rows"]), "", "| size | algorithm (adaptive) | busbw up | busbw out | busbw adaptive | adaptive / best single "
             "[95% CI] | A/A floor | ceiling | busbw bound (multipath) | verdict |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    up_Bps, out_Bps = parse_rate(up_rate) / 8, parse_rate(out_rate) / 8
    verdicts, oracles = [], []
    for size in sorted({r["size"] for r in data["rows"]}):
        up, up2, out, ad = (rows[(p, size)] for p in ("up", "up#2", "out", "adaptive"))
        best = up if up["busbw"] >= out["busbw"] else out
        ratio = ratio_ci(ad["times_us"], best["times_us"], paired=True)
        floor = noise_floor(up["times_us"], up2["times_us"])
        ok = holds(ratio, TARGET, floor)
        verdict = {"size": size, "ratio": ratio, "floor": floor, "holds": ok}
        bound_cells = "- | -"  # the closed-form bound (mpccs.sim.bounds) is all_reduce's
        if collective == "all_reduce":
            bounds = all_reduce_bounds(size, [0, 0, 1, 1], up_Bps, out_Bps)
            bound_busbw = 1.5 * size / bounds.multipath_s / 1e9  # nccl-tests' all_reduce factor 2(p-1)/p at p = 4
            verdict.update(ceiling=bounds.ceiling, bound_busbw=bound_busbw)
            bound_cells = f"{bounds.ceiling:.2f} | {bound_busbw:.3f}"
        oracle = min((rows[(f, size)] for f in fixed), key=lambda r: r["time_us"], default=None)
        if oracle is not None:
            oracle_ratio = ratio_ci(oracle["times_us"], best["times_us"], paired=True)
            verdict["oracle"] = {"fraction_on_up": oracle["policy"], "ratio": oracle_ratio,
                                 "holds": holds(oracle_ratio, TARGET, floor)}
            oracles.append(f"| {size >> 20} MiB | {oracle['policy']} | {oracle['busbw']:.3f} | "
                           f"{oracle_ratio[0]:.2f} [{oracle_ratio[1]:.2f}, {oracle_ratio[2]:.2f}] | "
                           f"{'holds' if verdict['oracle']['holds'] else 'NOT MET'} |")
        verdicts.append(verdict)
        algorithm = f"{ad.get('algorithm', '?')}, {ad.get('channels') or 1} channel(s)"
        lines.append(f"| {size >> 20} MiB | {algorithm} | {up['busbw']:.3f} | {out['busbw']:.3f} | "
                     f"{ad['busbw']:.3f} | {ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}] | {floor:.3f} | "
                     f"{bound_cells} | {'holds' if ok else 'NOT MET'} |")
    if oracles:
        lines += ["", f"The best fixed split of those timed ({', '.join(fixed)} on up), against the best single plane:",
                  "", "| size | fraction on up | busbw | fixed / best single [95% CI] | verdict |",
                  "|---|---|---:|---|---|", *oracles]
    return "\n".join(lines) + "\n", verdicts


def _settle_text(settled) -> str:
    """The controller's start-up, run before the sweep (mpccs-perf --settle)."""
    if not settled:
        return "The controller's start-up ran inside the 16 MiB point (no --settle)."
    return (f"The controller's start-up ran before the sweep: {settled['ops']} operations of "
            f"{settled['size'] >> 20} MiB under `adaptive` against as many under `up`, adaptive / up time "
            f"{settled['adaptive_s'] / settled['up_s']:.2f}x ({1e3 * settled['adaptive_s']:.0f} / "
            f"{1e3 * settled['up_s']:.0f} ms). The points below are steady state.")


def _plan_rates_text(rows: list) -> str:
    """What the tuner planned by at the end of each size's points (docs/controller.md, Plan rates)."""
    seen = {}
    for r in rows:
        rates = r.get("plan_rates")
        if rates:
            seen[r["size"]] = rates
    if not seen:
        return "Plan rates: not recorded."
    parts = [f"{size >> 20} MiB: {rates['source']} (up {rates['up'] / 1e6:.1f} MB/s, out {rates['out'] / 1e6:.1f} MB/s)"
             for size, rates in sorted(seen.items())]
    return "Plan rates at the end of each size's points: " + "; ".join(parts) + "."


def _priors_text() -> str:
    rates = ControlConfig().prior_rate_Bps  # what the tuner plans by when no rates are stated
    return f"none (the priors: {rates['up'] / 1e9:g} GB/s up, {rates['out'] / 1e6:g} MB/s out)"


if __name__ == "__main__":
    sys.exit(main())
