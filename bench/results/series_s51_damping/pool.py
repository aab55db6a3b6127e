"""Pool this folder's alternating runs, flap damping on and off: the `background` series (`on*/`, `off*/`),
per run the loaded rank's (rank 1) planned share under the background and after it; and target 1's testbed
(`testbed/new_*`, `testbed/base_*`), per point adaptive's time over the fixed rate-ratio split's (the oracle).
Writes pool.md.

    python bench/results/series_s51_damping/pool.py
"""
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
LOADED, UNLOADED = 1, 0


def segment(run: dict, rank: int, after: str) -> dict:
    return next(s for s in run["segments"] if s["rank"] == rank and s["after"] == after)


def planned(run: dict, rank: int, lo: float, hi: float) -> list[float]:
    return [op["planned_up"] for op in run["ops"][str(rank)]
            if lo <= op["t"] < hi and op["planned_up"] is not None]


def reversals(shares: list[float]) -> int:
    steps = [b - a for a, b in zip(shares, shares[1:]) if abs(b - a) > 0.01]
    return sum(1 for a, b in zip(steps, steps[1:]) if a * b < 0)


def row(path: str) -> dict:
    run = json.load(open(os.path.join(path, "matrix.json")))["series"]["background"]
    on, off = (segment(run, LOADED, after) for after in ("background on", "background off"))
    whole = planned(run, LOADED, on["t_change"], off["t_change"])
    mode = statistics.mode(whole)
    return {
        "run": os.path.basename(path),
        "near": on["near_model"]["first_ops"], "inside": on["near_model"]["inside"],
        "rev_half": on["planned_spread"]["reversals"], "ops_half": on["planned_spread"]["ops"],
        "rev_whole": reversals(whole), "ops_whole": len(whole),
        "off_mode": sum(1 for s in whole if abs(s - mode) > 0.01), "mode": mode,
        "p10": on["planned_spread"]["p10"], "p90": on["planned_spread"]["p90"],
        "median_ms": on["median_op_ms"], "after_near": off["near_model"]["first_ops"],
        "after_median_ms": off["median_op_ms"],
        "unloaded_rev": segment(run, UNLOADED, "background on")["planned_spread"]["reversals"],
    }


def main() -> None:
    lines = ["# Flap damping A/B: the `background` series, alternating runs (pool.py)", "",
             "Loaded rank (rank 1) under the background: operations until its 5-operation mean is within 5 points "
             "of the model (0.80), reversals of its planned share in the segment's second half (the report's "
             "measure) and in the whole segment, operations off the segment's most common share; after the "
             "background: operations until near the model (0.67) again.", "",
             "| run | near model after (inside) | reversals, 2nd half | reversals, whole | ops off the mode (mode) "
             "| p10-p90 | median op (ms) | after the load: near model after, median op | unloaded rank's reversals |",
             "|---|---|---:|---:|---|---|---:|---|---:|"]
    summary = {}
    for arm in ("on", "off"):
        rows = [row(p) for p in sorted(glob.glob(os.path.join(HERE, f"{arm}*"))) if os.path.isdir(p)]
        for r in rows:
            lines.append(f"| {r['run']} | {r['near']} ({r['inside']:.0%}) | {r['rev_half']} / {r['ops_half']} | "
                         f"{r['rev_whole']} / {r['ops_whole']} | {r['off_mode']} ({r['mode']:.2f}) | "
                         f"{r['p10']:.2f}-{r['p90']:.2f} | {r['median_ms']:.0f} | {r['after_near']}, "
                         f"{r['after_median_ms']:.0f} ms | {r['unloaded_rev']} |")
        if rows:
            summary[arm] = {k: statistics.median(r[k] for r in rows)
                            for k in ("near", "rev_half", "rev_whole", "off_mode", "median_ms", "after_near")}
            summary[arm]["n"] = len(rows)
    lines += ["", "Medians over the runs:", "", "| arm | runs | near model after | reversals, 2nd half | "
              "reversals, whole | ops off the mode | median op (ms) | after the load: near model after |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, s in summary.items():
        lines.append(f"| {arm} | {s['n']} | {s['near']:g} | {s['rev_half']:g} | {s['rev_whole']:g} | "
                     f"{s['off_mode']:g} | {s['median_ms']:.0f} | {s['after_near']:g} |")
    lines += testbed_lines()
    with open(os.path.join(HERE, "pool.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def testbed_cells(arm: str) -> dict:
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(HERE, "testbed", f"{arm}_*", "verdicts.json"))):
        for r in json.load(open(path))["results"]:
            point = f"{r['collective']} {r['size'] >> 20} MiB"
            out.setdefault(point, []).append({"ad_over_fixed": r["fixed"]["vs_up"][0] / r["vs_up"][0],
                                              "vs_sum": r["vs_sum"][0], "strict": r["holds_sum"] and r["holds_up"]})
    return out


def testbed_lines() -> list[str]:
    new, base = testbed_cells("new"), testbed_cells("base")
    if not new:
        return []
    lines = ["", "Target 1's testbed (2.4 / 1.2 Gbit/s, 20 iterations a point), runs alternating: adaptive's time "
             "over the fixed 0.667 split's (the oracle), median over the runs; adaptive / (up + out), median; "
             "points that meet the strict rule.", "",
             "| point | on: adaptive / fixed | off: adaptive / fixed | on: / sum | off: / sum | strict on | strict off |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    every = {"new": [], "base": []}
    for point in new:
        n, b = new[point], base.get(point, [])
        every["new"] += [c["ad_over_fixed"] for c in n]
        every["base"] += [c["ad_over_fixed"] for c in b]
        lines.append(f"| {point} | {statistics.median(c['ad_over_fixed'] for c in n):.3f} | "
                     f"{statistics.median(c['ad_over_fixed'] for c in b):.3f} | "
                     f"{statistics.median(c['vs_sum'] for c in n):.3f} | {statistics.median(c['vs_sum'] for c in b):.3f} | "
                     f"{sum(c['strict'] for c in n)} / {len(n)} | {sum(c['strict'] for c in b)} / {len(b)} |")
    lines.append(f"| all points | mean {statistics.mean(every['new']):.3f}, median {statistics.median(every['new']):.3f} "
                 f"| mean {statistics.mean(every['base']):.3f}, median {statistics.median(every['base']):.3f} | | | | |")
    return lines


if __name__ == "__main__":
    main()
