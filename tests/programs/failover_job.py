"""Rank 1's scale-out link goes down in the middle of a collective; every rank checks the result.

    failover_job.py NBYTES COLLECTIVE...    (or two_in_flight: two all_reduces at once)

MPCCS_TEST_FAIL_CMD / MPCCS_TEST_RESTORE_CMD are shell commands that take the
link down and bring it back (on the testbed: the switch port); without them
(no root) rank 1 closes its own scale-out endpoints instead. Per collective,
rank 1 starts the operation, lets it move bytes, fails the link, and every
rank waits: the result must equal the reference and the retry must have run
on 'up' only. Then the link returns and the job runs until 'out' carries
bytes again. Each rank prints one RESULT line (JSON).
"""
import json
import os
import subprocess
import sys
import time

import numpy as np

import mpccs

FAIL = os.environ.get("MPCCS_TEST_FAIL_CMD")
RESTORE = os.environ.get("MPCCS_TEST_RESTORE_CMD")


def inputs(name, rank, size, n):
    """(send, recv, expected) for this rank; contents differ per rank and position."""
    def data(r):
        return (np.arange(n, dtype=np.int64) * (r + 3) + r) % 1000

    if name == "all_reduce":
        return data(rank), np.empty(n, np.int64), sum(data(r) for r in range(size))
    if name in ("all_reduce_inplace", "all_reduce_inplace_late"):
        buf = data(rank)
        return buf, None, sum(data(r) for r in range(size))
    if name == "reduce_scatter_inplace":  # recv is this rank's block of send
        block = n // size
        buf = data(rank)[: block * size]
        expected = sum(data(r)[: block * size] for r in range(size))[rank * block:(rank + 1) * block]
        return buf, buf[rank * block:(rank + 1) * block], expected
    if name == "all_gather":
        return data(rank), np.empty(n * size, np.int64), np.concatenate([data(r) for r in range(size)])
    if name == "all_to_all":
        block = n // size
        expected = np.concatenate([data(r)[rank * block:(rank + 1) * block] for r in range(size)])
        return data(rank)[: block * size], np.empty(block * size, np.int64), expected
    raise ValueError(name)


def fail_link(comm):
    if FAIL:
        subprocess.run(FAIL, shell=True, check=True)
    else:
        comm._planes["out"].sever()  # without root: this rank's scale-out endpoints close under it


def restore_link():
    if RESTORE:
        subprocess.run(RESTORE, shell=True, check=True)


def fail_under(comm, works, late=False) -> None:
    """Rank 1 fails the link once the first operation has bytes in flight on 'out'
    (late: once rank 1 has also finished its first stage, so its retry resumes
    over ranges it already reduced)."""
    if comm.rank == 1:
        op = works[0]._op
        while ((op.bytes_per_plane["out"] == 0 or (late and op.stages_done == 0 and op.phase == "run"))
               and not works[0].is_completed()):
            pass
        fail_link(comm)


def row_of(name, work, exact) -> dict:
    stats = work.stats()
    return {"collective": name, "exact": exact, "attempts": stats.get("attempts", 1),
            "failover": stats.get("failover"), "events": [e["kind"] for e in stats.get("events", [])],
            "input_saved": stats.get("input_saved")}


def two_in_flight(comm, n):
    """An out-of-place and an in-place all_reduce in flight together when the link fails."""
    a_send, a_recv, a_expected = inputs("all_reduce", comm.rank, comm.size, n)
    b_buf, _, b_expected = inputs("all_reduce_inplace", comm.rank, comm.size, n)
    b_buf = b_buf[::-1].copy()  # other data than the first operation's
    b_expected = b_expected[::-1]
    comm.barrier()
    works = [comm.all_reduce(a_send, a_recv, async_op=True), comm.all_reduce(b_buf, async_op=True)]
    fail_under(comm, works)
    for w in reversed(works):  # waited for out of order on purpose
        w.wait()
    return [row_of("two_in_flight[0]", works[0], bool(np.array_equal(a_recv, a_expected))),
            row_of("two_in_flight[1]", works[1], bool(np.array_equal(b_buf, b_expected)))]


def mixed_in_place(comm, n):
    """Rank 0 calls all_reduce in place, the others out of place, and the link fails:
    their retries would not fit, so every rank must fail cleanly (and say why)."""
    send, recv, _ = inputs("all_reduce", comm.rank, comm.size, n)
    comm.barrier()
    work = comm.all_reduce(send, None if comm.rank == 0 else recv, async_op=True)
    fail_under(comm, [work])
    try:
        work.wait()
        error = None
    except mpccs.MpccsError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return [{"collective": "all_reduce_mixed", "error": error, "aborted": comm._aborted is not None}]


def collective_of(name):
    return name.replace("_inplace", "").replace("_late", "")


def run(comm, name, n):
    if name == "all_reduce_mixed":
        return mixed_in_place(comm, n)  # the communicator is aborted after it: run it last
    if name == "two_in_flight":
        rows = two_in_flight(comm, n)
        name = "all_reduce"
    else:
        send, recv, expected = inputs(name, comm.rank, comm.size, n)
        comm.barrier()
        work = getattr(comm, collective_of(name))(send, recv, async_op=True)
        fail_under(comm, [work], late=name.endswith("_late"))
        work.wait()
        rows = [row_of(name, work, bool(np.array_equal(send if recv is None else recv, expected)))]
    if comm.rank == 1:
        restore_link()
    rows[-1]["rejoined_after_ops"] = wait_for_rejoin(comm, name, n)
    return rows


def wait_for_rejoin(comm, name, n):
    call = getattr(comm, collective_of(name))
    # Later operations: the plane rejoins after the reprobe period and carries bytes again.
    rejoined_after = None
    deadline = time.monotonic() + 30
    i = 0
    while time.monotonic() < deadline:
        i += 1
        send2, recv2, expected2 = inputs(name, comm.rank, comm.size, n)
        call(send2, recv2)
        assert np.array_equal(send2 if recv2 is None else recv2, expected2), f"wrong result after the failover ({name} #{i})"
        out_bytes = np.array([comm.last_stats()["bytes_per_plane"]["out"]], np.int64)
        comm.all_reduce(out_bytes, op="min")  # every rank sent on 'out' again
        if out_bytes[0] > 0:
            rejoined_after = i
            break
        time.sleep(0.2)
    return rejoined_after


def main():
    n = int(sys.argv[1])
    comm = mpccs.init(path_policy=0.5, reprobe_s=1.0, timeout_s=30)
    rows = [row for name in sys.argv[2:] for row in run(comm, name, n)]
    print("RESULT " + json.dumps({"rank": comm.rank, "rows": rows}), flush=True)
    comm.close()


if __name__ == "__main__":
    main()
