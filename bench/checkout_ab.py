"""Direct-path collectives of this checkout against another, in alternating processes.

    git worktree add /tmp/old <rev>
    python bench/checkout_ab.py --old /tmp/old --rounds 3 --out bench/results/landing

Changes that touch every call (a kernel, where data lands) cannot be switched
inside one process, so each round runs the same timing under the other
checkout (PYTHONPATH) and under this one, back to back: 2 ranks, float32,
out of place, policy 'adaptive' as shipped, blocks of 128 KiB and 512 KiB
(what each rank sends each peer; from 8 bytes, --blocks 8,4K), per-op time = median over 40 blocks of 5
operations after a barrier, slowest rank. --blocks and --collectives pick
other blocks and calls (an all_reduce's block is its whole input). Writes
report.md (per round and the median of rounds) under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

BIN = os.path.dirname(sys.executable)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from stats import size_text, write_rounds  # noqa: E402


def rank_main() -> None:
    import mpccs

    comm = mpccs.init()
    p = comm.size
    res = {}
    blocks = [int(b) for b in os.environ["CHECKOUT_AB_BLOCKS"].split(",")]
    wanted = os.environ["CHECKOUT_AB_COLLECTIVES"].split(",")
    for blk in blocks:
        n = blk // 4
        cases = {
            "all_gather": (np.ones(n, np.float32), np.empty(n * p, np.float32), comm.all_gather),
            "all_to_all": (np.ones(n * p, np.float32), np.empty(n * p, np.float32), comm.all_to_all),
            "reduce_scatter": (np.ones(n * p, np.float32), np.empty(n, np.float32), comm.reduce_scatter),
            "broadcast": (np.ones(n, np.float32), None, lambda s, o: comm.broadcast(s, root=0)),
            "reduce": (np.ones(n, np.float32), np.empty(n, np.float32), lambda s, o: comm.reduce(s, o, root=0)),
            "all_reduce": (np.ones(n, np.float32), np.empty(n, np.float32), comm.all_reduce),
        }
        for name in wanted:
            send, out, call = cases[name]
            for _ in range(30):
                call(send, out)
            times = []
            for _ in range(40):
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(5):
                    call(send, out)
                times.append((time.perf_counter() - t0) / 5)
            t = np.array(times)
            worst = comm.all_reduce(t, np.empty_like(t), op="max")
            res[f"{name} {size_text(blk)}"] = float(np.median(worst)) * 1e6
    if comm.rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    comm.close()


COLLECTIVES = ("all_gather", "all_to_all", "reduce_scatter", "broadcast", "reduce", "all_reduce")


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def run(path: str, blocks: str, collectives: str) -> dict:
    env = dict(os.environ, PYTHONPATH=path, CHECKOUT_AB_BLOCKS=blocks, CHECKOUT_AB_COLLECTIVES=collectives)
    p = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "2", "--no-prefix", sys.executable, __file__, "--rank"],
                       env=env, cwd=path, capture_output=True, text=True, timeout=600, check=True)
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the other checkout (a git worktree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--blocks", default="128K,512K", help="block sizes, comma-separated (K and M suffixes)")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    args = ap.parse_args()
    blocks = ",".join(str(_bytes(b)) for b in args.blocks.split(","))
    unknown = set(args.collectives.split(",")) - set(COLLECTIVES)
    if unknown:
        ap.error(f"unknown collectives {sorted(unknown)}; choose from {COLLECTIVES}")
    new_path = os.path.dirname(HERE)
    rounds = []
    for k in range(args.rounds):
        rounds.append({"old": run(args.old, blocks, args.collectives),
                       "new": run(new_path, blocks, args.collectives)})
        print(f"# progress: {k + 1}/{args.rounds} rounds", flush=True)
    keys = list(rounds[0]["new"])
    lines = [f"# This checkout against {args.old}, alternating processes, {args.rounds} rounds", "",
             "Per-op time in us (old / new per round) and the median of the rounds' old/new ratios.", "",
             "| call | " + " | ".join(f"round {k + 1}" for k in range(args.rounds)) + " | old / new |",
             "|---|" + "---|" * args.rounds + "---:|"]
    for key in keys:
        cells = [f"{r['old'][key]:.0f} / {r['new'][key]:.0f}" for r in rounds]
        ratio = np.median([r["old"][key] / r["new"][key] for r in rounds])
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    write_rounds(args.out, args.old, rounds, lines)


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_main()
    else:
        main()
