"""Where 'adaptive' loses time against 'up' on the default planes (where 'out',
tcp on the same 2 cores, never pays): all_reduce, 2 ranks, the two policies
interleaved operation by operation over a long run, each adaptive operation
filed by what the controller did in it: settled (run as 'up' without
planning), planned (the operations around a probe epoch: the controller
decides every stage, 'out' still carries nothing) or probe ('out' carried
bytes).

    python bench/adaptive_cost.py --out bench/results/adaptive_cost [--repeats 300]

Writes cost.json and report.md: per size and category, how many operations
and the median of adaptive / up per interleaved pair; overall the ratio of the
summed times (what a training loop pays) and the ratio of medians with its
paired bootstrap interval. Per-op time = max across ranks. The first WARMUP_ROUNDS
rounds are left out; the controller's start-up (its first probe at epoch 4)
is in the first size's series.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import abjob  # noqa: E402
from stats import ratio_ci  # noqa: E402

SIZES = (2 << 20, 8 << 20)


def category(stats: dict) -> str:
    if stats["bytes_per_plane"]["out"] > 0:
        return "probe"
    return "planned" if stats["stages"][0]["split"].get("policy") == "adaptive" else "settled"


def rank_main(repeats: int, out_path: str) -> None:
    import mpccs

    # The pair's cross-memory reads off: with them both policies take the direct path at
    # these sizes (comm._direct_by_cma) and the controller is in neither call.
    comm = mpccs.init(cma=False)
    rows = []
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        up, adaptive, cats = [], [], []
        for i in range(repeats + abjob.WARMUP_ROUNDS):
            comm.set_path_policy("up")
            t_up = abjob.timed(comm, lambda: comm.all_reduce(x, y))
            comm.set_path_policy("adaptive")
            seen = []
            t_ad = abjob.timed(comm, lambda: (comm.all_reduce(x, y), seen.append(category(comm.last_stats()))))
            # Both ranks' categories: an operation is a probe if either rank probed.
            mine = np.array([("settled", "planned", "probe").index(seen[0])], np.int64)
            comm.all_reduce(mine, op="max")
            if i >= abjob.WARMUP_ROUNDS:
                up.append(t_up)
                adaptive.append(t_ad)
                cats.append(("settled", "planned", "probe")[int(mine[0])])
        rows.append({"nbytes": nbytes, "up": up, "adaptive": adaptive, "category": cats})
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"repeats": repeats, "rows": rows, "mpccs": mpccs.__version__}, f)
    comm.close()


def report(data: dict) -> str:
    lines = ["# Where adaptive loses time on the default planes (2 ranks, all_reduce float32)", "",
             f"`up` and `adaptive` interleaved operation by operation, {data['repeats']} pairs per size after "
             f"{abjob.WARMUP_ROUNDS} warm-up pairs; per-op time = slowest rank. `out` never pays here, so every "
             "adaptive operation should cost what `up` costs; the categories say what the controller did.", "",
             "| size | category | operations | adaptive / up, median of pairs |",
             "|---|---|---:|---:|"]
    summary = []
    for row in data["rows"]:
        up, ad = np.array(row["up"]), np.array(row["adaptive"])
        cats = np.array(row["category"])
        n = row["nbytes"]
        size = f"{n >> 20} MiB"
        for c in ("settled", "planned", "probe"):
            sel = cats == c
            if sel.any():
                lines.append(f"| {size} | {c} | {int(sel.sum())} | {np.median(ad[sel] / up[sel]):.3f} |")
        ratio = ratio_ci(ad, up, paired=True)  # time(up) / time(adaptive): speed(adaptive) / speed(up)
        summary.append(f"- {size}: speed adaptive / up by summed time {up.sum() / ad.sum():.3f}; by medians "
                       f"{ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}]; `up` median {np.median(up) * 1e6:.0f} us")
    return "\n".join(lines + [""] + summary) + "\n"


def main() -> None:
    abjob.main(__file__, __doc__.split("\n\n")[0], "bench/results/adaptive_cost", 300, rank_main, report)


if __name__ == "__main__":
    main()
