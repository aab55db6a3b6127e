"""Every collective with cupy arrays on a GPU shared by the ranks, checked bit
for bit: data movement against the same call on numpy arrays; reductions
against the rank-order reduction on the host when they are reduced on the
device (MPCCS_DEVICE_REDUCE=always, or auto for large reduce_scatter/reduce),
against the host path's own result when they are reduced on the host mirrors. Run by tests/test_gpu.py under
mpccs-run; prints ``GPU_JOB OK <cases>`` on rank 0, or fails with the first
difference.
"""
import os
import sys

import cupy as cp
import numpy as np

import mpccs
from mpccs.reduce import finish_avg, reduce_into

DTYPES = (np.float32, np.float64, np.float16, np.int32, np.int8, np.uint64)
# 0 and 1 element, a count no world size divides; float32 also 4 MiB (between
# comm.GPU_DIRECT_MIN_BYTES and GPU_DIRECT_READS_MIN_BYTES: the mirrors on a 2-rank
# pair that reads across processes, GPU-direct elsewhere) and one over 16 MiB
COUNTS = (0, 1, 1001, (1 << 20) + 1, (16 << 20) // 4 + 3)


def values(rank: int, count: int, dtype, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + 7 * count + salt)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(count).astype(dtype)
    return rng.integers(0, 7, count).astype(dtype)  # small: integer sums stay exact


def same_bits(got_device, want: np.ndarray, what: str) -> None:
    got = cp.asnumpy(got_device).reshape(-1)
    want = want.reshape(-1)
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{what}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    if got.tobytes() != want.tobytes():
        bad = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))
        raise AssertionError(f"{what}: {bad.size} bytes differ, first at byte {bad[0]}")


def reduced(comm, kind: str, inputs: list, op: str, root: int = 0):
    """What this rank's reduction must hold, bit for bit (None: nothing, a non-root rank of reduce)."""
    rank, size = comm.rank, comm.size
    if kind == "reduce" and rank != root:
        return None
    if not comm._device_reduces(kind, inputs[rank]):  # reduced on the mirrors: exactly the host path's result
        # (a collective call: every rank makes it, in the same place)
        x = inputs[rank].copy()
        if kind == "all_reduce":
            return comm.all_reduce(x, op=op)
        if kind == "reduce_scatter":
            out = np.empty(x.size // size, x.dtype)
            return comm.reduce_scatter(x, out, op=op)
        return comm.reduce(x, root=root, op=op)
    acc = inputs[0].copy()  # on the device: combined in rank order
    for x in inputs[1:]:
        reduce_into(acc, x, op)
    if op == "avg":
        finish_avg(acc, size)
    if kind == "reduce_scatter":
        m = acc.size // size
        return acc[rank * m:(rank + 1) * m]
    return acc


def collectives(comm, dtype, count: int) -> int:
    """Each collective on device arrays against numpy; returns the number of checks."""
    rank, size = comm.rank, comm.size
    x = values(rank, count, dtype)
    checks = 0
    ops = ("sum", "max", "avg") if np.dtype(dtype).kind == "f" else ("sum", "min")
    xs_all = [values(r, count, dtype) for r in range(size)]
    for op in ops:
        want = reduced(comm, "all_reduce", xs_all, op)
        same_bits(comm.all_reduce(cp.asarray(x), cp.empty_like(cp.asarray(x)), op=op), want, f"all_reduce {op}")
        d = cp.asarray(x)
        assert comm.all_reduce(d, op=op) is d  # in place: the caller's array, written
        same_bits(d, want, f"all_reduce in place {op}")
        checks += 2
    stats = comm.last_stats()
    staged = stats["staging"]
    if comm._gpu_direct_for(x.nbytes, "all_reduce") and comm._device_reduces("all_reduce", x):  # no mirror: nothing crossed PCIe
        assert staged["memory"] == "device" and staged["d2h_bytes"] == staged["h2d_bytes"] == 0, stats
    elif comm._device_reduces("all_reduce", x):
        assert staged["reduced_on"] == "cupy" and staged["d2h_bytes"] >= x.nbytes, stats
    else:
        assert staged["d2h_bytes"] == x.nbytes and staged["h2d_bytes"] == x.nbytes, stats
    xs = values(rank, count * size, dtype, 1)
    want = reduced(comm, "reduce_scatter", [values(r, count * size, dtype, 1) for r in range(size)], "sum")
    got = cp.empty(count, dtype)
    comm.reduce_scatter(cp.asarray(xs), got)
    same_bits(got, want, "reduce_scatter")
    want = np.empty(count * size, dtype)
    comm.all_gather(x, want)
    got = cp.empty(count * size, dtype)
    comm.all_gather(cp.asarray(x), got)
    same_bits(got, want, "all_gather")
    memory = comm.last_stats()["staging"]["memory"]
    assert memory == ("device" if comm._gpu_direct_for(got.nbytes) and count else "pinned host"), memory
    comm.all_to_all(xs, want)
    comm.all_to_all(cp.asarray(xs), got)
    same_bits(got, want, "all_to_all")
    send_counts = [(count + rank + j) % 5 for j in range(size)]
    recv_counts = [(count + i + rank) % 5 for i in range(size)]
    xv = values(rank, sum(send_counts), dtype, 2)
    want = np.empty(sum(recv_counts), dtype)
    comm.all_to_allv(xv, send_counts, want, recv_counts)
    got = cp.empty(sum(recv_counts), dtype)
    comm.all_to_allv(cp.asarray(xv), send_counts, got, recv_counts)
    same_bits(got, want, "all_to_allv")
    root = size - 1
    want = x.copy()
    comm.broadcast(want, root=root)
    got = cp.asarray(x)
    comm.broadcast(got, root=root)
    same_bits(got, want, "broadcast")
    if comm._device_reduces("reduce", x):
        want = reduced(comm, "reduce", xs_all, "sum", root)
    else:  # the host path's reduce, called on every rank
        want = np.empty(count, dtype) if rank == root else None
        comm.reduce(x, want, root=root)
    got = cp.empty(count, dtype) if rank == root else None
    result = comm.reduce(cp.asarray(x), got, root=root)
    if rank == root:
        assert result is got
        same_bits(got, want, "reduce")
    else:
        assert result is None
    return checks + 6


def policies(comm) -> int:
    """Which plane carried a byte never changes a result: every policy, bit for bit."""
    x = values(comm.rank, (16 << 20) // 4, np.float32, 3)
    comm.set_path_policy("up")
    want = reduced(comm, "all_reduce", [values(r, x.size, np.float32, 3) for r in range(comm.size)], "sum")
    for policy in ("up", "out", 0.5, "adaptive"):
        comm.set_path_policy(policy)
        for _ in range(2 if policy == "adaptive" else 1):
            same_bits(comm.all_reduce(cp.asarray(x)), want, f"all_reduce under {policy}")
    comm.set_path_policy("adaptive")
    return 5


def async_and_p2p(comm) -> int:
    rank, size = comm.rank, comm.size
    a, b = values(rank, 300_001, np.float32, 4), values(rank, 5, np.int64, 5)
    want_a = reduced(comm, "all_reduce", [values(r, a.size, np.float32, 4) for r in range(size)], "sum")
    want_b = reduced(comm, "all_reduce", [values(r, b.size, np.int64, 5) for r in range(size)], "max")
    da, db = cp.asarray(a), cp.asarray(b)
    wa = comm.all_reduce(da, async_op=True)
    wb = comm.all_reduce(db, op="max", async_op=True)
    assert wb.wait() is db and wa.wait() is da  # completed out of order
    same_bits(da, want_a, "async all_reduce")
    same_bits(db, want_b, "async all_reduce max")
    assert "staging" in wa.stats()
    payload = (np.arange(4099, dtype=np.int16) * (rank + 1)).astype(np.int16)
    peer = (rank + 1) % size
    src = (rank - 1) % size
    got = cp.zeros(4099, np.int16)
    w = comm.irecv(got, src)
    comm.send(cp.asarray(payload), peer)
    assert w.wait() is got
    same_bits(got, (np.arange(4099, dtype=np.int16) * (src + 1)).astype(np.int16), "send/recv")
    return 3


def bad_input(comm) -> int:
    x = cp.ones(8, cp.float32)
    cases = [
        (TypeError, lambda: comm.all_reduce(x, np.ones(8, np.float32)), "recv is a ndarray but send is a device"),
        (ValueError, lambda: comm.all_reduce(cp.ones((4, 4), cp.float32)[:, ::2]), "C-contiguous"),
        (TypeError, lambda: comm.all_reduce(cp.ones(4, cp.complex64)), "not supported"),
        (TypeError, lambda: comm.all_reduce(cp.ones(4, cp.int32), op="avg"), "floating"),
        (ValueError, lambda: comm.reduce_scatter(cp.ones(5, cp.float32), cp.empty(2, cp.float32)), "send"),
    ]
    for exc, call, words in cases:
        try:
            call()
        except exc as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"no {exc.__name__} ({words})")
    comm.barrier()  # the communicator is still usable
    return len(cases)


def main() -> int:
    cp.cuda.Device(0).use()
    comm = mpccs.init()
    want_direct = {"1": True, "0": False}.get(os.environ.get("MPCCS_GPU_DIRECT", ""))
    if want_direct is not None:
        assert comm.gpu_direct is want_direct, (comm.gpu_direct, want_direct)
    checks = 0
    for dtype in DTYPES:
        for count in (COUNTS if dtype is np.float32 else COUNTS[:3]):
            checks += collectives(comm, dtype, count)
    checks += policies(comm) + async_and_p2p(comm) + bad_input(comm)
    if comm.rank == 0:
        print(f"GPU_JOB OK {checks} checks on {comm.size} ranks", flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
