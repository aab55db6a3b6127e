"""Cross-memory reads between the two ranks of a pair: the transport
(transports/cma.py), the steps (cma_steps.py) through the two-step executor
(two_step_cma.py), and the direct all_reduce that reads its halves
(direct_ops.DirectShmAllReduceOp above DIRECT_CMA_FROM_BYTES).

The steps run first with both ranks in this one process: two segments mapped
into each other (as test_shm does) and the "peer" pid this process's own, so
every read is a real process_vm_readv. Then on live ranks (one pool).
"""
import errno
import mmap
import os
from types import SimpleNamespace

import numpy as np
import pytest

import mpccs
from collective_cases import dtype_of
from mpccs import cma_steps
from mpccs.direct_ops import DIRECT_CMA_FROM_BYTES, DIRECT_CMA_MAX_BYTES
from mpccs.errors import TransportError
from mpccs.transports import cma, shm
from mpccs.transports.shm import HEADER_BYTES, OUTBOX_BYTES, SLOT_POSTED, SLOT_SHAPE, SLOTS, ShmPair
from mpccs.two_step_cma import CmaTwoStepExecutor
from rankpool import RankPool
from test_two_step import inputs, reference

pytestmark = pytest.mark.skipif(not (shm.supported() and cma.available()),
                                reason="cross-memory reads need x86-64 Linux with process_vm_readv")
MIB = 1 << 20


def _pairs():
    a, b = (mmap.mmap(-1, HEADER_BYTES + OUTBOX_BYTES) for _ in range(2))
    pairs = ShmPair(a, b, cma=True), ShmPair(b, a, cma=True)
    for p in pairs:
        p.peer_pid = os.getpid()  # both "ranks" live here
    return pairs


class _Engine:
    controller = None

    def __init__(self):
        self.cma_slot_holders = {}

    def control_plane(self, peer):
        return SimpleNamespace(name="up")

    def kept_scratch(self, user, nbytes):
        return np.empty(nbytes, np.uint8)


def _op(name, rank, src, out, seq, op="sum"):
    return SimpleNamespace(engine=_Engine(), buffers={"in": src, "out": out}, name=name, rank=rank, others=(1 - rank,),
                           wire_seq=seq, op=op, bytes_per_plane={"up": 0, "out": 0}, stage_log=[],
                           splitter=SimpleNamespace(policy="up"))


def _run_both(pairs, name, srcs, outs, seq=1, op="sum", first=0):
    ops = [_op(name, r, srcs[r], outs[r], seq, op) for r in range(2)]
    order = (first, 1 - first)
    executors = {r: CmaTwoStepExecutor(ops[r], 1, pairs[r]) for r in order}
    for _ in range(10):
        for r in order:
            executors[r].advance()
        if all(e.done for e in executors.values()):
            return ops, executors
    raise AssertionError("the steps did not finish")


def _operands(n, dtype=np.float32):
    return [(np.resize(np.array([1e8, 1.0, -1e8, 3.5]), n) * (r + 1) + r / 3).astype(dtype) for r in range(2)]


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 100_001])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("first", [0, 1])
def test_all_reduce_exact_in_rank_order(n, in_place, first):
    ins = _operands(n)
    expected = ins[0] + ins[1]  # rank 0's operand on the left, as on every path
    srcs = [x.copy() for x in ins]
    outs = srcs if in_place else [np.full(n, np.nan, np.float32) for _ in range(2)]
    ops, _ = _run_both(_pairs(), "all_reduce", srcs, outs, first=first)
    for r in range(2):
        assert outs[r].tobytes() == expected.tobytes()
        if not in_place:
            assert srcs[r].tobytes() == ins[r].tobytes(), "the input changed out of place"
        # The same accounting as the UCX executor: half the input each step, both steps on 'up'.
        assert ops[r].bytes_per_plane["up"] == srcs[r][n // 2:].nbytes + srcs[r][:n // 2].nbytes
        assert [s["label"] for s in ops[r].stage_log] == ["reduce-scatter", "all-gather"]


@pytest.mark.parametrize("op,fold,dtype", [("max", np.maximum, np.float64), ("min", np.minimum, np.int32),
                                           ("prod", np.multiply, np.int64)])
def test_reduce_scatter_blocks_other_ops_and_dtypes(op, fold, dtype):
    m = 5003
    ins = [np.arange(2 * m, dtype=dtype) % 17 - 8 * r for r in range(2)]
    outs = [np.zeros(m, dtype) for _ in range(2)]
    ops, _ = _run_both(_pairs(), "reduce_scatter", ins, outs, op=op)
    whole = fold(ins[0], ins[1])
    for r in range(2):
        assert outs[r].tobytes() == whole[r * m:(r + 1) * m].tobytes()
        assert [s["label"] for s in ops[r].stage_log] == ["reduce-scatter"]


@pytest.mark.parametrize("in_place", [False, True])
def test_all_gather_places_both_blocks(in_place):
    m = 4099
    blocks = [np.arange(m, dtype=np.float32) + 10_000 * r for r in range(2)]
    outs = [np.full(2 * m, -1, np.float32) for _ in range(2)]
    srcs = blocks
    if in_place:
        for r in range(2):
            outs[r][r * m:(r + 1) * m] = blocks[r]
        srcs = [outs[r][r * m:(r + 1) * m] for r in range(2)]
    ops, _ = _run_both(_pairs(), "all_gather", srcs, outs)
    for r in range(2):
        assert outs[r].tobytes() == np.concatenate(blocks).tobytes()
        assert [s["label"] for s in ops[r].stage_log] == ["all-gather"]


def test_a_stale_slot_does_not_count():
    """seq and seq + SLOTS share a slot: the peer's older operation there is not this one."""
    pairs = _pairs()
    pairs[1].own_slots[3 % SLOTS, SLOT_SHAPE] = 1 << 56 | 256  # an all_reduce of this shape ...
    pairs[1].post_slot(3 % SLOTS, SLOT_POSTED, 3)  # ... SLOTS operations ago
    src = np.ones(64, np.float32)
    ex = CmaTwoStepExecutor(_op("all_reduce", 0, src, src.copy(), 3 + SLOTS), 1, pairs[0])
    assert not ex.advance() and ex.polls_memory
    assert "rank 1 to post its buffers" in ex.describe_stall()["waiting_for"]


def test_a_peer_of_another_shape_is_never_read(monkeypatch):
    """A peer whose call differs (here 4 bytes more) posts another shape: nothing is read
    from it; its fingerprint message brings the MismatchError (test_mismatch.py)."""
    reads = []
    monkeypatch.setattr(cma_steps.cma, "read_into", lambda *args: reads.append(args))
    pairs = _pairs()
    ex = [CmaTwoStepExecutor(_op("all_reduce", r, np.ones(64 + r, np.float32), np.zeros(64 + r, np.float32), 5),
                             1, pairs[r]) for r in range(2)]
    for _ in range(3):
        assert not ex[0].advance() and not ex[1].advance()
    assert reads == []


def test_an_operation_waits_for_its_slot_and_a_failed_one_lets_go():
    """seq and seq + SLOTS on one rank: the later waits until the earlier lets go of the
    slot; a failed operation clears its flags (a peer still reading fails its check)."""
    pairs = _pairs()
    engine = _Engine()
    src = np.ones(64, np.float32)
    first = cma_steps.CmaSteps(pairs[0], engine.cma_slot_holders, 7, 0, "all_reduce", src, src.copy(), "sum",
                               engine.kept_scratch, TransportError)
    later = cma_steps.CmaSteps(pairs[0], engine.cma_slot_holders, 7 + SLOTS, 0, "all_reduce", src, src.copy(), "sum",
                               engine.kept_scratch, TransportError)
    assert "let go of slot 7" in later.waiting_for and not later.advance()
    assert pairs[1].peer_slots[7, SLOT_POSTED] == 7  # the first posted, seen from the peer
    first.abandon()
    assert pairs[1].peer_slots[7, SLOT_POSTED] == 0 and first.done
    later.advance()
    assert pairs[1].peer_slots[7, SLOT_POSTED] == 7 + SLOTS  # the later holds it now


def test_a_peer_that_leaves_during_a_read_fails_the_operation(monkeypatch):
    """The peer's operation failed (its slot cleared) while this rank read: what was read
    may be what the peer's caller wrote since, so this rank fails instead of completing."""
    pairs = _pairs()
    srcs = [np.ones(1000, np.float32) for _ in range(2)]
    outs = [np.zeros(1000, np.float32) for _ in range(2)]
    executors = [CmaTwoStepExecutor(_op("all_reduce", r, srcs[r], outs[r], 9), 1, pairs[r]) for r in range(2)]
    real_read = cma.read_into

    def read_while_the_peer_fails(dst, pid, address):
        real_read(dst, pid, address)
        executors[1].pending()  # rank 1's operation fails meanwhile: it clears its slot

    monkeypatch.setattr(cma_steps.cma, "read_into", read_while_the_peer_fails)
    with pytest.raises(TransportError) as info:
        executors[0].advance()
    err = info.value
    assert "left the operation" in str(err)
    assert (err.rank, err.plane, err.peer, err.stage) == (0, "up", 1, "two-step reduce-scatter")


def test_a_failed_read_names_rank_plane_peer_and_step():
    pairs = _pairs()
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)
    pairs[0].peer_pid = gone  # a process that no longer exists
    srcs = [np.ones(256, np.float32) for _ in range(2)]
    executors = [CmaTwoStepExecutor(_op("all_gather", r, srcs[r], np.zeros(512, np.float32), 4), 1, pairs[r])
                 for r in range(2)]
    with pytest.raises(TransportError) as info:
        executors[0].advance()
    err = info.value
    assert "rank(s) [1] are gone" in str(err) and "cross-memory read of 1024 bytes failed" in str(err)
    assert (err.rank, err.plane, err.peer, err.stage, err.lost_ranks) == (0, "up", 1, "two-step all-gather", (1,))
    assert executors[1].pending() == [] and executors[1].done is False  # nothing left for UCX to park


def test_read_into_copies_and_reports_the_kernels_refusal():
    src = np.arange(100_000, dtype=np.int64)
    dst = np.zeros_like(src)
    cma.read_into(dst, os.getpid(), src.ctypes.data)
    assert np.array_equal(dst, src)
    with pytest.raises(OSError) as info:
        cma.read_into(np.zeros(8, np.uint8), os.getpid(), 16)  # nothing is mapped at address 16
    assert info.value.errno == errno.EFAULT


# -- live ranks -----------------------------------------------------------------
@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2)
    yield ranks
    ranks.close()


# (bytes, dtype, op, in place): from just above the outboxes' size to the bound, odd counts
# give unequal halves
CALLS = [
    (DIRECT_CMA_FROM_BYTES + 4, "float32", "sum", False),
    (3 * MIB + 2, "float16", "max", True),
    (4 * MIB, "bfloat16", "sum", False),
    (5 * MIB + 8, "int64", "prod", True),
    (8 * MIB, "float64", "avg", False),
    (DIRECT_CMA_MAX_BYTES, "float32", "min", True),
]


def direct_reads(comm, policy):
    comm.set_path_policy(policy)
    out = []
    for nbytes, dtype, op, in_place in CALLS:
        n = nbytes // dtype_of(dtype).itemsize
        x = inputs(comm.rank, n, dtype)
        got = x if in_place else np.full_like(x, 7)
        comm.all_reduce(x, None if in_place else got, op=op)
        if not in_place:
            assert np.array_equal(x, inputs(comm.rank, n, dtype)), "the input changed out of place"
        out.append((comm.last_stats()["algorithm"], got.tobytes() == reference(n, dtype, op).tobytes()))
    return out


@pytest.mark.parametrize("policy", ["up", "adaptive"])
def test_direct_all_reduce_reads_its_halves_bit_exactly(pool, policy):
    for per_rank in pool.run(direct_reads, policy):
        assert per_rank == [("direct_shm", True)] * len(CALLS), per_rank


def beyond_and_besides(comm):
    """Where the direct reads do not apply: over the bound, a fixed split, another collective."""
    seen = {}
    comm.set_path_policy("adaptive")
    comm.all_reduce(np.ones(DIRECT_CMA_MAX_BYTES // 4 + 1024, np.float32))
    seen["over the bound"] = comm.last_stats()["algorithm"]
    comm.set_path_policy(0.8)
    comm.all_reduce(np.ones(MIB, np.float32))
    seen["fixed split"] = comm.last_stats()["algorithm"]
    comm.set_path_policy("up")
    comm.all_reduce(np.ones(MIB, np.float32), algorithm="ring")
    seen["algorithm asked"] = comm.last_stats()["algorithm"]
    comm.all_gather(np.ones(MIB, np.float32), np.empty(2 * MIB, np.float32))
    seen["all_gather"] = comm.last_stats()["algorithm"], comm.last_stats()["moved_by"]
    return seen


def test_direct_reads_only_for_2_rank_all_reduce_within_the_bound_on_up(pool):
    for seen in pool.run(beyond_and_besides):
        assert "direct_shm" not in (seen["over the bound"], seen["fixed split"], seen["algorithm asked"]), seen
        assert seen["algorithm asked"] == "ring"
        assert seen["all_gather"] == ("two_step", "cma")  # the executor reads its blocks too


def async_in_flight(comm):
    """Four direct all_reduces in flight at once (in place, two above the outboxes' size),
    waited for in reverse; they take the segments in turn."""
    comm.set_path_policy("adaptive")
    xs = [np.full((MIB >> 1) + (MIB >> 2) * i, float(comm.rank + i), np.float32) for i in range(4)]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    for w in reversed(works):
        w.wait()
    return [w.stats()["algorithm"] for w in works], all(np.array_equal(x, np.full_like(x, 1.0 + 2 * i))
                                                        for i, x in enumerate(xs))


def test_direct_reads_in_flight_together_complete_exactly(pool):
    for algorithms, exact in pool.run(async_in_flight):
        assert algorithms == ["direct_shm"] * 4 and exact


def pair_state(comm):
    x = np.full(MIB, float(comm.rank + 1), np.float32)  # 4 MiB: direct reads, or the two-step executor
    comm.set_path_policy("up")
    comm.all_reduce(x)
    pair = comm._engine.shm
    return pair is not None, pair is not None and pair.cma, comm.last_stats()["algorithm"], bool((x == 3).all())


def init_with_cma_on_rank0_only(kwargs):
    return mpccs.init(cma=os.environ["RANK"] == "0", **kwargs)


@pytest.mark.parametrize("setup,cma_on,algorithm", [(None, True, "direct_shm"),
                                                     (init_with_cma_on_rank0_only, False, "two_step")])
def test_both_ranks_read_across_processes_or_neither(setup, cma_on, algorithm):
    """MPCCS_CMA=0 on one rank: neither reads (the segments stay open), no hang, no mismatch."""
    pool = RankPool(2) if setup is None else RankPool(2, setup=setup)
    try:
        for state in pool.run(pair_state):
            assert state == (True, cma_on, algorithm, True)
    finally:
        pool.close()
