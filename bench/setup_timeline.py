"""Where a 2-rank two-step all_reduce spends its time before, during and after its data moves.

    mpccs-run -n 2 --no-prefix python bench/setup_timeline.py --out bench/results/setup_timeline

Float32 all_reduce in place on the default planes under 'up' and 'adaptive'
(settled: what runs between probes once 'out' is dropped), one operation after
a barrier, repeated; marks at the entry or exit of the methods named below, as
microseconds after the call, median over the operations (each rank's own clock:
the report gives both ranks). The same two exchanges written against the 'up'
plane by hand (bench/two_step_ab.py's ByHand) are timed the same way: the floor.
Each mark wraps a method in Python, ~0.5-1 us a mark: the timeline is a little
longer than an unmarked operation, whose time the report gives too.
Writes timeline.json and report.md under --out.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import numpy as np

import mpccs
from mpccs import collective_op, comm as comm_module, operation, two_step

sys.path.insert(0, os.path.dirname(__file__))
from stats import host_text  # noqa: E402
from two_step_ab import ByHand  # noqa: E402

# (class, method, mark at entry, mark at exit), in the order an operation meets them
MARKS = (
    (comm_module.Communicator, "_run", "plan found, operation set-up starts", None),
    (collective_op.CollectiveOp, "_exchange_fingerprints", "operation built", "fingerprint messages posted"),
    (collective_op.CollectiveOp, "_choose_executor", "peer's fingerprint read", None),
    (two_step.TwoStepExecutor, "__init__", None, "executor's receives and first send posted"),
    (two_step.TwoStepExecutor, "_reduce", "first message arrived, reduction starts", "reduction done"),
    (operation.Operation, "_finish", "last message arrived, operation finishes", None),
)

_marks: list[tuple[str, float]] = []


def _wrap(cls, name: str, at_entry, at_exit) -> None:
    method = getattr(cls, name)

    @functools.wraps(method)
    def marked(*args, **kwargs):
        if at_entry:
            _marks.append((at_entry, time.perf_counter()))
        result = method(*args, **kwargs)
        if at_exit:
            _marks.append((at_exit, time.perf_counter()))
        return result

    setattr(cls, name, marked)


def timeline(comm, call, reset, ops: int, warmup: int) -> dict:
    """Median microseconds after the call of each mark's first occurrence, and of the return."""
    seen: dict[str, list[float]] = {}
    totals = []
    for i in range(warmup + ops):
        reset()
        comm.barrier()
        _marks.clear()
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        if i < warmup:
            continue
        totals.append(t1 - t0)
        first: dict[str, float] = {}
        for label, t in _marks:
            first.setdefault(label, t)
        for label, t in first.items():
            seen.setdefault(label, []).append(1e6 * (t - t0))
    points = {label: statistics.median(v) for label, v in seen.items() if len(v) >= ops // 2}
    return {"marks_us": dict(sorted(points.items(), key=lambda kv: kv[1])),
            "total_us": 1e6 * statistics.median(totals)}


def unmarked_us(comm, call, reset, ops: int) -> float:
    times = []
    for _ in range(ops):
        reset()
        comm.barrier()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def measure(comm, nbytes: int, ops: int, warmup: int) -> dict:
    x = np.ones(nbytes // 4, np.float32)
    by_hand = ByHand(comm, "all_reduce", nbytes // 4)

    def reset():
        x[:] = 1  # bounded values (every call doubles them), outside the timed call

    def call():
        comm.all_reduce(x)

    rows = {}
    for policy in ("up", "adaptive"):
        comm.set_path_policy(policy)
        for _ in range(100):  # 'adaptive' drops 'out' and settles first
            reset()
            call()
        rows[policy] = timeline(comm, call, reset, ops, warmup)
        rows[policy]["unmarked_us"] = unmarked_us(comm, call, reset, ops)
        call()
        rows[policy]["algorithm"] = comm.last_stats()["algorithm"]
    rows["by_hand"] = {"unmarked_us": unmarked_us(comm, lambda: by_hand(x, None), reset, ops)}
    return rows


def report(per_rank: list[dict], meta: dict) -> list[str]:
    lines = [f"# Timeline of a 2-rank two-step all_reduce ({meta['size'] >> 20} MiB float32, in place)", "",
             f"mpccs {meta['mpccs']}, {meta['ops']} operations after a barrier per policy, {meta['host']}; "
             "microseconds after the call, median, each rank's clock. Marks cost ~0.5-1 us each.", ""]
    for policy in ("up", "adaptive"):
        lines += [f"## `{policy}` ({per_rank[0][policy]['algorithm']})", "",
                  "| point | rank 0 (us) | rank 1 (us) |", "|:--|---:|---:|"]
        for label in per_rank[0][policy]["marks_us"]:
            cells = " | ".join(f"{r[policy]['marks_us'].get(label, float('nan')):.1f}" for r in per_rank)
            lines.append(f"| {label} | {cells} |")
        lines.append("| call returns (marked) | " + " | ".join(f"{r[policy]['total_us']:.1f}" for r in per_rank)
                     + " |")
        lines.append("| unmarked operation | " + " | ".join(f"{r[policy]['unmarked_us']:.1f}" for r in per_rank)
                     + " |")
        lines.append("")
    lines += ["The same exchanges by hand (pre-posted receives, no fingerprints): "
              + " / ".join(f"{r['by_hand']['unmarked_us']:.1f}" for r in per_rank) + " us (rank 0 / rank 1).", ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", type=int, default=2 << 20, help="bytes per call (two-step: 2-16 MiB)")
    ap.add_argument("--ops", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args()
    for cls, name, at_entry, at_exit in MARKS:
        _wrap(cls, name, at_entry, at_exit)
    comm = mpccs.init()
    if comm.size != 2:
        raise SystemExit("setup_timeline.py: run it on 2 ranks (the two-step executor is for 2)")
    rows = measure(comm, args.size, args.ops, args.warmup)
    per_rank = _gather_rows(comm, rows)
    if comm.rank == 0:
        meta = {"mpccs": mpccs.__version__, "size": args.size, "ops": args.ops,
                "host": host_text()}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "timeline.json"), "w") as fh:
            json.dump({"meta": meta, "ranks": per_rank}, fh, indent=1)
        text = "\n".join(report(per_rank, meta))
        with open(os.path.join(args.out, "report.md"), "w") as fh:
            fh.write(text)
        print(text)
    comm.close()


def _gather_rows(comm, rows: dict) -> list[dict]:
    """Both ranks' rows at every rank, through the communicator (a JSON string in a byte buffer)."""
    mine = json.dumps(rows).encode()
    sizes = comm.all_reduce(np.array([len(mine) if r == comm.rank else 0 for r in range(comm.size)], np.int64),
                            np.empty(comm.size, np.int64))
    width = int(sizes.max())
    buf = np.zeros(width, np.uint8)
    buf[:len(mine)] = np.frombuffer(mine, np.uint8)
    out = np.empty(width * comm.size, np.uint8)
    comm.all_gather(buf, out)
    return [json.loads(out[r * width:r * width + int(sizes[r])].tobytes()) for r in range(comm.size)]


if __name__ == "__main__":
    main()
