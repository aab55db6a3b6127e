"""Target 2 of the benchmarks issue by its strict rule: `adaptive` against `up`, with enough iterations.

    python bench/adaptive_vs_up.py --out bench/results/adaptive_vs_up        # 64 KiB-256 MiB (~5 min)
    python bench/adaptive_vs_up.py --out DIR --min 8 --max 32K --iters-small 6000  # below 64 KiB (~1 min)
    python bench/adaptive_vs_up.py --out /tmp/avu --max 1M --iters 20 --iters-small 20  # smoke

The rule: a target holds when the lower bound of the 95% interval of `adaptive`
over the best single plane, minus the A/A noise floor (the half-width of `up`
over `up#2`), clears 0.97; below 64 KiB the target asks only that adaptive
not fall below `up` beyond the noise floor (the upper bound plus the floor
reaches 1.0). The default-planes sweep (bench/default_planes.py)
interleaves five policies at 15 iterations per point, where both the interval
and the floor come out 0.1-0.4 wide on this VM, so the rule cannot hold there
whatever the library does. Here only `up`, `up#2` and `adaptive` are
interleaved (the sweep found `up` the best single plane by 2.8-7x at every size
from 8 KiB, its intervals far apart from `out`'s), --iters-small iterations per
point up to --small-max and --iters above (two mpccs-perf runs: a 256 MiB
operation takes ~0.1 s here), and the report gives the same three numbers per
size. With 200 iterations everywhere (twenty-sixth session) the intervals were
+-2-5% below 1 MiB, too wide for the rule even where the true difference was
under 1% (64 KiB, 2900 alternating pairs: 0.992 by the medians). 2 ranks, default planes,
float32 all_reduce, the controller's start-up before the sweep (--settle).
Writes perf.json and report.md under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from stats import code_text, holds, noise_floor, ratio_ci, size_text  # noqa: E402

from mpccs.config import parse_size  # noqa: E402

BIN = os.path.dirname(sys.executable)
TARGET = 0.97
# Target 2 asks >= 0.97x from 64 KiB, and below it only that adaptive is "not below the better single plane
# beyond the noise floor": the interval's upper bound plus the A/A floor reaches 1.0.
TARGET_FROM = 64 << 10


def measure(out: str, lo: str, hi: str, iters: int, name: str) -> None:
    cmd = [f"{BIN}/mpccs-run", "-n", "2", "--no-prefix", f"{BIN}/mpccs-perf", "all_reduce", "-b", lo, "-e", hi,
           "-f", "2", "-n", str(iters), "-w", "5", "--policies", "up,up,adaptive", "--settle", "40",
           "-J", f"{out}/{name}"]
    print("+", " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    subprocess.run(cmd, check=True, timeout=3600, env=env)


def sweeps(args) -> list[tuple[str, str, int, str]]:
    """(from, to, iterations, file) of each mpccs-perf run: the small sizes apart, with more iterations."""
    lo, hi, cut = parse_size(args.min), parse_size(args.max), parse_size(args.small_max)
    if hi <= cut:
        return [(args.min, args.max, args.iters_small, "perf.json")]
    if lo > cut:
        return [(args.min, args.max, args.iters, "perf.json")]
    return [(args.min, args.small_max, args.iters_small, "perf_small.json"),
            (str(2 * cut), args.max, args.iters, "perf.json")]


def report(out: str) -> str:
    runs = {}  # file -> its JSON: the small sizes' run apart where there was one (sweeps)
    for name in ("perf_small.json", "perf.json"):
        if os.path.exists(f"{out}/{name}"):
            with open(f"{out}/{name}") as fh:
                runs[name] = json.load(fh)
    rows = {(r["policy"], r["size"]): r for run in runs.values() for r in run["rows"]}
    sizes = sorted({size for _, size in rows})
    meta = runs["perf.json"]["meta"]
    iters = sorted({len(rows[("up", s)]["times_us"]) for s in sizes})
    lines = ["# `adaptive` against `up`, many iterations (target 2's strict rule)", "",
             f"2 ranks, default planes, float32 all_reduce, `up`, `up#2`, `adaptive` interleaved, "
             f"{' or '.join(map(str, iters))} iterations per point; mpccs {meta['mpccs']}, UCX {meta['ucx']}, "
             f"kernel {meta['kernel']}; measured {meta['time']}.",
             "", code_text({name: run["meta"].get("code") for name, run in runs.items()}), "",
             f"Rule from {size_text(TARGET_FROM)}: lower bound of adaptive / up minus the A/A floor >= {TARGET}. "
             "Below it, not below `up` beyond the noise floor: upper bound plus the A/A floor >= 1.", "",
             "| size | up (us) | adaptive (us) | adaptive / up | A/A floor | rule | reading | holds | algorithm "
             "| CPU stolen |",
             "|---:|---:|---:|---|---:|---|---:|---|---|---:|"]
    met = 0
    for s in sizes:
        up, up2, ad = rows[("up", s)], rows[("up#2", s)], rows[("adaptive", s)]
        ratio = ratio_ci(ad["times_us"], up["times_us"], paired=True)
        floor = noise_floor(up["times_us"], up2["times_us"])
        rule, reading, ok = judge(s, ratio, floor)
        met += ok
        steal = "-" if ad.get("steal") is None else f"{100 * ad['steal']:.0f}%"
        lines.append(f"| {size_text(s)} | {up['time_us']:.0f} | {ad['time_us']:.0f} | {ratio[0]:.3f} [{ratio[1]:.3f}, "
                     f"{ratio[2]:.3f}] | {floor:.3f} | {rule} | {reading:.3f} | {'yes' if ok else 'no'} | "
                     f"{ad.get('algorithm', '-')} | {steal} |")
    lines += ["", f"{met} of {len(sizes)} sizes hold by the strict rule."]
    return "\n".join(lines) + "\n"


def judge(size: int, ratio: tuple[float, float, float], floor: float) -> tuple[str, float, bool]:
    """(rule, its reading, holds) of target 2 at one size: >= 0.97x from TARGET_FROM (the interval's lower
    bound minus the floor), below it not below `up` beyond the noise (the upper bound plus the floor)."""
    if size >= TARGET_FROM:
        return f">= {TARGET}", ratio[1] - floor, holds(ratio, TARGET, floor)
    return "not below", ratio[2] + floor, ratio[2] + floor >= 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--min", default="64K")
    ap.add_argument("--max", default="256M")
    ap.add_argument("--iters", type=int, default=300, help="iterations per point above --small-max")
    ap.add_argument("--iters-small", type=int, default=1500, help="iterations per point up to --small-max")
    ap.add_argument("--small-max", default="4M")
    ap.add_argument("--report-only", action="store_true", help="rebuild report.md from perf.json")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    if not args.report_only:
        for lo, hi, iters, name in sweeps(args):
            measure(args.out, lo, hi, iters, name)
    text = report(args.out)
    with open(os.path.join(args.out, "report.md"), "w") as fh:
        fh.write(text)
    print(text + f"\n# done in {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
