"""The lane (lane_ops.py): small 2-rank all_reduces and barriers whole through
the shared-memory segments, without an Operation in the common case."""
import mmap
import time

import numpy as np
import pytest

from mpccs import direct_ops
from mpccs.direct_ops import LightRecord, peer_part
from mpccs.lane_ops import DONE, POSTED, UNPOSTED, Lane, LaneOp, combine, takes_lane
from mpccs.transports import shm
from mpccs.transports.shm import FLAG_WAITING, LANE_MAX_BYTES, SEGMENT_BYTES, ShmPair
from rankpool import RankPool

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory segments need x86-64 and /dev/shm")

WORDS = (0x1234, -(1 << 40))  # a fingerprint's two words, as int64 (the second negative: a high bit set)


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2)
    yield ranks
    ranks.close()


# -- the protocol, both ranks in this process ---------------------------------
def _pairs():
    a, b = (mmap.mmap(-1, SEGMENT_BYTES) for _ in range(2))
    return ShmPair(a, b), ShmPair(b, a)


def _post(pair, seq, values, words=WORDS):
    """What Lane.exchange does before it polls: the payload in the slot, then the entry."""
    assert pair.lane_free(seq)
    pair.lane_views(seq, values.dtype, values.size)[0][...] = values
    pair.post_lane(seq, values.nbytes, words)


def test_a_posted_payload_is_met_only_with_the_same_words_count_and_operation():
    pairs = _pairs()
    x = np.arange(5, dtype=np.float64)
    assert not pairs[1].lane_met(1, x.nbytes, WORDS, 1e-3)  # nothing posted: gives up after spin_s
    _post(pairs[0], 1, x)
    assert pairs[1].lane_met(1, x.nbytes, WORDS, 1e-3)
    assert pairs[1].peer_lane(1).view(np.float64).tolist() == x.tolist()
    assert not pairs[1].lane_met(1, x.nbytes + 8, WORDS, 1e-3)  # another byte count
    assert not pairs[1].lane_met(1, x.nbytes, (WORDS[0], WORDS[1] + 1), 1e-3)  # another fingerprint
    assert not pairs[1].lane_met(2, x.nbytes, WORDS, 1e-3)  # another operation
    assert pairs[1].peer_lane(3) is None  # slot 1 holds nothing of operation 3
    assert not pairs[0].lane_met(1, x.nbytes, WORDS, 1e-3)  # a rank reads its peer's segment, not its own
    pairs[0].post(FLAG_WAITING, 1)  # the peer sleeps on this operation: the engine's path rings it
    assert not pairs[1].lane_met(1, x.nbytes, WORDS, 1e-3)


def test_a_slot_is_written_again_only_after_the_peer_read_it():
    pairs = _pairs()
    _post(pairs[0], 1, np.ones(2, np.float32))
    _post(pairs[0], 2, np.ones(2, np.float32))  # the other slot: a rank one operation ahead posts at once
    assert not pairs[0].lane_free(3)  # slot 1 still holds operation 1, unread
    pairs[1].lane_taken(1)
    assert pairs[0].lane_free(3) and not pairs[0].lane_free(4)
    pairs[1].lane_taken(2)
    assert pairs[0].lane_free(4)


def test_reading_one_slot_ahead_of_the_other_frees_only_that_slot():
    """Operations in flight together may read out of order: operation 4 (slot 0)
    read before operation 3 (slot 1) must not let operation 5 overwrite slot 1."""
    pairs = _pairs()
    for seq in (1, 2):
        _post(pairs[0], seq, np.ones(2, np.float32))
        pairs[1].lane_taken(seq)
    for seq in (3, 4):
        _post(pairs[0], seq, np.ones(2, np.float32))
    pairs[1].lane_taken(4)
    assert pairs[0].lane_free(6) and not pairs[0].lane_free(5)
    pairs[1].lane_taken(3)
    assert pairs[0].lane_free(5)


@pytest.mark.parametrize("rank", [0, 1])
def test_exchange_reduces_in_rank_order_and_says_what_it_did(rank):
    """Both ranks compute in0 + in1 (bit-identical: rank 0's operand on the left).
    The peer here posted first; a second exchange finds nothing and says POSTED;
    a third, whose slot the peer has not read, says UNPOSTED."""
    pairs = _pairs()
    ins = [np.array([1e8, 1.0, -1e8, 3.5], np.float32) * (r + 1) + np.float32(r) / 3 for r in range(2)]
    _post(pairs[1 - rank], 1, ins[1 - rank])
    lane, out = Lane(pairs[rank], rank), np.full(4, np.nan, np.float32)

    def exchange(seq):
        parts = peer_part("all_reduce", ins[rank], rank, None)
        return lane.exchange(seq, "all_reduce", ins[rank], out, "sum", None, parts, WORDS, 1e-3)

    assert exchange(1) == DONE
    assert out.tobytes() == (ins[0] + ins[1]).tobytes()
    assert pairs[1 - rank].lane_free(3)  # read: the peer's slot 1 may take its operation 3
    assert exchange(2) == POSTED  # nothing of the peer's within the 1 ms asked
    assert exchange(4) == UNPOSTED  # slot 0: operation 2, unread


def _two_ranks(name, ins, outs, root=None, op="sum"):
    """Both ranks' peer_part and combine, each fed the other's payload as posted
    (copied into its slot before either combines)."""
    parts = [peer_part(name, ins[r], r, root) for r in range(2)]
    slots = [posted.copy() for posted, _ in parts]
    for r in range(2):
        theirs, wanted = slots[1 - r], parts[r][1]  # the peer's slot; what this rank reads of it
        assert theirs.size == wanted
        combine(name, ins[r], outs[r], theirs, op, r, root)
    return [p[0].nbytes for p in parts]


def _inputs(n, dtype=np.float32):
    return [np.array([1e8, 1.0, -1e8, 3.5] * n, dtype)[:n] * (r + 1) + dtype(r) / 3 for r in range(2)]


def test_every_collective_combines_in_rank_order():
    """What each rank publishes and makes of its peer's payload, both ranks in this
    process, against numpy (rank 0's operand on the left: bit-identical results)."""
    n = 6
    ins = _inputs(2 * n)
    outs = [np.full(2 * n, np.nan, np.float32) for _ in range(2)]
    assert _two_ranks("all_reduce", ins, outs) == [ins[0].nbytes] * 2
    assert all(o.tobytes() == (ins[0] + ins[1]).tobytes() for o in outs)
    outs = [np.full(n, np.nan, np.float32) for _ in range(2)]
    assert _two_ranks("reduce_scatter", ins, outs) == [n * 4] * 2  # each publishes the block its peer owns
    for r in range(2):
        assert outs[r].tobytes() == (ins[0][r * n:(r + 1) * n] + ins[1][r * n:(r + 1) * n]).tobytes()
    outs = [np.full(4 * n, np.nan, np.float32) for _ in range(2)]
    _two_ranks("all_gather", ins, outs)
    assert all(np.array_equal(o, np.concatenate(ins)) for o in outs)
    outs = [np.full(2 * n, np.nan, np.float32) for _ in range(2)]
    _two_ranks("all_to_all", ins, outs)
    for r in range(2):
        assert np.array_equal(outs[r], np.concatenate([ins[0][r * n:(r + 1) * n], ins[1][r * n:(r + 1) * n]]))
    for root in (0, 1):
        bufs = [x.copy() for x in ins]
        assert _two_ranks("broadcast", bufs, bufs, root) == [ins[0].nbytes if r == root else 0 for r in range(2)]
        assert all(np.array_equal(b, ins[root]) for b in bufs)
        outs = [np.full(2 * n, np.nan, np.float32) if r == root else np.empty(0, np.float32) for r in range(2)]
        assert _two_ranks("reduce", ins, outs, root, op="max") == [0 if r == root else ins[0].nbytes for r in range(2)]
        assert outs[root].tobytes() == np.maximum(ins[0], ins[1]).tobytes()


def test_in_place_forms_combine_over_their_own_input():
    """all_gather with its input as its own block of the output; reduce_scatter with
    the output as its own block of the input; all_reduce into its input."""
    n = 5
    gathered = [np.zeros(2 * n, np.int64) for _ in range(2)]
    for r in range(2):
        gathered[r][r * n:(r + 1) * n] = np.arange(n) + 10 * r
    _two_ranks("all_gather", [g[r * n:(r + 1) * n] for r, g in enumerate(gathered)], gathered)
    assert all(np.array_equal(g, np.concatenate([np.arange(n), np.arange(n) + 10])) for g in gathered)
    ins = [np.arange(2 * n, dtype=np.int64) * (r + 2) for r in range(2)]
    expected = ins[0] + ins[1]
    _two_ranks("reduce_scatter", ins, [x[r * n:(r + 1) * n] for r, x in enumerate(ins)])
    assert all(np.array_equal(x[r * n:(r + 1) * n], expected[r * n:(r + 1) * n]) for r, x in enumerate(ins))
    ins = _inputs(7)
    expected = ins[0] + ins[1]
    _two_ranks("all_reduce", ins, ins)
    assert all(x.tobytes() == expected.tobytes() for x in ins)


def test_the_bound_applies_to_what_a_rank_publishes_at_most():
    pair = object()  # any open pair
    at = np.empty(LANE_MAX_BYTES, np.uint8)
    over = np.empty(LANE_MAX_BYTES + 1, np.uint8)
    assert takes_lane(pair, "all_reduce", at) and not takes_lane(pair, "all_reduce", over)
    assert takes_lane(pair, "broadcast", at) and not takes_lane(pair, "reduce", over)
    assert takes_lane(pair, "reduce_scatter", np.empty(2 * LANE_MAX_BYTES, np.uint8))  # a block each way
    assert not takes_lane(pair, "all_to_all", np.empty(2 * LANE_MAX_BYTES + 2, np.uint8))
    assert not takes_lane(None, "all_reduce", at) and not takes_lane(pair, "all_to_allv", at)


def test_the_lazy_record_has_the_operations_keys():
    record = LightRecord("all_reduce", 7, 8, 1.0, 1.5, "direct_lane").stats()
    assert record["algorithm"] == LaneOp.algorithm == "direct_lane"
    assert record["bytes_per_plane"] == {"up": 8, "out": 0} and record["duration_s"] == 0.5
    keys = {"op", "seq", "duration_s", "t_start_wall", "bytes_per_plane", "algorithm", "channels", "policy",
            "stages", "slept_for_peer", "rang_peer"}
    assert set(record) == keys


# -- between two processes ------------------------------------------------------
def every_small_call(comm):
    """Every op and dtype, in place and out of place, 0 to LANE_MAX_BYTES, 2-D too:
    (case, algorithm, exact) rows, then the operation counter's growth."""
    before = comm.metrics().get('operations_total{op="all_reduce"}', 0)
    rows = []
    for dtype in (np.float32, np.float64, np.int8, np.uint64, np.float16):
        itemsize = np.dtype(dtype).itemsize
        for count in (0, 1, 3, LANE_MAX_BYTES // itemsize):
            ins = [((np.arange(count) % 5) + 1 + r).astype(dtype) for r in range(2)]
            for op, fold in (("sum", np.add), ("prod", np.multiply), ("min", np.minimum), ("max", np.maximum)):
                expected = fold(ins[0], ins[1]).astype(dtype)
                for in_place in (False, True):
                    x = ins[comm.rank].copy()
                    got = comm.all_reduce(x, op=op) if in_place else comm.all_reduce(x, np.empty_like(x), op=op)
                    rows.append(((str(np.dtype(dtype)), count, op, in_place), comm.last_stats()["algorithm"],
                                 got.tobytes() == expected.tobytes() and (got is x) == in_place))
    x = np.arange(12, dtype=np.float32).reshape(3, 4) * (comm.rank + 1)
    rows.append((("2-D", 12, "avg", False), comm.last_stats()["algorithm"],
                 bool(np.array_equal(comm.all_reduce(x, np.empty_like(x), op="avg"), x / (comm.rank + 1) * 1.5))))
    counted = comm.metrics()['operations_total{op="all_reduce"}'] - before
    return rows, counted


def test_every_small_call_takes_the_lane_and_matches_numpy(pool):
    for rows, counted in pool.run(every_small_call):
        assert len(rows) == 5 * 4 * 4 * 2 + 1 and counted == len(rows)
        wrong = [r for r in rows if r[1:] != ("direct_lane", True)]
        assert not wrong, wrong


def above_the_lane(comm):
    x = np.ones(LANE_MAX_BYTES // 4 + 1, np.float32)
    comm.all_reduce(x)
    return comm.last_stats()["algorithm"], float(x[0])


def test_a_call_above_the_lane_takes_the_halves(pool):
    assert pool.run(above_the_lane) == [("direct_shm", 2.0)] * 2


def async_calls_and_barriers(comm):
    """Five async lane calls in flight (more than its two slots: the later ones post
    once the peer read a slot), a barrier, then the waits in reverse."""
    xs = [np.full(3, k + comm.rank, np.int64) for k in range(5)]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    comm.barrier()
    results = [w.wait().tolist() for w in reversed(works)]
    comm.barrier()
    return results, comm.last_stats()["algorithm"], comm.last_stats()["op"]


def test_async_calls_in_flight_use_both_slots_in_turn(pool):
    for results, algorithm, op in pool.run(async_calls_and_barriers):
        assert results == [[2 * k + 1] * 3 for k in reversed(range(5))]
        assert (algorithm, op) == ("direct_lane", "barrier")


def async_calls_one_rank_after_the_other(comm):
    """Rank 1 calls only once rank 0's payload for the call is in its segment,
    five times: its async call finds it and returns a Work already done (no
    operation). PEER_SPIN_S is long here so that rank 0, whose operation waits
    meanwhile, never goes to sleep (a sleeping peer is rung by an operation):
    nothing in the order rests on timing."""
    spin, direct_ops.PEER_SPIN_S = direct_ops.PEER_SPIN_S, 10.0
    pair, rows = comm._engine.shm, []
    try:
        for k in range(5):
            comm.barrier()
            if comm.rank == 1:
                deadline = time.monotonic() + 10
                while pair.peer_fingerprint(comm._seq + 1) is None and time.monotonic() < deadline:
                    pass
            x = np.full(4, k + comm.rank, np.float32)
            work = comm.all_reduce(x, async_op=True)
            done_at_once = work.is_completed() and isinstance(work._op, LightRecord)
            result = work.wait()
            rows.append((done_at_once, result.tolist() == [2 * k + 1] * 4, work.stats()["algorithm"],
                         work.exception() is None, work._op.bytes_per_plane == {"up": 16, "out": 0}))
    finally:
        direct_ops.PEER_SPIN_S = spin
    return rows


def test_an_async_call_whose_peer_is_there_is_done_when_it_returns(pool):
    first, second = pool.run(async_calls_one_rank_after_the_other)
    assert second == [(True, True, "direct_lane", True, True)] * 5
    assert [row[1:] for row in first] == [(True, "direct_lane", True, True)] * 5  # done at once or not


def late_peer(comm, late_rank, count=2):
    """``late_rank`` comes 0.3 s late to an all_reduce of ``count`` elements: the
    early ranks hand the call to the engine, sleep on their planes' events and
    are rung awake (test_group_lane.py, test_group_reads.py: 3 ranks). The
    result's first and last elements."""
    import time

    x = np.full(count, comm.rank + 1.0, np.float32)
    comm.barrier()
    if comm.rank == late_rank:
        time.sleep(0.3)
    cpu = time.process_time()
    comm.all_reduce(x)
    stats = comm.last_stats()
    return (time.process_time() - cpu, stats["algorithm"], stats["slept_for_peer"], stats["rang_peer"],
            [float(x[0]), float(x[-1])])


@pytest.mark.parametrize("late_rank", [0, 1])
def test_a_late_peer_is_met_without_spinning(pool, late_rank):
    results = pool.run(late_peer, late_rank)
    early, late = results[1 - late_rank], results[late_rank]
    assert early[1:] == ("direct_lane", True, False, [3.0, 3.0]), early
    assert late[1:] == ("direct_lane", False, True, [3.0, 3.0]), late
    assert early[0] < 0.2, f"the early rank spent {early[0]:.2f} CPU seconds waiting 0.3 s"


def arrive_late_in_turn(comm, k: int, every: int = 8) -> None:
    """Every ``every``-th call one rank, in turn, comes 2 ms late: against a spin of 0
    the others must sleep and be rung (on some hosts racing ranks always meet at once)."""
    if k % every == 0 and (k // every) % comm.size == comm.rank:
        time.sleep(0.002)


def always_sleeping(comm, calls=400, late_every=8):
    """PEER_SPIN_S = 0: a rank that does not find every peer at its first look
    sleeps at once, so the ranks race through the flags and doorbells
    (test_group_lane.py runs it on 3 ranks). Ranks arriving together may all
    meet at their first look on some hosts (a CI run: none of 800 calls slept),
    so some calls arrive late in turn (arrive_late_in_turn): (exact results,
    calls that slept)."""
    direct_ops.PEER_SPIN_S = 0.0
    exact = slept = 0
    expected_rank_sum = sum(range(comm.size))
    try:
        for k in range(calls):
            arrive_late_in_turn(comm, k, late_every)
            x = np.array([k, comm.rank], np.int64)
            exact += comm.all_reduce(x, np.empty_like(x)).tolist() == [comm.size * k, expected_rank_sum]
            slept += comm.last_stats()["slept_for_peer"]
    finally:
        direct_ops.PEER_SPIN_S = 200e-6
    return exact, slept


def test_ranks_that_sleep_at_once_still_meet_every_time(pool):
    results = pool.run(always_sleeping, timeout=120)
    assert [r[0] for r in results] == [400, 400], results
    # Each rank waited for the other's late calls (25 each) at least once.
    assert all(r[1] > 0 for r in results), results


def without_fingerprints(comm):
    x = np.array([comm.rank + 1.5], np.float64)
    comm.all_reduce(x)
    return comm.last_stats()["algorithm"], x.tolist()


def test_the_lane_meets_without_fingerprints():
    ranks = RankPool(2, env={"MPCCS_FINGERPRINT": "0"})
    try:
        assert ranks.run(without_fingerprints) == [("direct_lane", [4.0])] * 2
    finally:
        ranks.close()


def every_small_collective(comm):
    """reduce_scatter, all_gather (in place too), all_to_all, broadcast and reduce
    from either root, blocking and async, against numpy: (case, algorithm, exact)."""
    rank, rows = comm.rank, []
    for dtype in (np.float32, np.int16, np.float64):
        n = 1000
        ins = [((np.arange(2 * n) % 7) + 1 + 3 * r).astype(dtype) for r in range(2)]
        mine = ins[rank].copy()

        def row(case, got, expected):
            rows.append(((str(np.dtype(dtype)),) + case, comm.last_stats()["algorithm"],
                         np.asarray(got).tobytes() == np.asarray(expected).tobytes()))

        out = np.empty(n, dtype)
        comm.reduce_scatter(mine, out, op="max")
        row(("reduce_scatter",), out, np.maximum(ins[0], ins[1])[rank * n:(rank + 1) * n])
        in_place = mine.copy()
        comm.reduce_scatter(in_place, in_place[rank * n:(rank + 1) * n])
        row(("reduce_scatter in place",), in_place[rank * n:(rank + 1) * n], (ins[0] + ins[1])[rank * n:(rank + 1) * n])
        gathered = np.empty(4 * n, dtype)
        comm.all_gather(mine, gathered, async_op=True).wait()
        row(("all_gather async",), gathered, np.concatenate(ins))
        gathered = np.zeros(4 * n, dtype)
        gathered[rank * 2 * n:(rank + 1) * 2 * n] = mine
        comm.all_gather(gathered[rank * 2 * n:(rank + 1) * 2 * n], gathered)
        row(("all_gather in place",), gathered, np.concatenate(ins))
        swapped = np.empty(2 * n, dtype)
        comm.all_to_all(mine, swapped)
        row(("all_to_all",), swapped, np.concatenate([x[rank * n:(rank + 1) * n] for x in ins]))
        for root in (0, 1):
            buf = mine.copy()
            comm.broadcast(buf, root=root)
            row(("broadcast", root), buf, ins[root])
            reduced = np.full(2 * n, 99, dtype)
            got = comm.reduce(mine, reduced, op="sum", root=root)
            row(("reduce", root), reduced, (ins[0] + ins[1]) if rank == root else np.full(2 * n, 99, dtype))
            assert (got is reduced) == (rank == root)
    return rows


def test_every_small_collective_takes_the_lane_and_matches_numpy(pool):
    for rows in pool.run(every_small_collective):
        assert len(rows) == 3 * 9
        wrong = [r for r in rows if r[1:] != ("direct_lane", True)]
        assert not wrong, wrong
