"""Ranks that call different operations get a clear error on every rank, never a hang."""
import time

import numpy as np
import pytest

import mpccs
from rankpool import RankPool


def mismatched(comm, kind):
    x = np.ones(1000, np.float32)
    r = comm.rank
    try:
        if kind == "size":
            comm.all_reduce(np.ones(1000 + r, np.float32))
        elif kind == "dtype":
            comm.all_reduce(x if r == 0 else np.ones(1000, np.int32))
        elif kind == "op":
            comm.all_reduce(x, op="sum" if r == 0 else "max")
        elif kind == "root":
            comm.broadcast(x, root=r)
        elif kind == "policy":  # one rank protected (0.5 puts bytes on 'out'), one not ('up')
            comm.set_path_policy("up" if r == 0 else 0.5)
            comm.all_reduce(np.ones(1 << 19, np.float32))
        elif kind == "medium_size":  # both on the direct path, payloads in their own messages
            comm.all_reduce(np.ones((16 << 10) * (1 + r), np.float32))
        elif kind == "medium_vs_dag":  # 64 KiB direct against 2 MiB on the DAG
            comm.all_reduce(np.ones((16 << 10) if r == 0 else (1 << 19), np.float32))
        elif kind == "medium_policy":  # 'up' goes direct at 64 KiB, a fixed split does not
            comm.set_path_policy("up" if r == 0 else 0.5)
            comm.all_reduce(np.ones(16 << 10, np.float32))
        elif kind == "gather_vs_dag":  # a 64 KiB block direct against a 2 MiB one on the DAG
            n = (16 << 10) if r == 0 else (1 << 19)
            comm.all_gather(np.ones(n, np.float32), np.empty(2 * n, np.float32))
        elif kind == "a2a_size":  # both direct, blocks of 4 KiB against 8 KiB: payloads in their own messages
            n = 2 * (1024 << r)
            comm.all_to_all(np.ones(n, np.float32), np.empty(n, np.float32))
        elif kind == "two_step_size":  # both offer the two-step executor: it waits for the fingerprints
            comm.set_path_policy("up")
            comm.all_reduce(np.ones((1 << 19) + 2 * r, np.float32))
        elif kind == "halves_size":  # both direct blocks (>= 640 KiB): unequal halves, larger messages
            comm.all_reduce(np.ones((256 << 10) + 2 * r, np.float32))
        elif kind in ("medium_size_out", "halves_size_out"):  # out of place: a peer's payload lands in the output
            n = (16 << 10) * (1 + r) if kind == "medium_size_out" else (256 << 10) + 2 * r
            comm.all_reduce(np.ones(n, np.float32), np.empty(n, np.float32))
        elif kind == "halves_vs_full":  # 600 KiB as one full exchange against 700 KiB as blocks (halves)
            comm.all_reduce(np.ones((600 << 8) if r == 0 else (700 << 8), np.float32))
        elif kind == "shm_vs_two_step":  # 1 MiB through the segments against 4 MiB on the two-step executor
            comm.all_reduce(np.ones((1 << 18) if r == 0 else (1 << 20), np.float32))
        elif kind == "shm_vs_gather":  # an all_reduce through the segments against a direct all_gather
            if r == 0:
                comm.all_reduce(np.ones(1 << 18, np.float32), np.empty(1 << 18, np.float32))
            else:
                comm.all_gather(np.ones(1 << 17, np.float32), np.empty(1 << 18, np.float32))
        elif kind == "shm_late_size":  # through the segments, rank 1 late: rank 0 sleeps when it meets a stranger
            if r == 1:
                time.sleep(0.3)
            comm.all_reduce(np.ones((1 << 18) + 2 * r, np.float32))
        elif kind == "cma_size":  # both direct, halves read across processes: shapes differ, nothing is read
            comm.all_reduce(np.ones((2 << 20) + 2 * r, np.float32))
        elif kind == "cma_dtype":  # the same bytes: the reads happen, the fingerprint still fails both
            comm.all_reduce(np.ones(2 << 20, np.float32 if r == 0 else np.int32))
        elif kind == "cma_all_reduce_vs_rs":  # both read across processes, 8 MiB inputs: the shapes name the collective
            if r == 0:
                comm.all_reduce(np.ones(2 << 20, np.float32))
            else:
                comm.reduce_scatter(np.ones(2 << 20, np.float32), np.empty(1 << 20, np.float32))
        elif kind == "cma_gather_size":  # all_gather blocks of 2 MiB against 2 MiB + 8 bytes, both read
            n = (1 << 19) + 2 * r
            comm.all_gather(np.ones(n, np.float32), np.empty(2 * n, np.float32))
        elif kind == "cma_a2a_vs_gather":  # 2 MiB blocks each, the same bytes read: the shapes name the collective
            if r == 0:
                comm.all_to_all(np.ones(1 << 20, np.float32), np.empty(1 << 20, np.float32))
            else:
                comm.all_gather(np.ones(1 << 19, np.float32), np.empty(1 << 20, np.float32))
        elif kind == "cma_bcast_root":  # 4 MiB broadcasts from different roots: the shapes name the root
            comm.broadcast(np.ones(1 << 20, np.float32), root=r)
        elif kind == "cma_reduce_vs_bcast":  # 4 MiB each, rooted at 0, both read across processes
            if r == 0:
                comm.reduce(np.ones(1 << 20, np.float32), root=0)
            else:
                comm.broadcast(np.ones(1 << 20, np.float32), root=0)
        elif kind == "cma_vs_dag":  # 4 MiB direct against 32 MiB on the DAG
            comm.all_reduce(np.ones((1 << 20) if r == 0 else (8 << 20), np.float32))
        elif kind == "op_after_warm":  # pooled buffers sent 'sum' fingerprints many times before
            for _ in range(20):
                comm.all_reduce(np.ones(2, np.float32))
            comm.all_reduce(np.ones(2, np.float32), op="sum" if r == 0 else "max")
        elif kind == "lane_size":  # both through the lane: 8 bytes against 12
            comm.all_reduce(np.ones(2 + r, np.float32), np.empty(2 + r, np.float32))
        elif kind == "lane_late_size":  # the lane, rank 1 late: rank 0 hands the call to the engine first
            if r == 1:
                time.sleep(0.3)
            comm.all_reduce(np.ones(2 + r, np.float32))
        elif kind == "lane_vs_shm":  # 8 bytes through the lane against 1 MiB through the outboxes
            comm.all_reduce(np.ones(2 if r == 0 else 1 << 18, np.float32))
        elif kind == "lane_vs_medium":  # the lane against a direct 64 KiB: its fingerprint is a UCX message
            comm.all_reduce(np.ones(2 if r == 0 else 16 << 10, np.float32))
        elif kind == "lane_gather_vs_a2a":  # both through the lane, 4 KiB published each way
            if r == 0:
                comm.all_gather(np.ones(1024, np.float32), np.empty(2048, np.float32))
            else:
                comm.all_to_all(np.ones(2048, np.float32), np.empty(2048, np.float32))
        elif kind == "lane_reduce_late_root":  # the lane, rank 1 late: reduce to root 0 against root 1
            if r == 1:
                time.sleep(0.3)
            comm.reduce(np.ones(16, np.float32), root=r)
        elif kind == "collective":
            if r == 0:
                comm.all_reduce(x)
            else:
                comm.all_gather(x[:500], np.empty(1000, np.float32))
    except mpccs.MpccsError as exc:
        try:
            comm.all_reduce(x)
            after = "usable"
        except mpccs.CommunicatorAborted:
            after = "aborted"
        return type(exc).__name__, str(exc), after
    return None


def _run_timed(fn, *args):
    """(per-rank results, seconds) of fn on a fresh 2-rank pool with a 20 s no-progress timeout."""
    pool = RankPool(2, env={"MPCCS_TIMEOUT": "20"})
    try:
        start = time.monotonic()
        results = pool.run(fn, *args, timeout=60)
        return results, time.monotonic() - start
    finally:
        pool.close()


@pytest.mark.parametrize("kind", ["size", "dtype", "op", "root", "collective", "policy", "medium_size",
                                  "medium_vs_dag", "medium_policy", "gather_vs_dag", "a2a_size",
                                  "two_step_size", "op_after_warm", "halves_size", "halves_vs_full",
                                  "medium_size_out", "halves_size_out", "shm_vs_two_step", "shm_vs_gather",
                                  "shm_late_size", "cma_size", "cma_dtype", "cma_all_reduce_vs_rs", "cma_vs_dag",
                                  "cma_gather_size",
                                  "cma_a2a_vs_gather", "cma_bcast_root", "cma_reduce_vs_bcast", "lane_size",
                                  "lane_late_size", "lane_vs_shm", "lane_vs_medium", "lane_gather_vs_a2a",
                                  "lane_reduce_late_root"])
def test_mismatched_calls_raise_on_every_rank(kind):
    results, elapsed = _run_timed(mismatched, kind)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} completed a mismatched {kind} call"
        name, message, after = result
        assert name in ("MismatchError", "ProtocolError"), message
        assert after == "aborted"
        if kind == "policy":  # a DONE round one rank skips used to wait out the no-progress timeout
            assert "failover protection" in message, message
        # the fingerprint, looked at before the payload: never a truncated receive
        if kind.startswith(("medium", "halves")) or kind in ("gather_vs_dag", "a2a_size", "two_step_size",
                                                              "shm_late_size", "cma_size", "cma_vs_dag",
                                                              "cma_gather_size", "lane_size", "lane_late_size",
                                                              "lane_vs_shm", "lane_vs_medium"):
            assert name == "MismatchError", message
            assert ("same path policy" if kind == "medium_policy" else "count") in message, message
    assert elapsed < 15, f"mismatch took {elapsed:.1f} s to surface (a timeout, not detection)"


def stall(comm):
    if comm.rank == 1:
        return None  # never joins the collective
    try:
        comm.all_reduce(np.ones(10, np.float32), async_op=True).wait(timeout=1.0)
    except mpccs.OperationTimeout as exc:
        return str(exc)
    return "completed"


def test_no_progress_timeout_names_operation_stage_and_peer():
    pool = RankPool(2)
    try:
        message, _ = pool.run(stall, timeout=30)
    finally:
        pool.kill()
    assert "all_reduce" in message and "no progress for 1 s" in message
    assert "peer=[1]" in message and "stage=" in message


def queued_behind_a_mismatch(comm):
    """Two async collectives; the first is mismatched. Waiting on the second
    (queued behind the first) must fail at once, naming the first."""
    r = comm.rank
    first = comm.all_reduce(np.ones(100_000 + r, np.float32), async_op=True, algorithm="ring")
    second = comm.all_reduce(np.ones(100_000, np.float32), async_op=True, algorithm="ring")
    try:
        second.wait()
        return None
    except mpccs.MpccsError as exc:
        return type(exc).__name__, str(exc), type(first.exception()).__name__


def test_a_collective_queued_behind_a_failed_one_fails_naming_it():
    results, elapsed = _run_timed(queued_behind_a_mismatch)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} completed the collective queued behind a mismatch"
        name, message, first = result
        assert first == "MismatchError", result
        assert "did not start" in message and "all_reduce #" in message, message
        assert "count 100000 vs 100001" in message or "count 100001 vs 100000" in message, message
    assert elapsed < 15, f"took {elapsed:.1f} s: a timeout, not the first failure"
