"""``mpccs-sim``: the flow-level simulator from the command line.

    mpccs-sim presets                               link rates and sources
    mpccs-sim run --preset h100 -c all_reduce -b 1M -e 1G [--policy ...]
    mpccs-sim report --out bench/results/sim         the committed report
    mpccs-sim fit-testbed --up 0.29GB/s,25us --out 0.15GB/s,25us
    mpccs-sim --fit-testbed ...                      same as fit-testbed

Every number printed is SIMULATED (predicted), never measured.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Optional

from .presets import PRESETS, Preset, get_preset, load_toml
from .report import (
    LABEL,
    REPORT_COLLECTIVES,
    Outcome,
    Scenario,
    algorithms_for,
    bandwidth_bound,
    count_for_size,
    evaluate,
    golden_min,
    nccl_style_table,
    parse_size,
)
from .run import Background, FixedShare, NominalSplit, PlaneDown, controller_factory


# --- argument parsing helpers ----------------------------------------------------
_RATE_UNITS = {"gb/s": 1.0, "gbps": 1.0, "mb/s": 1e-3, "gbit/s": 1 / 8, "mbit/s": 1 / 8000}
_TIME_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6, "ns": 1e-3}


def _parse_quantity(text: str, units: dict, default_unit: str, what: str, example: str) -> float:
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z/]*)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad {what} {text!r} (e.g. {example})")
    unit = (m.group(2) or default_unit).lower()
    if unit not in units:
        raise argparse.ArgumentTypeError(f"unknown {what} unit {unit!r}; use one of {sorted(units)}")
    return float(m.group(1)) * units[unit]


def parse_rate_GBps(text: str) -> float:
    return _parse_quantity(text, _RATE_UNITS, "GB/s", "rate", "0.29GB/s, 2.4Gbit/s")


def parse_time_us(text: str) -> float:
    return _parse_quantity(text, _TIME_UNITS, "us", "time", "25us, 1ms")


def parse_plane(text: str):
    """RATE[,LATENCY], e.g. ``0.29GB/s,25us``."""
    from .fit import PlaneFit

    rate, _, lat = text.partition(",")
    return PlaneFit(parse_rate_GBps(rate), parse_time_us(lat) if lat else 0.0)


def parse_background(text: str) -> Background:
    """PLANE:FRACTION[@START[-END]], times with units, e.g. ``out:0.5@1ms-5ms``."""
    m = re.fullmatch(r"(up|out):([0-9.]+)(?:@([^-]+)(?:-(.+))?)?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad background {text!r} (e.g. out:0.5@1ms-5ms)")
    start = parse_time_us(m.group(3)) * 1e-6 if m.group(3) else 0.0
    end = parse_time_us(m.group(4)) * 1e-6 if m.group(4) else math.inf
    return Background(m.group(1), float(m.group(2)), start, end)


def parse_failure(text: str) -> PlaneDown:
    """PLANE@TIME, e.g. ``up@2ms``."""
    plane, _, when = text.partition("@")
    if plane not in ("up", "out") or not when:
        raise argparse.ArgumentTypeError(f"bad failure {text!r} (e.g. up@2ms)")
    return PlaneDown(plane, parse_time_us(when) * 1e-6)


def size_range(begin: int, end: int, factor: int) -> list[int]:
    sizes, s = [], begin
    while s <= end:
        sizes.append(s)
        s *= factor
    return sizes


def load_preset(args) -> Preset:
    return load_toml(args.toml) if getattr(args, "toml", None) else get_preset(args.preset)


# --- commands -------------------------------------------------------------------------
def cmd_presets(args) -> int:
    presets = [load_toml(args.toml)] if args.toml else list(PRESETS.values())
    print(f"{'preset':10s} {'GPUs/dom':>8s} {'up kind':>11s} {'up GB/s':>8s} {'out GB/s/GPU':>12s} {'bound':>6s}  description")
    for p in presets:
        up = p.up_port.usable_GBps if p.up_kind != "mesh" else p.mesh_aggregate.usable_GBps
        out = p.nic.usable_GBps / p.gpus_per_nic
        print(f"{p.name:10s} {p.gpus_per_domain:8d} {p.up_kind:>11s} {up:8.1f} {out:12.1f} "
              f"{bandwidth_bound(p):6.1%}  {p.description}")
    return 0


def _policy_outcome(sc: Scenario, algorithm: str, policy: str, args) -> Outcome:
    kw = dict(events=args.events, aggregate=not args.no_aggregate,
              chunk_bytes=args.chunk, window_bytes=args.window)
    if policy == "single":
        res = sc.run(algorithm, FixedShare(0.0), **kw)
    elif policy == "out":
        res = sc.run(algorithm, FixedShare(1.0), **kw)
    elif policy.startswith("share:"):
        res = sc.run(algorithm, FixedShare(float(policy[6:]), steal=args.steal), **kw)
    elif policy == "spec":
        res = sc.run(algorithm, make_policy=NominalSplit, **kw)
    elif policy == "controller":
        runs = sc.series(algorithm, controller_factory(chunk_bytes=args.chunk), args.warmup + args.iters, **kw)
        runs = runs[args.warmup:]
        t = sum(r.time_s for r in runs) / len(runs)
        return Outcome(algorithm, t, sc.busbw(t), sum(r.out_share for r in runs) / len(runs))
    elif policy == "tuned":
        share, t = golden_min(lambda x: sc.run(algorithm, FixedShare(x), **kw).time_s, 0.0, 0.7)
        return Outcome(algorithm, t, sc.busbw(t), share)
    else:
        raise SystemExit(f"unknown policy {policy!r}")
    if not res.ok:
        raise SystemExit(f"simulated operation failed: {res.error}")
    for t, what in res.events:
        print(f"# event t={t * 1e6:.1f}us: {what}")
    return Outcome(algorithm, res.time_s, sc.busbw(res.time_s), res.out_share)


def cmd_run(args) -> int:
    preset = load_preset(args)
    print(f"# {LABEL}: {preset.name} x {args.domains} domain(s), {preset.gpus_per_domain * args.domains} ranks, "
          f"policy {args.policy}")
    scenarios = [Scenario(preset, args.domains, args.collective, size, local_copies=args.local_copies)
                 for size in size_range(args.begin, args.end, args.factor)]
    if args.policy == "compare":
        algos = None if args.algorithm == "best" else [args.algorithm]
        rows = [evaluate(sc, algos, controller_factory=controller_factory(chunk_bytes=args.chunk),
                         warmup=args.warmup, iters=args.iters, events=args.events,
                         aggregate=not args.no_aggregate, chunk_bytes=args.chunk) for sc in scenarios]
        print(nccl_style_table(rows))
        payload = [r.to_json() for r in rows]
    else:
        results = []
        for sc in scenarios:
            algos = algorithms_for(args.collective, args.domains) if args.algorithm == "best" else [args.algorithm]
            results.append((sc, min((_policy_outcome(sc, a, args.policy, args) for a in algos),
                                    key=lambda o: o.time_s)))
        print(_outcome_table(results))
        payload = [{"label": LABEL, "preset": sc.preset.name, "world": sc.world, "collective": sc.collective,
                    "size_bytes": sc.size_bytes, "policy": args.policy, **o.to_json()} for sc, o in results]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1, default=str)
    return 0


def _outcome_table(results) -> str:
    lines = ["#       size    count  collective       algo    time(us)  algbw(GB/s)  busbw(GB/s)  out-share"]
    for sc, o in results:
        lines.append(f"{sc.size_bytes:12d} {count_for_size(sc.collective, sc.size_bytes, sc.world):9d}  "
                     f"{sc.collective:14s} {o.algorithm:>8s} {o.time_s * 1e6:10.1f} "
                     f"{sc.size_bytes / o.time_s / 1e9:12.2f} {o.busbw_GBps:12.2f}  {o.out_share:8.1%}")
    return "\n".join(lines)


def cmd_fit_testbed(args) -> int:
    from .fit import MIN_FIT_BYTES, Measurements, load_measurements, preset_for_testbed

    if args.measured:
        measured = load_measurements(args.measured)
    elif args.up and args.out:
        measured = Measurements({"up": args.up, "out": args.out}, args.world, {})
    else:
        raise SystemExit("fit-testbed needs --measured FILE, or both --up and --out")
    planes = measured.planes
    preset = preset_for_testbed(planes["up"], planes["out"], world=measured.world,
                                shared_GBps=args.shared, reduce_GBps=args.reduce or math.inf)
    print(f"# {LABEL}: dual-plane all_reduce predicted for the testbed ({measured.world} ranks)")
    for plane, fit in planes.items():
        how = f"fitted from {fit.points} points, max residual {fit.residual:.1%}" if fit.points else "given"
        print(f"#   {plane}: {fit.rate_GBps:.4g} GB/s, {fit.latency_us:.3g} us per step ({how})")
    measured_sizes = sorted({s for by_size in measured.multipath.values() for s in by_size if s >= MIN_FIT_BYTES})
    sizes = args.sizes or measured_sizes or [parse_size(x) for x in ("64K", "1M", "16M", "64M", "256M")]
    rows = [evaluate(Scenario(preset, 1, "all_reduce", size), ["ring"],
                     controller_factory=controller_factory(chunk_bytes=args.chunk),
                     warmup=args.warmup, iters=args.iters, chunk_bytes=args.chunk)
            for size in sizes]
    print(nccl_style_table(rows))
    print("# sum of the planes alone: "
          f"{planes['up'].rate_GBps + planes['out'].rate_GBps:.4g} GB/s (the bound for large sizes)")
    comparison = _measured_vs_predicted(rows, measured.multipath)
    if comparison:
        print("# measured multipath (MEASURED) vs predicted controller (SIMULATED), busbw GB/s")
        for size, policy, meas, pred in comparison:
            print(f"{size:12d}  {policy:>10s}  measured {meas:8.4g}  predicted {pred:8.4g}  {pred / meas - 1:+7.1%}")
    if args.json:
        payload = {"label": LABEL, "planes": {k: v.to_json() for k, v in planes.items()},
                   "rows": [r.to_json() for r in rows],
                   "measured_vs_predicted": [dict(zip(("size", "policy", "measured_busbw", "predicted_busbw"), c))
                                             for c in comparison]}
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1, default=str)
    return 0


def _measured_vs_predicted(rows, multipath: dict) -> list[tuple]:
    out = []
    for row in rows:
        size = row.scenario.size_bytes
        predicted = (row.controller or row.tuned).busbw_GBps
        for policy, by_size in sorted(multipath.items()):
            if size in by_size:
                out.append((size, policy, by_size[size], predicted))
    return out


def cmd_report(args) -> int:
    from .study import write_report

    write_report(args.out, quick=args.quick)
    return 0


# --- parser -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpccs-sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("presets", help="list presets with usable link rates")
    p.add_argument("--toml", help="show a custom cluster file instead")
    p.set_defaults(fn=cmd_presets)

    p = sub.add_parser("run", help="predict busbw for one collective over a size range (nccl-tests style)")
    p.add_argument("--preset", default="h100", choices=sorted(PRESETS))
    p.add_argument("--toml", help="custom cluster (overrides --preset); see docs/simulator.md")
    p.add_argument("--domains", type=int, default=1, help="scale-up domains (servers, racks)")
    p.add_argument("-c", "--collective", default="all_reduce", choices=REPORT_COLLECTIVES + ("broadcast", "reduce"))
    p.add_argument("-a", "--algorithm", default="best", help="builder name, or 'best' (fastest per size)")
    p.add_argument("-b", "--begin", type=parse_size, default=parse_size("1M"))
    p.add_argument("-e", "--end", type=parse_size, default=parse_size("1G"))
    p.add_argument("-f", "--factor", type=int, default=4)
    p.add_argument("--policy", default="compare",
                   help="compare (all below) | single | out | share:F | spec | tuned | controller")
    p.add_argument("--steal", action="store_true", help="with share:F, let a plane that runs ahead steal")
    p.add_argument("--background", dest="events", action="append", type=parse_background, default=[],
                   help="PLANE:FRACTION[@START[-END]], e.g. out:0.5@1ms")
    p.add_argument("--fail", dest="events", action="append", type=parse_failure,
                   help="PLANE@TIME: the plane dies at TIME, e.g. up@200us")
    p.add_argument("--chunk", type=parse_size, default=parse_size("1M"))
    p.add_argument("--window", type=parse_size, default=parse_size("16M"),
                   help="bytes in flight per plane and flow for fixed policies")
    p.add_argument("--no-aggregate", action="store_true", help="simulate every rank (slower)")
    p.add_argument("--local-copies", action="store_true", help="charge the schedules' in->out copies")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", help="also write the rows as JSON")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("report", help="write the full SIMULATED report (markdown, PNG, JSON)")
    p.add_argument("--out", default="bench/results/sim")
    p.add_argument("--quick", action="store_true", help="fewer sizes and presets (for a smoke test)")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("fit-testbed", help="predict the testbed's dual-plane all_reduce from single-plane numbers")
    p.add_argument("--up", type=parse_plane, help="RATE[,LATENCY] of the up plane alone, e.g. 0.29GB/s,25us")
    p.add_argument("--out", type=parse_plane, help="RATE[,LATENCY] of the out plane alone")
    p.add_argument("--measured", help='an mpccs-perf -J file of all_reduce rows (policies up, out and any '
                                      'multipath ones), or JSON {"up": {...}, "out": {...}}, each '
                                      '{"rate_GBps", "latency_us"} or {"all_reduce": [[size_bytes, time_us], ...]}')
    p.add_argument("--world", type=int, default=2, help="ranks (with --up/--out)")
    p.add_argument("--shared", type=parse_rate_GBps, help="a per-rank resource both planes cross (CPU), e.g. 0.5GB/s")
    p.add_argument("--reduce", type=parse_rate_GBps, help="receiver reduction rate (default: free)")
    p.add_argument("--sizes", type=lambda t: [parse_size(x) for x in t.split(",")], default=None,
                   help="default: the measured multipath sizes, else 64K,1M,16M,64M,256M")
    p.add_argument("--chunk", type=parse_size, default=parse_size("1M"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json")
    p.set_defaults(fn=cmd_fit_testbed)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--fit-testbed":  # the flag spelling of the sub-command
        argv[0] = "fit-testbed"
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
