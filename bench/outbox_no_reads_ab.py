"""On a pair that does not read across processes (a container whose seccomp
profile refuses process_vm_readv): a 2-rank all_reduce through the outboxes in
rounds (comm._direct_by_outboxes), or a broadcast or reduce round the outbox in
chunks (pipe_steps.py, --collective), or on the path it took before (the
controller's two-step executor, ring or tree over UCX)?

    MPCCS_CMA=0 MPCCS_UP_TLS=posix,sysv,self mpccs-run -n 2 --no-prefix \
        python bench/outbox_no_reads_ab.py --out bench/results/outbox_no_reads_s53 [--collective broadcast]

MPCCS_CMA=0 closes mpccs's reads; leaving `cma` out of the scale-up plane's
UCX transports takes UCX's own cross-process copy away too, as such a
container does. Float32, policy 'adaptive' as shipped, default planes,
--sizes MiB (a reduce_scatter's input: blocks of half that), out of place and
in place (a broadcast: in place; a reduce_scatter: out of place; root 0).
Each iteration times a block of back-to-back calls three ways, interleaved:
the path before (the bound, direct_ops.DIRECT_OUTBOX_MAX_BYTES or the pipe's
PIPE_MAX_BYTES_WITHOUT_READS, set to the outbox's on both ranks between the
same calls), through the outboxes, and the path before again (the A/A floor); one
call each way precedes every timed block. Per-op time = block time / block
length, max across ranks. Writes outbox_no_reads.json and a section of
report.md under --out.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import mpccs
from mpccs import comm as comm_module
from mpccs import pipe_steps
from mpccs.transports import shm

sys.path.insert(0, os.path.dirname(__file__))
from stats import ab_meta, ab_parser, ab_report_head, ab_size_row, interleaved_modes, size_sweep  # noqa: E402
from stats import time_block, write_ab_results  # noqa: E402

MIB = 1 << 20
WAYS = {"before": False, "outboxes": True, "before_again": False}


def set_way(collective: str, outboxes: bool) -> None:
    """The bound of the outboxes' path for ``collective``: 256 MiB, or where it was before."""
    if collective == "all_reduce":
        comm_module.DIRECT_OUTBOX_MAX_BYTES = 256 * MIB if outboxes else 0
    else:
        before = 0 if collective == "reduce_scatter" else shm.OUTBOX_BYTES
        pipe_steps.PIPE_MAX_BYTES_WITHOUT_READS[collective] = 256 * MIB if outboxes else before


def caller(comm, collective: str, x: np.ndarray, out: np.ndarray, in_place: bool):
    # In place "max" keeps the operand's values (a sum would double them into inf).
    if collective == "broadcast":
        return lambda: comm.broadcast(x, root=0)
    if collective == "reduce":
        recv = None if in_place or comm.rank != 0 else out
        return lambda: comm.reduce(x, recv, op="max", root=0)
    if collective == "reduce_scatter":  # (x: a block's worth for each rank)
        return lambda: comm.reduce_scatter(x, out[:x.size // 2])
    return (lambda: comm.all_reduce(x, op="max")) if in_place else (lambda: comm.all_reduce(x, out))


def measure(comm, collective: str, nbytes: int, in_place: bool, args, ways: dict, switch) -> dict:
    """One size's rows: the ways interleaved, each switched on both ranks by ``switch(ways[way])``."""
    x = (np.arange(nbytes // 4) % 7).astype(np.float32)
    out = np.empty_like(x)
    call = caller(comm, collective, x, out, in_place)

    def time_way(way: str) -> float:
        switch(ways[way])
        comm._forget_plans()  # the kept answers of the other way
        call()
        return time_block(comm, call, args.block)

    times, ran = interleaved_modes(comm, list(ways), time_way, args.iters, args.warmup)
    return {"size": nbytes, "in_place": in_place, "algorithm": ran, "times_s": times}


def main() -> None:
    parser = ab_parser(__doc__, block=5)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64", help="MiB, comma-separated")
    parser.add_argument("--collective", default="all_reduce",
                        choices=["all_reduce", "broadcast", "reduce", "reduce_scatter"])
    args = parser.parse_args()
    sizes = [int(float(mib) * MIB) for mib in args.sizes.split(",")]
    shipped = comm_module.DIRECT_OUTBOX_MAX_BYTES, dict(pipe_steps.PIPE_MAX_BYTES_WITHOUT_READS)
    comm = mpccs.init()
    if not (comm.size == 2 and comm._engine.shm is not None and not comm._engine.shm.cma):
        sys.exit("needs 2 ranks on one host whose segments are open and whose pair does not read across "
                 "processes (MPCCS_CMA=0)")
    modes = {"broadcast": (True,), "reduce_scatter": (False,)}.get(args.collective, (False, True))
    try:
        rows = size_sweep(comm, modes, sizes, lambda nbytes, in_place: measure(
            comm, args.collective, nbytes, in_place, args, WAYS, lambda outboxes: set_way(args.collective, outboxes)))
    finally:
        comm_module.DIRECT_OUTBOX_MAX_BYTES = shipped[0]
        pipe_steps.PIPE_MAX_BYTES_WITHOUT_READS.update(shipped[1])
    if comm.rank == 0:
        meta = ab_meta(comm, args, mpccs.__version__)
        meta["up_tls"] = os.environ.get("MPCCS_UP_TLS", "default")
        meta["collective"] = args.collective
        lines = ab_report_head("Outboxes in rounds against the path before, on a pair that does not read "
                               f"(2-rank {args.collective}, float32)", meta,
                               "| size | in place | path before | before (us) | outboxes (us) | before / outboxes "
                               "| A/A floor |", "|---:|---|---|---:|---:|---:|---:|")
        lines += [ab_size_row(row, "before", "outboxes", "before_again", row["algorithm"]["before"]) for row in rows]
        lines += ["", f"Scale-up transports: {meta['up_tls']}. before / outboxes: the path before's time over the "
                  "outboxes' (> 1: the outboxes faster), paired 95% interval; the floor: before against before again."]
        name = "outbox_no_reads" + ("" if args.collective == "all_reduce" else f"_{args.collective}")
        write_ab_results(args.out, name + ".json", meta, rows, lines)
    comm.close()


if __name__ == "__main__":
    main()
