"""Point-to-point ping-pong with small payloads inside the header against the rendezvous.

    mpccs-run -n 2 --no-prefix python bench/p2p_latency_ab.py --out bench/results/p2p_latency

2 ranks, default planes, policy 'adaptive' as shipped; per size, rounds of 200
round trips alternate between senders that put payloads of up to
P2P_INLINE_MAX_BYTES inside their header and senders that never do (the
header, the receiver's accept, then the data); receivers handle both alike.
Reports the median round trip over the rounds (rank 0) and its range.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import mpccs
from mpccs import p2p_ops

sys.path.insert(0, os.path.dirname(__file__))
from stats import host_text  # noqa: E402

SIZES = (8, 4096, 65536)
MODES = ("inline", "rendezvous")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--trips", type=int, default=200)
    args = ap.parse_args()
    inline_max = p2p_ops.P2P_INLINE_MAX_BYTES
    comm = mpccs.init()
    peer = 1 - comm.rank
    rtts = {}
    for n in SIZES:
        x, y = np.ones(n, np.uint8), np.empty(n, np.uint8)

        def trip():
            if comm.rank == 0:
                comm.send(x, peer)
                comm.recv(y, peer)
            else:
                comm.recv(y, peer)
                comm.send(x, peer)

        for mode in MODES * args.rounds:
            p2p_ops.P2P_INLINE_MAX_BYTES = inline_max if mode == "inline" else -1  # what senders check
            for _ in range(20):
                trip()
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(args.trips):
                trip()
            rtts.setdefault(f"{n}", {}).setdefault(mode, []).append((time.perf_counter() - t0) / args.trips * 1e6)
    p2p_ops.P2P_INLINE_MAX_BYTES = inline_max
    if comm.rank == 0:
        lines = ["# Point-to-point round trip, payload inside the header against the rendezvous", "",
                 f"2 ranks, default planes, 'adaptive'; {args.rounds} alternating rounds of {args.trips} round trips; "
                 f"{host_text()}", "",
                 "| size | inline RTT (us) | rendezvous RTT (us) | speedup |", "|---:|---:|---:|---:|"]
        for n, by_mode in rtts.items():
            a, b = (np.median(by_mode[m]) for m in MODES)
            lines.append(f"| {n} B | {a:.1f} ({min(by_mode['inline']):.1f}-{max(by_mode['inline']):.1f}) | "
                         f"{b:.1f} ({min(by_mode['rendezvous']):.1f}-{max(by_mode['rendezvous']):.1f}) | {b / a:.2f} |")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "rtt.json"), "w") as fh:
            json.dump({"host": host_text(), "rtt_us": rtts}, fh, indent=1)
        print("\n".join(lines), flush=True)
    comm.close()


if __name__ == "__main__":
    main()
