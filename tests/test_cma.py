"""Cross-memory reads between the two ranks of a pair: the transport
(transports/cma.py), the steps (cma_steps.py), and the direct path's 2-rank
all_reduce (DirectShmAllReduceOp above DIRECT_CMA_FROM_BYTES), reduce_scatter,
all_gather, all_to_all, broadcast and reduce (DirectShmBlocksOp) that read
their blocks so.

The steps run first with both ranks in this one process: two segments mapped
into each other (as test_shm does) and the "peer" pid this process's own, so
every read is a real process_vm_readv. Then on live ranks (one pool).
"""
import errno
import mmap
import os

import numpy as np
import pytest

import mpccs
from collective_cases import dtype_of
from mpccs import cma_steps
from mpccs.direct_ops import DIRECT_CMA_FROM_BYTES, OUTBOX_ROUNDS
from mpccs.control.landing import LandingChoices, size_class_of
from mpccs.errors import TransportError
from mpccs.transports import cacheflush, cma, shm
from mpccs.transports.shm import SEGMENT_BYTES, SLOT_POSTED, SLOT_SHAPE, SLOTS, ShmPair
from landing_cases import RecordedLanding, recorded_flushes
from rankpool import RankPool
from test_two_step import BLOCK_CALLS, all_reduce_case, block_calls, inputs, reference

pytestmark = pytest.mark.skipif(not (shm.supported() and cma.available()),
                                reason="cross-memory reads need x86-64 Linux with process_vm_readv")
MIB = 1 << 20


def _pairs():
    a, b = (mmap.mmap(-1, SEGMENT_BYTES) for _ in range(2))
    pairs = ShmPair(a, b, cma=True), ShmPair(b, a, cma=True)
    for p in pairs:
        p.peer_pid = os.getpid()  # both "ranks" live here
    return pairs


def _error(message, step):
    return TransportError(message, rank=0, plane="up", peer=1, op="test", stage=step)


def _steps(pair, rank, collective, src, out, seq, op="sum", root=0, landing=None):
    return cma_steps.CmaSteps(pair, seq, rank, collective, src, out, op, lambda n: np.empty(n, np.uint8), _error,
                              root, landing=landing)


def _run_both(collective, srcs, outs, seq=1, op="sum", first=0, root=0, landings=(None, None)):
    """Both ranks' steps to the end, taking turns from rank ``first``."""
    pairs = _pairs()
    order = (first, 1 - first)
    steps = {r: _steps(pairs[r], r, collective, srcs[r], outs[r], seq, op, root, landings[r]) for r in order}
    for _ in range(10):
        for r in order:
            steps[r].advance()
        if all(s.done for s in steps.values()):
            return
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
    _run_both("all_reduce", srcs, outs, first=first)
    for r in range(2):
        assert outs[r].tobytes() == expected.tobytes()
        if not in_place:
            assert srcs[r].tobytes() == ins[r].tobytes(), "the input changed out of place"


@pytest.mark.parametrize("op,fold,dtype", [("max", np.maximum, np.float64), ("min", np.minimum, np.int32),
                                           ("prod", np.multiply, np.int64)])
@pytest.mark.parametrize("in_place", [False, True])
def test_reduce_scatter_blocks_other_ops_and_dtypes(op, fold, dtype, in_place):
    m = 5003
    ins = [np.arange(2 * m, dtype=dtype) % 17 - 8 * r for r in range(2)]
    whole = fold(ins[0], ins[1])
    srcs = [x.copy() for x in ins]
    outs = [srcs[r][r * m:(r + 1) * m] if in_place else np.zeros(m, dtype) for r in range(2)]
    _run_both("reduce_scatter", srcs, outs, op=op)
    for r in range(2):
        assert outs[r].tobytes() == whole[r * m:(r + 1) * m].tobytes()
        if not in_place:
            assert srcs[r].tobytes() == ins[r].tobytes(), "the input changed out of place"


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
    _run_both("all_gather", srcs, outs)
    for r in range(2):
        assert outs[r].tobytes() == np.concatenate(blocks).tobytes()


@pytest.mark.parametrize("m", [1, 4099])
def test_all_to_all_exchanges_the_blocks(m):
    srcs = [np.arange(2 * m, dtype=np.int16) + 1000 * r for r in range(2)]
    outs = [np.full(2 * m, -1, np.int16) for _ in range(2)]
    _run_both("all_to_all", srcs, outs)
    for r in range(2):  # block i of rank r's output: block r of rank i's input
        expected = np.concatenate([srcs[0][r * m:(r + 1) * m], srcs[1][r * m:(r + 1) * m]])
        assert outs[r].tobytes() == expected.tobytes()


@pytest.mark.parametrize("root", [0, 1])
@pytest.mark.parametrize("first", [0, 1])
def test_broadcast_reads_the_roots_buffer(root, first):
    bufs = [np.arange(5003, dtype=np.float64) * (r + 2) for r in range(2)]
    expected = bufs[root].copy()
    _run_both("broadcast", bufs, bufs, root=root, first=first)
    assert all(b.tobytes() == expected.tobytes() for b in bufs)


@pytest.mark.parametrize("root", [0, 1])
@pytest.mark.parametrize("in_place", [False, True])
def test_reduce_reads_into_the_root_in_rank_order(root, in_place):
    ins = _operands(4099)
    expected = ins[0] + ins[1]  # rank 0's operand on the left
    srcs = [x.copy() for x in ins]
    outs = [(srcs[r] if in_place else np.full(4099, np.nan, np.float32)) if r == root else np.empty(0, np.float32)
            for r in range(2)]
    _run_both("reduce", srcs, outs, root=root)
    assert outs[root].tobytes() == expected.tobytes()
    assert srcs[1 - root].tobytes() == ins[1 - root].tobytes()  # the other rank's input is only read


def _count_reads(monkeypatch) -> list:
    """The size of every cross-memory read from here on (the reads themselves still happen)."""
    reads = []
    real_read = cma_steps.cma.read_at
    monkeypatch.setattr(cma_steps.cma, "read_at", lambda local, nbytes, pid, at: (reads.append(nbytes),
                                                                                 real_read(local, nbytes, pid, at)))
    return reads


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "reduce"])
def test_reads_reduce_in_parts(monkeypatch, collective, in_place):
    """A block larger than READ_PART_BYTES (lowered to 4 KiB here) is read and reduced
    part by part (in place through the kept buffer, else in the output): the same
    bits as whole, and with the reads counted."""
    monkeypatch.setattr(cma_steps, "READ_PART_BYTES", 4096)
    reads = _count_reads(monkeypatch)
    n = 10_001  # float32: 40 KiB, ten parts of 1024 elements and a short one
    ins = _operands(2 * n)
    whole = ins[0] + ins[1]
    srcs = [x.copy() for x in ins]
    if collective == "all_reduce":
        outs, expected = (srcs if in_place else [np.empty(2 * n, np.float32) for _ in range(2)]), [whole, whole]
    elif collective == "reduce_scatter":
        outs = [srcs[r][r * n:(r + 1) * n] if in_place else np.empty(n, np.float32) for r in range(2)]
        expected = [whole[:n], whole[n:]]
    else:  # reduce to rank 1
        outs = [np.empty(0, np.float32), srcs[1] if in_place else np.empty(2 * n, np.float32)]
        expected = [np.empty(0, np.float32), whole]
    _run_both(collective, srcs, outs, root=1)
    for r in range(2):
        assert outs[r].tobytes() == expected[r].tobytes()
    assert sum(1 for b in reads if b <= 4096) >= 10, reads  # (whole: one read of 40 KiB per reader)


@pytest.mark.parametrize("collective, intervals", [
    ("all_reduce", ["wait_post", "first_step", "wait_reduced", "landing", "wait_finish"]),
    ("reduce_scatter", ["wait_post", "first_step", "wait_finish"])])
def test_the_steps_keep_a_timeline_of_each_step_and_wait(monkeypatch, collective, intervals):
    """Each step's end is marked as it happens (CmaSteps.marks): the waits for the peer,
    the first step (reads and reduction), an all_reduce's landing; in order, and what
    step_times_us reports, every interval once. Below TIMELINE_FROM_BYTES (lowered to the
    input's size here) a call keeps none."""
    n = 4000
    monkeypatch.setattr(cma_steps, "TIMELINE_FROM_BYTES", 2 * n * 4)
    ins = _operands(2 * n)
    outs = ([np.empty(2 * n, np.float32) for _ in range(2)] if collective == "all_reduce"
            else [np.empty(n, np.float32) for _ in range(2)])
    pairs = _pairs()
    steps = [_steps(pairs[r], r, collective, ins[r], outs[r], 5) for r in range(2)]
    for _ in range(4):
        for s in steps:
            s.advance()
    for s in steps:
        assert s.done
        times = [t for _, t in s.marks]
        assert times == sorted(times) and s.marks[0][0] == "posted"
        got = s.step_times_us()
        assert list(got) == intervals and all(v >= 0 for v in got.values())
        assert abs(sum(got.values()) - (times[-1] - times[0]) * 1e6) < 1e-3
    assert cma_steps.step_times_us([("posted", 1.0), ("done", 1.5)]) == {"wait_finish": 500000.0}
    src = ins[0][:-2]  # one element a half less: under the bound
    out = np.empty(src.size if collective == "all_reduce" else src.size // 2, np.float32)
    small = _steps(_pairs()[0], 0, collective, src, out, 6)
    assert small.marks is None and small.step_times_us() is None


def test_large_blocks_out_of_place_are_read_whole(monkeypatch):
    """Out of place, a block above READ_PARTS_MAX_OUT_BYTES (lowered to 8 KiB) is read in one go."""
    monkeypatch.setattr(cma_steps, "READ_PART_BYTES", 4096)
    monkeypatch.setattr(cma_steps, "READ_PARTS_MAX_OUT_BYTES", 8192)
    reads = _count_reads(monkeypatch)
    n = 10_001
    ins = _operands(2 * n)
    outs = [np.empty(n, np.float32) for _ in range(2)]
    _run_both("reduce_scatter", ins, outs)
    whole = ins[0] + ins[1]
    assert outs[0].tobytes() == whole[:n].tobytes() and outs[1].tobytes() == whole[n:].tobytes()
    assert reads == [n * 4, n * 4], reads


@pytest.mark.skipif(not cacheflush.available(), reason="needs an x86-64 CPU with CLFLUSHOPT")
@pytest.mark.parametrize("mode", ["always", "never"])
def test_an_in_place_all_reduce_flushes_where_its_second_read_lands(monkeypatch, mode):
    """In place, the second read's region (the peer's half, in this rank's buffer) is
    flushed first where the choice says so, and only it; the landing and the first
    reads are timed for the choice; the result is the same bits either way."""
    flushed = recorded_flushes(monkeypatch, cacheflush)
    n = 100_001
    ins = _operands(n)
    srcs = [x.copy() for x in ins]
    landings = (RecordedLanding(mode), RecordedLanding(mode))
    _run_both("all_reduce", srcs, srcs, landings=landings)
    for r in range(2):
        assert srcs[r].tobytes() == (ins[0] + ins[1]).tobytes()
        (was_flushed, landing_s, reference_s), = landings[r].landings
        assert was_flushed == (mode == "always") and landing_s > 0 and reference_s > 0
    half = n // 2  # rank 0 owns the first half: it lands the second, rank 1 the first
    assert landings[0].asked == [srcs[0][half:].nbytes] and landings[1].asked == [srcs[1][:half].nbytes]
    regions = {(srcs[0][half:].ctypes.data, srcs[0][half:].nbytes), (srcs[1][:half].ctypes.data, srcs[1][:half].nbytes)}
    assert set(flushed) == (regions if mode == "always" else set())


def test_a_flush_kernel_that_fails_to_build_leaves_the_landing_plain(monkeypatch):
    """numba installed but broken: no exception reaches the caller, the landing goes
    plain from then on, the result is exact, and the failure is kept to be read."""
    def broken():
        raise ImportError("numba needs another numpy")
    monkeypatch.setattr(cacheflush, "_build_kernel", broken)
    monkeypatch.setattr(cacheflush, "_kernel", None)
    monkeypatch.setattr(cacheflush, "failure", None)
    n = 10_001
    ins = _operands(n)
    srcs = [x.copy() for x in ins]
    landings = (RecordedLanding("always"), RecordedLanding("always"))
    _run_both("all_reduce", srcs, srcs, landings=landings)
    for r in range(2):
        assert srcs[r].tobytes() == (ins[0] + ins[1]).tobytes()
        assert [flushed for flushed, _, _ in landings[r].landings] == [False]
        assert not landings[r].can_flush and not landings[r].flush_next()
    assert cacheflush.failure == "ImportError: numba needs another numpy" and not cacheflush.available()


def test_only_an_in_place_all_reduce_asks_the_landing_choice():
    """Out of place the second read lands where the peer read nothing; the other collectives have one read."""
    n = 10_001
    ins = _operands(2 * n)
    landings = (RecordedLanding("always"), RecordedLanding("always"))
    _run_both("all_reduce", ins, [np.empty(2 * n, np.float32) for _ in range(2)], landings=landings)
    _run_both("reduce_scatter", [x.copy() for x in ins], [x[r * n:(r + 1) * n] for r, x in enumerate(ins)],
              landings=landings)
    assert landings[0].landings == [] and landings[1].landings == []


def test_a_stale_slot_does_not_count():
    """seq and seq + SLOTS share a slot: the peer's older operation there is not this one."""
    pairs = _pairs()
    pairs[1].own_slots[3 % SLOTS, SLOT_SHAPE] = 1 << 56 | 256  # an all_reduce of this shape ...
    pairs[1].post_slot(3 % SLOTS, SLOT_POSTED, 3)  # ... SLOTS operations ago
    src = np.ones(64, np.float32)
    steps = _steps(pairs[0], 0, "all_reduce", src, src.copy(), 3 + SLOTS)
    assert not steps.advance() and not steps.done
    assert steps.waiting_for == "the peer to post its buffers"


def test_a_peer_of_another_shape_is_never_read(monkeypatch):
    """A peer whose call differs (here 4 bytes more) posts another shape: nothing is read
    from it; its fingerprint message brings the MismatchError (test_mismatch.py)."""
    reads = []
    monkeypatch.setattr(cma_steps.cma, "read_at", lambda *args: reads.append(args))
    pairs = _pairs()
    steps = [_steps(pairs[r], r, "all_reduce", np.ones(64 + r, np.float32), np.zeros(64 + r, np.float32), 5)
             for r in range(2)]
    for _ in range(3):
        assert not steps[0].advance() and not steps[1].advance()
    assert reads == []


def test_a_failed_operation_clears_its_slot_and_the_next_takes_another():
    """A failed operation clears its flags (a peer still reading fails its check);
    the next sequence number posts in the next slot, leaving the cleared one be."""
    pairs = _pairs()
    src = np.ones(64, np.float32)
    failed = _steps(pairs[0], 0, "all_reduce", src, src.copy(), 7)
    assert pairs[1].peer_slots[7, SLOT_POSTED] == 7  # posted, seen from the peer
    failed.abandon()
    assert pairs[1].peer_slots[7, SLOT_POSTED] == 0 and failed.done
    _steps(pairs[0], 0, "all_reduce", src, src.copy(), 8)
    assert pairs[1].peer_slots[8, SLOT_POSTED] == 8 and pairs[1].peer_slots[7, SLOT_POSTED] == 0


def test_a_peer_that_leaves_during_a_read_fails_the_operation(monkeypatch):
    """The peer's operation failed (its slot cleared) while this rank read: what was read
    may be what the peer's caller wrote since, so this rank fails instead of completing."""
    pairs = _pairs()
    srcs = [np.ones(1000, np.float32) for _ in range(2)]
    outs = [np.zeros(1000, np.float32) for _ in range(2)]
    steps = [_steps(pairs[r], r, "all_reduce", srcs[r], outs[r], 9) for r in range(2)]
    real_read = cma.read_at

    def read_while_the_peer_fails(local, nbytes, pid, address):
        real_read(local, nbytes, pid, address)
        steps[1].abandon()  # rank 1's operation fails meanwhile: it clears its slot

    monkeypatch.setattr(cma_steps.cma, "read_at", read_while_the_peer_fails)
    with pytest.raises(TransportError) as info:
        steps[0].advance()
    assert "left the operation" in str(info.value) and info.value.stage == "reduce-scatter"


def test_a_failed_read_names_the_step_and_a_gone_peer():
    pairs = _pairs()
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)
    pairs[0].peer_pid = gone  # a process that no longer exists
    srcs = [np.ones(256, np.float32) for _ in range(2)]
    steps = [_steps(pairs[r], r, "all_gather", srcs[r], np.zeros(512, np.float32), 4) for r in range(2)]
    with pytest.raises(TransportError) as info:
        steps[0].advance()
    err = info.value
    assert "rank(s) [1] are gone" in str(err) and "cross-memory read of 1024 bytes failed" in str(err)
    assert (err.stage, err.lost_ranks) == ("all-gather", (1,))


def test_read_into_copies_and_reports_the_kernels_refusal():
    src = np.arange(100_000, dtype=np.int64)
    dst = np.zeros_like(src)
    cma.read_into(dst, os.getpid(), src.ctypes.data)
    assert np.array_equal(dst, src)
    with pytest.raises(OSError) as info:
        cma.read_into(np.zeros(8, np.uint8), os.getpid(), 16)  # nothing is mapped at address 16
    assert info.value.errno == errno.EFAULT


def test_naming_the_peer_as_reader_is_harmless_without_yama():
    """The set-up names the peer as the process that may read this one (Yama's
    ptrace_scope 1 lets only ancestors otherwise); without Yama the kernel refuses
    the request with EINVAL and nothing changes: reads are allowed anyway."""
    allowed = cma.allow_reads_by(os.getppid())
    if os.path.exists("/proc/sys/kernel/yama/ptrace_scope"):
        assert isinstance(allowed, bool)  # scope 2 and 3 refuse an unprivileged caller
    else:
        assert allowed is False
        src = np.arange(10, dtype=np.int64)  # and this process still reads (itself)
        dst = np.zeros_like(src)
        cma.read_into(dst, os.getpid(), src.ctypes.data)
        assert np.array_equal(dst, src)


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
    (10 * MIB + 2, "float16", "max", True),
    (12 * MIB, "bfloat16", "sum", False),
    (9 * MIB + 8, "int64", "prod", True),
    (16 * MIB, "float64", "avg", False),
    (20 * MIB, "float32", "min", True),  # in place, halves over the kept buffer: read in two parts
]


def direct_reads(comm, policy):
    comm.set_path_policy(policy)
    out = []
    for case in CALLS:
        stats, exact = all_reduce_case(comm, *case)
        out.append((stats["algorithm"], exact))
    return out


def flushed_landings(comm):
    """The in-place CALLS with every landing flushed, then as chosen by default."""
    saved = comm._engine.landing
    comm._engine.landing = LandingChoices("always")
    try:
        exact = []
        for nbytes, dtype, op, in_place in CALLS:
            n = nbytes // dtype_of(dtype).itemsize
            x = inputs(comm.rank, n, dtype)
            comm.all_reduce(x, op=op)
            exact.append(x.tobytes() == reference(n, dtype, op).tobytes())
        return saved.mode, comm.landing, exact
    finally:
        comm._engine.landing = saved


@pytest.mark.skipif(not cacheflush.available(), reason="needs an x86-64 CPU with CLFLUSHOPT")
def test_flushed_landings_keep_the_in_place_results_exact(pool):
    for default_mode, landing, exact in pool.run(flushed_landings):
        assert default_mode == "auto"
        classes = sorted({size_class_of(nbytes // 2) for nbytes, _, _, _ in CALLS})  # each call's landing: a half
        assert landing == {"mode": "auto", "flushing": classes, "outbox_flushing": [], "switches": 0}
        assert exact == [True] * len(CALLS)


@pytest.mark.parametrize("policy", ["up", "adaptive"])
def test_direct_all_reduce_reads_its_halves_bit_exactly(pool, policy):
    for per_rank in pool.run(direct_reads, policy):
        assert per_rank == [("direct_shm", True)] * len(CALLS), per_rank


def around_the_outboxes_bound(comm):
    """float32 all_reduce of 8 MiB - 4 bytes (unequal halves, two rounds through the outboxes),
    8 MiB (two full rounds) and 8 MiB + 4, out of place and in place: (bytes, in place,
    algorithm, read across processes (the steps' timeline, which only the reads keep), exact)."""
    rows = []
    for nbytes in (DIRECT_CMA_FROM_BYTES - 4, DIRECT_CMA_FROM_BYTES, DIRECT_CMA_FROM_BYTES + 4):
        for in_place in (False, True):
            n = nbytes // 4
            x = inputs(comm.rank, n, "float32")
            got = x if in_place else np.full_like(x, 7)
            comm.all_reduce(x, None if in_place else got)
            stats = comm.last_stats()
            rows.append((nbytes, in_place, stats["algorithm"], "steps_us" in stats,
                         got.tobytes() == reference(n, "float32", "sum").tobytes()))
    return rows


def test_halves_that_fit_the_outboxes_go_through_them_and_larger_ones_are_read(pool):
    # Where both ways work the outboxes won at 3-8 MiB (bench/results/outbox_rounds_s53/).
    assert DIRECT_CMA_FROM_BYTES == 2 * OUTBOX_ROUNDS * shm.OUTBOX_BYTES == 8 * MIB
    for rows in pool.run(around_the_outboxes_bound):
        assert [(nbytes - DIRECT_CMA_FROM_BYTES, reads) for nbytes, _, _, reads, _ in rows] == \
            [(-4, False), (-4, False), (0, False), (0, False), (4, True), (4, True)], rows
        assert all(algorithm == "direct_shm" and exact for _, _, algorithm, _, exact in rows), rows


def beyond_and_besides(comm):
    """Where the direct reads do not apply: over the bounds (lowered here to 16 MiB
    and 8 MiB blocks, not to move 256 MiB), a fixed split, an algorithm asked for,
    blocks under 512 KiB (and above the lane's bound)."""
    import mpccs.comm as comm_module

    seen = {}
    saved = comm_module.DIRECT_CMA_MAX_BYTES, comm_module.DIRECT_CMA_BLOCK_BYTES
    comm_module.DIRECT_CMA_MAX_BYTES, comm_module.DIRECT_CMA_BLOCK_BYTES = 16 * MIB, (MIB, 8 * MIB)
    try:
        comm.set_path_policy("adaptive")
        comm.all_reduce(np.ones(4 * MIB + 1024, np.float32))
        seen["over the bound"] = comm.last_stats()["algorithm"]
        comm.set_path_policy("up")
        comm.all_gather(np.ones(3 * MIB, np.float32), np.empty(6 * MIB, np.float32))  # 12 MiB blocks
        seen["all_gather over the bound"] = comm.last_stats()["algorithm"]
    finally:
        comm_module.DIRECT_CMA_MAX_BYTES, comm_module.DIRECT_CMA_BLOCK_BYTES = saved
        comm.set_path_policy("adaptive")  # (drops the kept path answers)
    comm.set_path_policy(0.8)
    comm.all_reduce(np.ones(MIB, np.float32))
    seen["fixed split"] = comm.last_stats()["algorithm"]
    comm.set_path_policy("up")
    comm.all_reduce(np.ones(MIB, np.float32), algorithm="ring")
    seen["algorithm asked"] = comm.last_stats()["algorithm"]
    comm.reduce_scatter(np.ones(2 * 112 << 10, np.float32), np.empty(112 << 10, np.float32))  # 448 KiB blocks
    seen["reduce_scatter under the bound"] = comm.last_stats()["algorithm"]
    return seen


def test_direct_reads_only_within_their_bounds_and_where_nothing_else_is_asked(pool):
    for seen in pool.run(beyond_and_besides):
        assert "direct_shm" not in seen.values(), seen
        assert seen["algorithm asked"] == "ring"
        assert seen["reduce_scatter under the bound"] == "direct"  # the direct path's messages


@pytest.mark.parametrize("policy", ["up", "adaptive"])
def test_reduce_scatter_and_all_gather_read_their_blocks_exactly(pool, policy):
    """Blocks of 1-8 MiB (test_two_step's cases: odd sizes, in and out of place)."""
    for per_rank in pool.run(block_calls, policy):
        assert per_rank == [(c, "direct_shm", True) for c in ("reduce_scatter", "all_gather")] * len(BLOCK_CALLS)


def all_to_all_blocks(comm, policy):
    """all_to_all of 1-8 MiB blocks, odd counts and several dtypes: (executor, exact)."""
    comm.set_path_policy(policy)
    out = []
    for nbytes, dtype in ((MIB, "float32"), (MIB + 2, "float16"), (3 * MIB + 8, "int64"), (8 * MIB, "uint8")):
        m = nbytes // dtype_of(dtype).itemsize
        x = inputs(comm.rank, 2 * m, dtype)
        got = np.full_like(x, 7)
        comm.all_to_all(x, got)
        expected = np.concatenate([inputs(r, 2 * m, dtype)[comm.rank * m:(comm.rank + 1) * m] for r in range(2)])
        out.append((comm.last_stats()["algorithm"], got.tobytes() == expected.tobytes()))
    return out


def rooted_calls(comm, policy):
    """broadcast and reduce of 2-8 MiB (the broadcast above the pipe's bound, read; the reduce
    round the outbox: test_pipe.py) from either root, odd counts, several dtypes and ops, reduce
    in and out of place: (collective, executor, exact)."""
    comm.set_path_policy(policy)
    out = []
    cases = ((2 * MIB + 4, "float32", "sum", False), (2 * MIB + 2, "float16", "max", True),
             (3 * MIB + 8, "int64", "prod", False), (8 * MIB, "float64", "avg", True))
    for k, (nbytes, dtype, op, in_place) in enumerate(cases):
        root = k % 2
        n = nbytes // dtype_of(dtype).itemsize
        buf = inputs(comm.rank, n, dtype)
        comm.broadcast(buf, root=root)
        out.append(("broadcast", comm.last_stats()["algorithm"], buf.tobytes() == inputs(root, n, dtype).tobytes()))
        x = inputs(comm.rank, n, dtype)
        got = x if in_place or comm.rank != root else np.full_like(x, 7)
        comm.reduce(x, None if in_place or comm.rank != root else got, op=op, root=root)
        exact = got.tobytes() == reference(n, dtype, op).tobytes() if comm.rank == root else \
            x.tobytes() == inputs(comm.rank, n, dtype).tobytes()
        out.append(("reduce", comm.last_stats()["algorithm"], exact))
    return out


@pytest.mark.parametrize("policy", ["up", "adaptive"])
def test_broadcast_reads_its_buffer_and_reduce_goes_round_the_outbox_exactly(pool, policy):
    for per_rank in pool.run(rooted_calls, policy):
        assert per_rank == [("broadcast", "direct_shm", True), ("reduce", "direct_pipe", True)] * 4, per_rank


def reader_runs_ahead(comm, n, algorithm):
    """Broadcasts from rank 0 and reduces to rank 1 of ``n`` float32, back to back, where the rank
    that reads nothing (the broadcast's root, the reduce's non-root: rank 0 both
    times) first looks for its peer 20 ms late in every call: by then the reader has
    met it, read, finished and published its next call's fingerprint. (exact) per call."""
    import time

    from mpccs import direct_ops

    meet = direct_ops.DirectShmAllReduceOp._meet_peer

    def late_first_look(op):
        if comm.rank == 0 and not getattr(op, "_looked", False):
            op._looked = True
            time.sleep(0.02)
        return meet(op)

    direct_ops.DirectShmAllReduceOp._meet_peer = late_first_look
    exact = []
    try:
        for k in range(6):
            buf = np.full(n, comm.rank + k, np.float32)
            comm.broadcast(buf, root=0)
            exact.append(bool(np.all(buf == k)) and comm.last_stats()["algorithm"] == algorithm)
            x = np.full(n, comm.rank + 1, np.float32)
            comm.reduce(x, op="sum", root=1)
            exact.append(comm.rank == 0 or bool(np.all(x == 3)))
    finally:
        direct_ops.DirectShmAllReduceOp._meet_peer = meet
    return exact


@pytest.mark.parametrize("n,algorithm", [(MIB, "direct_shm"), (MIB // 4, "direct_pipe")])
def test_a_rank_that_reads_nothing_finds_its_peer_after_it_moved_on(pool, n, algorithm):
    """The fingerprints stay in a ring of entries, not one the reader overwrites with
    its next call's (before, the late rank waited for the reader's entry of a call the
    reader had finished, until the no-progress timeout). 4 MiB calls read, 1 MiB ones
    go through the pipe (pipe_steps.py), where the reader posts nothing either."""
    for per_rank in pool.run(reader_runs_ahead, n, algorithm, timeout=60):
        assert per_rank == [True] * 12, per_rank


@pytest.mark.parametrize("policy", ["up", "adaptive"])
def test_all_to_all_reads_its_blocks_exactly(pool, policy):
    for per_rank in pool.run(all_to_all_blocks, policy):
        assert per_rank == [("direct_shm", True)] * 4, per_rank


def async_in_flight(comm):
    """Direct all_reduces (through the outboxes and by reads), a reduce_scatter and an
    all_gather in flight at once, waited for in reverse: they take the segments in turn."""
    comm.set_path_policy("adaptive")
    xs = [np.full((MIB >> 1) + (MIB >> 2) * i, float(comm.rank + i), np.float32) for i in range(4)]
    works = [comm.all_reduce(x, async_op=True) for x in xs[:2]]
    scattered, gathered = np.empty(MIB // 2, np.float32), np.empty(MIB // 2, np.float32)
    works.append(comm.reduce_scatter(np.full(MIB, float(comm.rank + 1), np.float32), scattered, async_op=True))
    works += [comm.all_reduce(x, async_op=True) for x in xs[2:]]
    works.append(comm.all_gather(np.full(MIB // 4, float(comm.rank), np.float32), gathered, async_op=True))
    bcast = np.full(MIB // 2, float(comm.rank + 5), np.float32)
    works.append(comm.broadcast(bcast, root=1, async_op=True))
    reduced = np.full(MIB // 2, float(comm.rank + 1), np.float32)
    works.append(comm.reduce(reduced, root=0, async_op=True))
    for w in reversed(works):
        w.wait()
    exact = (all(np.array_equal(x, np.full_like(x, 1.0 + 2 * i)) for i, x in enumerate(xs))
             and np.array_equal(scattered, np.full_like(scattered, 3.0))
             and np.array_equal(gathered, np.repeat(np.array([0.0, 1.0], np.float32), MIB // 4))
             and np.array_equal(bcast, np.full_like(bcast, 6.0))
             and np.array_equal(reduced, np.full_like(reduced, 3.0 if comm.rank == 0 else 2.0)))
    return [w.stats()["algorithm"] for w in works], exact


def test_direct_reads_in_flight_together_complete_exactly(pool):
    for algorithms, exact in pool.run(async_in_flight):  # (the 2 MiB broadcast and reduce: the pipe)
        assert algorithms == ["direct_shm"] * 6 + ["direct_pipe"] * 2 and exact


def pair_state(comm):
    x = np.full(4 * MIB, float(comm.rank + 1), np.float32)  # 16 MiB: read across processes, or the outboxes in rounds
    comm.set_path_policy("up")
    comm.all_reduce(x)
    pair, stats = comm._engine.shm, comm.last_stats()
    return (pair is not None, pair is not None and pair.cma, stats["algorithm"], "steps_us" in stats,
            bool((x == 3).all()))


def init_with_cma_on_rank0_only(kwargs):
    return mpccs.init(cma=os.environ["RANK"] == "0", **kwargs)


@pytest.mark.parametrize("setup,cma_on", [(None, True), (init_with_cma_on_rank0_only, False)])
def test_both_ranks_read_across_processes_or_neither(setup, cma_on):
    """MPCCS_CMA=0 on one rank: neither reads (the segments stay open: the outboxes
    carry the call), no hang, no mismatch."""
    pool = RankPool(2) if setup is None else RankPool(2, setup=setup)
    try:
        for state in pool.run(pair_state):
            assert state == (True, cma_on, "direct_shm", cma_on, True)
    finally:
        pool.close()
