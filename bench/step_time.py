"""End-to-end step time on the testbed: does a faster collective shorten training steps?

    python bench/step_time.py --out bench/results/step_time        (root; ~3 min)

Fixed configuration (examples/train_numpy.py): 2 ranks, MLP 64-1024-1024-1024-10
(2.2 M parameters, 8.3 MiB of gradients per step), batch 64 per rank, 4 MiB
gradient buckets, numpy on one thread per rank. Testbed: both planes shaped tcp
at 1 and 0.5 Gbit/s. For each policy (up, out, 0.667, adaptive) and a
compute-only run (--no-comm), and torch gloo all-reducing the same buckets on the
scale-out interface (--gloo), the median step time is measured; rounds are
repeated and interleaved. Then:

    f   = exposed communication share of the best single-plane step = 1 - t_compute / t_step(best single)
    S_c = collective speedup of a policy = (t_step(best single) - t_compute) / (t_step(policy) - t_compute)
    predicted step speedup = 1 / ((1 - f) + f / S_c), against the measured t_step(best single) / t_step(policy).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from mpccs.testbed import Cluster

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_numpy.py")
CONFIG = ["--steps", "40", "--warmup", "8", "--hidden", "1024", "--layers", "3", "--batch", "64",
          "--bucket-kb", "4096", "--threads", "1"]
POLICIES = ("up", "out", "0.667", "adaptive")
PEERS = ("gloo",)  # torch.distributed gloo on the scale-out interface, same buckets


def one_run(cluster, extra: list[str]) -> dict:
    run = cluster.run([sys.executable, EXAMPLE, *CONFIG, *extra], timeout=600, stream=open(os.devnull, "w"))
    if run.exit_code != 0:
        raise SystemExit("\n".join(run.output[0][-20:]))
    for line in reversed(run.output[0]):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit("no result line")


def plot(result: dict, path: str) -> None:
    """Step time per policy and peer, split into compute and exposed communication."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["policy"] for r in rows]
    steps = [r["step_ms"] for r in rows]
    compute = result["compute_ms"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(names, [compute] * len(rows), color="#bbbbbb", label="compute only")
    ax.bar(names, [s - compute for s in steps], bottom=[compute] * len(rows), color="#4477aa",
           label="exposed communication")
    for i, r in enumerate(rows):
        ax.text(i, r["step_ms"] * 1.01, f"{r['step_speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"train_numpy step time, 2 ranks, testbed 1/0.5 Gbit/s (f = {result['f']:.2f}; "
                 f"labels: speedup over {result['best_single']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plot-only", action="store_true", help="redraw step_time.png from step_time.json")
    ns = ap.parse_args()
    if ns.plot_only:
        with open(os.path.join(ns.out, "step_time.json")) as fh:
            plot(json.load(fh), os.path.join(ns.out, "step_time.png"))
        return 0
    os.makedirs(ns.out, exist_ok=True)
    samples = {p: [] for p in (*POLICIES, *PEERS, "compute")}
    shares = {}
    with Cluster(n=2, up="tcp", up_rate="1gbit", out_rate="500mbit", log=lambda m: None) as cluster:
        for _ in range(ns.rounds):
            samples["compute"].append(one_run(cluster, ["--no-comm"])["median_step_ms"])
            for policy in POLICIES:
                res = one_run(cluster, ["--policy", policy])
                samples[policy].append(res["median_step_ms"])
                bpp = res.get("bytes_per_plane") or {}
                shares[policy] = bpp.get("up", 0) / max(1, sum(bpp.values()))
            for peer in PEERS:
                samples[peer].append(one_run(cluster, ["--gloo"])["median_step_ms"])
    med = {k: statistics.median(v) for k, v in samples.items()}
    best_single = min(("up", "out"), key=lambda p: med[p])
    t_c, t_b = med["compute"], med[best_single]
    f = 1 - t_c / t_b
    rows = []
    for p in (*POLICIES, *PEERS):
        s_c = (t_b - t_c) / (med[p] - t_c) if med[p] > t_c else float("inf")
        predicted = 1 / ((1 - f) + f / s_c)
        rows.append({"policy": p, "step_ms": med[p], "steps_ms": samples[p], "up_share": shares.get(p),
                     "collective_speedup": s_c, "step_speedup": t_b / med[p], "predicted_step_speedup": predicted})
    result = {"config": CONFIG, "testbed": "2 ranks, up tcp 1gbit, out tcp 500mbit", "compute_ms": t_c,
              "compute_samples_ms": samples["compute"], "best_single": best_single, "f": f, "rows": rows,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(os.path.join(ns.out, "step_time.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    lines = [
        "# Step time on the testbed (2 ranks, up tcp 1 Gbit/s, out tcp 0.5 Gbit/s)",
        "",
        f"examples/train_numpy.py {' '.join(CONFIG)}; {ns.rounds} interleaved rounds, medians.",
        f"Compute-only step: {t_c:.1f} ms; best single plane: {best_single} ({t_b:.1f} ms); "
        f"exposed communication share f = {f:.2f}.",
        "",
        "| policy | step (ms) | up share | collective speedup S_c | step speedup (measured) | predicted 1/((1-f)+f/S_c) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        share = "-" if r["up_share"] is None else f"{100 * r['up_share']:.0f}%"
        lines.append(f"| {r['policy']} | {r['step_ms']:.1f} | {share} | {r['collective_speedup']:.2f} | "
                     f"{r['step_speedup']:.2f} | {r['predicted_step_speedup']:.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(ns.out, "report.md"), "w") as fh:
        fh.write(text + "\n![step time](step_time.png)\n")
    plot(result, os.path.join(ns.out, "step_time.png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
