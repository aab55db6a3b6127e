"""A finished call keeps none of the caller's arrays alive.

The communicator keeps its last operation for last_stats() (a direct or
two-step call's record is built only when asked). That operation, and a Work
handle the caller drops, must not hold the call's arrays: a device array's
pinned host mirrors go back to cupy's pool only once nothing refers to them,
and a mirror held one call longer made the next call allocate a fresh one
(cudaHostAlloc, ~20 ms for 64 MiB on an H200 host: a 64 MiB all_reduce on the
mirrors took 75-111 ms instead of ~26). On host arrays it would keep a
caller's temporary buffer alive until the next collective.

Each case runs a call on live ranks, drops its arrays and checks by weak
reference that they are gone, then that last_stats() still names the path
the call took.
"""
import gc
import weakref

import numpy as np
import pytest

from rankpool import RankPool

KIB, MIB = 1 << 10, 1 << 20


def _arrays(collective: str, nbytes: int, rank: int):
    """(send, recv) for one call of ``nbytes`` (all_gather: the output's size; else the input's)."""
    n = nbytes // 4
    if collective == "reduce_scatter":
        return np.full(n, rank + 1, np.float32), np.empty(n // 2, np.float32)
    if collective == "all_gather":
        return np.full(n // 2, rank + 1, np.float32), np.empty(n, np.float32)
    if collective == "broadcast":
        return np.full(n, rank + 1, np.float32), None
    return np.full(n, rank + 1, np.float32), np.empty(n, np.float32)


def _call(comm, collective: str, send, recv, in_place: bool, async_op: bool):
    if collective == "all_reduce":
        return comm.all_reduce(send, None if in_place else recv, async_op=async_op)
    if collective == "broadcast":
        return comm.broadcast(send, async_op=async_op)
    return getattr(comm, collective)(send, recv, async_op=async_op)


def call_and_let_go(comm, cases):
    """For each (collective, nbytes, in_place, async_op): (algorithm, arrays gone)."""
    comm.set_path_policy("up")
    seen = []
    for collective, nbytes, in_place, async_op in cases:
        send, recv = _arrays(collective, nbytes, comm.rank)
        refs = [weakref.ref(a) for a in (send, recv) if a is not None]
        work = _call(comm, collective, send, recv, in_place, async_op)
        if async_op:
            work.wait()
        del send, recv, work
        gc.collect()
        gone = all(r() is None for r in refs)
        seen.append((comm.last_stats()["algorithm"], gone))
    comm.set_path_policy("adaptive")
    return seen


# (collective, bytes, in place, async): every light record the direct path makes
DIRECT_CASES = [
    (("all_reduce", 8, False, False), "direct_lane"),  # through the lane, no Operation (lane_ops.py)
    (("all_reduce", 64 * KIB, True, False), "direct_lane"),
    (("all_reduce", 256 * KIB, False, True), "direct_lane"),  # the lane's Operation (async)
    (("all_reduce", 1 * MIB, False, False), "direct_shm"),  # the segments' outboxes
    (("all_reduce", 4 * MIB, False, False), "direct_shm"),  # the outboxes, halves of 2 MiB
    (("all_reduce", 8 * MIB, False, False), "direct_shm"),  # the outboxes in two rounds
    (("all_reduce", 16 * MIB, True, True), "direct_shm"),  # reads where the pair allows, else the rounds
    (("reduce_scatter", 4 * MIB, False, False), "direct_shm"),
    (("all_gather", 1 * KIB, False, True), "direct_lane"),
    # the pipe (pipe_steps.py), with or without reads: steps alone, and an async call's Operation
    (("reduce", 1 * MIB, False, False), "direct_pipe"),
    (("broadcast", 2 * MIB, True, False), "direct_pipe"),
    (("broadcast", 1 * MIB, True, True), "direct_pipe"),
]
# The cases whose path is the same whether the pair reads across processes or not.
SAME_EITHER_WAY = [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2)
    yield ranks
    ranks.close()


def test_direct_calls_let_go_of_the_callers_arrays(pool):
    cases = [case for case, _ in DIRECT_CASES]
    for per_rank in pool.run(call_and_let_go, cases):
        gone = [g for _, g in per_rank]
        assert all(gone), [(case, algorithm) for (case, (algorithm, g)) in zip(cases, per_rank) if not g]
        # the record is still there once the arrays are gone (where the pair reads, the
        # 16 MiB and reduce_scatter cases read; else they ran other light paths)
        assert all(isinstance(a, str) and a for a, _ in per_rank), per_rank
        assert [per_rank[k][0] for k in SAME_EITHER_WAY] == [DIRECT_CASES[k][1] for k in SAME_EITHER_WAY], per_rank


def test_two_step_calls_let_go_of_the_callers_arrays():
    """The two-step executor's record (a pair without the segments: 2 MiB all_reduce and blocks go two-step)."""
    ranks = RankPool(2, env={"MPCCS_SHM": "0"})
    try:
        cases = [("all_reduce", 2 * MIB, False, False), ("all_reduce", 2 * MIB, True, True),
                 ("reduce_scatter", 4 * MIB, False, False), ("all_gather", 4 * MIB, False, False)]
        for per_rank in ranks.run(call_and_let_go, cases):
            assert per_rank == [("two_step", True)] * len(cases), per_rank
    finally:
        ranks.close()
