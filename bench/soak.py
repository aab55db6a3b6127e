"""Soak: thousands of random collectives with scale-out failures injected.

    python bench/soak.py -n 2 --ops 2000 [--seed 1] [--fail-rate 0.03] [--json out.json]
    python bench/soak.py -n 3 --ops 1000 --focus resume --late-ms 5 --fail-rate 0.2

Every rank draws the same sequence from the seed: collective, size, dtype,
reduction op, path policy, in place or not. The first WARM_OPS operations
sweep every (dtype, op) kernel and every collective once, so nothing compiles
later, and then each rank arrives late to large transfers once, so UCX's
receive pools reach their bound (warm_receive_pools); from then on, with probability --fail-rate per operation, one rank
closes its scale-out endpoints in the middle of the operation (Plane.sever;
the plane then fails over and rejoins after MPCCS_REPROBE). Each result is
checked against a numpy reference (inputs are small integers, so sums, mins,
maxes and products are exact in every dtype; avg within the dtype's rounding).
Reports wrong results, hangs (no-progress timeouts), failovers, rejoins, and
resident memory from operation WARM_OPS to the end; exits 1 on any wrong
result or error, or (runs of 1000 operations or more) on memory growth over 10%.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

WARM_OPS = 100
WARM_FAILURES = {2: 0, 6: 1}  # sweep operation -> rank that fails: largest size, split policy
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")
POLICIES = ("up", "out", 0.5, "adaptive")
SIZES = (1, 3, 17, 1000, 4099, 65536, 300_000, 1 << 20)  # elements per rank block
RESUME_SPLITS = (0.3, 0.5, 0.8)  # --focus resume: 'out' always carries bytes


def dtypes():
    from mpccs.reduce import supported_dtypes

    return list(supported_dtypes())


def ops_for(dtype) -> list[str]:
    floating = dtype.kind == "f" or "bfloat16" in str(dtype)
    return ["sum", "prod", "min", "max"] + (["avg"] if floating else [])


def rss_bytes() -> int:
    """Resident memory once garbage is collected and freed heap is handed back,
    so what is measured is what the process holds, not where malloc's high-water
    mark happened to be after the last large array."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def draw(rng, i: int, kinds: list, focus: str = "all") -> dict:
    """Operation i: first every collective at the largest size and every
    (dtype, op) kernel through a reduction, so all compiling and pool growth
    happens before WARM_OPS; then random (focus 'resume': from WARM_OPS on,
    in-place all_reduce of at least 64K elements under a fixed split, the calls
    whose retries resume over the buffer as left)."""
    spec = {"collective": COLLECTIVES[int(rng.integers(len(COLLECTIVES)))],
            "count": int(rng.choice(SIZES)), "policy": POLICIES[int(rng.integers(len(POLICIES)))],
            "inplace": bool(rng.integers(2)), "root": int(rng.integers(1 << 16)), "seed": int(rng.integers(1 << 30))}
    dtype, op = kinds[int(rng.integers(len(kinds)))]
    sweep = 2 * len(COLLECTIVES)
    if i < sweep:
        spec.update(collective=COLLECTIVES[i % len(COLLECTIVES)], count=SIZES[-1], policy=POLICIES[i % len(POLICIES)])
    elif i < sweep + len(kinds):
        dtype, op = kinds[i - sweep]
        spec.update(collective=("all_reduce", "reduce_scatter", "reduce")[i % 3], inplace=bool(i % 2))
    elif focus == "resume" and i >= WARM_OPS:
        spec.update(collective="all_reduce", inplace=True, count=int(rng.choice([c for c in SIZES if c >= 65536])),
                    policy=float(rng.choice(RESUME_SPLITS)))
    if spec["collective"] not in ("all_reduce", "reduce_scatter", "reduce"):
        op = "sum"
    return {**spec, "dtype": dtype, "op": op}


def data(spec, rank: int, n: int) -> np.ndarray:
    """Small integers: every reduction of up to 4 ranks is exact in every dtype (prod uses 1 and 2)."""
    g = np.random.default_rng((spec["seed"], rank))
    hi = 3 if spec["op"] == "prod" else 8
    return g.integers(1, hi, n).astype(spec["dtype"])


def reduce_ref(arrays, op: str, dtype):
    wide = [a.astype(np.float64) for a in arrays]
    if op in ("sum", "avg"):
        out = np.sum(wide, axis=0)
        if op == "avg":
            out = out / len(arrays)
    elif op == "prod":
        out = np.prod(wide, axis=0)
    else:
        out = (np.min if op == "min" else np.max)(wide, axis=0)
    return out.astype(dtype)


def warm_receive_pools(comm) -> None:
    """Fill UCX's receive pools to their bound before memory is measured.

    The engine receives by probing, so every chunk first lands in UCX as an
    unexpected message; over tcp (eager for every size) UCX holds a whole
    window of a peer's chunks in its receive buffer pool while the receiver is
    busy elsewhere. That pool grows in steps and never shrinks: its high-water
    mark (about one window per peer) was reached at a random operation, and
    resident memory then stepped up 6-8 MB long after warm-up. Here each rank
    in turn arrives late to large transfers on each plane, so every other
    rank's window queues up unexpected at it: the worst case, reached now.
    """
    # The soak's own largest operations (8-byte dtype, SIZES[-1] elements per block), no larger.
    n = SIZES[-1]
    blocks = np.ones(n * comm.size, np.float64)
    one = np.ones(n, np.float64)
    out_blocks, out_one = np.empty_like(blocks), np.empty_like(one)
    for policy in ("out", "up", 0.5):
        comm.set_path_policy(policy)
        for late in range(comm.size):
            # (in place too: an in-place 2-rank all_reduce receives into the engine's kept
            # scratch, where out of place the peer's half lands in the output)
            for run in (lambda: comm.all_to_all(blocks, out_blocks), lambda: comm.all_reduce(one, out_one),
                        lambda: comm.all_reduce(out_one), lambda: comm.all_gather(one, out_blocks),
                        lambda: comm.reduce_scatter(blocks, out_one)):
                comm.barrier()
                if comm.rank == late:
                    time.sleep(0.1)  # the peers' windows (4 MiB each over loopback: ~5 ms) queue up meanwhile
                run()


def run_one(comm, spec, inject: bool, late_s: float = 0.0) -> tuple[bool, dict]:
    size, rank, n = comm.size, comm.rank, spec["count"]
    name, op, dtype = spec["collective"], spec["op"], spec["dtype"]
    root = spec["root"] % size
    comm.set_path_policy(spec["policy"])
    mine = [data(spec, r, n * size if name in ("reduce_scatter", "all_to_all") else n) for r in range(size)]
    send = mine[rank].copy()
    if name == "all_reduce":
        expected, recv = reduce_ref(mine, op, dtype), (None if spec["inplace"] else np.empty_like(send))
        work = comm.all_reduce(send, recv, op=op, async_op=True)
    elif name == "reduce_scatter":
        expected = reduce_ref(mine, op, dtype)[rank * n:(rank + 1) * n]
        recv = np.empty(n, dtype)
        work = comm.reduce_scatter(send, recv, op=op, async_op=True)
    elif name == "all_gather":
        expected, recv = np.concatenate(mine), np.empty(n * size, dtype)
        work = comm.all_gather(send, recv, async_op=True)
    elif name == "all_to_all":
        expected = np.concatenate([m[rank * n:(rank + 1) * n] for m in mine])
        recv = np.empty(n * size, dtype)
        work = comm.all_to_all(send, recv, async_op=True)
    elif name == "broadcast":
        expected, recv = mine[root], None
        work = comm.broadcast(send, root=root, async_op=True)
    else:  # reduce
        expected = reduce_ref(mine, op, dtype) if rank == root else None
        recv = None if (spec["inplace"] or rank != root) else np.empty_like(send)
        work = comm.reduce(send, recv, op=op, root=root, async_op=True)
    if inject:
        # Sever once this rank has bytes on 'out' (or after 0.2 s: a rank that
        # only receives, like a reduce root, may never send on it).
        deadline = time.monotonic() + 0.2
        while work._op.bytes_per_plane["out"] == 0 and not work.is_completed() and time.monotonic() < deadline:
            pass
        # then a little later, at a random point (each stage and reduction
        # state of the retry's starting point gets its turn)
        late = time.monotonic() + late_s
        while time.monotonic() < late and not work.is_completed():
            pass
        comm._planes["out"].sever()
    work.wait()
    stats = work.stats()
    if expected is None:
        return True, stats
    got = send if recv is None else recv
    if op == "avg":
        ok = np.allclose(got.astype(np.float64), expected.astype(np.float64), rtol=1e-2, atol=1e-2)
    else:
        ok = np.array_equal(got, expected)
    if not ok:
        stats = {**stats, "mismatch": mismatch(got, expected)}
    return bool(ok), stats


def mismatch(got: np.ndarray, expected: np.ndarray) -> dict:
    """Where a wrong result differs: enough to tell a lost chunk from a stale
    one or a wrong reduction without rerunning (a soak failure may not recur)."""
    bad = np.flatnonzero(got.astype(np.float64) != expected.astype(np.float64))
    runs = np.split(bad, np.flatnonzero(np.diff(bad) != 1) + 1) if bad.size else []
    return {"elements": int(bad.size), "of": int(got.size),
            "ranges": [[int(r[0]), int(r[-1]) + 1] for r in runs[:8]],
            "first": {"got": got[bad[0]].item(), "expected": expected[bad[0]].item()} if bad.size else None}


def rank_main(args) -> int:
    import mpccs

    comm = mpccs.init(reprobe_s=args.reprobe, timeout_s=args.timeout)
    rng = np.random.default_rng(args.seed)
    kinds = [(d, o) for d in dtypes() for o in ops_for(d)]
    summary = {"ops": args.ops, "ranks": comm.size, "seed": args.seed, "wrong": [], "errors": [],
               "focus": args.focus, "late_ms": args.late_ms,
               "failures_injected": 0, "failovers": 0, "rejoins": 0, "resumed_in_place": 0,
               "resumed_over_reduced": 0}
    rss_warm = None
    t0 = time.monotonic()
    for i in range(args.ops):
        spec = draw(rng, i, kinds, args.focus)
        victim = int(rng.integers(comm.size))
        late_s = float(rng.uniform(0, args.late_ms)) / 1e3 if args.late_ms else 0.0  # (the default draws stay as they were)
        inject = i >= WARM_OPS and rng.random() < args.fail_rate and comm.rank == victim
        # Two failures in the warm sweep (large operations on both planes, one
        # per rank of the first two), so
        # UCX's buffer pools reach their high-water mark of a failover (the
        # unexpected chunks drained) before memory is measured.
        warm_victim = WARM_FAILURES.get(i)
        inject |= warm_victim is not None and comm.rank == warm_victim % comm.size
        if i == WARM_OPS:
            warm_receive_pools(comm)
            rss_warm = rss_bytes()
            if os.environ.get("SOAK_TRACEMALLOC"):
                import tracemalloc
                tracemalloc.start(8)
                snap0 = tracemalloc.take_snapshot()
        try:
            ok, stats = run_one(comm, spec, inject, late_s)
        except Exception as exc:  # noqa: BLE001 - reported, the soak stops
            summary["errors"].append({"op": i, "spec": {**spec, "dtype": str(spec["dtype"])}, "error": repr(exc)})
            break
        summary["failures_injected"] += inject
        # retries of in-place reductions that resumed over the buffer as left (no input copy)
        if stats.get("attempts", 1) > 1 and stats.get("input_saved") == "resume":
            summary["resumed_in_place"] += 1
            # ... over ranges the failed attempt had already reduced in on this rank
            summary["resumed_over_reduced"] += (stats.get("failover") or {}).get("resumed_elements", 0) > 0
        if not ok:
            summary["wrong"].append({"op": i, "spec": {**spec, "dtype": str(spec["dtype"])},
                                     "mismatch": stats["mismatch"], "attempts": stats.get("attempts"),
                                     "failover": stats.get("failover"), "bytes_per_plane": stats.get("bytes_per_plane"),
                                     "injected": inject})
        if (i + 1) % 250 == 0:
            summary.setdefault("rss_mib", []).append(round(rss_bytes() / 2**20, 1))
            summary.setdefault("scratch_mib", []).append(
                round(sum(b.nbytes for pool in comm._engine._scratch.values() for b in pool) / 2**20, 1))
        if comm.rank == 0 and (i + 1) % 100 == 0:
            print(f"soak: {i + 1}/{args.ops} ops, {time.monotonic() - t0:.0f} s, wrong {len(summary['wrong'])}",
                  flush=True)
    comm.set_path_policy("up")
    if os.environ.get("SOAK_TRACEMALLOC") and comm.rank == 1:
        import gc
        import tracemalloc
        gc.collect()
        for stat in tracemalloc.take_snapshot().compare_to(snap0, "traceback")[:6]:
            print("TRACE", stat, "\n    " + "\n    ".join(stat.traceback.format()[-6:]), flush=True)
    parked = comm._engine._parked
    summary["parked_requests"] = [len(parked), sum(1 for r, _ in parked if not r.completed)]
    metrics = comm.metrics()
    summary["failovers"] = sum(v for k, v in metrics.items() if k.startswith("retries_total"))
    summary["rejoins"] = sum(v for k, v in metrics.items() if k.startswith("plane_rejoins_total"))
    summary["seconds"] = round(time.monotonic() - t0, 1)
    summary["rss_warm_mib"] = round((rss_warm or rss_bytes()) / 2**20, 1)
    summary["rss_end_mib"] = round(rss_bytes() / 2**20, 1)
    summary["rss_growth"] = round(summary["rss_end_mib"] / summary["rss_warm_mib"] - 1, 4)
    print("SOAK " + json.dumps({"rank": comm.rank, **summary}), flush=True)
    # Memory is judged on long runs only: over a few hundred operations the
    # last caches still fill and the figure says nothing about leaks.
    bad = summary["wrong"] or summary["errors"] or (args.ops >= 1000 and summary["rss_growth"] > 0.10)
    if not summary["errors"]:
        comm.close()
    return 1 if bad else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--np", type=int, default=2, help="ranks (2)")
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fail-rate", type=float, default=0.03, help="chance per operation of a scale-out failure (0.03)")
    p.add_argument("--reprobe", type=float, default=0.5, help="MPCCS_REPROBE for the run (0.5 s)")
    p.add_argument("--timeout", type=float, default=30.0, help="no-progress timeout per operation (30 s)")
    p.add_argument("--focus", choices=("all", "resume"), default="all",
                   help="'resume': in-place all_reduce under fixed splits only (after the warm-up)")
    p.add_argument("--late-ms", type=float, default=0.0,
                   help="fail up to this many ms after the first bytes on 'out' (uniform; 0)")
    p.add_argument("--json", help="write every rank's summary here")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        sys.exit(rank_main(args))
    cmd = [os.path.join(os.path.dirname(sys.executable), "mpccs-run"), "-n", str(args.np), sys.executable,
           __file__, "--rank", "--ops", str(args.ops), "--seed", str(args.seed), "--fail-rate", str(args.fail_rate),
           "--reprobe", str(args.reprobe), "--timeout", str(args.timeout), "--focus", args.focus,
           "--late-ms", str(args.late_ms)]
    # A fixed mmap threshold: glibc's dynamic one rises after large arrays are
    # freed, so later ones land in the heap and fragment it, and RSS then steps
    # up by an array's size without any leak. Fixed, RSS measures what is held.
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    summaries = [json.loads(line.split("SOAK ", 1)[1]) for line in proc.stdout.splitlines() if "SOAK " in line]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
