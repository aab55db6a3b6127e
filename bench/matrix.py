"""Procurement matrix on the emulated two-fabric testbed (issue #6, item 4).

    python bench/matrix.py                                   (root; ~13 min here) -> bench/results/matrix/
    python bench/matrix.py --quick --out /tmp/matrix         (root; ~3 min smoke run)
    python bench/matrix.py --report-only                     rebuild report.md and the plots from raw/

2 ranks, both planes shaped tcp at 2:1 (up 1 Gbit/s, out 500 Mbit/s: at higher
rates the 2 cores, not the links, are the limit). Four parts:

1. The matrix: sizes x collectives (all_reduce, reduce_scatter, all_gather,
   all_to_all) x policies (up, up#2 = A/A control, out, fixed 0.8, adaptive,
   interleaved iteration by iteration by mpccs-perf) x conditions:
   - idle;
   - background: a paced TCP flow at half the scale-out rate from the testbed's
     extra host into rank 0's scale-out link, on for every timed cell;
   - failure: rank 1's scale-out link down for a few seconds in the middle of
     the 64 MiB cell (16 MiB with --quick), then back (failover + rejoin);
   - shared: Cluster(shared_bottleneck=True), both planes over one 1 Gbit/s trunk.
   Each cell: busbw (median; per-iteration time = slowest rank), the ratio of
   adaptive to the best single plane with its paired bootstrap interval, the A/A
   noise floor (bench/stats.py), and each rank's CPU time per operation
   (time.process_time() around the operation inside the rank: user + system of
   the whole process, UCX threads included).
2. Time series: a long run of adaptive 16 MiB all_reduces with MPCCS_TRACE on,
   background switched on and off mid-run (with and without MPCCS_OUT_CAP, and
   with a fixed 2:1 split for reference), and the scale-out link taken down and
   back mid-run; share of bytes on 'up' per operation with the change points,
   and the controller's convergence after each change (operations and seconds
   until the share stays within 5 points of the segment's final value).
3. The background flow's own delivered throughput (its sink's byte count from
   first to last byte, mpccs/testbed/traffic.py): alone, next to adaptive,
   next to adaptive with MPCCS_OUT_CAP, next to a fixed 2:1 split.
4. report.md, PNG plots and the raw JSON under --out.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from stats import holds, noise_floor, ratio_ci  # noqa: E402

UP_RATE, OUT_RATE, BG_RATE, SHARED_RATE = "1gbit", "500mbit", "250mbit", "1gbit"
UP_BPS, OUT_BPS, BG_BPS = 1e9, 500e6, 250e6
CAP = 0.3
RATE_CAP = "250mbit"  # MPCCS_OUT_CAP_RATE of the rate-capped run: the background's fair share
SERIES = ("background", "background_cap", "background_rate_cap", "background_fixed", "background_sweep", "failure")
# fixed fractions on 'up' the sweep series cycles through, one per operation: the best of them under
# the background load is the reference of the convergence target (the benchmarks issue, target 5)
SWEEP_FRACTIONS = (0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)
SETTLE_S = 1.0  # sweep operations this soon after a change are not used (the load ramps up)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
POLICIES = "up,up,out,0.8,adaptive"
LABELS = ("up", "up#2", "out", "0.8", "adaptive")
CONDITIONS = ("idle", "background", "failure", "shared")
KiB, MiB = 1 << 10, 1 << 20
SERIES_BYTES = 16 * MiB
TOLERANCE = 0.05  # convergence band: 5 points of share

# name -> (sizes, iterations, warm-up, failure delay after the trigger row, link down seconds)
PLANS = {
    "default": {"sizes": [8, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB], "iters": 10, "warmup": 2,
                "fail_delay": 8.0, "fail_down": 4.0,
                # time series, seconds after the ranks start
                "bg_series": {"on": 12.0, "off": 32.0, "end": 46.0},
                "fail_series": {"down": 12.0, "up": 16.0, "end": 34.0},
                "bg_alone_s": 8.0},
    "quick": {"sizes": [64 * KiB, 16 * MiB], "iters": 4, "warmup": 1, "fail_delay": 1.2, "fail_down": 3.0,
              "bg_series": {"on": 6.0, "off": 13.0, "end": 18.0},
              "fail_series": {"down": 6.0, "up": 9.0, "end": 20.0},
              "bg_alone_s": 4.0},
}


# ---------------------------------------------------------------------------------------------
# Inside the ranks (this file is also the rank program)
# ---------------------------------------------------------------------------------------------

def rank_perf(argv: list[str]) -> int:
    """mpccs-perf with a size ladder (MATRIX_SIZES) and per-operation CPU time.

    Wraps mpccs.perf without changing it: ``sizes`` returns the ladder and ``timed``
    is the same function with time.process_time() read around the operation.
    """
    cpu_out, args = argv[0], argv[1:]
    import resource

    import mpccs.perf as perf

    ladder = [int(x) for x in os.environ["MATRIX_SIZES"].split(",")]
    perf.sizes = lambda begin, end, factor: list(ladder)
    records = []

    def timed(comm, case, policy):
        comm.set_path_policy(policy.base if isinstance(policy, perf.Repeat) else policy)
        comm.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        case.run()
        dt = time.perf_counter() - t0
        records.append((case.nbytes, perf.policy_label(policy), dt, time.process_time() - c0))
        return dt, comm.last_stats() or {}

    perf.timed = timed
    code = 1
    try:
        code = perf.main(args)
    finally:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        with open(f"{cpu_out}.rank{os.environ.get('RANK', '0')}.json", "w") as fh:
            json.dump({"rank": int(os.environ.get("RANK", 0)), "records": records,
                       "rusage": {"utime": ru.ru_utime, "stime": ru.ru_stime, "maxrss_kb": ru.ru_maxrss}}, fh)
    return code


def rank_series(argv: list[str]) -> int:
    """Repeated all_reduce of NBYTES under POLICY until the wall-clock deadline (all ranks agree).
    POLICY 'sweep:F1,F2,...' cycles through fixed fractions, one per operation."""
    out, nbytes, policy, deadline = argv[0], int(argv[1]), argv[2], float(argv[3])
    import resource

    import mpccs
    from mpccs.config import parse_policy

    comm = mpccs.init()
    policies = ([parse_policy(f) for f in policy.split(":", 1)[1].split(",")] if policy.startswith("sweep:")
                else [parse_policy(policy)])
    x = np.ones(nbytes // 4, np.float32)
    flag = np.zeros(1, np.float32)
    ops = []
    c_start = time.process_time()
    while True:
        x[...] = 1.0
        policy = policies[len(ops) % len(policies)]  # every rank counts the same operations
        comm.set_path_policy(policy)
        t_wall, c0, t0 = time.time(), time.process_time(), time.perf_counter()
        comm.all_reduce(x)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = comm.last_stats() or {}
        ops.append({"t": t_wall, "dt": dt, "cpu": cpu, "bytes_per_plane": stats.get("bytes_per_plane"),
                    "attempts": stats.get("attempts", 1), "policy": str(policy)})
        # the stop decision: one tiny all_reduce on 'up' (never on the plane that may be down)
        comm.set_path_policy("up")
        flag[0] = 1.0 if time.time() > deadline else 0.0
        comm.all_reduce(flag, op="max")
        if flag[0] > 0:
            break
    ok = bool(np.all(x == comm.size))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open(f"{out}.rank{comm.rank}.json", "w") as fh:
        json.dump({"rank": comm.rank, "ops": ops, "correct_last": ok, "cpu_s": time.process_time() - c_start,
                   "metrics": comm.metrics() if hasattr(comm, "metrics") else None,
                   # rate steps the estimator saw on paths measured here (each one resets estimates)
                   "regime_changes": comm._engine.controller.estimator.local_regime_changes(comm.rank),
                   "rusage": {"utime": ru.ru_utime, "stime": ru.ru_stime}}, fh, default=str)
    comm.close()
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------

ROW = re.compile(r"^\[rank 0\]\s+(\d+)\s")


class LineLog:
    """The stream Cluster.run writes rank output to: a log file with arrival times, the wall
    time at which rank 0 printed each size's first row (the end of that size's measurement),
    plus a hook per line."""

    def __init__(self, path: str, hook=None):
        self.fh = open(path, "a")
        self.hook = hook
        self.buf = ""
        self.rows = {}

    def write(self, text: str) -> None:
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            now = time.time()
            self.fh.write(f"{now:.3f} {line}\n")
            m = ROW.match(line)
            if m:
                self.rows.setdefault(int(m.group(1)), now)
            if self.hook:
                try:
                    self.hook(line)
                except Exception as e:  # a hook must never break the run's output pump
                    self.fh.write(f"# hook failed: {e}\n")

    def flush(self) -> None:
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def library_state() -> dict:
    """Which library code a run used: a hash of every mpccs/*.py, the commit, and the files that
    differ from it (the engine is being changed by others while benchmarks run)."""
    from mpccs.info import sources_digest

    root = os.path.dirname(HERE)

    def git(*args):
        try:
            return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    status = git("status", "--porcelain", "--", "mpccs")
    return {"hash": sources_digest(os.path.join(root, "mpccs"), root), "commit": git("rev-parse", "--short", "HEAD"),
            "modified": status.split("\n") if status else []}


def say(msg: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rel_events(cluster, since: float) -> list:
    return [dict(e, t=round(e["wall"] - since, 3)) for e in cluster.events if e["wall"] >= since]


def counters_delta(before: dict, after: dict) -> dict:
    out = {}
    for rank in (0, 1):
        out[str(rank)] = {plane: {k: after[rank][plane].get(k, 0) - before[rank][plane].get(k, 0)
                                  for k in ("tx_bytes", "rx_bytes")}
                          for plane in ("up", "out") if plane in after[rank]}
    return out


def run_perf(cluster, cond: str, collective: str, raw: str, plan: dict, env: dict,
             hook_factory=None) -> dict:
    """One mpccs-perf sweep (all sizes of the ladder, all policies interleaved) in the cluster."""
    base = os.path.join(raw, cond, collective)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for stale in (f"{base}.json", f"{base}.cpu.rank0.json", f"{base}.cpu.rank1.json"):
        if os.path.exists(stale):
            os.unlink(stale)
    argv = [sys.executable, os.path.abspath(__file__), "_perf", f"{base}.cpu", collective, "-b", "8", "-e", "64M",
            "-n", str(plan["iters"]), "-w", str(plan["warmup"]), "--policies", POLICIES, "--quiet",
            "-J", f"{base}.json"]
    env = dict(env, MATRIX_SIZES=",".join(map(str, plan["sizes"])), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    hook, cleanup = hook_factory() if hook_factory else (None, None)
    log = LineLog(f"{base}.log", hook)
    lib = library_state()
    before = cluster.counters()
    t0 = time.time()
    try:
        res = cluster.run(argv, env=env, timeout=900, stream=log)
    finally:
        if cleanup:
            cleanup()
        log.close()
    after = cluster.counters()
    rec = {"condition": cond, "collective": collective, "exit_code": res.exit_code, "duration_s": res.duration_s,
           "returncodes": res.returncodes, "events": rel_events(cluster, t0), "started": res.started,
           "library": lib, "library_after": library_state()["hash"],
           "size_done": {str(k): v - res.started for k, v in log.rows.items()},
           "counters": counters_delta(before, after)}
    if res.exit_code != 0:
        rec["output_tail"] = {k: v[-30:] for k, v in res.output.items()}
    say(f"{cond}/{collective}: exit {res.exit_code} in {res.duration_s:.0f} s")
    with open(f"{base}.run.json", "w") as fh:
        json.dump(rec, fh, indent=1, default=str)
    return rec


def failure_hook(cluster, plan: dict, trigger_size: int):
    """Take rank 1's scale-out link down fail_delay s after rank 0 prints the row of trigger_size
    (the next, largest size is then being measured), and back up fail_down s later."""
    timers, state = [], {"armed": True, "down": False}
    pattern = re.compile(rf"^\[rank 0\]\s+{trigger_size}\s")

    def down():
        cluster.fail_link(1, "out")
        state["down"] = True

    def up():
        if state["down"]:
            cluster.restore_link(1, "out")
            state["down"] = False

    def hook(line: str) -> None:
        if "# Out of bounds values" in line:  # the sweep is over: never leave the link down under close()
            for t in timers:
                t.cancel()
            up()
        elif state["armed"] and pattern.match(line):
            state["armed"] = False
            timers.append(threading.Timer(plan["fail_delay"], down))
            timers.append(threading.Timer(plan["fail_delay"] + plan["fail_down"], up))
            for t in timers:
                t.daemon = True
                t.start()

    def cleanup():
        for t in timers:
            t.cancel()
        up()

    return hook, cleanup


def run_series(cluster, name: str, raw: str, policy: str, sched: dict, env: dict, kind: str) -> dict:
    """Adaptive (or fixed) 16 MiB all_reduces with MPCCS_TRACE on; background or link failure mid-run."""
    from mpccs.testbed import TimedAction

    base = os.path.join(raw, "series", name)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for k in (0, 1):
        for path in (f"{base}.trace.rank{k}", f"{base}.trace.rank{k}.gz", f"{base}.ops.rank{k}.json"):
            if os.path.exists(path):
                os.unlink(path)
    n_bg = len(cluster.background_records)
    if kind == "background":
        actions = (TimedAction(sched["on"], "background on", lambda: cluster.start_background(BG_RATE, dst_rank=0)),
                   TimedAction(sched["off"], "background off", lambda: cluster.stop_background(), at_end=True))
    else:
        actions = (TimedAction(sched["down"], "link down", lambda: cluster.fail_link(1, "out")),
                   TimedAction(sched["up"], "link up", lambda: cluster.restore_link(1, "out"), at_end=True))
    deadline = time.time() + sched["end"]
    argv = [sys.executable, os.path.abspath(__file__), "_series", f"{base}.ops", str(SERIES_BYTES), policy,
            f"{deadline:.3f}"]
    env = dict(env, MPCCS_TRACE=f"{base}.trace", OMP_NUM_THREADS="1")
    log = LineLog(f"{base}.log")
    lib = library_state()
    before = cluster.counters()
    t0 = time.time()
    try:
        res = cluster.run(argv, env=env, timeout=sched["end"] + 120, stream=log, actions=actions)
    finally:
        log.close()
    after = cluster.counters()
    for k in (0, 1):  # traces are ~1 MB a rank; compressed ~10x
        path = f"{base}.trace.rank{k}"
        if os.path.exists(path):
            subprocess.run(["gzip", "-f", path], check=False)
    rec = {"name": name, "policy": policy, "kind": kind, "schedule": sched, "env": {k: v for k, v in env.items()
           if k.startswith("MPCCS_")}, "exit_code": res.exit_code, "duration_s": res.duration_s,
           "started": res.started, "events": rel_events(cluster, t0), "counters": counters_delta(before, after),
           "returncodes": res.returncodes, "library": lib, "library_after": library_state()["hash"],
           "background": cluster.background_records[n_bg:]}
    if res.exit_code != 0:
        rec["output_tail"] = {k: v[-30:] for k, v in res.output.items()}
    say(f"series {name}: exit {res.exit_code} in {res.duration_s:.0f} s"
        + (f"; background delivered {rec['background'][0]['delivered_Bps'] * 8 / 1e6:.0f} Mbit/s"
           if rec["background"] else ""))
    with open(f"{base}.run.json", "w") as fh:
        json.dump(rec, fh, indent=1, default=str)
    return rec


def background_alone(cluster, raw: str, seconds: float) -> dict:
    cluster.start_background(BG_RATE, dst_rank=0)
    time.sleep(seconds)
    cluster.stop_background()
    rec = cluster.background_records[-1]
    say(f"background alone: {rec['delivered_Bps'] * 8 / 1e6:.0f} Mbit/s of {BG_BPS / 1e6:.0f} asked")
    os.makedirs(os.path.join(raw, "series"), exist_ok=True)
    with open(os.path.join(raw, "series", "background_alone.json"), "w") as fh:
        json.dump(rec, fh, indent=1, default=str)
    return rec


def calibration(cluster) -> dict:
    from mpccs.testbed.calibrate import calibrate, summary

    try:
        res = calibrate(cluster)
        res["summary"] = summary(res)
    except Exception as e:  # recorded, never a reason to stop
        res = {"error": str(e)}
    say(f"calibration: {res.get('summary', res.get('error'))}")
    return res


def measure(ns, plan: dict) -> None:
    from mpccs.info import versions
    from mpccs.testbed import Cluster

    raw = os.path.join(ns.out, "raw")
    os.makedirs(raw, exist_ok=True)
    conditions = ns.conditions.split(",")
    collectives = ns.collectives.split(",")
    meta = {"command": " ".join(["python", "bench/matrix.py"] + sys.argv[1:]), "plan": plan,
            "quick": ns.quick, "start": time.strftime("%Y-%m-%dT%H:%M:%S"), "rates": {
                "up": UP_RATE, "out": OUT_RATE, "background": BG_RATE, "shared_trunk": SHARED_RATE},
            "cap": CAP, "host": host_info(), "clusters": {}, "calibration": {}, "library_start": library_state(),
            "versions": versions()}
    t_start = time.time()
    env = {"MPCCS_REPROBE": "5"}
    log = open(os.path.join(raw, "testbed.log"), "a")
    tb_log = lambda m: (log.write(f"{time.strftime('%H:%M:%S')} {m}\n"), log.flush())  # noqa: E731
    if {"idle", "background", "failure"} & set(conditions) or not ns.no_series:
        with Cluster(n=2, up="tcp", up_rate=UP_RATE, out_rate=OUT_RATE, log=tb_log) as cluster:
            meta["clusters"]["separate"] = cluster.describe()
            meta["calibration"]["separate"] = calibration(cluster)
            for cond in ("idle", "background", "failure"):
                if cond not in conditions:
                    continue
                for coll in collectives:
                    if cond == "background":
                        n_bg = len(cluster.background_records)
                        cluster.start_background(BG_RATE, dst_rank=0)
                        try:
                            rec = run_perf(cluster, cond, coll, raw, plan, env)
                        finally:
                            cluster.stop_background()
                        rec["background"] = cluster.background_records[n_bg:]
                        with open(os.path.join(raw, cond, f"{coll}.run.json"), "w") as fh:
                            json.dump(rec, fh, indent=1, default=str)
                    elif cond == "failure":
                        trigger = plan["sizes"][-2]
                        rec = run_perf(cluster, cond, coll, raw, plan, env,
                                       hook_factory=lambda: failure_hook(cluster, plan, trigger))
                    else:
                        run_perf(cluster, cond, coll, raw, plan, env)
            if not ns.no_series:
                wanted = ns.series.split(",")
                background_alone(cluster, raw, plan["bg_alone_s"])
                runs = {
                    "background": ("adaptive", plan["bg_series"], env, "background"),
                    "background_cap": ("adaptive", plan["bg_series"], dict(env, MPCCS_OUT_CAP=str(CAP)), "background"),
                    "background_rate_cap": ("adaptive", plan["bg_series"], dict(env, MPCCS_OUT_CAP_RATE=RATE_CAP),
                                            "background"),
                    "background_fixed": ("0.667", plan["bg_series"], env, "background"),
                    "background_sweep": ("sweep:" + ",".join(map(str, SWEEP_FRACTIONS)), plan["bg_series"], env,
                                         "background"),
                    "failure": ("adaptive", plan["fail_series"], env, "failure"),
                }
                for name in SERIES:
                    if name in wanted:
                        policy, sched, series_env, kind = runs[name]
                        run_series(cluster, name, raw, policy, sched, series_env, kind)
    if "shared" in conditions:
        with Cluster(n=2, up="tcp", up_rate=UP_RATE, out_rate=OUT_RATE, shared_bottleneck=True,
                     shared_rate=SHARED_RATE, log=tb_log) as cluster:
            meta["clusters"]["shared"] = cluster.describe()
            meta["calibration"]["shared"] = calibration(cluster)
            for coll in collectives:
                run_perf(cluster, "shared", coll, raw, plan, env)
    meta["runtime_s"] = time.time() - t_start
    meta["library_end"] = library_state()
    meta["load_at_end"] = os.getloadavg()
    meta["end"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    log.close()
    meta_path = os.path.join(raw, "meta.json")
    if not set(conditions) & set(CONDITIONS) and os.path.exists(meta_path):
        # series only, into an existing matrix: keep the matrix's record, note this run beside it
        full = load(meta_path)
        full.setdefault("partial_runs", []).append(
            {k: meta[k] for k in ("command", "start", "end", "runtime_s", "library_start", "library_end", "clusters",
                                  "calibration") if k in meta})
        meta = full
    with open(meta_path, "w") as fh:
        json.dump(meta, fh, indent=1, default=str)


def host_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        tc = subprocess.run(["tc", "-V"], capture_output=True, text=True).stdout.strip()
    except OSError:
        tc = None
    return {"kernel": platform.release(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "tc": tc, "load_at_start": os.getloadavg()}


# ---------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------

def load(path):
    with open(path) as fh:
        return json.load(fh)


def size_label(s: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if s >= 1 << shift:
            return f"{s >> shift} {unit}"
    return f"{s} B"


def fmt_ci(r) -> str:
    return "-" if r is None else f"{r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]"


def cpu_by_cell(raw: str, cond: str, coll: str, warmup: int) -> dict:
    """{(size, policy): {rank: [cpu s per timed op], 'wall': [...]}} (warm-up operations dropped)."""
    out = {}
    for rank in (0, 1):
        path = os.path.join(raw, cond, f"{coll}.cpu.rank{rank}.json")
        if not os.path.exists(path):
            continue
        seen = {}
        for size, policy, dt, cpu in load(path)["records"]:
            key = (size, policy)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= warmup:
                continue
            cell = out.setdefault(key, {})
            cell.setdefault(rank, []).append((dt, cpu))
    return out


def analyse_matrix(raw: str, meta: dict) -> list[dict]:
    cells = []
    warmup = meta["plan"]["warmup"]
    for cond in CONDITIONS:
        for coll in COLLECTIVES:
            path = os.path.join(raw, cond, f"{coll}.json")
            run_path = os.path.join(raw, cond, f"{coll}.run.json")
            run = load(run_path) if os.path.exists(run_path) else None
            if not os.path.exists(path):
                if run is not None:
                    cells.append({"condition": cond, "collective": coll, "size": None, "missing": True,
                                  "exit_code": run["exit_code"]})
                continue
            data = load(path)
            rows = {(r["policy"], r["size"]): r for r in data["rows"]}
            cpu = cpu_by_cell(raw, cond, coll, warmup)
            for size in sorted({r["size"] for r in data["rows"]}):
                get = lambda p: rows.get((p, size))  # noqa: E731
                if any(get(p) is None for p in LABELS):
                    continue
                up, up2, out_, fix, ad = (get(p) for p in LABELS)
                t = {p: np.asarray(get(p)["times_us"]) for p in LABELS}
                best = "up" if up["time_us"] <= out_["time_us"] else "out"
                sums = 1 / (1 / t["up"] + 1 / t["out"])
                cell = {
                    "condition": cond, "collective": coll, "size": size,
                    "busbw": {p: get(p)["busbw"] for p in LABELS},
                    "p90_us": {p: get(p)["time_us_p90"] for p in LABELS},
                    "max_us": {p: float(np.max(t[p])) for p in LABELS},
                    "share_up": {p: get(p)["up_share"] for p in LABELS},
                    "algorithm": ad.get("algorithm"), "wrong": sum(get(p)["wrong"] for p in LABELS),
                    "best_single": best,
                    "floor": noise_floor(t["up"], t["up#2"]),
                    "vs_best": ratio_ci(t["adaptive"], t[best], paired=True),
                    "vs_up": ratio_ci(t["adaptive"], t["up"], paired=True),
                    "vs_sum": ratio_ci(t["adaptive"], sums, paired=True),
                    "fixed_vs_best": ratio_ci(t["0.8"], t[best], paired=True),
                    "cpu": {}, "exit_code": run["exit_code"] if run else None,
                }
                for p in LABELS:
                    c = cpu.get((size, p), {})
                    per_rank = {}
                    for rank, vals in c.items():
                        arr = np.asarray(vals)
                        per_rank[str(rank)] = {"cpu_ms": float(np.median(arr[:, 1])) * 1e3,
                                               "util": float(np.sum(arr[:, 1]) / max(1e-12, np.sum(arr[:, 0])))}
                    cell["cpu"][p] = per_rank
                cells.append(cell)
    return cells


def converge(shares: list[float], times: list[float], t_change: float) -> dict:
    """Operations and seconds after a change until the share stays within TOLERANCE of the
    segment's final value (median of its last quarter, at least 5 operations)."""
    n = len(shares)
    if n == 0:
        return {"ops": None, "s": None, "final": None, "n": 0}
    tail = max(5, n // 4)
    final = float(np.median(shares[-tail:]))
    res = {"final": final, "n": n}
    inside = np.abs(np.asarray(shares) - final) <= TOLERANCE
    # strict: the first operation from which every later one is inside the band
    bad = np.nonzero(~inside)[0]
    i = 0 if bad.size == 0 else int(bad[-1]) + 1
    res["strict"] = {"ops": i, "s": (times[i] - t_change) if i < n else None,
                     "outside_after": int(np.count_nonzero(~inside[i:]))}
    # rolling median over 5 operations (a lone probe does not count as leaving)
    roll = np.array([np.median(shares[max(0, j - 2):j + 3]) for j in range(n)])
    bad = np.nonzero(np.abs(roll - final) > TOLERANCE)[0]
    j = 0 if bad.size == 0 else int(bad[-1]) + 1
    res["rolling5"] = {"ops": j, "s": (times[j] - t_change) if j < n else None}
    res["late_outliers"] = int(np.count_nonzero(~inside[min(j, n):]))
    return res


def near_model(shares: list[float], model: float) -> dict:
    """The 5-operation rolling mean against the model share: the first operation
    at which it is within TOLERANCE and the fraction of operations inside.

    A realised share moves in whole chunks (1/16 of a stage at 16 MiB, 6.25
    points, and stealing moves chunks at run time), so single operations and
    rolling medians wander outside a 5-point band around any final value; the
    mean over five operations is what a fixed fraction would deliver."""
    if not shares:
        return {"first_ops": None, "inside": None}
    arr = np.asarray(shares, dtype=float)
    roll = np.array([arr[max(0, j - 4):j + 1].mean() for j in range(len(arr))])
    inside = np.abs(roll - model) <= TOLERANCE
    return {"first_ops": int(np.argmax(inside)) if inside.any() else None, "inside": float(inside.mean())}


def model_share(label: str, env: dict, policy: str, rank: int) -> float:
    """The share on 'up' that makes a rank's two planes finish together (rates as shaped), within the cap.

    The background flow enters rank 0's scale-out downlink, so it slows what rank 1 sends on 'out';
    rank 0's own sends keep the full rate (and have slack: the stage ends with rank 1)."""
    try:
        return float(policy)
    except ValueError:
        pass
    out_Bps = {"background on": OUT_BPS - BG_BPS if rank == 1 else OUT_BPS, "link down": 0.0}.get(label, OUT_BPS)
    if "MPCCS_OUT_CAP_RATE" in env:
        from mpccs.config import parse_rate
        out_Bps = min(out_Bps, parse_rate(env["MPCCS_OUT_CAP_RATE"]) * 8)
    share = UP_BPS / (UP_BPS + out_Bps)
    cap = float(env.get("MPCCS_OUT_CAP", 1.0))
    return max(share, 1.0 - cap)


def own_decisions(record: dict) -> list[dict]:
    """The controller's record of the rank's own decision in each stage of one
    operation (none under a fixed policy)."""
    ranks = (((stage.get("split") or {}).get("ranks") or {}) for stage in record.get("stages", []))
    return [mine for mine in (r.get(str(record["rank"])) for r in ranks) if mine]


def planned_share(record: dict):
    """The share on 'up' the controller planned for this rank's own flows in one
    operation (its decision records, before chunk rounding and stealing), or None
    where no stage was decided (a fixed policy)."""
    decisions = own_decisions(record)
    up = sum(d["bytes"]["up"] for d in decisions)
    out = sum(d["bytes"]["out"] for d in decisions)
    return up / (up + out) if up + out else None


def planned_spread(plan: list) -> dict | None:
    """How much the planned share still moves in the second half of a segment (after
    any convergence): its 10th-90th percentile range and how often consecutive
    operations reverse direction by more than one point (an oscillation's mark)."""
    half = plan[len(plan) // 2:]
    if len(half) < 4:
        return None
    steps = [b - a for a, b in zip(half, half[1:]) if abs(b - a) > 0.01]
    reversals = sum(1 for a, b in zip(steps, steps[1:]) if a * b < 0)
    lo, hi = np.percentile(half, [10, 90])
    return {"p10": float(lo), "p90": float(hi), "reversals": reversals, "ops": len(half)}


def analyse_series(raw: str, name: str) -> dict | None:
    base = os.path.join(raw, "series", name)
    if not os.path.exists(f"{base}.run.json"):
        return None
    run = load(f"{base}.run.json")
    out = {"name": name, "policy": run["policy"], "kind": run["kind"], "exit_code": run["exit_code"],
           "background": run.get("background"), "env": run.get("env")}
    trace = []
    for rank in (0, 1):
        path = f"{base}.trace.rank{rank}"
        for p, opener in ((path, open), (path + ".gz", gzip.open)):
            if os.path.exists(p):
                with opener(p, "rt") as fh:
                    trace += [json.loads(line) for line in fh if line.strip()]
                break
    big = [r for r in trace if r.get("op") == "all_reduce"
           and sum((r.get("bytes_per_plane") or {}).values()) >= SERIES_BYTES // 4]
    ops, planned = {}, {}
    for r in big:
        bpp = r["bytes_per_plane"]
        start = r.get("t_start_wall", r["t"])
        ops.setdefault(r["rank"], []).append((start, bpp.get("up", 0) / sum(bpp.values()),
                                              r.get("duration_s", 0), r.get("attempts", 1)))
        planned.setdefault(r["rank"], {})[start] = planned_share(r)
    for k in ops:
        ops[k].sort()
    rank_ops = ops.get(0, []) or ops.get(1, [])
    # change points (wall) from the testbed's events
    changes = change_points(run)
    first = load(f"{base}.ops.rank0.json")["ops"][0]["t"] if os.path.exists(f"{base}.ops.rank0.json") else None
    t0 = rank_ops[0][0] if rank_ops else (first or 0)
    out["t0"] = t0
    out["changes"] = [{"t": w - t0, "label": lab} for w, lab in changes]
    out["ops"] = {str(k): [{"t": a - t0, "share_up": s, "planned_up": planned[k][a], "dt": d, "attempts": at}
                           for a, s, d, at in v]
                  for k, v in ops.items()}
    # segments: before the first change, then after each change; an operation belongs to the
    # segment in which it started. Each rank decides its own split, so each has its own series.
    bounds = [t0] + [w for w, _ in changes] + [float("inf")]
    labels = ["start"] + [lab for _, lab in changes]
    segs = []
    for rank in sorted(ops):
        for i, label in enumerate(labels):
            lo, hi = bounds[i], bounds[i + 1]
            seg = [(a, s, d) for a, s, d, _ in ops[rank] if lo <= a < hi]
            shares = [s for _, s, _ in seg]
            times = [a for a, _, _ in seg]
            model = model_share(label, run.get("env") or {}, run["policy"], rank)
            plan = [planned[rank][a] for a, _, _ in seg if planned[rank][a] is not None]
            segs.append({"rank": rank, "after": label, "t_change": lo - t0, "ops": len(seg),
                         "planned_spread": planned_spread(plan),
                         "mean_share": float(np.mean(shares)) if shares else None,
                         "median_op_ms": float(np.median([d for _, _, d in seg])) * 1e3 if seg else None,
                         "max_op_ms": float(np.max([d for _, _, d in seg])) * 1e3 if seg else None,
                         "model_share": model, "near_model": near_model(shares, model),
                         "convergence": converge(shares, times, lo)})
    out["segments"] = segs
    # Do the ranks split together? An all_reduce stage ends with its slowest rank, so a split (or a
    # probe) on one rank alone cannot make the operation faster.
    by_seq = {}
    for r in big:
        bpp = r["bytes_per_plane"]
        modes = sorted({d.get("mode") for d in own_decisions(r)} - {None})
        by_seq.setdefault(r.get("seq"), {})[r["rank"]] = (bpp.get("up", 0) / sum(bpp.values()),
                                                           r.get("duration_s", 0), modes)
    classes = {"both ranks split": [], "one rank split": [], "neither (all on up)": []}
    probes = {"both": 0, "one": 0}
    for seq, d in by_seq.items():
        if len(d) != 2:
            continue
        split = [d[k][0] < 0.95 for k in (0, 1)]
        key = "both ranks split" if all(split) else "one rank split" if any(split) else "neither (all on up)"
        classes[key].append(max(d[0][1], d[1][1]))
        probing = ["probe" in d[k][2] for k in (0, 1)]
        if all(probing):
            probes["both"] += 1
        elif any(probing):
            probes["one"] += 1
    out["coordination"] = {"classes": {k: {"ops": len(v), "median_op_ms": float(np.median(v)) * 1e3 if v else None}
                                       for k, v in classes.items()}, "probe_ops": probes}
    # ranks' own view: retries, last result correct
    for rank in (0, 1):
        path = f"{base}.ops.rank{rank}.json"
        if os.path.exists(path):
            d = load(path)
            out.setdefault("rank_summary", {})[str(rank)] = {
                "ops": len(d["ops"]), "retried": sum(1 for o in d["ops"] if (o.get("attempts") or 1) > 1),
                "correct_last": d["correct_last"], "cpu_s": d["cpu_s"],
                "wall_s": d["ops"][-1]["t"] - d["ops"][0]["t"] if d["ops"] else 0,
                "cpu_ms_per_op": 1e3 * float(np.median([o["cpu"] for o in d["ops"]])) if d["ops"] else None,
                "metrics": d.get("metrics")}
    return out


def lockstep_ops(base: str) -> list[dict]:
    """Both ranks' operations of a series, paired by index (the ranks run them in lockstep): start
    (wall), time (the slower rank), the share on 'up' of all bytes (both ranks) and of each rank's
    own, and the policy."""
    per_rank = [load(f"{base}.ops.rank{k}.json")["ops"] for k in (0, 1) if os.path.exists(f"{base}.ops.rank{k}.json")]
    if len(per_rank) < 2:
        return []

    def share(planes: list[dict]):
        total = sum(sum(p.values()) for p in planes)
        return sum(p.get("up", 0) for p in planes) / total if total else None

    rows = []
    for pair in zip(*per_rank):
        planes = [o.get("bytes_per_plane") or {} for o in pair]
        rows.append({"t": min(o["t"] for o in pair), "dt": max(o["dt"] for o in pair),
                     "share_up": share(planes), "rank_share_up": [share([p]) for p in planes],
                     "policy": pair[0].get("policy")})
    return rows


def change_points(run: dict) -> list[tuple[float, str]]:
    """(wall time, label) of each change. The background's load starts when its first byte
    arrives (~0.1-0.15 s after the testbed starts the sender) and ends with its last byte."""
    kinds = {"background_start": "background on", "background_stop": "background off",
             "link_down": "link down", "link_up": "link up"}
    flow = (run.get("background") or [{}])[0]
    load_edges = {"background_start": flow.get("first_byte"), "background_stop": flow.get("last_byte")}
    return [(load_edges.get(e["event"]) or e["wall"], kinds[e["event"]]) for e in run["events"] if e["event"] in kinds]


def segment_rows(rows: list[dict], changes: list, label: str, settle_s: float = 0.0) -> list[dict]:
    """Rows that started after the change ``label`` (plus settle_s) and before the next change."""
    bounds = [w for w, _ in changes] + [float("inf")]
    for i, (w, lab) in enumerate(changes):
        if lab == label:
            return [r for r in rows if w + settle_s <= r["t"] < bounds[i + 1]]
    first = changes[0][0] if changes else float("inf")
    return [r for r in rows if r["t"] < first] if label == "start" else []


def analyse_sweep(raw: str) -> dict | None:
    """The fixed-fraction sweep: per load segment, each fraction's operation time; the best
    fraction (lowest median time) is the reference a converged 'adaptive' share is judged against."""
    base = os.path.join(raw, "series", "background_sweep")
    if not os.path.exists(f"{base}.run.json"):
        return None
    run = load(f"{base}.run.json")
    rows, changes = lockstep_ops(base), change_points(run)
    out = {"segments": {}, "background": run.get("background")}
    for label in ("start", "background on", "background off"):
        seg = segment_rows(rows, changes, label, 0.0 if label == "start" else SETTLE_S)
        by = {}
        for r in seg:
            by.setdefault(r["policy"], []).append(r["dt"])
        if not by:
            continue
        stats = {p: {"n": len(v), "median_ms": float(np.median(v)) * 1e3,
                     "p25_ms": float(np.percentile(v, 25)) * 1e3, "p75_ms": float(np.percentile(v, 75)) * 1e3}
                 for p, v in sorted(by.items(), key=lambda kv: float(kv[0]))}
        best = min(stats, key=lambda p: stats[p]["median_ms"])
        out["segments"][label] = {"by_fraction": stats, "best": float(best), "best_ms": stats[best]["median_ms"]}
    return out


def converge_to_sweep(raw: str, name: str, sweep: dict | None) -> dict:
    """The target's convergence test: after each load change, when the 5-operation mean of the
    share on 'up' comes within TOLERANCE of the sweep's best fraction, for all bytes (both ranks)
    and for each rank's own sends (each rank splits its own; only rank 1's cross the loaded link).
    With it, the operation time against the best fixed fraction's (after SETTLE_S)."""
    base = os.path.join(raw, "series", name)
    if not sweep or not os.path.exists(f"{base}.run.json"):
        return {}
    rows, changes = lockstep_ops(base), change_points(load(f"{base}.run.json"))
    out = {}
    for label in ("background on", "background off"):
        ref = sweep["segments"].get(label) or {}
        seg = segment_rows(rows, changes, label)
        if not ref or not seg:
            continue
        shares = {"all": [r["share_up"] for r in seg]}
        for k in (0, 1):
            shares[f"rank {k}"] = [r["rank_share_up"][k] for r in seg]
        settled = [r["dt"] for r in segment_rows(rows, changes, label, SETTLE_S)]
        op_ms = float(np.median(settled)) * 1e3 if settled else None
        out[label] = {"best_fixed": ref["best"], "best_fixed_ms": ref["best_ms"], "ops": len(seg),
                      "median_op_ms": op_ms, "time_vs_best_fixed": ref["best_ms"] / op_ms if op_ms else None,
                      "shares": {who: {"mean": float(np.mean(v)), "first": [round(x, 3) for x in v[:8]],
                                       **near_model(v, ref["best"])} for who, v in shares.items()}}
    return out


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def verdict_best(cell) -> str:
    return "holds" if holds(cell["vs_best"], 0.97, cell["floor"]) else "NOT MET"


def spread_cell(spread: dict | None) -> str:
    if not spread:
        return "-"
    return f"{spread['p10']:.2f}-{spread['p90']:.2f} ({spread['reversals']} / {spread['ops']})"


def render(cells: list, series: dict, meta: dict, versions: dict) -> str:
    plan = meta["plan"]
    host = meta["host"]
    L = ["# Procurement matrix: 2 ranks, up and out shaped tcp at 2:1", ""]
    L += [f"Command: `{meta['command']}` (root). Runtime {meta.get('runtime_s', 0) / 60:.1f} min, "
          f"{meta['start']} to {meta.get('end')}.", "",
          f"mpccs {versions.get('mpccs')}, ucxx {versions.get('ucxx')}, UCX {versions.get('ucx')}, numpy "
          f"{versions.get('numpy')}, Python {versions.get('python')}; kernel {host['kernel']}; CPU {host['cpu']} "
          f"x {host['cores']} (load at start {', '.join(f'{x:.2f}' for x in host['load_at_start'])}); "
          f"{host.get('tc') or 'tc'}.", "",
          f"Testbed: up {UP_RATE}, out {OUT_RATE} per direction (tbf, both ends, MTU 9000); shared-bottleneck "
          f"condition: both planes as macvlans on one {SHARED_RATE} trunk (htb; each plane alone keeps its own "
          f"rate). Background: one paced TCP flow at {BG_RATE} (half the scale-out rate) from the testbed's "
          f"extra host into rank 0's scale-out link. QoS cap for the capped run: MPCCS_OUT_CAP={CAP}. "
          f"MPCCS_REPROBE=5 s, MPCCS_PLANE_TIMEOUT default (1 s).", ""]
    for name, cal in meta.get("calibration", {}).items():
        L.append(f"- calibration ({name} planes; recorded, not gated): {cal.get('summary', cal.get('error'))}")
    L += library_lines(meta)
    L += ["",
          f"Method (docs/benchmarks.md): mpccs-perf with policies `{POLICIES}` interleaved iteration by iteration, "
          f"{plan['iters']} timed iterations after {plan['warmup']} warm-up per point, per-iteration time = slowest "
          "rank, medians; ratios are paired bootstrap 95% intervals (bench/stats.py); the A/A floor is up vs up#2. "
          "A target holds when the interval's lower bound minus the floor clears it. busbw in GB/s (1e9 B/s), "
          "nccl-tests factors. CPU = time.process_time() of the rank process around each timed operation "
          "(user + system, all threads), median over iterations, ms per operation; `util` = CPU time / wall time "
          "of those operations (1.00 = one core busy for the whole operation).", "",
          "Sizes up to 1 MiB partly ride the shapers' token buckets (tbf burst = max(64 KiB, 4 ms of the rate): "
          "500 KB on up, 250 KB on out, docs/testbed.md), so their busbw can exceed the link rates and a split "
          "gains more there than the links allow; the link-limited numbers are 16 and 64 MiB.", ""]
    # --- headline
    L += ["## Headline: adaptive against the best single plane at 16 and 64 MiB", "",
          "| condition | collective | size | busbw up | out | 0.8 | adaptive | adaptive / best single | "
          "A/A floor | >= 0.97x best | adaptive / (up+out) | adaptive up share |",
          "|---|---|---:|---:|---:|---:|---:|---|---:|---|---|---:|"]
    for c in cells:
        if c.get("missing") or c["size"] < 16 * MiB:
            continue
        sh = c["share_up"]["adaptive"]
        L.append(f"| {c['condition']} | {c['collective']} | {size_label(c['size'])} | {c['busbw']['up']:.3f} | "
                 f"{c['busbw']['out']:.3f} | {c['busbw']['0.8']:.3f} | {c['busbw']['adaptive']:.3f} | "
                 f"{fmt_ci(c['vs_best'])} ({c['best_single']}) | {c['floor']:.3f} | {verdict_best(c)} | "
                 f"{fmt_ci(c['vs_sum'])} | {'-' if sh is None else f'{100 * sh:.0f}%'} |")
    missing = [c for c in cells if c.get("missing")]
    if missing:
        L += ["", "Runs that produced no results: " + ", ".join(
            f"{c['condition']}/{c['collective']} (exit {c['exit_code']})" for c in missing) + "."]
    L += ["", verdict_text(cells, series), ""]
    # --- full tables
    L += ["## Every cell", ""]
    for cond in CONDITIONS:
        cc = [c for c in cells if c["condition"] == cond and not c.get("missing")]
        if not cc:
            continue
        L += [f"### {cond}", "", condition_note(cond), "",
              "| collective | size | algorithm | busbw up | up#2 | out | 0.8 | adaptive | adaptive / best | A/A floor | "
              "0.8 / best | adaptive up share | max op ms up / out / adaptive | CPU ms/op up (r0/r1) | CPU ms/op adaptive (r0/r1) "
              "| util up / out / adaptive |",
              "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---|---:|---|---|---|---|"]
        for c in cc:
            sh = c["share_up"]["adaptive"]

            def cpu(p):
                v = c["cpu"].get(p, {})
                return "/".join(f"{v[r]['cpu_ms']:.1f}" if r in v else "-" for r in ("0", "1"))

            def util(p):
                v = [x["util"] for x in c["cpu"].get(p, {}).values()]
                return f"{np.mean(v):.2f}" if v else "-"
            L.append(f"| {c['collective']} | {size_label(c['size'])} | {c['algorithm']} | "
                     + " | ".join(f"{c['busbw'][p]:.3f}" for p in LABELS)
                     + f" | {fmt_ci(c['vs_best'])} | {c['floor']:.3f} | {fmt_ci(c['fixed_vs_best'])} | "
                     f"{'-' if sh is None else f'{100 * sh:.0f}%'} | {c['max_us']['up'] / 1e3:.1f} / "
                     f"{c['max_us']['out'] / 1e3:.1f} / {c['max_us']['adaptive'] / 1e3:.1f} | {cpu('up')} | {cpu('adaptive')} | "
                     f"{util('up')} / {util('out')} / {util('adaptive')} |")
        wrong = sum(c["wrong"] for c in cc)
        L += ["", f"Wrong elements (mpccs-perf -c 1, every policy and size): {wrong}.", ""]
        if cond == "failure":
            L += failure_timing(meta.get("_runs", [])) + [""]
        L += [f"![busbw, {cond}](busbw_{cond}.png)", ""]
    # --- time series
    L += ["## Time series: adaptive 16 MiB all_reduce, changes mid-run", "",
          "Share = bytes on `up` / all bytes a rank sent in the operation (its MPCCS_TRACE lines; each rank decides "
          "its own split). An operation belongs to the segment in which it started. Final = median share "
          "of the segment's last quarter (>= 5 operations). Strict convergence: operations (and seconds from the "
          "change to the start of that operation) until every later operation of the segment stays within 5 points "
          "of the final share; rolling: the same on a 5-operation rolling median (single probes ignored); "
          "near model: the first operation at which the 5-operation rolling mean is within 5 points of the model "
          "share, and the fraction of the segment's operations where it is (a realised share moves in whole "
          "chunks, 6.25 points at 16 MiB, so single operations leave any 5-point band). "
          f"Model share (both planes of a rank finish together at the shaped rates): idle {UP_BPS / (UP_BPS + OUT_BPS):.2f}; "
          f"with the background, which takes half of rank 0's scale-out downlink, rank 1 (whose 'out' bytes cross "
          f"it) {UP_BPS / (UP_BPS + OUT_BPS - BG_BPS):.2f} and rank 0 unchanged {UP_BPS / (UP_BPS + OUT_BPS):.2f} "
          "(its sends have slack: the stage ends with rank 1's); out down 1.00; with MPCCS_OUT_CAP=c at least 1-c; "
          f"with MPCCS_OUT_CAP_RATE={RATE_CAP} 'out' at most that rate.", ""]
    for name in SERIES:
        s = series.get(name)
        if not s:
            continue
        env = ", ".join(f"{k}={v}" for k, v in (s.get("env") or {}).items() if k != "MPCCS_TRACE")
        L += [f"### {name} (policy {s['policy']}{', ' + env if env else ''})", "",
              f"Exit code {s['exit_code']}; " + "; ".join(
                  f"rank {r}: {v['ops']} operations in {v['wall_s']:.1f} s, {v['retried']} retried, last result "
                  f"{'correct' if v['correct_last'] else 'WRONG'}, CPU {v['cpu_ms_per_op']:.1f} ms/op"
                  for r, v in (s.get("rank_summary") or {}).items()) + ".", "",
              "| rank | segment (after) | at t (s) | operations | model share | mean share up | final share | "
              "median op (ms) | longest op (ms) | strict: ops / s | rolling: ops / s | outliers after rolling convergence "
              "| near model: first op (inside) | planned share, second half: p10-p90 (reversals / ops) |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|"]
        for seg in s["segments"]:
            cv = seg["convergence"]

            def f2(d):
                if not d or d.get("ops") is None:
                    return "-"
                return f"{d['ops']} / " + ("never" if d["s"] is None else f"{d['s']:.1f}")

            def num(v, fmt):
                return "-" if v is None else format(v, fmt)
            L.append(f"| {seg['rank']} | {seg['after']} | {seg['t_change']:.1f} | {seg['ops']} | "
                     f"{num(seg.get('model_share'), '.2f')} | "
                     f"{num(seg['mean_share'], '.2f')} | {num(cv.get('final'), '.2f')} | {num(seg['median_op_ms'], '.0f')} | "
                     f"{num(seg.get('max_op_ms'), '.0f')} | "
                     f"{f2(cv.get('strict'))} | {f2(cv.get('rolling5'))} | {cv.get('late_outliers', '-')} | "
                     f"{near_cell(seg.get('near_model'))} | {spread_cell(seg.get('planned_spread'))} |")
        co = s.get("coordination")
        if co:
            L += ["", "Operations by whether the ranks split together (share on `up` < 0.95), with the operation's "
                  "time (slowest rank): " + "; ".join(
                      f"{k}: {v['ops']}" + (f" ({v['median_op_ms']:.0f} ms median)" if v["median_op_ms"] else "")
                      for k, v in co["classes"].items())
                  + f". Operations in which a rank's decision record says `probe`: on both ranks "
                  f"{co['probe_ops']['both']}, on one rank only {co['probe_ops']['one']}."]
        L += ["", f"![share over time, {name}](share_{name}.png)", ""]
    # --- background throughput
    L += ["## The background flow's own throughput", "",
          f"A {BG_RATE} paced TCP flow into rank 0's scale-out link (its sink counts bytes from first to last). "
          "`alone`: no job running. The others: during the time series above (the flow is on while the job runs "
          "16 MiB all_reduces back to back), and during the matrix's background condition (mpccs-perf cycling "
          "through up, up, out, 0.8, adaptive at every size).", "",
          "| next to | delivered (Mbit/s) | of asked | job's median op in that window (ms) |", "|---|---:|---:|---:|"]
    for label, rate, op_ms in background_rows(series, cells):
        L.append(f"| {label} | {rate * 8 / 1e6:.0f} | {100 * rate * 8 / BG_BPS:.0f}% | {op_ms} |")
    L += ["", "![background throughput](background_throughput.png)", ""]
    L += ["## Library behaviour seen", ""] + problems(cells, series, meta)
    L += ["", "Raw data: `raw/` (mpccs-perf JSON per condition and collective, per-rank CPU records, testbed "
          "events and kernel counters per run, MPCCS_TRACE lines and per-op records of the time series, "
          "meta.json). `python bench/matrix.py --report-only` rebuilds this file and the plots."]
    return "\n".join(L) + "\n"


def library_lines(meta: dict) -> list[str]:
    """Which library code each run imported (others may edit mpccs/ while this runs)."""
    start = meta.get("library_start")
    if not start:
        return []
    groups, changed = {}, []
    for r in meta.get("_runs", []):
        lib = r.get("library") or {}
        name = f"{r.get('condition', 'series')}/{r.get('collective', r.get('name'))}"
        groups.setdefault(lib.get("hash"), []).append(name)
        if r.get("library_after") and r.get("library_after") != lib.get("hash"):
            changed.append(name)
    mods = ", ".join(m.strip() for m in start.get("modified") or []) or "none"
    out = [f"- library: commit {start.get('commit')}, uncommitted changes under mpccs/ at the start: {mods}; "
           f"code hash {start['hash']} at the start, {(meta.get('library_end') or {}).get('hash')} at the end."]
    partial = meta.get("partial_runs") or []
    for pr in partial:
        lib = pr.get("library_start") or {}
        out.append(f"- series re-run into this matrix at {pr.get('start')}: `{pr.get('command')}` (commit "
                   f"{lib.get('commit')}, code hash {lib.get('hash')}); the cells and other series are from the run above.")
    if (len(groups) > 1 or changed) and not partial:
        out.append("- **the library's code changed while this ran** (another engineer's work in progress): "
                   + "; ".join(f"hash {h}: {len(v)} runs ({', '.join(v)})" for h, v in groups.items())
                   + (f". Files changed during {', '.join(changed)} (a rank may have imported either version)."
                      if changed else "."))
    load = meta.get("load_at_end")
    if load:
        out.append(f"- load average at the end: {', '.join(f'{x:.2f}' for x in load)} (2 cores; other jobs shared "
                   "the machine when this is above ~2)")
    return out


def condition_note(cond: str) -> str:
    return {
        "idle": "Nothing else on the links.",
        "background": f"The {BG_RATE} background flow runs from before the ranks start to after they end; it "
                      "competes with rank 1 -> rank 0 scale-out traffic on rank 0's downlink.",
        "failure": "Rank 1's scale-out link (switch port) goes down during the largest size's measurement, "
                   "then back; the operations in flight fail over to `up` and `out` rejoins after MPCCS_REPROBE. "
                   "Medians hide a single failure; the max column and the raw per-iteration times show it.",
        "shared": f"Both planes share one {SHARED_RATE} trunk per rank: together they cannot beat `up` alone "
                  "(the best split is all on one plane).",
    }[cond]


def failure_timing(runs: list) -> list[str]:
    """When the link went down relative to the cell it was meant to hit."""
    out = []
    for r in runs:
        if r.get("condition") != "failure":
            continue
        ev = {e["event"]: e["t"] for e in r.get("events", []) if e["event"] in ("link_down", "link_up")}
        done = sorted((float(t), int(size)) for size, t in (r.get("size_done") or {}).items())
        where = "no link failure happened"
        if "link_down" in ev:
            prev = 0.0
            where = f"link down at {ev['link_down']:.1f} s, up at {ev.get('link_up', float('nan')):.1f} s after launch"
            for t, size in done:
                if prev <= ev["link_down"] < t:
                    where += (f"; inside the {size_label(size)} cell ({prev:.1f}-{t:.1f} s), "
                              f"{ev['link_down'] - prev:.1f} s after it began")
                    break
                prev = t
            else:
                where += "; after the last cell had finished"
        out.append(f"- {r['collective']}: {where}.")
    return out


def background_rows(series: dict, cells: list):
    rows = []
    alone = series.get("_alone")
    if alone:
        rows.append(("alone (no job)", alone["delivered_Bps"], "-"))
    names = {"background": "adaptive", "background_cap": f"adaptive, MPCCS_OUT_CAP={CAP}",
             "background_rate_cap": f"adaptive, MPCCS_OUT_CAP_RATE={RATE_CAP} (paced)",
             "background_fixed": "fixed 2:1 split (0.667)"}
    for name, label in names.items():
        s = series.get(name)
        if s and s.get("background"):
            seg = next((g for g in s["segments"] if g["after"] == "background on" and g["rank"] == 0), None)
            op = f"{seg['median_op_ms']:.0f}" if seg and seg["median_op_ms"] else "-"
            rows.append((label, s["background"][0]["delivered_Bps"], op))
    for coll, recs in series.get("_matrix_bg", {}).items():
        if recs:
            rows.append((f"matrix: mpccs-perf {coll}, all policies", recs[0]["delivered_Bps"], "-"))
    return rows


def verdict_text(cells: list, series: dict) -> str:
    out = ["Verdicts (generated from the numbers above):", ""]
    for cond in CONDITIONS:
        big = [c for c in cells if c["condition"] == cond and not c.get("missing") and c["size"] >= 16 * MiB]
        if not big:
            continue
        met = [c for c in big if verdict_best(c) == "holds"]
        ratios = [c["vs_best"][0] for c in big]
        floors = [c["floor"] for c in big]
        out.append(f"- **{cond}**: adaptive / best single plane at 16-64 MiB {min(ratios):.2f}-{max(ratios):.2f} "
                   f"(median {np.median(ratios):.2f}; A/A floors {min(floors):.2f}-{max(floors):.2f}); "
                   f"the >= 0.97x rule (lower bound minus floor) holds in {len(met)} of {len(big)} cells."
                   + (" " + ", ".join(f"{c['collective']} {size_label(c['size'])} {c['vs_best'][0]:.2f}x"
                                      for c in big if verdict_best(c) != "holds") + " fall short."
                          if len(met) < len(big) else ""))
        if cond == "idle":
            top = max(c["size"] for c in big)
            sums = [c for c in big if c["size"] == top]
            ok_sum = [c["collective"] for c in sums if holds(c["vs_sum"], 0.90, c["floor"])]
            ok_up = [c["collective"] for c in sums if holds(c["vs_up"], 1.35, c["floor"])]
            out.append(f"  Idle targets at {size_label(top)} (testbed_targets.py): >= 0.90x the sum of the planes holds "
                       f"for {', '.join(ok_sum) or 'none'}; >= 1.35x up holds for {', '.join(ok_up) or 'none'} "
                       f"(medians: vs sum " + ", ".join(f"{c['vs_sum'][0]:.2f}" for c in sums)
                       + "; vs up " + ", ".join(f"{c['vs_up'][0]:.2f}" for c in sums) + ").")
    for name in ("background", "failure"):
        s = series.get(name)
        if not s:
            continue
        parts = []
        for seg in s["segments"]:
            if seg["after"] == "start":
                continue
            cv = seg["convergence"].get("rolling5") or {}
            st = seg["convergence"].get("strict") or {}
            fin = seg["convergence"].get("final")
            if fin is None:
                parts.append(f"rank {seg['rank']}: after {seg['after']}: no operations")
                continue

            def when(d):
                return f"{d.get('ops')} ops / " + ("never" if d.get("s") is None else f"{d['s']:.1f} s")
            nm = seg.get("near_model") or {}
            near = ("never" if nm.get("first_ops") is None else
                    f"after {nm['first_ops']} ops ({nm['inside']:.0%} of the segment inside)")
            parts.append(f"rank {seg['rank']}: after {seg['after']} the share ends at {fin:.2f} "
                         f"(model {seg['model_share']:.2f}; mean {seg['mean_share']:.2f}), within 5 points after "
                         f"{when(cv)} (rolling), {when(st)} (strict); 5-op mean within 5 points of the model "
                         f"{near}")
        out.append(f"- **time series, {name}**: " + "; ".join(parts) + ".")
    out += sweep_lines(series.get("_sweep"), series.get("_vs_sweep") or {})
    bg = dict((label, rate) for label, rate, _ in background_rows(series, cells))
    if bg:
        out.append("- **background flow**: " + ", ".join(f"{k} {v * 8 / 1e6:.0f} Mbit/s" for k, v in bg.items())
                   + f" (asked {BG_BPS / 1e6:.0f}).")
    return "\n".join(out)


def sweep_lines(sweep: dict | None, vs: dict) -> list[str]:
    if not sweep or not sweep["segments"]:
        return []
    segs = sweep["segments"]
    labels = [lab for lab in ("start", "background on", "background off") if lab in segs]
    fractions = sorted({p for lab in labels for p in segs[lab]["by_fraction"]}, key=float)
    out = [f"- **best fixed fraction** (`background_sweep`: fixed fractions on 'up' in turn, one per 16 MiB "
           f"all_reduce; median op time in ms [p25-p75], operations within {SETTLE_S:.0f} s of a change left out):",
           "", "  | fraction on up | " + " | ".join(labels) + " |", "  |---|" + "---|" * len(labels)]
    for p in fractions:
        cells = []
        for lab in labels:
            st = segs[lab]["by_fraction"].get(p)
            mark = "**" if st and float(p) == segs[lab]["best"] else ""
            cells.append(f"{mark}{st['median_ms']:.0f}{mark} [{st['p25_ms']:.0f}-{st['p75_ms']:.0f}] (n={st['n']})"
                         if st else "-")
        out.append(f"  | {p} | " + " | ".join(cells) + " |")
    out.append("")
    for name, res in vs.items():
        if not res:
            continue
        out.append(f"- **convergence against the sweep, {name}** (from the background's first / last byte; "
                   "operations until the 5-operation mean of the share on 'up' is within 5 points of the best "
                   "fixed fraction, the part of the segment inside, the mean and the first shares):")
        for lab, r in res.items():
            who = "; ".join(
                f"{k} " + ("never" if v.get("first_ops") is None else f"{v['first_ops']} ops")
                + f" ({v['inside']:.0%} inside, mean {v['mean']:.2f}: " + ", ".join(f"{x:.2f}" for x in v["first"]) + ")"
                for k, v in r["shares"].items())
            t = (f"; median op {r['median_op_ms']:.0f} ms against {r['best_fixed_ms']:.0f} for the best fixed "
                 f"fraction ({r['time_vs_best_fixed']:.2f}x its speed)") if r.get("median_op_ms") else ""
            out.append(f"  - after {lab} (best fixed {r['best_fixed']:.2f}, {r['ops']} operations): {who}{t}.")
    return out


def near_cell(nm) -> str:
    if not nm or nm.get("first_ops") is None:
        return "never" if nm else "-"
    return f"{nm['first_ops']} ({nm['inside']:.0%})"


def problems(cells, series, meta) -> list[str]:
    out = []
    raw_runs = meta.get("_runs", [])
    for r in raw_runs:
        if r.get("exit_code") not in (0, None):
            tail = " / ".join(line for lines in (r.get("output_tail") or {}).values() for line in lines[-3:])
            out.append(f"- {r.get('condition', r.get('name'))}/{r.get('collective', '')}: exit code "
                       f"{r['exit_code']}. Last lines: `{tail[:400]}`")
        for e in r.get("events", []):
            if e.get("event") == "action_failed":
                out.append(f"- {r.get('condition', r.get('name'))}: testbed action failed: {e}")
    wrong = [c for c in cells if not c.get("missing") and c["wrong"]]
    for c in wrong:
        out.append(f"- WRONG RESULTS: {c['condition']}/{c['collective']} {size_label(c['size'])}: {c['wrong']} elements")
    for name, s in series.items():
        if name.startswith("_") or not s:
            continue
        for rank, v in (s.get("rank_summary") or {}).items():
            if not v["correct_last"]:
                out.append(f"- series {name}: rank {rank}'s last result was wrong")
        if s["policy"] != "adaptive":
            continue
        off = [g for g in s["segments"] if g["ops"] >= 20 and g["mean_share"] is not None
               and abs(g["mean_share"] - g["model_share"]) > 0.10]
        if off:
            out.append(f"- series {name}: the share stayed more than 10 points from the model share in "
                       + ", ".join(f"rank {g['rank']} after {g['after']} ({g['mean_share']:.2f} vs {g['model_share']:.2f})"
                                   for g in off) + ".")
        co = s.get("coordination") or {}
        pr, cl = co.get("probe_ops") or {}, co.get("classes") or {}
        if pr.get("one", 0) > pr.get("both", 0):
            ms = {k: (v.get("median_op_ms") or float("nan")) for k, v in cl.items()}
            out.append(f"- series {name}: {pr['one']} probe operations had one rank probing and {pr['both']} both; "
                       f"operations with one rank split took {ms['one rank split']:.0f} ms (median), with both "
                       f"{ms['both ranks split']:.0f} ms, with neither {ms['neither (all on up)']:.0f} ms. An "
                       "all_reduce stage ends with its slowest rank, so a probe on one rank cannot show the gain "
                       "of the split, and a dropped plane stays dropped.")
    return out or ["- No failed runs, wrong results or failed testbed actions."]


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------

COLORS = {"up": "C0", "up#2": "C0", "out": "C1", "0.8": "C2", "adaptive": "C3"}


def plot_all(out: str, cells: list, series: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for cond in CONDITIONS:
        cc = [c for c in cells if c["condition"] == cond and not c.get("missing")]
        if not cc:
            continue
        fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
        for ax, coll in zip(axes.flat, COLLECTIVES):
            pts = sorted((c for c in cc if c["collective"] == coll), key=lambda c: c["size"])
            for p in LABELS:
                if pts:
                    ax.plot([c["size"] for c in pts], [c["busbw"][p] for c in pts], "o-" if p != "up#2" else ":",
                            ms=3, color=COLORS[p], alpha=0.5 if p == "up#2" else 1, label=p)
            ax.set_xscale("log", base=2)
            ax.set_title(coll)
            ax.grid(alpha=0.3)
            ax.set_ylabel("busbw (GB/s)")
        for ax in axes[1]:
            ax.set_xlabel("size (bytes)")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{cond}: 2 ranks, up {UP_RATE} / out {OUT_RATE} tcp"
                     + (f", {BG_RATE} background into rank 0's out link" if cond == "background" else "")
                     + (", rank 1's out link down mid-run" if cond == "failure" else "")
                     + (f", one {SHARED_RATE} trunk for both planes" if cond == "shared" else ""))
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"busbw_{cond}.png"), dpi=100)
        plt.close(fig)
    for name, s in series.items():
        if name.startswith("_") or not s or not s["ops"].get("0"):
            continue
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
        for rank, ops in sorted(s["ops"].items()):
            ax.plot([o["t"] for o in ops], [o["share_up"] for o in ops], ".-", ms=3, lw=0.6,
                    color=f"C{rank}", alpha=1 if rank == "0" else 0.6, label=f"rank {rank}")
            plan = [(o["t"], o["planned_up"]) for o in ops if o.get("planned_up") is not None]
            if plan:
                ax.plot(*zip(*plan), "--", lw=0.8, color=f"C{rank}", alpha=0.8, label=f"rank {rank} planned")
        ops = s["ops"]["0"]
        # all_reduce busbw factor 2(n-1)/n = 1 for 2 ranks
        ax2.plot([o["t"] for o in ops], [SERIES_BYTES / o["dt"] / 1e9 if o["dt"] else 0 for o in ops],
                 ".", ms=3, color="C3")
        for ch in s["changes"]:
            for a in (ax, ax2):
                a.axvline(ch["t"], color="k", ls="--", lw=0.8)
            ax.text(ch["t"], 1.02, " " + ch["label"], fontsize=8, va="bottom")
        for seg in s["segments"]:
            fin = seg["convergence"].get("final")
            color = f"C{seg['rank']}"
            if fin is None or not seg["ops"]:
                continue
            end = next((c["t"] for c in s["changes"] if c["t"] > seg["t_change"]), ops[-1]["t"])
            ax.hlines([fin - TOLERANCE, fin + TOLERANCE], seg["t_change"], end, colors=color, lw=0.5, alpha=0.6)
            r5 = (seg["convergence"].get("rolling5") or {}).get("s")
            if seg["after"] != "start" and r5 is not None:
                ax.plot([seg["t_change"] + r5], [fin], marker="v", color=color, ms=8)
        ax.axhline(UP_BPS / (UP_BPS + OUT_BPS), color="C2", lw=0.8, ls=":", label="2:1 model share")
        ax.set_ylim(-0.02, 1.1)
        ax.set_ylabel("share of bytes on up")
        ax.legend(fontsize=8, loc="lower left")
        ax2.set_ylabel("busbw (GB/s)")
        ax2.set_xlabel("seconds since the first operation")
        ax2.grid(alpha=0.3)
        ax.grid(alpha=0.3)
        env = ", ".join(f"{k}={v}" for k, v in (s.get("env") or {}).items() if k != "MPCCS_TRACE")
        ax.set_title(f"{name}: 16 MiB all_reduce, {s['policy']} ({env})\nlines: final share +-5 points; "
                     "triangles: converged (rolling); dashed: the share planned (before chunks and stealing)",
                     fontsize=10)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"share_{name}.png"), dpi=100)
        plt.close(fig)
    rows = background_rows(series, cells)
    if rows:
        fig, ax = plt.subplots(figsize=(9, 4))
        vals = [r[1] * 8 / 1e6 for r in rows][::-1]
        ax.barh([r[0] for r in rows][::-1], vals, color="C1")
        for i, v in enumerate(vals):
            ax.text(v * 0.98, i, f"{v:.0f}", va="center", ha="right", fontsize=8)
        ax.axvline(BG_BPS / 1e6, color="k", ls="--", lw=0.8, label=f"asked {BG_BPS / 1e6:.0f} Mbit/s")
        ax.set_xlabel("background flow delivered (Mbit/s)")
        ax.legend(fontsize=8, loc="lower left")
        ax.set_title("paced background flow into rank 0's scale-out link (500 Mbit/s link)", fontsize=10)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "background_throughput.png"), dpi=100)
        plt.close(fig)


# ---------------------------------------------------------------------------------------------

def report(out: str) -> str:
    raw = os.path.join(out, "raw")
    meta = load(os.path.join(raw, "meta.json"))
    versions = meta.get("versions", {})  # (a run of series alone has no mpccs-perf JSON to take them from)
    runs = []
    for cond in CONDITIONS:
        for coll in COLLECTIVES:
            p = os.path.join(raw, cond, f"{coll}.json")
            if os.path.exists(p) and not versions.get("mpccs"):
                versions = load(p)["meta"]
            rp = os.path.join(raw, cond, f"{coll}.run.json")
            if os.path.exists(rp):
                runs.append(load(rp))
    series = {name: analyse_series(raw, name) for name in SERIES}
    series["_sweep"] = analyse_sweep(raw)
    # the uncapped series only: a cap binds the share by design
    series["_vs_sweep"] = {"background": converge_to_sweep(raw, "background", series["_sweep"])}
    for name in list(series):
        rp = os.path.join(raw, "series", f"{name}.run.json")
        if os.path.exists(rp):
            runs.append(load(rp))
    alone = os.path.join(raw, "series", "background_alone.json")
    series["_alone"] = load(alone) if os.path.exists(alone) else None
    series["_matrix_bg"] = {r["collective"]: r.get("background") for r in runs
                            if r.get("condition") == "background"}
    meta["_runs"] = runs
    cells = analyse_matrix(raw, meta)
    text = render(cells, series, meta, versions)
    with open(os.path.join(out, "report.md"), "w") as fh:
        fh.write(text)
    summary = {"meta": {k: v for k, v in meta.items() if k != "_runs"}, "versions": versions, "cells": cells,
               "series": {k: v for k, v in series.items()}}
    with open(os.path.join(out, "matrix.json"), "w") as fh:
        json.dump(summary, fh, indent=1, default=str)
    plot_all(out, cells, series)
    return text


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_perf":
        return rank_perf(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "_series":
        return rank_series(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "matrix"))
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 sizes, 4 iterations, short series (~3 min)")
    ap.add_argument("--report-only", action="store_true", help="rebuild report.md, matrix.json and plots from raw/")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("--no-series", action="store_true", help="skip the time series and background runs")
    ap.add_argument("--series", default=",".join(SERIES), help="which time series to run (default: all)")
    ns = ap.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    start = time.time()
    if not ns.report_only:
        measure(ns, PLANS["quick" if ns.quick else "default"])
    text = report(ns.out)
    print(text)
    say(f"done in {time.time() - start:.0f} s; report: {os.path.join(ns.out, 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
