"""Collectives of 2-4 ranks on one host (by default 3 and 4): this checkout against
another, and MPICH through mpi4py, in alternating processes.

    git worktree add /tmp/old <rev>
    python bench/group_lane_ab.py --old /tmp/old --rounds 4 --out bench/results/group_lane_s29
    python bench/group_lane_ab.py --old /tmp/old --collective all_gather --sizes 1M,4M --out DIR

Each round runs, for each rank count, the same timing under the other
checkout (PYTHONPATH), under this one, and under MPICH (mpiexec, no mpccs
code in the processes), back to back. Timing: float32 sum all_reduce (or
--collective: reduce_scatter, all_gather, all_to_all, broadcast and reduce
from rank 0; a size is the input of one rank), out of place (a broadcast in place); per size 30 warm-up calls, then 20 blocks of K back-to-back calls
after a barrier (a training loop's calls come back to back), per-call time =
the block's time / K on the slowest rank, median over the blocks. Writes
report.md and rounds.json under --out.
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

SIZES = (8, 1 << 10, 16 << 10, 64 << 10, 256 << 10)  # --sizes picks others (the ranks read GROUP_LANE_AB_SIZES)


def _calls_per_block(nbytes: int) -> int:
    return 50 if nbytes <= 1 << 10 else 20 if nbytes <= 16 << 10 else 10 if nbytes <= 64 << 10 else 5


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")


def _collective() -> str:
    return os.environ.get("GROUP_LANE_AB_COLLECTIVE", "all_reduce")


def _out_count(name: str, count: int, world: int) -> int:
    """The output's elements for an input of ``count``."""
    return count // world if name == "reduce_scatter" else count * world if name == "all_gather" else count


def _sizes() -> tuple:
    text = os.environ.get("GROUP_LANE_AB_SIZES")
    return tuple(int(x) for x in text.split(",")) if text else SIZES
BLOCKS, WARMUP = 20, 30


def _allocator():
    """np.empty, or mpccs.empty where GROUP_LANE_AB_MEMORY=hugepages (bench/hostmem_ab.py), loaded
    from its file: an MPI rank imports no mpccs package (no UCX) to get it."""
    if os.environ.get("GROUP_LANE_AB_MEMORY", "numpy") != "hugepages":
        return np.empty
    import importlib.util

    spec = importlib.util.spec_from_file_location("hostmem", os.path.join(os.path.dirname(HERE), "mpccs", "hostmem.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.empty


def _time_sizes(call, barrier, slowest, world: int, algorithm=None) -> dict:
    """Per size the median per-call time in us; with ``algorithm`` (a callable
    giving the last call's), also "algorithm_<size>"."""
    res, empty = {}, _allocator()
    for nbytes in _sizes():
        count = nbytes // 4 // world * world  # (a whole block per rank)
        send, out = empty(count, np.float32), empty(_out_count(_collective(), count, world), np.float32)
        send[...] = 1
        k = _calls_per_block(nbytes)
        for _ in range(WARMUP):
            call(send, out)
        times = np.empty(BLOCKS)
        for b in range(BLOCKS):
            barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                call(send, out)
            times[b] = (time.perf_counter() - t0) / k
        if algorithm is not None:  # (before slowest(), itself a call)
            res[f"algorithm_{nbytes}"] = algorithm()
        res[str(nbytes)] = float(np.median(slowest(times))) * 1e6
    return res


def rank_mpccs() -> None:
    import mpccs

    comm = mpccs.init()
    name = _collective()
    call = {"broadcast": lambda send, out: comm.broadcast(send, root=0),
            "reduce": lambda send, out: comm.reduce(send, out, root=0)}.get(name) or getattr(comm, name)
    res = _time_sizes(call, comm.barrier,
                      lambda t: comm.all_reduce(t, np.empty_like(t), op="max"), comm.size,
                      lambda: comm.last_stats()["algorithm"])
    x = np.ones(2, np.float32)
    comm.all_reduce(x, np.empty_like(x))
    res["algorithm_8"] = comm.last_stats()["algorithm"]
    if comm.rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    comm.close()


def rank_mpi() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    call = {"all_reduce": comm.Allreduce, "reduce_scatter": comm.Reduce_scatter_block,
            "all_gather": comm.Allgather, "all_to_all": comm.Alltoall,
            "broadcast": lambda send, out: comm.Bcast(send, root=0),
            "reduce": lambda send, out: comm.Reduce(send, out, root=0)}[_collective()]
    res = _time_sizes(call, comm.Barrier, lambda t: _mpi_max(comm, t), comm.size)
    if comm.rank == 0:
        print("RESULT " + json.dumps(res), flush=True)


def _mpi_max(comm, t: np.ndarray) -> np.ndarray:
    from mpi4py import MPI

    out = np.empty_like(t)
    comm.Allreduce(t, out, op=MPI.MAX)
    return out


def _result(proc: subprocess.CompletedProcess) -> dict:
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def run_mpccs(path: str, n: int) -> dict:
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", str(n), "--no-prefix", sys.executable, __file__,
                           "--rank", "mpccs"], env=env, cwd=path, capture_output=True, text=True, timeout=600,
                          check=True)
    return _result(proc)


def run_mpi(n: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPCCS_", "PYTHONPATH"))}
    proc = subprocess.run([os.path.join(BIN, "mpiexec"), "-n", str(n), sys.executable, __file__, "--rank", "mpi"],
                          env=env, capture_output=True, text=True, timeout=600, check=True)
    return _result(proc)


def report(rounds: list, old: str, worlds: tuple, name: str = "all_reduce") -> list:
    lines = [f"# {name} of {' and '.join(str(n) for n in worlds)} ranks: this checkout against {old}, and MPICH", "",
             "Per-call time in us, float32 sum, out of place, slowest rank, median of 20 blocks of back-to-back "
             "calls (a size: one rank's input); per round old / new / MPICH; then the medians of the rounds' "
             "ratios.", "",
             "| ranks | size | " + " | ".join(f"round {k + 1}" for k in range(len(rounds)))
             + " | old / new | new / MPICH |", "|---|---|" + "---|" * len(rounds) + "---:|---:|"]
    for n in worlds:
        for nbytes in _sizes():
            key = str(nbytes)
            cells = [f"{r[n]['old'][key]:.0f} / {r[n]['new'][key]:.0f} / {r[n]['mpi'][key]:.0f}" for r in rounds]
            speedup = np.median([r[n]["old"][key] / r[n]["new"][key] for r in rounds])
            to_mpi = np.median([r[n]["new"][key] / r[n]["mpi"][key] for r in rounds])
            lines.append(f"| {n} | {size_text(nbytes)} | " + " | ".join(cells) + f" | {speedup:.2f} | {to_mpi:.2f} |")
    for n in worlds:
        old_new = [(size_text(b), rounds[0][n]["old"].get(f"algorithm_{b}"), rounds[0][n]["new"].get(f"algorithm_{b}"))
                   for b in _sizes()]
        if all(a is not None for _, a, _ in old_new):
            lines.append(f"\n{n} ranks, algorithm per size (old -> new): "
                         + ", ".join(f"{s} {a} -> {b}" for s, a, b in old_new))
    paths = {n: (rounds[0][n]["old"]["algorithm_8"], rounds[0][n]["new"]["algorithm_8"]) for n in worlds}
    lines += ["", "8-byte call's algorithm (old, new): "
              + ", ".join(f"{n} ranks {a} -> {b}" for n, (a, b) in paths.items())]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the other checkout (a git worktree)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--ranks", default="3,4")
    ap.add_argument("--sizes", help="bytes per call, comma-separated (K and M suffixes); default 8 B-256 KiB")
    ap.add_argument("--collective", choices=COLLECTIVES, default="all_reduce")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["GROUP_LANE_AB_COLLECTIVE"] = args.collective
    worlds = tuple(int(n) for n in args.ranks.split(","))
    if args.sizes:
        units = {"K": 1 << 10, "M": 1 << 20}
        os.environ["GROUP_LANE_AB_SIZES"] = ",".join(
            str(int(x[:-1]) * units[x[-1].upper()] if x[-1].upper() in units else int(x)) for x in args.sizes.split(","))
    new_path = os.path.dirname(HERE)
    rounds = []
    for k in range(args.rounds):
        rounds.append({n: {"old": run_mpccs(args.old, n), "new": run_mpccs(new_path, n), "mpi": run_mpi(n)}
                       for n in worlds})
        print(f"# progress: {k + 1}/{args.rounds} rounds", flush=True)
    write_rounds(args.out, args.old, rounds, report(rounds, args.old, worlds, args.collective))


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_mpi() if sys.argv[sys.argv.index("--rank") + 1] == "mpi" else rank_mpccs()
    else:
        main()
