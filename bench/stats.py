"""Ratios with bootstrap intervals, the method every benchmark report uses.

A ratio "A over B" is speed(A) / speed(B) = time(B) / time(A). For policies
timed interleaved in one run the iterations are paired (iteration i of A and
of B ran back to back), so the bootstrap resamples iteration indices; for
peers timed in other processes the two samples are resampled independently.
The reported value is the median ratio with a 95% percentile interval.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

RESAMPLES = 2000


def ratio_ci(times_a, times_b, paired: bool, seed: int = 0) -> tuple[float, float, float]:
    """(median ratio, 2.5th, 97.5th percentile) of time(B)/time(A): >1 means A is faster."""
    a, b = np.asarray(times_a, float), np.asarray(times_b, float)
    rng = np.random.default_rng(seed)
    if paired and len(a) == len(b):
        idx = rng.integers(0, len(a), (RESAMPLES, len(a)))
        ratios = np.median(b[idx], axis=1) / np.median(a[idx], axis=1)
    else:
        ia = rng.integers(0, len(a), (RESAMPLES, len(a)))
        ib = rng.integers(0, len(b), (RESAMPLES, len(b)))
        ratios = np.median(b[ib], axis=1) / np.median(a[ia], axis=1)
    point = float(np.median(b) / np.median(a))
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return point, float(lo), float(hi)


def holds(ratio: tuple[float, float, float], target: float, noise_floor: float) -> bool:
    """A target holds when the interval's lower bound minus the A/A noise floor clears it."""
    return ratio[1] - noise_floor >= target


def mann_whitney_p(a, b) -> float:
    """Two-sided p of the Mann-Whitney U test (normal approximation with tie and
    continuity corrections, as scipy's asymptotic method): for A/Bs whose runs are
    the samples (alternating testbed runs, one ratio per run and point)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        return float("nan")
    both = np.concatenate([a, b])
    order = both.argsort(kind="mergesort")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    _, inverse, counts = np.unique(both, return_inverse=True, return_counts=True)
    ranks = np.bincount(inverse, ranks)[inverse] / counts[inverse]  # ties share their mean rank
    u = ranks[:n1].sum() - n1 * (n1 + 1) / 2
    n = n1 + n2
    sigma = np.sqrt(n1 * n2 / 12 * ((n + 1) - (counts ** 3 - counts).sum() / (n * (n - 1))))
    if sigma == 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / sigma
    return float(min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2))))


def code_text(codes: dict) -> str:
    """Which mpccs each run's ranks imported (mpccs-perf's meta.code), for a report: one line,
    the runs that share a code together (docs/benchmarks.md, method 10)."""
    by_code: dict = {}
    for run, code in codes.items():
        if code:
            by_code.setdefault((code["path"], code["sources"]), []).append(run)
    if not by_code:
        return "Code: not recorded."
    parts = [f"{path} (sources {sources}): {', '.join(runs)}" for (path, sources), runs in by_code.items()]
    return "Code the ranks imported (mpccs-perf's `# code:`): " + "; ".join(parts) + "."


def size_text(n: int) -> str:
    """A report's size label: 8 B, 64 KiB, 16 MiB; a size between whole units in the
    smaller one (1536 KiB, not "1 MiB": two sizes must not read alike)."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n >> 10} KiB" if n >= 1 << 10 and n % (1 << 10) == 0 else f"{n} B"


def noise_floor(times_a, times_a2) -> float:
    """Half-width of the A/A ratio's interval around 1 (how far identical runs stray)."""
    point, lo, hi = ratio_ci(times_a, times_a2, paired=True)
    return max(abs(1 - lo), abs(hi - 1), abs(point - 1))


def slowest_rank(comm, times: dict) -> dict:
    """Per-iteration times of every mode, each the slowest rank's (an mpccs
    communicator's max all_reduce): {mode: [seconds, ...]}, the same on every rank."""
    modes = list(times)
    local = np.array([times[m] for m in modes], np.float64)
    worst = comm.all_reduce(local, np.empty_like(local), op="max")
    return {m: worst[k].tolist() for k, m in enumerate(modes)}


def interleaved_modes(comm, modes, time_mode, iters: int, warmup: int) -> tuple[dict, dict]:
    """Each mode's per-op times, the slowest rank's (slowest_rank), over ``iters``
    rounds after ``warmup``, the modes interleaved within every round so that the
    machine's drift hits them alike (``time_mode(mode)``: this rank's seconds per
    call); and the algorithm each mode's last call ran."""
    times = {mode: [] for mode in modes}
    ran = {}
    for i in range(warmup + iters):
        for mode in modes:
            t = time_mode(mode)
            ran[mode] = comm.last_stats()["algorithm"]
            if i >= warmup:
                times[mode].append(t)
    return slowest_rank(comm, times), ran


def time_block(comm, call, block: int) -> float:
    """Seconds per call of ``block`` back-to-back calls after a barrier (this rank's clock)."""
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(block):
        call()
    return (time.perf_counter() - t0) / block


def host_text() -> str:
    """The machine a result came from, as every results file records it."""
    return f"{os.uname().sysname} {os.uname().release}, {os.cpu_count()} CPUs"


def ab_meta(comm, args, version: str, **extra) -> dict:
    """What an in-process interleaved A/B benchmark records about its run (ab_parser's flags)."""
    return {"mpccs": version, **extra, "iters": args.iters, "block": args.block, "world": comm.size,
            "host": host_text()}


def ab_cells(times: dict, before: str, after: str, before_again: str) -> str:
    """The cells of an A/B row: median us before and after, the speedup time(before) / time(after)
    with its paired 95% interval, and the A/A floor of ``before`` against ``before_again``."""
    point, lo, hi = ratio_ci(times[after], times[before], paired=True)
    return (f"{1e6 * np.median(times[before]):.0f} | {1e6 * np.median(times[after]):.0f} | "
            f"{point:.2f} [{lo:.2f}, {hi:.2f}] | {noise_floor(times[before], times[before_again]):.2f}")


def ab_size_row(row: dict, before: str, after: str, before_again: str, *cells: str) -> str:
    """A report line of one size_sweep row: its size in MiB, in place or not, ``cells``, then ab_cells."""
    middle = "".join(f"{cell} | " for cell in cells)
    return (f"| {row['size'] >> 20} MiB | {'yes' if row['in_place'] else 'no'} | {middle}"
            + ab_cells(row["times_s"], before, after, before_again) + " |")


def size_sweep(comm, in_place_modes, sizes, measure_one) -> list[dict]:
    """``measure_one(nbytes, in_place)`` for every size, out of place and in place as
    ``in_place_modes`` lists them (outermost), with a progress line on rank 0 after each."""
    rows = []
    for in_place in in_place_modes:
        for nbytes in sizes:
            rows.append(measure_one(nbytes, in_place))
            if comm.rank == 0:
                print(f"# progress: {'in place' if in_place else 'out of place'} {nbytes >> 20} MiB", flush=True)
    return rows


def ab_parser(doc: str, block: int) -> argparse.ArgumentParser:
    """The flags of the in-process interleaved A/B benchmarks (direct_ab, two_step_ab)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=15, help="interleaved iterations per size")
    ap.add_argument("--block", type=int, default=block, help="operations timed together per iteration")
    ap.add_argument("--warmup", type=int, default=2, help="iterations left out")
    return ap


def write_ab_results(out_dir: str, json_name: str, meta: dict, rows: list, lines: list[str]) -> None:
    """An A/B benchmark's rows as JSON, and its report section printed and appended to report.md."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, json_name), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print("\n".join(lines), flush=True)
    with open(os.path.join(out_dir, "report.md"), "a") as fh:
        fh.write("\n".join(lines) + "\n")


def write_rounds(out_dir: str, old: str, rounds: list, lines: list[str]) -> None:
    """A checkout A/B's rounds as rounds.json and its report as report.md (written afresh), printed too."""
    write_results(out_dir, "rounds.json", {"old": old, "rounds": rounds}, "report.md", "\n".join(lines) + "\n")


def ways_in_launches(doc: str, script: str, rank_main, launches: int, nbytes: int, calls: int):
    """The command line of an A/B within launches (landing_phases.py, outbox_flush_probe.py). In a
    rank (``--rank-main BYTES CALLS OUT``): run ``rank_main(bytes, calls, out)``, return None. Else
    parse ``--out --launches --bytes --calls`` (these defaults), launch, and return the arguments
    and each launch's rows."""
    if "--rank-main" in sys.argv:
        nbytes_arg, calls_arg, out = sys.argv[2:5]
        rank_main(int(nbytes_arg), int(calls_arg), out)
        return None
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--launches", type=int, default=launches)
    ap.add_argument("--bytes", type=int, default=nbytes)
    ap.add_argument("--calls", type=int, default=calls)
    args = ap.parse_args()
    return args, rank_rows_per_launch(script, args.launches, [str(args.bytes), str(args.calls)])


def rank_rows_per_launch(script: str, launches: int, rank_args: list[str]) -> list:
    """Launch ``script --rank-main ARGS... OUT`` on 2 ranks ``launches`` times (a progress line
    each); each launch's rank 0 writes its rows as JSON to OUT. The rows of every launch."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    bin_dir = os.path.dirname(sys.executable)
    per_launch = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(launches):
            out = f"{tmp}/rows{k}.json"
            subprocess.run([f"{bin_dir}/mpccs-run", "-n", "2", "--no-prefix", sys.executable, script, "--rank-main",
                            *rank_args, out], check=True, env=env, timeout=300, stdout=subprocess.DEVNULL)
            with open(out) as fh:
                per_launch.append(json.load(fh))
            print(f"# progress: {k + 1}/{launches} launches", flush=True)
    return per_launch


def write_results(out_dir: str, json_name: str, payload: dict, report_name: str, text: str) -> None:
    """A run's data as JSON and its report as markdown (both written afresh), the report printed too."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, json_name), "w") as fh:
        json.dump(payload, fh, indent=1)
    with open(os.path.join(out_dir, report_name), "w") as fh:
        fh.write(text)
    print(text, flush=True)


def ab_report_head(title: str, meta: dict, columns: str, align: str) -> list[str]:
    """The head of an A/B benchmark's report section: title, what ran, and the table's header rows."""
    return [f"## {title}", "",
            f"mpccs {meta['mpccs']}, {meta['iters']} interleaved iterations of {meta['block']} operations, "
            f"{meta['host']}", "", columns, align]


def launched(cmd: list[str], env: dict[str, str], timeout: float = 600) -> str:
    """The output of one launch of ``cmd`` (a launcher and its ranks); exits with its tail if it failed."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def launched_rows(cmd: list[str], env: dict[str, str]) -> list[dict]:
    """The JSON rows (``-J``) of one launch of mpccs-perf or bench/peers.py; exits if any element was wrong."""
    with tempfile.TemporaryDirectory() as tmp:
        launched(cmd + ["-J", f"{tmp}/rows.json"], env)
        with open(f"{tmp}/rows.json") as fh:
            rows = json.load(fh)["rows"]
    wrong = sum(r["wrong"] for r in rows)
    if wrong:
        sys.exit(f"{' '.join(cmd)}: {wrong} wrong elements")
    return rows
