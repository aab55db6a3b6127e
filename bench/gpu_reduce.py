#!/usr/bin/env python
"""Reductions of cupy arrays on one GPU shared by the ranks: reduced on the device
(mpccs.staging.DeviceReduction), reduced on the pinned host mirrors (the host
algorithms), and the same call on numpy arrays, interleaved call by call so the
three see the same machine. Needs a GPU and cupy.

    python -m mpccs -n 2 python bench/gpu_reduce.py --out bench/results/gpu_reduce_h200

Sizes are the bytes of ``send`` (reduce_scatter: the whole input). Each cell:
--reps timed calls per mode after --warmup, the max over ranks of each call,
median and quartiles; rank 0 writes results.json and results.md to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import numpy as np

import mpccs

KINDS = ("all_reduce", "reduce_scatter", "reduce")
MODES = ("device", "mirrors", "numpy")


def call(comm, kind: str, send, out):
    if kind == "all_reduce":
        comm.all_reduce(send, out)
    elif kind == "reduce_scatter":
        comm.reduce_scatter(send, out)
    else:
        comm.reduce(send, out if comm.rank == 0 else None, root=0)


def timed(comm, cp, kind: str, mode: str, host_x, dev_x):
    if mode == "numpy":
        send = host_x
        out = np.empty(host_x.size // comm.size if kind == "reduce_scatter" else host_x.size, host_x.dtype)
    else:
        comm.options = dataclasses.replace(comm.options, device_reduce="always" if mode == "device" else "never")
        send = dev_x
        out = cp.empty(dev_x.size // comm.size if kind == "reduce_scatter" else dev_x.size, dev_x.dtype)
    comm.barrier()
    cp.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    call(comm, kind, send, out)
    cp.cuda.get_current_stream().synchronize()
    dt = np.array([time.perf_counter() - t0])
    staging = (comm.last_stats() or {}).get("staging") if mode != "numpy" else None
    comm.all_reduce(dt, op="max")
    return float(dt[0]), staging


def quartiles(xs: list) -> tuple:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="65536,1048576,16777216,67108864")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy as cp

    comm = mpccs.init()
    cp.cuda.Device(0).use()
    rows, runs = [], {}
    for nbytes in [int(s) for s in args.sizes.split(",")]:
        host_x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        host_x = host_x[: host_x.size // comm.size * comm.size]
        dev_x = cp.asarray(host_x)
        for kind in KINDS:
            times = {m: [] for m in MODES}
            staged = None
            for rep in range(args.warmup + args.reps):
                order = MODES[rep % 3:] + MODES[:rep % 3]  # rotate: no mode always goes first
                for mode in order:
                    dt, staging = timed(comm, cp, kind, mode, host_x, dev_x)
                    if rep >= args.warmup:
                        times[mode].append(dt)
                        if mode == "device":
                            staged = staging
            runs[f"{kind}/{nbytes}"] = times
            q = {m: quartiles(times[m]) for m in MODES}
            rows.append({"kind": kind, "bytes": nbytes, **{f"{m}_ms": [round(v * 1e3, 3) for v in q[m]] for m in MODES},
                         "device_vs_mirrors": round(q["mirrors"][1] / q["device"][1], 3),
                         "device_vs_numpy": round(q["numpy"][1] / q["device"][1], 3),
                         "device_staging": staged})
            if comm.rank == 0:
                print(f"{kind:15s} {nbytes >> 10:8d} KiB  device {q['device'][1] * 1e3:8.3f} ms  mirrors "
                      f"{q['mirrors'][1] * 1e3:8.3f} ms  numpy {q['numpy'][1] * 1e3:8.3f} ms", flush=True)
    if comm.rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"ranks": comm.size, "reps": args.reps, "rows": rows, "times_s": runs}, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(f"# Reductions of cupy arrays, {comm.size} ranks on one GPU ({args.reps} calls per mode, "
                    "interleaved; median [q1, q3] of the max over ranks)\n\n")
            f.write("| collective | send | on the device ms | on the mirrors ms | numpy arrays ms | "
                    "mirrors / device | numpy / device |\n|---|---|---|---|---|---|---|\n")
            for r in rows:
                cell = lambda m: "{1:.3f} [{0:.3f}, {2:.3f}]".format(*r[f"{m}_ms"])  # noqa: E731
                f.write(f"| {r['kind']} | {r['bytes'] >> 10} KiB | {cell('device')} | {cell('mirrors')} | "
                        f"{cell('numpy')} | {r['device_vs_mirrors']:.2f} | {r['device_vs_numpy']:.2f} |\n")
    comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
