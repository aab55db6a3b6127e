"""Pool this folder's testbed_targets runs: adaptive against the fixed rate-ratio split (the oracle),
per point, over runs; writes pool.md and adaptive_vs_fixed.png.

    python bench/results/testbed_2.4g_s33/pool.py
"""
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GROUPS = {"shipped controller": "runs", "tried: coflow_slack 0.25": "tried_slack_0.25",
          "tried: dead band 0.25": "tried_deadband"}


def cells(folder: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(HERE, folder, "*", "verdicts.json"))):
        for r in json.load(open(path))["results"]:
            out.append({"point": f"{r['collective']} {r['size'] >> 20} MiB", "ad_over_fixed": r["fixed"]["vs_up"][0] / r["vs_up"][0],
                        "vs_sum": r["vs_sum"][0], "vs_up": r["vs_up"][0], "fixed_sum": r["fixed"]["vs_sum"][0],
                        "fixed_up": r["fixed"]["vs_up"][0], "strict": r["holds_sum"] and r["holds_up"],
                        "fixed_strict": r["fixed"]["holds_sum"] and r["fixed"]["holds_up"]})
    return out


def main() -> None:
    lines = ["# Pooled testbed_targets runs (2.4 / 1.2 Gbit/s, 20 iterations, fixed 0.667 beside adaptive)", "",
             "adaptive / fixed: adaptive's median time over the fixed split's, same run (above 1: adaptive slower). "
             "Both checks: >= 0.90x the sum and >= 1.35x `up`; by the median (point estimates) and by the strict rule "
             "(interval's lower bound minus the A/A floor).", "",
             "| controller | runs | points | adaptive / fixed: mean, p90, max | adaptive both checks by the median | "
             "by the strict rule | fixed both checks by the median | by the strict rule |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    shipped = None
    for name, folder in GROUPS.items():
        c = cells(folder)
        if not c:
            continue
        runs = len(glob.glob(os.path.join(HERE, folder, "*", "verdicts.json")))
        af = np.array([x["ad_over_fixed"] for x in c])
        ad_med = np.mean([x["vs_sum"] >= 0.90 and x["vs_up"] >= 1.35 for x in c])
        fx_med = np.mean([x["fixed_sum"] >= 0.90 and x["fixed_up"] >= 1.35 for x in c])
        lines.append(f"| {name} | {runs} | {len(c)} | {af.mean():.3f}, {np.percentile(af, 90):.3f}, {af.max():.2f} | "
                     f"{100 * ad_med:.0f}% | {100 * np.mean([x['strict'] for x in c]):.0f}% | {100 * fx_med:.0f}% | "
                     f"{100 * np.mean([x['fixed_strict'] for x in c]):.0f}% |")
        if shipped is None:
            shipped = c
    points = sorted({x["point"] for x in shipped}, key=lambda p: (p.split()[0], int(p.split()[1])))
    lines += ["", "Shipped controller, per point over its runs (median [min, max]):", "",
              "| point | adaptive / (up+out) | fixed / (up+out) | adaptive / fixed |", "|---|---|---|---|"]
    for p in points:
        xs = [x for x in shipped if x["point"] == p]
        f = lambda k: f"{np.median([x[k] for x in xs]):.2f} [{min(x[k] for x in xs):.2f}, {max(x[k] for x in xs):.2f}]"  # noqa: E731
        lines.append(f"| {p} | {f('vs_sum')} | {f('fixed_sum')} | {f('ad_over_fixed')} |")
    with open(os.path.join(HERE, "pool.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.boxplot([[x["ad_over_fixed"] for x in shipped if x["point"] == p] for p in points], tick_labels=points)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("adaptive time / fixed 0.667 time")
    ax.set_title(f"Testbed 2:1, shipped controller, {len(glob.glob(os.path.join(HERE, 'runs', '*', 'verdicts.json')))} runs")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "adaptive_vs_fixed.png"), dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
