"""The group lane (group_lane_ops.py, transports/shm_group.py): small
collectives of 3 to 8 ranks on one host whole through segments every rank
maps, folded in rank order like the direct path."""
import mmap
import os

import numpy as np
import pytest

from mpccs.errors import MismatchError
from mpccs.group_lane_ops import combine, published, takes_group_lane
from mpccs.transports import shm
from mpccs.transports.shm import WORD_PID
from mpccs.transports.shm_group import GROUP_LANE_MAX_BYTES, ShmGroup, blocks_bound, lane_bound, segment_bytes
from rankpool import RankPool
from test_lane import always_sleeping, late_peer

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory segments need x86-64 and /dev/shm")

WORDS = (0x1234, -(1 << 40))


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(3)
    yield ranks
    ranks.close()


# -- the protocol, every rank in this process ---------------------------------
def groups_here(size=3, cma=False):
    """``size`` ranks' segments in this process (anonymous maps), each naming this
    process as its owner (``cma``: the reads, which may read this process's own memory)."""
    maps = [mmap.mmap(-1, segment_bytes(size)) for _ in range(size)]
    for m in maps:
        np.ndarray(1, np.int64, m, WORD_PID * 8)[0] = os.getpid()
    return [ShmGroup(maps, r, cma=cma) for r in range(size)]


def _post(group, seq, values, words=WORDS):
    assert group.lane_free(seq)
    group.slot_view(group.rank, seq, values.dtype, values.size)[...] = values
    group.post_lane(seq, values.nbytes, words)


def test_every_peer_is_met_only_with_the_same_words_and_byte_count():
    g0, g1, g2 = groups_here()
    counts = (8, 8, 8)
    _post(g0, 1, np.arange(2, dtype=np.float32))
    _post(g1, 1, np.arange(2, dtype=np.float32))
    assert not g0.met_all(1, counts, WORDS, spin_s=0.0)  # rank 2 has not posted
    _post(g2, 1, np.arange(2, dtype=np.float32), words=(0x1234, 5))
    assert g0.peer_fingerprint(2, 1) is not None and not g0.met_all(1, counts, WORDS, spin_s=0.0)  # words differ
    assert not g2.met_all(1, (8, 8, 4), (0x1234, 5), spin_s=0.0)
    h0, h1, h2 = groups_here()
    for g in (h0, h1, h2):
        _post(g, 1, np.arange(2, dtype=np.float32))
    assert all(g.met_all(1, counts, WORDS, spin_s=0.0) for g in (h0, h1, h2))
    h2.post_waiting(1)
    assert not h0.met_all(1, counts, WORDS, spin_s=0.0)  # asleep: it needs a doorbell, which the op rings
    assert h0.peer_waiting(2, 1) and not h0.peer_waiting(1, 1)


def test_a_slot_is_written_again_only_after_every_rank_read_it():
    g0, g1, g2 = groups_here()
    _post(g0, 1, np.ones(4, np.int32))
    _post(g0, 2, np.ones(4, np.int32))  # the other slot
    assert not g0.lane_free(3)  # slot 1 holds operation 1, read by nobody
    g1.lane_taken(1)
    assert not g0.lane_free(3)  # rank 2 has not read it
    g2.lane_taken(1)
    # Rank 0 itself has not: its reduction takes its own operand from its slot (an async
    # call posted over it before its earlier call combined summed 5 where 3 was due).
    assert not g0.lane_free(3)
    g0.lane_taken(1)
    assert g0.lane_free(3) and not g0.lane_free(4)
    assert g1.peer_slot_bytes(0, 2) == 16 and g1.peer_slot_bytes(0, 4) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_fold_is_the_direct_paths_rank_order(dtype):
    """x0 + x1 + x2 + x3 from the left: with values whose sum depends on the order."""
    big = 1e8 if dtype == np.float32 else 2048.0  # where adding 1 rounds away
    xs = [np.array([big, 1.0], dtype), np.array([1.0, big], dtype), np.array([-big, -big], dtype),
          np.array([1.0, 1.0], dtype)]
    out = np.empty(2, dtype)
    combine("all_reduce", xs, out, "sum", 2, None)
    expected = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    assert out.tobytes() == expected.tobytes()
    assert out.tobytes() != (xs[3] + xs[2] + xs[1] + xs[0]).tobytes()  # the order shows


def test_what_a_rank_publishes_and_the_bound():
    send = np.zeros(16, np.float32)
    assert published("broadcast", send, 1, root=0).size == 0
    assert published("broadcast", send, 0, root=0) is send
    assert published("reduce", send, 1, root=0) is send
    group = groups_here(4)[0]
    assert group.lane_bytes == lane_bound(4) == 680 << 10  # 2 MiB read from 3 peers at most, in pages
    assert lane_bound(3) == GROUP_LANE_MAX_BYTES and lane_bound(8) == 292 << 10
    assert takes_group_lane(group, "all_reduce", group.lane_bytes)
    assert not takes_group_lane(group, "all_reduce", group.lane_bytes + 1)
    # A reduce_scatter, all_gather or all_to_all takes blocks of each slot: the larger bound, the slots' size.
    assert group.blocks_bytes == blocks_bound(4) == 2728 << 10 and blocks_bound(3) == 4 << 20
    assert group.slot_view(1, 1, np.uint8, group.blocks_bytes).nbytes == group.blocks_bytes
    for name in ("reduce_scatter", "all_gather"):
        assert takes_group_lane(group, name, group.blocks_bytes)
        assert not takes_group_lane(group, name, group.blocks_bytes + 1)
    assert takes_group_lane(group, "all_to_all", 2 << 20) and not takes_group_lane(group, "all_to_all", (2 << 20) + 1)
    assert not takes_group_lane(group, "broadcast", group.lane_bytes + 1)
    assert not takes_group_lane(group, "all_to_allv", send.nbytes)
    assert not takes_group_lane(None, "all_reduce", send.nbytes)


# -- real ranks ---------------------------------------------------------------
def segments_state(comm):
    import os

    left = [f for f in os.listdir(shm.SHM_DIR) if any(f.startswith(f"mpccs-g-{pid}-") for pid in comm._pids)]
    return comm._group is not None, comm._group.size, left


def test_every_rank_maps_every_segment_and_no_file_is_left(pool):
    assert pool.run(segments_state) == [(True, 3, [])] * 3


def init_without_segments_on_rank1(kwargs):
    import os

    import mpccs

    return mpccs.init(shm=os.environ["RANK"] != "1", **kwargs)


def init_without_room_on_rank1(kwargs):
    """Rank 1's /dev/shm has no room for its segment (posix_fallocate: ENOSPC)."""
    import errno
    import os

    import mpccs

    if os.environ["RANK"] == "1":
        def no_room(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")
        os.posix_fallocate = no_room
    return mpccs.init(**kwargs)


def small_call_without_group(comm):
    x = np.array([comm.rank + 1.0], np.float64)
    comm.all_reduce(x)
    return comm._group is None, comm.last_stats()["algorithm"], x.tolist()


@pytest.mark.parametrize("setup", [init_without_segments_on_rank1, init_without_room_on_rank1],
                         ids=["shm off on rank 1", "no room for rank 1's segment"])
def test_one_rank_without_its_segment_leaves_every_rank_on_messages(setup):
    """Rank 1 alone without a segment (shm off, or no room in /dev/shm): no rank uses the
    group (all or none), and calls still agree."""
    ranks = RankPool(3, setup=setup)
    try:
        assert ranks.run(small_call_without_group) == [(True, "direct", [6.0])] * 3
    finally:
        ranks.close()


def every_small_collective(comm):
    """Each collective, blocking and async, in place too, from every root, against
    numpy: rows of (case, algorithm, bit-exact)."""
    rank, size, rows = comm.rank, comm.size, []
    for dtype in (np.float32, np.int16):
        n = 300
        ins = [((np.arange(size * n) % 7) + 1 + 3 * r).astype(dtype) for r in range(size)]
        mine = ins[rank].copy()
        total = ins[0].copy()
        for x in ins[1:]:
            total = total + x

        def row(case, got, expected):
            rows.append(((str(np.dtype(dtype)),) + case, comm.last_stats()["algorithm"],
                         np.asarray(got).tobytes() == np.asarray(expected).tobytes()))

        out = np.empty_like(mine)
        comm.all_reduce(mine, out)
        row(("all_reduce",), out, total)
        in_place = mine.copy()
        comm.all_reduce(in_place, op="max", async_op=True).wait()
        row(("all_reduce in place async max",), in_place, np.maximum.reduce(ins))
        block_collective_rows(comm, ins, total, n, row)
        for root in range(size):
            buf = mine.copy()
            comm.broadcast(buf, root=root)
            row(("broadcast", root), buf, ins[root])
            reduced = np.full_like(mine, 99)
            comm.reduce(mine, reduced, op="sum", root=root)
            row(("reduce", root), reduced, total if rank == root else np.full_like(mine, 99))
        comm.barrier()
        row(("barrier",), 0, 0)
    return rows


def block_collective_rows(comm, ins, total, n, row, op="sum"):
    """reduce_scatter, all_gather (async, and in place) and all_to_all of ``ins[rank]``
    (``size`` x ``n`` elements) against numpy: ``row(case, got, expected)`` for each."""
    rank, size = comm.rank, comm.size
    mine, dtype = ins[rank].copy(), ins[rank].dtype
    block = np.empty(n, dtype)
    comm.reduce_scatter(mine, block, op=op)
    row(("reduce_scatter",), block, total[rank * n:(rank + 1) * n])
    gathered = np.empty(size * size * n, dtype)
    comm.all_gather(mine, gathered, async_op=True).wait()
    row(("all_gather async",), gathered, np.concatenate(ins))
    gathered = np.zeros(size * size * n, dtype)
    gathered[rank * size * n:(rank + 1) * size * n] = mine
    comm.all_gather(gathered[rank * size * n:(rank + 1) * size * n], gathered)
    row(("all_gather in place",), gathered, np.concatenate(ins))
    swapped = np.empty_like(mine)
    comm.all_to_all(mine, swapped)
    row(("all_to_all",), swapped, np.concatenate([x[rank * n:(rank + 1) * n] for x in ins]))


def test_every_small_collective_takes_the_group_lane_and_matches_numpy(pool):
    for rows in pool.run(every_small_collective):
        assert len(rows) == 2 * (7 + 2 * 3)
        wrong = [r for r in rows if r[1:] != ("direct_lane", True)]
        assert not wrong, wrong


def above_the_bound(comm):
    x = np.full(lane_bound(comm.size) // 4 + 1, comm.rank + 1.0, np.float32)
    comm.all_reduce(x)
    return comm.last_stats()["algorithm"], float(x[0])


def test_a_call_above_the_bound_takes_another_path(pool):
    for algorithm, value in pool.run(above_the_bound):
        assert algorithm != "direct_lane" and value == 6.0


def at_the_bound(comm):
    """Inputs of exactly the bound, for the collectives whose DAG plans would otherwise
    claim them (an all_gather's last stage, a broadcast's whole buffer): rows of
    (collective, algorithm, right)."""
    n, rows = blocks_bound(comm.size) // 4, []
    mine = np.full(n, comm.rank + 1.0, np.float32)
    gathered = np.empty(n * comm.size, np.float32)
    comm.all_gather(mine, gathered)
    rows.append(("all_gather", comm.last_stats()["algorithm"], bool((gathered[::n] == np.arange(1, comm.size + 1)).all())))
    n = lane_bound(comm.size) // 4
    buf = np.full(n, comm.rank + 1.0, np.float32)
    comm.broadcast(buf, root=1)
    rows.append(("broadcast", comm.last_stats()["algorithm"], bool((buf == 2.0).all())))
    return rows


def test_a_call_at_the_bound_takes_the_group_lane(pool):
    for rows in pool.run(at_the_bound):
        assert rows == [("all_gather", "direct_lane", True), ("broadcast", "direct_lane", True)], rows


def async_calls_in_flight(comm):
    """Five async calls in flight at once share the two slots in turn."""
    xs = [np.array([k, comm.rank], np.int64) for k in range(5)]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    for w in works:
        w.wait()
    return [x.tolist() for x in xs]


def test_async_calls_in_flight_take_the_slots_in_turn(pool):
    expected = [[3 * k, 3] for k in range(5)]
    assert pool.run(async_calls_in_flight) == [expected] * 3


@pytest.mark.parametrize("late", [0, 2])
def test_a_late_rank_is_met_without_spinning(pool, late):
    results = pool.run(late_peer, late)
    for rank, (cpu, algorithm, slept, rang, values) in enumerate(results):
        assert (algorithm, values) == ("direct_lane", [6.0, 6.0])
        if rank == late:
            assert rang and not slept, results
        else:
            assert slept and cpu < 0.2, results


def test_ranks_that_sleep_at_once_still_meet_every_time(pool):
    results = pool.run(always_sleeping, 300, timeout=120)
    assert [r[0] for r in results] == [300] * 3, results
    # Where ranks outnumber cores a look yields the core first, so racing ranks often meet
    # without sleeping; each rank still waited for the others' late calls.
    assert all(r[1] > 0 for r in results), results


def one_rank_calls_another_size(comm, n=4, odd=2, extra=1):
    """Rank ``odd`` calls an all_reduce of ``extra`` more elements than the others' ``n``:
    every rank gets a MismatchError, and the communicator says it aborted."""
    n += extra if comm.rank == odd else 0
    try:
        comm.all_reduce(np.ones(n, np.float32))
    except MismatchError as exc:
        return "mismatch", "operation #" in str(exc)
    return "no error", False


def test_a_size_mismatch_fails_every_rank():
    ranks = RankPool(3)
    try:
        assert ranks.run(one_rank_calls_another_size, timeout=60) == [("mismatch", True)] * 3
    finally:
        ranks.close()


def four_ranks(comm):
    x = np.array([comm.rank + 0.5], np.float64)
    comm.all_reduce(x)
    y = np.empty(4, np.int32)
    comm.all_gather(np.array([comm.rank * 10], np.int32), y)
    rows = at_the_bound(comm)  # (680 KiB: an all_gather the DAG's recursive doubling took, 12x slower)
    return comm.last_stats()["algorithm"], x.tolist(), y.tolist(), rows


def test_four_ranks_and_fingerprints_off():
    ranks = RankPool(4, env={"MPCCS_FINGERPRINT": "0"})
    try:
        rows = [("all_gather", "direct_lane", True), ("broadcast", "direct_lane", True)]
        assert ranks.run(four_ranks) == [("direct_lane", [8.0], [0, 10, 20, 30], rows)] * 4
    finally:
        ranks.close()
