"""Testbed targets: 2 ranks, both planes shaped tcp at 2:1, every collective.

    python bench/testbed_targets.py --out bench/results/testbed            (root; ~2-5 min)
    python bench/testbed_targets.py --out DIR --iters 200     (the strict rule's reading; ~15 min)

For all_reduce, reduce_scatter, all_gather and all_to_all at 16-64 MiB,
mpccs-perf runs up, up#2 (A/A), out and adaptive interleaved inside the
emulated cluster (mpccs-testbed's Python API); the report gives adaptive
against the sum of the single-plane busbws and against up, with paired
bootstrap intervals and the noise floor, next to the targets (>= 0.90x the
sum, >= 1.35x up). The controller's start-up runs before each sweep
(--settle, its own adaptive / up ratio in the report), so the points are
steady state. It also records each rank's kernel byte counters.

A fixed split at the rate ratio (0.667 at 2:1: the one an oracle that
knows the shaped rates would pick; --fixed F for another, --fixed none for
none) runs in the same interleaving, judged by the same rule: it tells
whether the rule can hold on this host at all, estimates aside.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from stats import code_text, holds, noise_floor, ratio_ci  # noqa: E402

from mpccs.perf import host_speed_text  # noqa: E402
from mpccs.testbed import Cluster  # noqa: E402
from mpccs.testbed.netns import parse_rate  # noqa: E402

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
# The controller's start-up: probes at operations 4 and 5, the re-add's check at 8 (docs/controller.md).
# Run before the sweep (as default_planes.py does), the points measure steady state and the start-up
# gets its own ratio; inside the 16 MiB point it was 2-3 of its 10 timed operations.
SETTLE_OPS = 12
PLOT_TEXT = ("`targets.png`: each point's two ratios with their 95% intervals, adaptive and the fixed split, and the "
             "strict rule's reading (the lower bound minus the A/A floor) as a tick; a tick above the dashed target "
             "holds.")


def run_collective(cluster, collective: str, out: str, iters: int, settle: int, fixed: str | None) -> dict:
    policies = "up,up,out,adaptive" + (f",{fixed}" if fixed else "")
    return run_perf(cluster, collective, out, policies, ("16M", "64M"), iters, settle)


def run_perf(cluster, collective: str, out: str, policies: str, sizes: tuple[str, str], iters: int,
             settle: int, timeout: float = 1800) -> dict:
    """One mpccs-perf sweep (sizes x4 apart, the policies interleaved) inside the testbed; its JSON."""
    path = os.path.join(out, f"{collective}.json")
    argv = [sys.executable, "-m", "mpccs.perf", collective, "-b", sizes[0], "-e", sizes[1], "-f", "4",
            "-n", str(iters), "-w", "3", "--policies", policies, "--quiet", "-J", path]
    if settle > 0:
        argv += ["--settle", str(settle)]
    result = cluster.run(argv, timeout=timeout, stream=open(os.devnull, "w"))
    if result.exit_code != 0:
        raise SystemExit(f"{collective} failed:\n" + "\n".join(result.output[0][-20:]))
    with open(path) as fh:
        return json.load(fh)


def judged(policy_row: dict, up: dict, out_: dict, floor: float) -> dict:
    """One policy's two target-1 ratios at one point, paired by iteration, and whether each holds."""
    t_up, t_out, t = (np.asarray(r["times_us"]) for r in (up, out_, policy_row))
    sums = 1 / (1 / t_up + 1 / t_out)  # the time the summed bandwidth would give
    vs_up = ratio_ci(t, t_up, paired=True)
    vs_sum = ratio_ci(t, sums, paired=True)
    return {"vs_up": vs_up, "vs_sum": vs_sum, "share_up": policy_row["up_share"],
            "holds_up": holds(vs_up, 1.35, floor), "holds_sum": holds(vs_sum, 0.90, floor)}


def verdicts(data: dict, fixed: str | None = None) -> list[dict]:
    rows = {(r["policy"], r["size"]): r for r in data["rows"]}
    out = []
    for size in sorted({r["size"] for r in data["rows"]}):
        up, up2, out_, ad = (rows[(p, size)] for p in ("up", "up#2", "out", "adaptive"))
        floor = noise_floor(up["times_us"], up2["times_us"])
        point = {"collective": data["rows"][0]["collective"], "size": size,
                 "busbw": {p: rows[(p, size)]["busbw"] for p in ("up", "out", "adaptive")}, "floor": floor,
                 "steal": ad.get("steal"), "host_speed": data.get("meta", {}).get("host_speed"),
                 "settle": data.get("meta", {}).get("settle"), "code": data.get("meta", {}).get("code"),
                 **judged(ad, up, out_, floor)}
        if fixed:
            point["fixed"] = {"fraction": fixed, "busbw": rows[(fixed, size)]["busbw"],
                              **judged(rows[(fixed, size)], up, out_, floor)}
        out.append(point)
    return out


def _percent(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _host_text(results: list[dict]) -> str:
    """The host's reference speeds at the start of each collective's run (mpccs.perf.host_speed)."""
    seen = {r["collective"]: r.get("host_speed") for r in results}
    parts = [f"{c}: {host_speed_text(speed)}" for c, speed in seen.items() if speed]
    return ("Host speed at the start of each run (docs/benchmarks.md, method): " + "; ".join(parts) + "."
            if parts else "Host speed: not recorded.")


def _settle_text(results: list[dict]) -> str:
    """The controller's start-up, run before each collective's sweep (mpccs-perf --settle)."""
    seen = {r["collective"]: r.get("settle") for r in results}
    parts = [f"{c} {s['adaptive_s'] / s['up_s']:.2f}x ({1e3 * s['adaptive_s']:.0f} / {1e3 * s['up_s']:.0f} ms)"
             for c, s in seen.items() if s and s.get("up_s")]
    if not parts:
        return "The controller's start-up (its first probes and the re-add's check) ran inside the 16 MiB points."
    ops, size = next((s["ops"], s["size"]) for s in seen.values() if s)
    return (f"The controller's start-up (its first probes and the re-add's check) ran before each sweep: {ops} "
            f"operations of {size >> 20} MiB under `adaptive` against as many under `up`, adaptive / up time: "
            + ", ".join(parts) + ". The points below are steady state.")


def render(results: list[dict], meta: dict) -> str:
    lines = [
        "# Testbed targets: 2 ranks, up and out both shaped tcp at 2:1",
        "",
        f"Rates: up {meta['up_rate']}, out {meta['out_rate']} (per direction, both ends shaped); "
        f"{meta['iters']} iterations per point, interleaved; measured {meta['time']}. CPU stolen: the share of "
        "the host's CPU time the hypervisor gave to other guests during the point (/proc/stat): the runs here "
        "came in slow spells where it rose, and every column with it.",
        "",
        _host_text(results),
        "",
        code_text({r["collective"]: r.get("code") for r in results}),
        "",
        _settle_text(results),
        "",
        "| collective | size | busbw up | busbw out | busbw adaptive | up share | adaptive / (up+out) | "
        "adaptive / up | A/A floor | CPU stolen | >= 0.90x sum | >= 1.35x up |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['collective']} | {r['size'] >> 20} MiB | {r['busbw']['up']:.3f} | {r['busbw']['out']:.3f} | "
            f"{r['busbw']['adaptive']:.3f} | {100 * (r['share_up'] or 0):.0f}% | {_ratio(r['vs_sum'])} | "
            f"{_ratio(r['vs_up'])} | {r['floor']:.3f} | {_percent(r.get('steal'))} | {_verdict(r['holds_sum'])} | "
            f"{_verdict(r['holds_up'])} |")
    fixed = [r for r in results if r.get("fixed")]
    if fixed:
        lines += _fixed_lines(fixed)
    return "\n".join(lines) + "\n"


def _ratio(x) -> str:
    return f"{x[0]:.2f} [{x[1]:.2f}, {x[2]:.2f}]"


def _verdict(ok: bool) -> str:
    return "holds" if ok else "NOT MET"


def _fixed_lines(results: list[dict]) -> list[str]:
    """The fixed split next to adaptive, judged against the same up, out and floor (--fixed)."""
    lines = ["", f"A fixed split ({results[0]['fixed']['fraction']} of every stage on `up`), interleaved with the "
             "policies above and judged by the same rule against the same `up`, `out` and A/A floor: where it "
             "does not hold either, no split would on this host in this run.", "",
             "| collective | size | busbw fixed | fixed / (up+out) | fixed / up | adaptive / fixed (time) | "
             "A/A floor | >= 0.90x sum | >= 1.35x up |", "|---|---:|---:|---|---|---:|---:|---|---|"]
    for r in results:
        fx = r["fixed"]
        lines.append(
            f"| {r['collective']} | {r['size'] >> 20} MiB | {fx['busbw']:.3f} | {_ratio(fx['vs_sum'])} | "
            f"{_ratio(fx['vs_up'])} | {fx['vs_up'][0] / r['vs_up'][0]:.2f} | {r['floor']:.3f} | "
            f"{_verdict(fx['holds_sum'])} | {_verdict(fx['holds_up'])} |")
    return lines


def plot(results: list[dict], meta: dict, path: str) -> None:
    """targets.png: each point's two target-1 ratios with their 95% intervals, the fixed split beside
    adaptive, the target as a line, and the strict rule's reading (the interval's lower bound minus the
    A/A floor) as a tick: a tick above the line is a point that holds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['collective']}\n{r['size'] >> 20} MiB" for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    series = [("adaptive", results, "C0", -0.15)]
    if all(r.get("fixed") for r in results):
        series.append((f"fixed {results[0]['fixed']['fraction']}", [r["fixed"] for r in results], "C1", 0.15))
    for ax, key, target, title in ((axes[0], "vs_sum", 0.90, "busbw / (busbw up + busbw out)"),
                                   (axes[1], "vs_up", 1.35, "busbw / busbw up")):
        for name, rows, colour, dx in series:
            xs = [i + dx for i in range(len(rows))]
            mid = [r[key][0] for r in rows]
            err = [[r[key][0] - r[key][1] for r in rows], [r[key][2] - r[key][0] for r in rows]]
            ax.errorbar(xs, mid, yerr=err, fmt="o", color=colour, capsize=3, label=f"{name}: median, 95% interval")
            strict = [r[key][1] - p["floor"] for r, p in zip(rows, results)]
            ax.plot(xs, strict, "_", color=colour, ms=12, mew=2, label=f"{name}: lower bound - A/A floor")
        ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:.2f}")
        ax.set_xticks(range(len(results)), labels, fontsize=6.5)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"Target 1: testbed, up {meta['up_rate']} / out {meta['out_rate']}, 2 ranks, "
                 f"{meta['iters']} interleaved iterations per point ({meta['time']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_text(results: list[dict], meta: dict, counters: dict) -> str:
    """report.md: the tables, the plot's legend and the kernel's byte counters."""
    return (render(results, meta) + f"\n{PLOT_TEXT}\n"
            "\nKernel tx bytes per rank and interface during each collective's sweep (the outside view):\n\n"
            "```\n" + json.dumps(counters, indent=1) + "\n```\n")


def fixed_fraction(choice: str, up_rate: str, out_rate: str) -> str | None:
    """The fixed split's policy label, as mpccs-perf labels a fraction's rows ("0.667")."""
    if choice == "none":
        return None
    if choice == "ratio":
        up, out = parse_rate(up_rate), parse_rate(out_rate)
        return f"{round(up / (up + out), 3):g}"
    return f"{float(choice):g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--up-rate", default="2.4gbit")
    ap.add_argument("--out-rate", default="1.2gbit")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("--fixed", default="ratio", metavar="F",
                    help="also time a fixed split, F of the bytes on up, and judge it by the same rule "
                         "(default: the rate ratio up / (up + out); none: no fixed split)")
    ap.add_argument("--settle", type=int, default=SETTLE_OPS,
                    help="adaptive operations run before each sweep, timed apart (0: the start-up runs in the 16 MiB point)")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild report.md and targets.png from --out's verdicts.json")
    ns = ap.parse_args()
    if ns.report_only:
        with open(os.path.join(ns.out, "verdicts.json")) as fh:
            saved = json.load(fh)
        text = report_text(saved["results"], saved["meta"], saved["counters"])
        with open(os.path.join(ns.out, "report.md"), "w") as fh:
            fh.write(text)
        plot(saved["results"], saved["meta"], os.path.join(ns.out, "targets.png"))
        print(text)
        return 0
    ns.fixed = fixed_fraction(ns.fixed, ns.up_rate, ns.out_rate)
    os.makedirs(ns.out, exist_ok=True)
    results, counters = [], {}
    with Cluster(n=2, up="tcp", up_rate=ns.up_rate, out_rate=ns.out_rate, log=lambda m: None) as cluster:
        for collective in ns.collectives.split(","):
            before = cluster.counters()
            data = run_collective(cluster, collective, ns.out, ns.iters, ns.settle, ns.fixed)
            after = cluster.counters()
            counters[collective] = {
                str(rank): {plane: after[rank][plane].get("tx_bytes", 0) - before[rank][plane].get("tx_bytes", 0)
                            for plane in ("up", "out")} for rank in range(2)}
            results += verdicts(data, ns.fixed)
            print(render(results, {"up_rate": ns.up_rate, "out_rate": ns.out_rate, "iters": ns.iters,
                                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}), flush=True)
    meta = {"up_rate": ns.up_rate, "out_rate": ns.out_rate, "iters": ns.iters, "settle": ns.settle, "fixed": ns.fixed,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    text = report_text(results, meta, counters)
    with open(os.path.join(ns.out, "report.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(ns.out, "verdicts.json"), "w") as fh:
        json.dump({"meta": meta, "results": results, "counters": counters}, fh, indent=1)
    plot(results, meta, os.path.join(ns.out, "targets.png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
