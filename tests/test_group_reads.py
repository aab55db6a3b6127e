"""The group reads (group_read_steps.py, group_lane_ops.GroupReadsOp): all_reduce,
reduce_scatter, all_gather and all_to_all of 3 to 8 ranks on one host above the
group lane's bound, each rank reading what it needs straight from the others'
buffers, folded in rank order like every other path."""

import numpy as np
import pytest

from mpccs.errors import TransportError
from mpccs.group_lane_ops import read_bytes, takes_group_reads
from mpccs.group_read_steps import BLOCK_ALIGN_BYTES, GroupReadSteps, block_bounds
from mpccs.transports import cma, shm
from mpccs.transports.shm import SLOT_POSTED
from mpccs.transports.shm_group import blocks_bound, lane_bound
from rankpool import RankPool
from test_group_lane import block_collective_rows, groups_here, one_rank_calls_another_size
from test_lane import late_peer

pytestmark = pytest.mark.skipif(not (shm.supported() and cma.available()),
                                reason="the group reads need x86-64, /dev/shm and process_vm_readv")


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(3)
    yield ranks
    ranks.close()


# -- the steps, every rank in this process (it may read its own memory) -------
def _error(message, step, peer):
    return TransportError(message, peer=peer, stage=step)


def _steps(groups, seq, name, ins, outs, op="sum"):
    scratch = [np.empty(4 << 20, np.uint8) for _ in groups]
    return [GroupReadSteps(g, seq, g.rank, name, ins[g.rank], outs[g.rank], op,
                           lambda n, s=scratch[g.rank]: s[:n], _error) for g in groups]


def _run(steps, limit=100):
    for _ in range(limit):
        for s in steps:
            s.advance()
        if all(s.done for s in steps):
            return
    raise AssertionError([s.waiting_for for s in steps])


def test_block_bounds_cover_the_buffer_on_page_boundaries():
    for count, itemsize, size in ((262144, 4, 3), (1000003, 2, 4), (5, 8, 3), (3 << 20, 1, 8)):
        bounds = block_bounds(count, itemsize, size)
        assert bounds[0] == 0 and bounds[-1] == count and len(bounds) == size + 1
        assert all(a <= b for a, b in zip(bounds, bounds[1:]))
        assert all(b * itemsize % BLOCK_ALIGN_BYTES == 0 for b in bounds[:-1])
        if count * itemsize >= size * BLOCK_ALIGN_BYTES * 4:  # large: even to within a page
            sizes = np.diff(bounds) * itemsize
            assert sizes.max() - sizes.min() <= 2 * BLOCK_ALIGN_BYTES


@pytest.mark.parametrize("in_place", [False, True])
def test_all_reduce_folds_every_block_in_rank_order(in_place):
    """Values whose sum depends on the order: every rank gets ((x0 + x1) + x2), bit for bit."""
    n = 3 * 300000  # blocks of ~1.2 MB: three read parts each
    big = np.float32(1e8)
    ins = [np.tile(np.array(v, np.float32), n // 3) for v in ([big, 1, -big], [1, big, 1], [-big, -big, 1])]
    expected = (ins[0] + ins[1]) + ins[2]
    assert expected.tobytes() != ((ins[2] + ins[1]) + ins[0]).tobytes()  # the order shows
    groups = groups_here(cma=True)
    outs = [x if in_place else np.empty_like(x) for x in ins]
    _run(_steps(groups, 7, "all_reduce", ins, outs))
    for out in outs:
        assert out.tobytes() == expected.tobytes()


def test_the_other_collectives_place_every_block():
    size, n = 3, 200000
    ins = [(np.arange(size * n) * (r + 2)).astype(np.int32) for r in range(size)]
    total = ins[0] + ins[1] + ins[2]
    groups = groups_here(cma=True)
    for seq, (name, out_size) in enumerate((("reduce_scatter", n), ("all_to_all", size * n)), start=1):
        outs = [np.empty(out_size, np.int32) for _ in range(size)]
        _run(_steps(groups, seq, name, ins, outs))
        for r, out in enumerate(outs):
            want = total[r * n:(r + 1) * n] if name == "reduce_scatter" else \
                np.concatenate([x[r * n:(r + 1) * n] for x in ins])
            assert np.array_equal(out, want), name
    outs = [np.empty(size * size * n, np.int32) for _ in range(size)]
    _run(_steps(groups, 3, "all_gather", ins, outs))
    for out in outs:
        assert np.array_equal(out, np.concatenate(ins))


def test_no_rank_finishes_before_every_peer_is_done_reading_it():
    groups = groups_here(cma=True)
    ins = [np.full(3 * 4096, r + 1.0, np.float32) for r in range(3)]
    outs = [np.empty_like(x) for x in ins]
    s0, s1, s2 = _steps(groups, 1, "all_reduce", ins, outs)
    for _ in range(5):
        s0.advance()
        s1.advance()
    assert not s0.done and not s1.done and s0.waiting == [2]  # reduced their blocks; rank 2 has not
    s2.advance()  # reduces, reads the others' reduced blocks, posts DONE; ranks 0 and 1 still read its block
    assert not s2.done and s2.waiting == [0, 1]
    s0.advance()  # reads rank 2's block, posts DONE; rank 1 has not read rank 0's
    assert not s0.done and s0.waiting == [1]
    s1.advance()  # the last reader
    assert s1.done
    s0.advance()
    s2.advance()
    assert s0.done and s2.done
    assert all(np.all(out == 6.0) for out in outs)


def test_another_calls_shape_fails_the_step_naming_the_peer():
    groups = groups_here(cma=True)
    ins = [np.ones(3 * 4096 if r != 2 else 3 * 4096 + 1024, np.float32) for r in range(3)]
    outs = [np.empty_like(x) for x in ins]
    steps = _steps(groups, 1, "all_reduce", ins, outs)
    with pytest.raises(TransportError, match="rank 2 posted another call's shape") as info:
        steps[0].advance()
    assert info.value.peer == 2


def test_a_peer_that_abandons_while_read_fails_the_reader(monkeypatch):
    """A failed rank clears its slot: a read that raced it fails instead of completing."""
    groups = groups_here(cma=True)
    ins = [np.ones(3 * 4096, np.float32) for _ in range(3)]
    outs = [np.empty_like(x) for x in ins]
    steps = _steps(groups, 1, "all_reduce", ins, outs)
    steps[2].abandon()
    assert groups[0].slots[2][1, SLOT_POSTED] == 0
    groups[2].post_slot(1, SLOT_POSTED, 1)  # as if it still stood there when rank 0 looked
    real = cma.read_at

    def read_then_clear(*args):
        real(*args)
        groups[2].own_slots[1, SLOT_POSTED] = 0  # rank 2 abandons under the read
    monkeypatch.setattr(cma, "read_at", read_then_clear)
    with pytest.raises(TransportError, match="rank 2 left the operation while this rank read") as info:
        steps[0].advance()
    assert info.value.peer == 2


def test_which_calls_take_the_reads_and_what_they_read():
    class Group:
        cma, lane_bytes, blocks_bytes = True, lane_bound(4), blocks_bound(4)
    bound = lane_bound(4)
    assert not takes_group_reads(Group, "all_reduce", bound)  # the group lane's
    assert takes_group_reads(Group, "all_reduce", bound + 4)
    assert not takes_group_reads(Group, "all_gather", bound + 4)  # the lane's larger bound for blocks
    assert takes_group_reads(Group, "all_gather", blocks_bound(4) + 4)
    assert not takes_group_reads(Group, "broadcast", 8 << 20)
    Group.cma = False
    assert not takes_group_reads(Group, "all_reduce", 8 << 20)
    assert read_bytes("all_reduce", 4 << 20, 4) == 6 << 20
    assert read_bytes("all_gather", 1 << 20, 4) == 3 << 20
    assert read_bytes("reduce_scatter", 4 << 20, 4) == 3 << 20


# -- real ranks ---------------------------------------------------------------
def every_collective_read(comm):
    """Each collective above the bound, blocking and async, in place where the API
    allows, against numpy folded in rank order: rows of (case, algorithm, bit-exact)."""
    rank, size, rows = comm.rank, comm.size, []
    for dtype, op in ((np.float32, "sum"), (np.int16, "max"), (np.float64, "min")):
        # Above the lane's larger bound (a reduce_scatter's, all_gather's, all_to_all's), blocks not page-sized.
        n = blocks_bound(size) // np.dtype(dtype).itemsize // size + 1001
        rng = np.random.default_rng(11)
        ins = [(rng.standard_normal(size * n) * 1000).astype(dtype) for _ in range(size)]
        mine = ins[rank].copy()
        fold = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
        total = ins[0].copy()
        for x in ins[1:]:
            total = fold(total, x)

        def row(case, got, expected):
            rows.append(((str(np.dtype(dtype)), op) + case, comm.last_stats()["algorithm"],
                         np.asarray(got).tobytes() == np.asarray(expected).tobytes()))

        out = np.empty_like(mine)
        comm.all_reduce(mine, out, op=op)
        row(("all_reduce",), out, total)
        in_place = mine.copy()
        comm.all_reduce(in_place, op=op, async_op=True).wait()
        row(("all_reduce in place async",), in_place, total)
        block_collective_rows(comm, ins, total, n, row, op)
    return rows


def test_every_collective_above_the_bound_reads_and_matches_numpy(pool):
    for rows in pool.run(every_collective_read, timeout=120):
        assert len(rows) == 3 * 6
        wrong = [r for r in rows if r[1:] != ("group_reads", True)]
        assert not wrong, wrong


def lane_and_reads_interleaved(comm):
    """Small and large calls alternate, async ones in flight together: the lane's
    slots and the reads' slot table share the fingerprint ring."""
    big = lane_bound(comm.size) // 4 * 3
    works, xs = [], []
    for k in range(6):
        x = np.full(8 if k % 2 else big, comm.rank + k, np.float32)
        xs.append(x)
        works.append(comm.all_reduce(x, async_op=True))
    for w in works:
        w.wait()
    y = np.full(big, 1.0, np.float32)
    comm.all_reduce(y)
    return [float(x[0]) for x in xs] + [float(x[-1]) for x in xs] + [float(y[0]), comm.last_stats()["algorithm"]]


def test_lane_and_reads_calls_in_flight_together(pool):
    expected = [3.0 + 3 * k for k in range(6)] * 2 + [3.0, "group_reads"]
    assert pool.run(lane_and_reads_interleaved, timeout=60) == [expected] * 3


@pytest.mark.parametrize("late", [0, 2])
def test_a_late_rank_is_met_without_spinning(pool, late):
    results = pool.run(late_peer, late, 1 << 20)  # 4 MiB
    for rank, (cpu, algorithm, slept, rang, values) in enumerate(results):
        assert (algorithm, values) == ("group_reads", [6.0, 6.0])
        if rank == late:
            assert rang and not slept, results
        else:
            assert slept and cpu < 0.2, results


def test_a_size_mismatch_fails_every_rank_before_any_read():
    ranks = RankPool(3)
    try:
        assert ranks.run(one_rank_calls_another_size, 1 << 20, 1, 1024, timeout=60) == [("mismatch", True)] * 3
    finally:
        ranks.close()


def four_ranks_reads(comm):
    n = 3 << 20
    x = np.full(n // 4, comm.rank + 0.5, np.float64)
    comm.all_reduce(x)
    m = 3 << 18  # 3 MiB: above the lane's bound for blocks on 4 ranks (2.67 MiB)
    y = np.empty(4 * m, np.int32)
    comm.all_gather(np.full(m, comm.rank * 10, np.int32), y)
    return comm._group.cma, comm.last_stats()["algorithm"], float(x[0]), y[::m].tolist()


def test_four_ranks_and_fingerprints_off():
    ranks = RankPool(4, env={"MPCCS_FINGERPRINT": "0"})
    try:
        assert ranks.run(four_ranks_reads, timeout=60) == [(True, "group_reads", 8.0, [0, 10, 20, 30])] * 4
    finally:
        ranks.close()


def reads_off(comm):
    x = np.full(1 << 20, comm.rank + 1.0, np.float32)
    comm.all_reduce(x)
    return comm._group is not None, comm._group.cma, comm.last_stats()["algorithm"], float(x[0])


def test_cma_off_keeps_the_group_lane_and_leaves_large_calls_to_the_dag():
    ranks = RankPool(3, env={"MPCCS_CMA": "0"})
    try:
        for present, reads, algorithm, value in ranks.run(reads_off, timeout=60):
            assert present and not reads and algorithm not in ("group_reads", "direct_lane") and value == 6.0
    finally:
        ranks.close()
