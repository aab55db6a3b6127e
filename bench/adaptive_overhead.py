"""What an 'adaptive' operation spends in Python that a fixed split does not, on
the testbed's 2:1 tcp planes (target 1), where a rank's two cores are busy with
the planes' sockets and every millisecond of Python is a millisecond of the
operation.

    mpccs-testbed -n 2 --up tcp --up-rate 2.4gbit --out-rate 1.2gbit --no-calibrate -- \\
        python bench/adaptive_overhead.py [--nbytes 16M] [--ops 60] [--rounds 2] [--json PREFIX]

Each rank times its operations (after a barrier) under a fixed split at the
rate ratio and under 'adaptive', alternating in rounds, and sums the wall time
spent in the functions below (wrapped with perf_counter, no profiler: cProfile
doubled their cost): the controller's decision, the stage planning around it,
teaching it a stage's deliveries, and the estimates the fingerprint messages
carry. Prints one line per rank and round: the median operation and each
function's microseconds and calls per operation.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import mpccs
from mpccs import collective_op, flows
from mpccs.config import parse_size
from mpccs.control import controller, estimator

# (owner, method): what only adaptive operations run, and the pieces inside it
TIMED = (
    (collective_op.CollectiveOp, "_plan_stage"),
    (controller.PathController, "decide"),
    (collective_op.CollectiveOp, "_teach_controller"),
    (controller.PathController, "on_delivery"),
    (controller.PathController, "on_stage"),
    (estimator.PathEstimator, "add"),
    (collective_op.CollectiveOp, "_exchange_fingerprints"),
    (controller.PathController, "export_estimates"),
    (flows.StageRun, "delivery_samples"),
)


class Clock:
    """Wall time and calls per wrapped function, since the last reset."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def per_op(self, ops: int) -> dict:
        return {name: {"us": self.seconds[name] / ops * 1e6, "calls": self.calls[name] / ops}
                for name in sorted(self.seconds)}


def run(comm, send, recv, policy, ops: int) -> list[float]:
    comm.set_path_policy(policy)
    times = []
    for _ in range(ops):
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(send, recv)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nbytes", type=parse_size, default=16 << 20)
    ap.add_argument("--ops", type=int, default=60, help="operations per policy and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fixed", type=float, default=2 / 3, help="the fixed split's share on 'up' (2:1 planes)")
    ap.add_argument("--json", help="each rank writes its rounds to JSON.rank<k>.json")
    ns = ap.parse_args()
    clock = Clock()
    for owner, name in TIMED:
        clock.wrap(owner, name)
    comm = mpccs.init()
    send = np.ones(ns.nbytes // 4, np.float32)
    recv = np.empty_like(send)
    run(comm, send, recv, "adaptive", 40)  # the controller's start-up (probes at its 4th, 16th, 32nd operation)
    run(comm, send, recv, ns.fixed, 10)
    rounds = []
    for k in range(ns.rounds):
        for policy in (ns.fixed, "adaptive"):
            clock.reset()
            times = run(comm, send, recv, policy, ns.ops)
            label = policy if isinstance(policy, str) else f"{policy:.3f}"
            row = {"round": k, "policy": label, "median_ms": float(np.median(times) * 1e3),
                   "per_op": clock.per_op(ns.ops)}
            rounds.append(row)
            parts = ", ".join(f"{n} {v['us']:.0f} us / {v['calls']:.1f}" for n, v in row["per_op"].items())
            print(f"rank {comm.rank} round {k} {label}: median {row['median_ms']:.1f} ms; per op: {parts}",
                  flush=True)
    if ns.json:
        with open(f"{ns.json}.rank{comm.rank}.json", "w") as fh:
            json.dump({"rank": comm.rank, "nbytes": ns.nbytes, "ops": ns.ops, "rounds": rounds}, fh, indent=1)
    comm.close()


if __name__ == "__main__":
    main()
