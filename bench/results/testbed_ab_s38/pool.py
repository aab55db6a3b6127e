"""Pool this folder's alternating testbed_targets A/B runs: per comparison and point, adaptive's time over
the fixed rate-ratio split's (the oracle) for the code before and after, with a Mann-Whitney p; writes
pool.md and adaptive_vs_fixed.png.

    python bench/results/testbed_ab_s38/pool.py
"""
import glob
import json
import os
import statistics

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from stats import mann_whitney_p  # noqa: E402
# folder -> (what "base" ran, what "new" ran)
COMPARISONS = {
    "min_rate_samples_s37": ("main at fde9994", "+ three samples for the rate's median (the session before, all_reduce only)"),
    "min_rate_samples": ("main at fde9994", "+ three samples for the rate's median (943bde9)"),
    "size_evidence": ("943bde9", "+ whole-flow stages are not size evidence"),
    "ratio_reach": ("486c109", "+ the larger transfers' ratio plans only transfers of its smaller group's size (40f1f00)"),
}


def cells(folder: str, group: str) -> dict:
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(HERE, folder, "**", f"{group}_*", "verdicts.json"), recursive=True)):
        for r in json.load(open(path))["results"]:
            point = f"{r['collective']} {r['size'] >> 20} MiB"
            out.setdefault(point, []).append({
                "ad_over_fixed": r["fixed"]["vs_up"][0] / r["vs_up"][0], "vs_sum": r["vs_sum"][0],
                "vs_up": r["vs_up"][0], "fixed_sum": r["fixed"]["vs_sum"][0], "strict": r["holds_sum"] and r["holds_up"],
                "fixed_strict": r["fixed"]["holds_sum"] and r["fixed"]["holds_up"]})
    return out


def row(point: str, base: list, new: list) -> str:
    a, b = ([x["ad_over_fixed"] for x in v] for v in (base, new))
    p = mann_whitney_p(a, b)
    fmt = lambda v, k: f"{statistics.median([x[k] for x in v]):.2f}"  # noqa: E731
    return (f"| {point} | {len(a)} / {len(b)} | {statistics.mean(a):.3f} / {statistics.mean(b):.3f} | "
            f"{fmt(base, 'vs_sum')} / {fmt(new, 'vs_sum')} | {fmt(base, 'vs_up')} / {fmt(new, 'vs_up')} | "
            f"{sum(x['strict'] for x in base)} / {sum(x['strict'] for x in new)} | "
            f"{sum(x['fixed_strict'] for x in base)} / {sum(x['fixed_strict'] for x in new)} | {p:.2f} |")


def latest_code_table() -> list[str]:
    """The last comparison's new code per point: median [min, max] over its runs (the README's table)."""
    folder = list(COMPARISONS)[-1]
    new = cells(folder, "new")
    span = lambda v: f"{statistics.median(v):.2f} [{min(v):.2f}, {max(v):.2f}]"  # noqa: E731
    out = [f"## The code after the last change ({folder}/new_*), per point: median [min, max] over its runs", "",
           "| point | adaptive / (up + out) | fixed / (up + out) | adaptive / up | adaptive time / fixed time |",
           "|---|---|---|---|---|"]
    for point, v in sorted(new.items()):
        out.append(f"| {point} | {span([x['vs_sum'] for x in v])} | {span([x['fixed_sum'] for x in v])} | "
                   f"{span([x['vs_up'] for x in v])} | {span([x['ad_over_fixed'] for x in v])} |")
    return out + [""]


# series folder -> (what "base" ran, what "new" ran): target 5's series, bench/matrix.py --series failure,background
SERIES_COMPARISONS = {
    "series": ("943bde9", "882741d"),
    "series_ratio_reach": ("486c109", "40f1f00"),
}


def series_table() -> list[str]:
    out: list[str] = []
    for folder, names in SERIES_COMPARISONS.items():
        out += series_comparison(folder, names)
    return out


def series_comparison(folder: str, names: tuple) -> list[str]:
    """One folder of target 5's series, base against new: the loaded direction's convergence after the
    background flow starts."""
    res: dict = {"base": [], "new": []}
    for path in sorted(glob.glob(os.path.join(HERE, folder, "*.json"))):
        group = os.path.basename(path).split("_")[0]
        for seg in json.load(open(path))["series"]["background"]["segments"]:
            if seg["rank"] == 1 and seg["after"] == "background on":  # rank 1 sends into the loaded link
                res[group].append(seg)
    if not res["base"] or not res["new"]:
        return []
    out = [f"## Target 5's series ({folder}/): the loaded direction (rank 1) after the background flow starts, "
           f"{names[0]} (base) against {names[1]} (new)", "",
           "| | runs | operations until the 5-op mean is within 5 points of the model | share of the segment "
           "inside | planned-share reversals | median operation (ms) | final share |", "|---|---:|---|---|---|---|---|"]
    cols = (lambda g: g["near_model"]["first_ops"], lambda g: round(100 * g["near_model"]["inside"]),
            lambda g: g["planned_spread"]["reversals"], lambda g: round(g["median_op_ms"]),
            lambda g: g["convergence"]["final"])
    for group, segs in res.items():
        cells_ = [[f(g) for g in segs] for f in cols]
        out.append(f"| {group} | {len(segs)} | " + " | ".join(
            f"{statistics.median(c):g} ({', '.join(map(str, c))})" for c in cells_) + " |")
    ps = [mann_whitney_p([f(g) for g in res["base"]], [f(g) for g in res["new"]]) for f in cols[:4]]
    out += ["", "Mann-Whitney p, base against new: " + ", ".join(
        f"{name} {p:.2f}" for name, p in zip(("operations", "inside", "reversals", "median operation"), ps)), ""]
    return out


def main() -> None:
    lines = ["# Alternating A/B runs of testbed_targets (2.4 / 1.2 Gbit/s, 20 iterations, fixed 0.667 beside adaptive)", "",
             "adaptive / fixed: adaptive's median time over the fixed split's in the same run (above 1: adaptive "
             "slower); its mean over the runs, base / new. vs sum, vs up: the run's median ratios, their median over "
             "the runs. strict: runs in which the point met both checks by the strict rule (adaptive; the fixed split "
             "beside it). p: two-sided Mann-Whitney on adaptive / fixed.", ""]
    widths = [max(1, len(cells(folder, "base"))) for folder in COMPARISONS]
    fig, axes = plt.subplots(1, len(COMPARISONS), figsize=(1.1 * sum(widths) + 2, 5), sharey=True,
                             gridspec_kw={"width_ratios": widths})
    for ax, (folder, (base_name, new_name)) in zip(axes, COMPARISONS.items()):
        base, new = cells(folder, "base"), cells(folder, "new")
        if not base:
            continue
        lines += [f"## {folder}: {base_name} (base) against {new_name} (new)", "",
                  "| point | runs | adaptive / fixed | vs sum | vs up | strict | fixed strict | p |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        points = sorted(base)
        lines += [row(p, base[p], new.get(p, [])) for p in points]
        flat = lambda d: [x for p in points for x in d.get(p, [])]  # noqa: E731
        lines += [row("all points", flat(base), flat(new)), ""]
        data = []
        for p in points:
            data += [[x["ad_over_fixed"] for x in base[p]], [x["ad_over_fixed"] for x in new.get(p, [])]]
        boxes = ax.boxplot(data, patch_artist=True)
        for i, box in enumerate(boxes["boxes"]):
            box.set_facecolor("#bbbbbb" if i % 2 == 0 else "#6fa8dc")
        ax.set_xticks([2 * i + 1.5 for i in range(len(points))], [p.replace(" ", "\n", 1) for p in points], fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{folder}", fontsize=9)
    lines += latest_code_table()
    lines += series_table()
    axes[0].set_ylabel("adaptive time / fixed 0.667 time (grey: base, blue: new)")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "adaptive_vs_fixed.png"), dpi=110)
    with open(os.path.join(HERE, "pool.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
