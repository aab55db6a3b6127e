"""The pipe: a pair's parts through the shared-memory outboxes in chunks
(pipe_steps.py, direct_ops.DirectPipeBlocksOp).

The steps run first with both "ranks" in this one process, on two segments
mapped into each other (as test_shm and test_cma do), in every interleaving
the tests choose; then on live ranks (one pool): what takes the pipe, exact
results, calls in flight together, a size that differs.
"""
import mmap

import numpy as np
import pytest

from collective_cases import dtype_of
from mpccs import pipe_steps
from mpccs.direct_ops import peer_part
from mpccs.errors import TransportError
from mpccs.pipe_steps import CHUNK_SPAN, PipeSteps
from mpccs.transports import shm
from mpccs.transports.shm import FLAG_CHUNKS, FLAG_PIPE_SHAPE, SEGMENT_BYTES, ShmPair
from rankpool import RankPool
from test_two_step import inputs, reference

pytestmark = pytest.mark.skipif(not shm.supported(), reason="the segments need x86-64 Linux with /dev/shm")
KIB, MIB = 1 << 10, 1 << 20


def _pairs():
    a, b = (mmap.mmap(-1, SEGMENT_BYTES) for _ in range(2))
    return ShmPair(a, b), ShmPair(b, a)


def _error(message, step):
    return TransportError(message, rank=0, plane="up", peer=1, op="test", stage=step)


def _steps(pair, rank, collective, src, out, seq, op="sum", root=0):
    part, count = peer_part(collective, src, rank, root)
    return PipeSteps(pair, seq, rank, collective, src, out, op, part, count, _error, root)


def _run_both(collective, srcs, outs, seq=1, op="sum", root=0, ahead=0, pairs=None):
    """Both ranks' steps to the end: rank ``ahead`` advances until it cannot move, then
    the other once, and so on (each rank runs as far ahead of the other as it can)."""
    pairs = pairs or _pairs()
    steps = {r: _steps(pairs[r], r, collective, srcs[r], outs[r], seq, op, root) for r in (ahead, 1 - ahead)}
    for _ in range(1000):
        while steps[ahead].advance():
            pass
        steps[1 - ahead].advance()
        if all(s.done for s in steps.values()):
            return steps
    raise AssertionError("the steps did not finish")


def _chunks(monkeypatch, nbytes=4 * KIB):
    """Small chunks, so that small arrays cross many of them (and a short last one)."""
    monkeypatch.setattr(pipe_steps, "PIPE_CHUNK_BYTES", nbytes)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "bfloat16"])
@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.parametrize("in_place", [False, True])
def test_all_gather_places_both_blocks(monkeypatch, dtype, ahead, in_place):
    _chunks(monkeypatch)
    m = 10_007
    blocks = [inputs(r, m, dtype) for r in range(2)]
    outs = [np.zeros(2 * m, dtype_of(dtype)) for _ in range(2)]
    srcs = blocks
    if in_place:
        for r in range(2):
            outs[r][r * m:(r + 1) * m] = blocks[r]
        srcs = [outs[r][r * m:(r + 1) * m] for r in range(2)]
    _run_both("all_gather", srcs, outs, ahead=ahead)
    for r in range(2):
        assert outs[r].tobytes() == np.concatenate(blocks).tobytes()


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("ahead", [0, 1])
def test_reduce_scatter_reduces_in_rank_order(monkeypatch, op, in_place, ahead):
    _chunks(monkeypatch)
    m = 5003
    ins = [inputs(r, 2 * m, "float32") for r in range(2)]
    expected = reference(2 * m, "float32", op)  # rank 0's operand on the left
    srcs = [x.copy() for x in ins]
    outs = [srcs[r][r * m:(r + 1) * m] if in_place else np.zeros(m, np.float32) for r in range(2)]
    _run_both("reduce_scatter", srcs, outs, op=op, ahead=ahead)
    for r in range(2):
        assert outs[r].tobytes() == expected[r * m:(r + 1) * m].tobytes()
        if not in_place:
            assert srcs[r].tobytes() == ins[r].tobytes(), "the input changed out of place"


@pytest.mark.parametrize("ahead", [0, 1])
def test_all_to_all_exchanges_the_blocks(monkeypatch, ahead):
    _chunks(monkeypatch)
    m = 4099
    srcs = [inputs(r, 2 * m, "int16") for r in range(2)]
    outs = [np.full(2 * m, -1, np.int16) for _ in range(2)]
    _run_both("all_to_all", srcs, outs, ahead=ahead)
    for r in range(2):  # block i of rank r's output: block r of rank i's input
        expected = np.concatenate([srcs[0][r * m:(r + 1) * m], srcs[1][r * m:(r + 1) * m]])
        assert outs[r].tobytes() == expected.tobytes()


@pytest.mark.parametrize("root", [0, 1])
@pytest.mark.parametrize("ahead", [0, 1])
def test_broadcast_places_the_roots_buffer(monkeypatch, root, ahead):
    _chunks(monkeypatch)
    bufs = [inputs(r, 5003, "float64") for r in range(2)]
    expected = bufs[root].copy()
    steps = _run_both("broadcast", bufs, bufs, root=root, ahead=ahead)
    assert all(b.tobytes() == expected.tobytes() for b in bufs)
    assert steps[root].taken == 0 and steps[1 - root].posted == 0  # the root takes nothing, the reader posts nothing


@pytest.mark.parametrize("root", [0, 1])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_reduces_into_the_root_in_rank_order(monkeypatch, root, in_place, op):
    _chunks(monkeypatch)
    n = 4099
    ins = [inputs(r, n, "float32") for r in range(2)]
    srcs = [x.copy() for x in ins]
    outs = [(srcs[r] if in_place else np.zeros(n, np.float32)) if r == root else np.empty(0, np.float32)
            for r in range(2)]
    _run_both("reduce", srcs, outs, op=op, root=root)
    assert outs[root].tobytes() == reference(n, "float32", op).tobytes()
    assert srcs[1 - root].tobytes() == ins[1 - root].tobytes()  # the other rank's input is only read


def test_chunks_overlap_the_peers_copies(monkeypatch):
    """Each advance posts one chunk and takes what the peer posted: in lockstep a rank
    takes its peer's chunk k right after the peer posted it, while it posts its own
    next one, not once a whole part is in."""
    _chunks(monkeypatch)
    m, c = 4 * 1024, 1024  # float32: four chunks of 4 KiB
    pairs = _pairs()
    srcs = [np.full(m, r + 1, np.float32) for r in range(2)]
    outs = [np.zeros(2 * m, np.float32) for _ in range(2)]
    steps = [_steps(pairs[r], r, "all_gather", srcs[r], outs[r], 3) for r in range(2)]  # chunk 0 posted by both
    taken = []
    for _ in range(4):
        for s in steps:
            s.advance()
        taken.append([s.taken for s in steps])
    # rank 0 advances first: it sees one chunk more of rank 1's each round, rank 1 all of rank 0's
    assert taken == [[c, 2 * c], [2 * c, 3 * c], [3 * c, m], [m, m]]
    assert all(o.tobytes() == np.repeat(np.array([1, 2], np.float32), m).tobytes() for o in outs)


def test_a_rank_never_takes_more_than_it_posted(monkeypatch):
    """A peer whose whole part is there: this rank still takes only as far as it posted
    its own (an in-place call's part leaves the output before the peer's lands there)."""
    _chunks(monkeypatch)
    m = 4 * 1024  # float32: four chunks of 1024 elements
    pairs = _pairs()
    srcs = [np.full(m, r + 1, np.float32) for r in range(2)]
    outs = [np.zeros(2 * m, np.float32) for _ in range(2)]
    peer = _steps(pairs[1], 1, "all_gather", srcs[1], outs[1], 4)
    for _ in range(4):
        peer.advance()  # rank 1 posts every chunk (it takes nothing: rank 0 posted nothing yet)
    assert peer.posted == m and peer.taken == 0
    mine = _steps(pairs[0], 0, "all_gather", srcs[0], outs[0], 4)  # posts chunk 0
    mine.advance()  # posts chunk 1, then takes chunks 0 and 1 only
    assert mine.posted == mine.taken == 2 * 1024


def _ring(monkeypatch, chunks=4):
    """4 KiB chunks and an outbox of ``chunks`` of them: parts of a few KiB go round it."""
    _chunks(monkeypatch)
    monkeypatch.setattr(pipe_steps, "OUTBOX_BYTES", chunks * 4 * KIB)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("ahead", [0, 1])
def test_parts_larger_than_the_outbox_go_round_it(monkeypatch, collective, in_place, ahead):
    """Parts of 4.4 outboxes (a short last chunk): each chunk lands once, in its place, in
    rank order, whichever rank runs ahead (it cannot run more than an outbox ahead)."""
    _ring(monkeypatch)
    m = 4507  # float32 elements per block: 17.6 KiB, over four 4 KiB chunks an outbox
    n = m if collective == "all_gather" else 2 * m
    ins = [inputs(r, n, "float32") for r in range(2)]
    srcs = [x.copy() for x in ins]
    root = 1 - ahead
    if collective == "all_gather":
        outs = [np.zeros(2 * m, np.float32) for _ in range(2)]
        if in_place:
            for r in range(2):
                outs[r][r * m:(r + 1) * m] = ins[r]
            srcs = [outs[r][r * m:(r + 1) * m] for r in range(2)]
        expected = [np.concatenate(ins)] * 2
    elif collective == "reduce_scatter":
        outs = [srcs[r][r * m:(r + 1) * m] if in_place else np.zeros(m, np.float32) for r in range(2)]
        total = reference(n, "float32", "sum")
        expected = [total[r * m:(r + 1) * m] for r in range(2)]
    elif collective == "all_to_all":
        outs = srcs if in_place else [np.zeros(n, np.float32) for _ in range(2)]
        expected = [np.concatenate([ins[0][r * m:(r + 1) * m], ins[1][r * m:(r + 1) * m]]) for r in range(2)]
    elif collective == "broadcast":
        outs = srcs
        expected = [ins[root]] * 2
    else:
        outs = [(srcs[r] if in_place else np.zeros(n, np.float32)) if r == root else np.empty(0, np.float32)
                for r in range(2)]
        expected = [reference(n, "float32", "sum") if r == root else outs[r] for r in range(2)]
    steps = _run_both(collective, srcs, outs, root=root, ahead=ahead)
    assert steps[0].ring == 4
    for r in range(2):
        assert outs[r].tobytes() == expected[r].tobytes(), r


def test_a_rank_waits_for_its_peer_to_take_before_going_round(monkeypatch):
    """The outbox full (four chunks posted, none taken): the next chunk waits, and goes
    in once the peer took the first."""
    _ring(monkeypatch)
    pairs = _pairs()
    buf = np.arange(6 * 1024, dtype=np.float32)  # six chunks of 1024 float32
    root = _steps(pairs[0], 0, "broadcast", buf, buf, 5, root=0)
    for _ in range(5):
        root.advance()
    assert root.posted == 4 * 1024 and not root.advance()
    assert root.waiting_for == "the peer to take chunks of this rank's outbox (posted to element 4096)"
    reader_buf = np.zeros_like(buf)
    reader = _steps(pairs[1], 1, "broadcast", reader_buf, reader_buf, 5, root=0)
    assert reader.advance() and reader.taken == 4 * 1024  # all four, then FLAG_CHUNKS_TAKEN
    assert root.advance() and root.posted == 5 * 1024


def test_an_earlier_operations_chunks_do_not_count(monkeypatch):
    """FLAG_CHUNKS only grows (seq x CHUNK_SPAN + chunks): the peer's last operation,
    every chunk posted, is not this one's first chunk."""
    pairs = _pairs()
    pairs[1].post(FLAG_CHUNKS, 6 * CHUNK_SPAN + 9)  # operation 6, nine chunks
    src = np.ones(600 * KIB // 4, np.float32)
    steps = _steps(pairs[0], 0, "all_gather", src, np.zeros(2 * src.size, np.float32), 7)
    assert not steps.advance() or steps.taken == 0
    assert steps.taken == 0 and not steps.done
    assert steps.waiting_for.startswith("the peer's chunk at element 0")


def test_a_peer_of_another_shape_fails_before_anything_is_taken(monkeypatch):
    """A peer whose call differs (here a reduce of another size, fingerprints off)
    posts another shape: the rank that takes from it fails naming the step, with
    nothing of the peer's placed in its output."""
    _chunks(monkeypatch)
    pairs = _pairs()
    outs = [np.zeros(5000, np.float32), np.zeros(0, np.float32)]
    srcs = [np.ones(5000, np.float32), np.ones(5001, np.float32)]
    steps = [_steps(pairs[r], r, "reduce", srcs[r], outs[r], 2) for r in range(2)]
    with pytest.raises(TransportError) as info:
        steps[0].advance()
    assert "shape" in str(info.value) and info.value.stage == "pipe"
    assert not outs[0].any()
    assert int(pairs[0].peer_flags[FLAG_PIPE_SHAPE]) == steps[1].shape


def test_operations_back_to_back_reuse_the_outboxes(monkeypatch):
    """Each operation's chunks are told apart by their sequence numbers: operations of
    different collectives and sizes one after another on the same segments stay exact."""
    _chunks(monkeypatch, 8 * KIB)
    pairs = _pairs()
    for seq, m in enumerate((3000, 777, 12_345, 1), start=1):
        blocks = [inputs(r, m, "float32") for r in range(2)]
        outs = [np.zeros(2 * m, np.float32) for _ in range(2)]
        _run_both("all_gather", blocks, outs, seq=seq, ahead=seq % 2, pairs=pairs)
        assert all(o.tobytes() == np.concatenate(blocks).tobytes() for o in outs)
        bufs = [inputs(r, m, "float32") for r in range(2)]
        _run_both("broadcast", bufs, bufs, seq=seq + 100, root=seq % 2, pairs=pairs)
        assert bufs[0].tobytes() == bufs[1].tobytes() == inputs(seq % 2, m, "float32").tobytes()


@pytest.mark.parametrize("collective,nbytes,reads,expected", [
    ("broadcast", 384 * KIB, True, False),  # the lane's
    ("broadcast", 384 * KIB + 1, True, True),
    ("reduce", 2 * MIB, True, True),
    ("reduce", 2 * MIB, False, True),
    ("reduce", 2 * MIB + 1, True, True),  # round the outbox, where the pair reads or not
    ("reduce", 256 * MIB, True, True),
    ("reduce", 256 * MIB + 1, False, False),
    ("broadcast", 2 * MIB + 1, True, False),  # the reads
    ("broadcast", 4 * MIB, False, True),
    ("broadcast", 4 * MIB + 1, False, False),  # the tree won above
    ("reduce_scatter", 128 * MIB, False, True),  # a pair that does not read
    ("reduce_scatter", 128 * MIB + 1, False, False),
    ("all_gather", 512 * KIB, True, False),  # the reads (from 512 KiB), or below them the messages
    ("all_gather", 768 * KIB, False, True),  # a pair that does not read
    ("all_gather", MIB, False, False),
    ("all_to_all", 512 * KIB, False, False),
    ("reduce_scatter", 512 * KIB, True, False),  # the reads, where the pair reads
    ("reduce_scatter", 512 * KIB, False, True),
    ("all_reduce", 512 * KIB, False, False),
])
def test_what_takes_the_pipe(collective, nbytes, reads, expected):
    assert pipe_steps.takes(collective, nbytes, reads) is expected


# -- live ranks -----------------------------------------------------------------
@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2)
    yield ranks
    ranks.close()


# (collective, bytes, dtype, op, in place, root): odd counts; both roots
LIVE_CALLS = [
    ("broadcast", 400 * KIB + 6, "float16", "sum", True, 0),
    ("broadcast", 2 * MIB, "float64", "sum", True, 1),
    ("reduce", 512 * KIB + 8, "int64", "prod", False, 1),
    ("reduce", MIB + 4, "float32", "avg", True, 0),
    ("reduce", 2 * MIB, "bfloat16", "max", False, 1),
    ("reduce", 9 * MIB + 8, "int64", "prod", True, 0),  # round the outbox
    ("reduce", 20 * MIB + 4, "float32", "sum", False, 1),
]
# On a pair that does not read across processes, all_gather's blocks too, and a
# broadcast round the outbox.
LIVE_CALLS_WITHOUT_READS = LIVE_CALLS + [
    ("all_gather", 500 * KIB + 4, "float32", "sum", False, 0),
    ("all_gather", 768 * KIB, "uint8", "sum", True, 0),
    ("broadcast", 4 * MIB - 2, "float16", "sum", True, 1),
    ("reduce_scatter", 600 * KIB + 8, "int64", "prod", False, 0),
    ("reduce_scatter", 9 * MIB + 4, "float32", "sum", True, 0),
]


def _call(comm, collective, nbytes, dtype, op, in_place, root):
    """One LIVE_CALLS call: (algorithm, exact)."""
    n = nbytes // dtype_of(dtype).itemsize
    me = comm.rank
    if collective == "broadcast":
        buf = inputs(me, n, dtype)
        comm.broadcast(buf, root=root)
        return comm.last_stats()["algorithm"], buf.tobytes() == inputs(root, n, dtype).tobytes()
    if collective == "reduce":
        x = inputs(me, n, dtype)
        got = x if in_place or me != root else np.full_like(x, 7)
        comm.reduce(x, None if in_place or me != root else got, op=op, root=root)
        exact = got.tobytes() == reference(n, dtype, op).tobytes() if me == root else \
            x.tobytes() == inputs(me, n, dtype).tobytes()
        return comm.last_stats()["algorithm"], exact
    if collective == "reduce_scatter":  # n: the block; in place: the output is this rank's block of the input
        x = inputs(me, 2 * n, dtype)
        got = x[me * n:(me + 1) * n] if in_place else np.full(n, 7, dtype_of(dtype))
        comm.reduce_scatter(x, got, op=op)
        return comm.last_stats()["algorithm"], got.tobytes() == reference(2 * n, dtype, op)[me * n:(me + 1) * n].tobytes()
    out = np.full(2 * n, 7, dtype_of(dtype))
    x = inputs(me, n, dtype)
    if in_place:
        out[me * n:(me + 1) * n] = x
        x = out[me * n:(me + 1) * n]
    comm.all_gather(x, out)
    expected = np.concatenate([inputs(r, n, dtype) for r in range(2)])
    return comm.last_stats()["algorithm"], out.tobytes() == expected.tobytes()


def live_calls(comm, policy, cases=LIVE_CALLS):
    comm.set_path_policy(policy)
    return [_call(comm, *case) for case in cases]


@pytest.mark.parametrize("policy", ["up", "adaptive"])
def test_pipe_calls_are_exact(pool, policy):
    for per_rank in pool.run(live_calls, policy):
        assert per_rank == [("direct_pipe", True)] * len(LIVE_CALLS), per_rank


def test_a_pair_that_does_not_read_across_processes_takes_the_pipe_too():
    """MPCCS_CMA=0: the segments stay open, and the pipe needs nothing else."""
    ranks = RankPool(2, env={"MPCCS_CMA": "0"})
    try:
        for per_rank in ranks.run(live_calls, "up", LIVE_CALLS_WITHOUT_READS):
            assert per_rank == [("direct_pipe", True)] * len(LIVE_CALLS_WITHOUT_READS), per_rank
    finally:
        ranks.close()


def beside_the_pipe(comm):
    """What does not take the pipe: a fixed split, an algorithm asked for, the
    collectives it lost at, all_gather where the pair reads (or above 768 KiB).
    {call: algorithm}."""
    seen = {}
    comm.set_path_policy(0.8)
    comm.broadcast(np.ones(MIB // 4, np.float32))
    seen["fixed split"] = comm.last_stats()["algorithm"]
    comm.set_path_policy("up")
    comm.broadcast(np.ones(MIB // 4, np.float32), algorithm="pipeline")
    seen["algorithm asked"] = comm.last_stats()["algorithm"]
    comm.all_to_all(np.ones(MIB // 4, np.float32), np.empty(MIB // 4, np.float32))  # 512 KiB blocks
    seen["all_to_all"] = comm.last_stats()["algorithm"]
    comm.reduce_scatter(np.ones(MIB // 4, np.float32), np.empty(MIB // 8, np.float32))
    seen["reduce_scatter"] = comm.last_stats()["algorithm"]
    comm.all_gather(np.ones(MIB // 4, np.float32), np.empty(MIB // 2, np.float32))  # 1 MiB blocks
    seen["all_gather over its bound"] = comm.last_stats()["algorithm"]
    if comm._engine.shm.cma:
        comm.all_gather(np.ones(MIB // 8, np.float32), np.empty(MIB // 4, np.float32))  # 512 KiB blocks
        seen["all_gather on a pair that reads"] = comm.last_stats()["algorithm"]
    return seen


def test_the_pipe_takes_only_its_calls(pool):
    for seen in pool.run(beside_the_pipe):
        assert "direct_pipe" not in seen.values(), seen
        assert seen["algorithm asked"] == "pipeline"


def pair_reads(comm):
    return comm._engine.shm.cma


def in_flight_together(comm):
    """Pipe calls in flight with all_reduces through the outboxes and reads, waited for
    in reverse: they take the segments in turn, each exact."""
    comm.set_path_policy("up")
    me = comm.rank
    bufs = [np.full(MIB // 4 + 17 * k, float(me + k), np.float32) for k in range(3)]
    reduced = np.full(MIB // 2, float(me + 1), np.float32)
    gathered = np.empty(2 * 150_000, np.float32)
    sums = [np.full(MIB // 2 + MIB * k, float(me + 1), np.float32) for k in range(2)]  # outboxes, then reads
    works = [comm.broadcast(bufs[0], root=1, async_op=True), comm.all_reduce(sums[0], async_op=True),
             comm.reduce(reduced, root=0, async_op=True), comm.broadcast(bufs[1], root=0, async_op=True),
             comm.all_gather(np.full(150_000, float(me), np.float32), gathered, async_op=True),
             comm.all_reduce(sums[1], async_op=True), comm.broadcast(bufs[2], root=1, async_op=True)]
    for w in reversed(works):
        w.wait()
    exact = (np.all(bufs[0] == 1.0) and np.all(bufs[1] == 1.0) and np.all(bufs[2] == 3.0)
             and np.all(reduced == (3.0 if me == 0 else 2.0))
             and np.array_equal(gathered, np.repeat(np.array([0.0, 1.0], np.float32), 150_000))
             and all(np.all(s == 3.0) for s in sums))
    return [w.stats()["algorithm"] for w in works], bool(exact)


def test_pipe_calls_in_flight_with_others_complete_exactly(pool):
    gather_path = "direct_shm" if pool.run(pair_reads)[0] else "direct_pipe"  # (600 KB blocks)
    for algorithms, exact in pool.run(in_flight_together):
        assert algorithms == ["direct_pipe", "direct_shm", "direct_pipe", "direct_pipe", gather_path,
                              "direct_shm", "direct_pipe"] and exact, algorithms


def sizes_that_differ(comm):
    """Rank 1 broadcasts 4 bytes more than rank 0 asks for: both raise, neither hangs."""
    from mpccs.errors import MpccsError

    n = MIB // 4 + comm.rank
    try:
        comm.broadcast(np.ones(n, np.float32), root=1)
    except MpccsError as exc:
        return type(exc).__name__, str(exc)
    return None, ""


def test_a_size_that_differs_fails_on_both_ranks(pool):
    for name, text in pool.run(sizes_that_differ, timeout=60):
        assert name == "MismatchError", text
