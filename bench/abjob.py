"""A/B costs measured inside one 2-rank job on the default planes.

A cost script (bench/failover_cost.py, bench/telemetry_cost.py) runs itself as
every rank under mpccs-run; each rank times the variants interleaved and rank
0 writes cost.json; the launching process then renders report.md from it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Callable

import numpy as np


def timed(comm, call: Callable[[], object]) -> float:
    """One operation's time, the slowest rank's (every rank calls this together)."""
    comm.barrier()
    t0 = time.perf_counter()
    call()
    dt = np.array([time.perf_counter() - t0])
    comm.all_reduce(dt, op="max")
    return float(dt[0])


WARMUP_ROUNDS = 3  # interleaved rounds timed but not kept


def interleaved(comm, variants, repeats: int, prepare: Callable[[str], None],
                call: Callable[[], object]) -> dict[str, list[float]]:
    """Each variant's times over ``repeats`` rounds (after WARMUP_ROUNDS), the
    variants interleaved within every round so drift hits them alike;
    ``prepare(variant)`` sets the variant up before its timed ``call``."""
    times: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(repeats + WARMUP_ROUNDS):
        for v in variants:
            prepare(v)
            dt = timed(comm, call)
            if i >= WARMUP_ROUNDS:
                times[v].append(dt)
    return times


def main(script: str, description: str, default_out: str, default_repeats: int,
         rank_main: Callable[[int, str], None], report: Callable[[dict], str]) -> None:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=default_out)
    p.add_argument("--repeats", type=int, default=default_repeats)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    path = os.path.join(args.out, "cost.json")
    if args.rank:
        rank_main(args.repeats, path)
        return
    os.makedirs(args.out, exist_ok=True)
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "mpccs-run"), "-n", "2", "--no-prefix",
                    sys.executable, script, "--rank", "--out", args.out, "--repeats", str(args.repeats)],
                   check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=1800)
    with open(path) as f:
        text = report(json.load(f))
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
