"""The shared-memory segments of a 2-rank job on one host (transports/shm.py)
and the steps that run through them (shm_steps.py)."""
import mmap
import os
import time

import numpy as np
import pytest

import mpccs
from mpccs import engine
from mpccs.bootstrap import usable_cores
from mpccs.control.landing import LandingChoices, size_class_of
from mpccs.shm_steps import ROUND_SPAN, SHM_MAX_HALF_BYTES, ShmSteps
from mpccs.transports import cacheflush, shm
from mpccs.transports.shm import FLAG_POSTED, FLAG_ROUND_TAKEN, SEGMENT_BYTES, ShmPair
from landing_cases import RecordedLanding, recorded_flushes
from rankpool import RankPool
from test_two_step import all_reduce_case
from test_lane import arrive_late_in_turn

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory segments need x86-64 and /dev/shm")
MIB = 1 << 20


@pytest.fixture(scope="module")
def pool():
    """2 ranks on this host, default options: the segments open (the cases below share it)."""
    ranks = RankPool(2)
    yield ranks
    ranks.close()


# -- the steps, both ranks in this process ------------------------------------
def _pairs():
    """Two anonymous shared mappings standing in for the two ranks' segments."""
    a, b = (mmap.mmap(-1, SEGMENT_BYTES) for _ in range(2))
    return ShmPair(a, b), ShmPair(b, a)


def _run_both(pairs, seq, ins, outs, op="sum", first=0, landings=(None, None)):
    """Drive both ranks' steps to the end, taking turns from rank ``first``."""
    steps = [ShmSteps(pairs[rank], seq, rank, ins[rank], outs[rank], op, landings[rank]) for rank in (first, 1 - first)]
    for _ in range(10 * steps[0].rounds):
        for s in steps:
            s.advance()
        if all(s.done for s in steps):
            return steps
    raise AssertionError("the steps did not finish")


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 100_001])
@pytest.mark.parametrize("in_place", [False, True])
def test_all_reduce_halves_in_rank_order(n, in_place):
    pairs = _pairs()
    ins = [np.resize(np.array([1e8, 1.0, -1e8, 3.5], np.float32), n) * (r + 1) + np.float32(r) / 3
           for r in range(2)]
    expected = ins[0] + ins[1]  # rank 0's operand on the left: the order of every other path
    outs = ins if in_place else [np.full(n, np.nan, np.float32) for _ in range(2)]
    sources = [x.copy() for x in ins] if in_place else ins
    _run_both(pairs, 1, sources, sources if in_place else outs)
    for r in range(2):
        got = sources[r] if in_place else outs[r]
        assert got.tobytes() == expected.tobytes()


# float32 elements: one past what a round holds, 2.5 MiB halves, 6 MiB ones (an odd count: halves differ by one)
@pytest.mark.parametrize("n,rounds", [(2 * (SHM_MAX_HALF_BYTES // 4) + 2, 2), (5 << 18, 2), ((12 << 18) + 1, 4)])
@pytest.mark.parametrize("in_place", [False, True])
def test_halves_larger_than_an_outbox_go_through_it_in_rounds(n, rounds, in_place):
    """Each round carries its part of both halves; a rank writes its outbox again only once
    its peer took the round before (distinct values per element show any part lost or
    carried twice). Rank 1 starts: the larger half is rank 1's."""
    pairs = _pairs()
    ins = [(np.arange(n) % 1021 * (r + 1) + r).astype(np.float32) for r in range(2)]
    expected = ins[0] + ins[1]
    outs = [x.copy() for x in ins] if in_place else [np.full(n, np.nan, np.float32) for _ in range(2)]
    for seq in (1, 2):  # the second call's flags must not be met by the first's
        sources = outs if in_place else ins
        if in_place:
            for r in range(2):
                outs[r][...] = ins[r]
        steps = _run_both(pairs, seq, sources, outs, first=1)
        assert [s.rounds for s in steps] == [rounds, rounds]
        for r in range(2):
            assert outs[r].tobytes() == expected.tobytes()


def test_a_round_waits_for_its_own_flags():
    """Round 1 does not start on round 0's flags: the peer's post of round 0 lets this
    rank reduce once, and nothing more moves until the peer takes that round."""
    pairs = _pairs()
    n = 4 * (SHM_MAX_HALF_BYTES // 4)  # halves of two rounds each
    ins = [np.ones(n, np.float32) * (r + 1) for r in range(2)]
    outs = [np.zeros(n, np.float32) for _ in range(2)]
    alone = ShmSteps(pairs[0], 3, 0, ins[0], outs[0], "sum")
    assert alone.rounds == 2 and alone.waiting_for == "the peer's half in its segment (round 1 of 2)"
    pairs[1].post(FLAG_POSTED, 3 * ROUND_SPAN)
    assert alone.advance() and alone.round == 0 and alone.stage == 1
    assert not alone.advance()
    assert alone.waiting_for == "the peer to take this rank's half (round 1 of 2)"
    pairs[1].post(FLAG_ROUND_TAKEN, 3 * ROUND_SPAN)
    assert alone.advance() and alone.round == 1 and alone.stage == 0
    assert int(pairs[1].peer_flags[FLAG_POSTED]) == 3 * ROUND_SPAN + 1  # round 1 posted
    assert not alone.advance()


@pytest.mark.parametrize("op,fold", [("max", np.maximum), ("min", np.minimum), ("prod", np.multiply)])
def test_other_ops_and_dtypes_either_rank_first(op, fold):
    pairs = _pairs()
    for seq, (dtype, first) in enumerate([(np.int64, 0), (np.int16, 1), (np.float64, 1)], start=1):
        ins = [(np.arange(4099) % 7 * (r + 2) - 5).astype(dtype) for r in range(2)]
        outs = [np.zeros(4099, dtype) for _ in range(2)]
        _run_both(pairs, seq, ins, outs, op=op, first=first)
        for r in range(2):
            assert np.array_equal(outs[r], fold(ins[0], ins[1]))


def test_a_rank_waits_for_its_peer_and_stale_flags_do_not_count():
    """Flags only grow: the previous operation's flags do not let the next one on."""
    pairs = _pairs()
    ins = [np.ones(64, np.float32) * (r + 1) for r in range(2)]
    outs = [np.zeros(64, np.float32) for _ in range(2)]
    _run_both(pairs, 1, ins, outs)
    alone = ShmSteps(pairs[0], 2, 0, ins[0], outs[0], "sum")
    for _ in range(5):
        assert not alone.advance() and not alone.done  # rank 1 has not posted operation 2
    assert alone.waiting_for == "the peer's half in its segment"
    pairs[1].post(FLAG_POSTED, 2 * ROUND_SPAN)  # posted, not yet taken: half way only
    alone.advance()
    assert alone.stage == 1 and not alone.done


def test_fingerprints_and_waiting_flags_name_their_operation():
    """A peer's fingerprint counts for the operation its ring entry names only, and
    stays readable after the peer published its next one (a broadcast's root may look
    after the reader moved on); the waiting flag names its operation too (the meeting
    at the start of DirectShmAllReduceOp)."""
    pairs = _pairs()
    words = np.array([0x1234, 1 << 40], np.uint64)
    assert pairs[1].peer_fingerprint(1) is None  # nothing published yet
    pairs[0].post_fingerprint(words, 1)
    assert pairs[1].peer_fingerprint(1).tobytes() == words.tobytes()
    assert pairs[1].peer_fingerprint(2) is None  # operation 1's, not operation 2's
    pairs[0].post_fingerprint(words + 1, 2)
    assert pairs[1].peer_fingerprint(2).tobytes() == (words + 1).tobytes()
    assert pairs[1].peer_fingerprint(1).tobytes() == words.tobytes()  # the next one did not overwrite it
    pairs[0].post_fingerprint(words + 2, 1 + shm.FP_RING)  # the ring came round to operation 1's entry
    assert pairs[1].peer_fingerprint(1) is None
    assert pairs[0].peer_fingerprint(2) is None  # a rank reads its peer's header, not its own
    assert not pairs[1].peer_waiting(3)
    pairs[0].post_waiting(3)
    assert pairs[1].peer_waiting(3) and not pairs[1].peer_waiting(4) and not pairs[0].peer_waiting(3)


# -- the segments between two processes ---------------------------------------
def segments_state(comm):
    pids = comm._pids
    left = [f for f in os.listdir(shm.SHM_DIR) if any(f.startswith(f"mpccs-{pid}-") for pid in pids)]
    x = np.arange(300_000, dtype=np.float32) * (comm.rank + 1)
    out = comm.all_reduce(x, np.empty_like(x))
    return comm._engine.shm is not None, left, comm.last_stats()["algorithm"], bool(np.all(out == x / (comm.rank + 1) * 3))


def test_two_ranks_on_one_host_open_the_segments_and_leave_no_file(pool):
    for is_open, left, algorithm, exact in pool.run(segments_state):
        assert is_open and left == [] and algorithm == "direct_shm" and exact


def init_with_segments_on_rank0_only(kwargs):
    return mpccs.init(shm=os.environ["RANK"] == "0", **kwargs)


def test_one_unwilling_rank_closes_them_on_both():
    """MPCCS_SHM=0 on one rank: neither uses the segments (no hang, no mismatch)."""
    pool = RankPool(2, setup=init_with_segments_on_rank0_only)
    try:
        for is_open, left, algorithm, exact in pool.run(segments_state):
            assert not is_open and left == [] and algorithm == "direct_blocks" and exact
    finally:
        pool.close()


def test_a_dev_shm_without_room_fails_at_creation_and_leaves_no_file(monkeypatch):
    """The pages are reserved up front: no room is an OSError here, not a SIGBUS on first touch."""
    import errno

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match="No space"):
        shm.create_segment("mpccs-noroom", 1 << 20)
    assert not [f for f in os.listdir(shm.SHM_DIR) if f.startswith(f"mpccs-noroom-{os.getpid()}-")]


def test_three_ranks_have_no_pair_segments_and_yield_at_once_where_cores_are_fewer():
    pool = RankPool(3)
    try:
        for segments, local_size, cores, spins, oversubscribed, group_yields in pool.run(segments_and_cores):
            assert segments is None and local_size == 3  # (3 ranks: the group's segments, not the pair's)
            assert spins == (engine.IDLE_SPINS_BEFORE_YIELD_OVERSUBSCRIBED if cores < 3
                             else engine.IDLE_SPINS_BEFORE_YIELD), (cores, spins)
            assert oversubscribed == group_yields == (cores < 3)  # lane spins give the core away too
    finally:
        pool.close()


def segments_and_cores(comm):
    engine = comm._engine
    return engine.shm, comm.local_size, usable_cores(), engine.idle_spins_before_yield, engine.oversubscribed, \
        comm._group.yields


def test_usable_cores_are_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert usable_cores() == 3
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    assert usable_cores() == 7


def async_calls_in_flight(comm):
    """Three async all_reduces through the segments at once, then waited on in reverse."""
    n = 200_003  # above the lane
    xs = [np.arange(n, dtype=np.float32) * (k + 1) + comm.rank for k in range(3)]
    outs = [np.empty(n, np.float32) for _ in range(3)]
    works = [comm.all_reduce(x, out, async_op=True) for x, out in zip(xs, outs)]
    for w in reversed(works):
        w.wait()
    expected = [np.arange(n, dtype=np.float32) * (k + 1) * 2 + 1 for k in range(3)]
    return [bool(np.array_equal(o, e)) for o, e in zip(outs, expected)], comm.last_stats()["algorithm"]


def test_operations_in_flight_take_the_segments_in_turn(pool):
    for exact, algorithm in pool.run(async_calls_in_flight):
        assert exact == [True, True, True] and algorithm == "direct_shm"


def late_peer_cpu(comm):
    """Rank 1 comes 1 s late to an all_reduce through the segments: CPU seconds rank 0 spent waiting."""
    import time

    x = np.ones(300_000, np.float32)
    comm.all_reduce(x, np.empty_like(x))  # warm
    comm.barrier()
    if comm.rank == 1:
        time.sleep(1.0)
    cpu = time.process_time()
    out = comm.all_reduce(x, np.empty_like(x))
    return time.process_time() - cpu, comm.last_stats()["algorithm"], float(out[0])


def test_a_late_peer_costs_no_spinning(pool):
    """A rank whose peer has not published its fingerprint in the segments within
    PEER_SPIN_S sleeps on the planes' events until the peer rings; it polls the
    flags only before and once they met (Operation.polls_memory)."""
    (cpu0, algorithm, value), _ = pool.run(late_peer_cpu)
    assert algorithm == "direct_shm" and value == 2.0
    assert cpu0 < 0.4, f"rank 0 spent {cpu0:.2f} CPU seconds waiting 1 s for its peer"


@pytest.mark.skipif(not cacheflush.available(), reason="needs an x86-64 CPU with CLFLUSHOPT")
@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_outbox_is_flushed_around_its_copy_where_the_choice_says(monkeypatch, mode, in_place):
    """Step 1 flushes this rank's outbox (its operand of the peer's half) before and after
    copying into it, only where asked; the copy in and the copy out are timed for the
    choice; the result is the same bits either way."""
    flushed = recorded_flushes(monkeypatch, cacheflush)
    pairs = _pairs()
    n = 100_001
    ins = [(np.arange(n) % 9 + r).astype(np.float32) for r in range(2)]
    sources = [x.copy() for x in ins]
    outs = sources if in_place else [np.full(n, np.nan, np.float32) for _ in range(2)]
    landings = (RecordedLanding(mode), RecordedLanding(mode))
    _run_both(pairs, 1, sources, outs, landings=landings)
    half = n // 2  # rank 0 owns the first half: its outbox carries its operand of the second
    boxes = [(pairs[0].own_box.ctypes.data, (n - half) * 4), (pairs[1].own_box.ctypes.data, half * 4)]
    for r in range(2):
        assert outs[r].tobytes() == (ins[0] + ins[1]).tobytes()
        (was_flushed, copy_in_s, copy_out_s), = landings[r].landings
        assert was_flushed == (mode == "always") and copy_in_s > 0 and copy_out_s > 0
        assert landings[r].asked == [boxes[r][1]]
    assert flushed == ([boxes[0], boxes[0], boxes[1], boxes[1]] if mode == "always" else [])


def outbox_flushed_calls(comm):
    """1 and 2 MiB all_reduce through the outboxes, in place and out of place, every outbox flushed."""
    saved = comm._engine.outbox_landing
    comm._engine.outbox_landing = LandingChoices("always")
    try:
        exact = []
        for nbytes in (1 << 20, (2 << 20) - 8):
            n = nbytes // 4
            x = ((np.arange(n) % 11) + comm.rank).astype(np.float32)
            expected = ((np.arange(n) % 11) * 2 + 1).astype(np.float32).tobytes()
            out = comm.all_reduce(x, np.empty_like(x))
            comm.all_reduce(x)
            exact.append((comm.last_stats()["algorithm"], out.tobytes() == expected, x.tobytes() == expected))
        return saved.mode, comm.landing, exact
    finally:
        comm._engine.outbox_landing = saved


@pytest.mark.skipif(not cacheflush.available(), reason="needs an x86-64 CPU with CLFLUSHOPT")
def test_flushed_outboxes_keep_the_results_exact(pool):
    for default_mode, landing, exact in pool.run(outbox_flushed_calls):
        assert default_mode == "auto"
        assert landing["outbox_flushing"] == [size_class_of(1 << 19)]  # both calls' halves: 512 KiB-1 MiB
        assert landing["mode"] == "always" and landing["switches"] == 0
        assert exact == [("direct_shm", True, True)] * 2


def every_op_through_the_segments(comm):
    """sum, prod, min, max and avg through the segments, out of place and in place, against numpy."""
    n = 150_001  # 600 KB of float32: above the lane (lane_ops.py), odd halves
    rows = []
    for dtype in (np.float32, np.int32):
        ins = [((np.arange(n) % 5) + 1 + r).astype(dtype) for r in range(2)]
        for op, fold in (("sum", np.add), ("prod", np.multiply), ("min", np.minimum), ("max", np.maximum)):
            expected = fold(ins[0], ins[1]).astype(dtype)
            for in_place in (False, True):
                x = ins[comm.rank].copy()
                got = comm.all_reduce(x, op=op) if in_place else comm.all_reduce(x, np.empty_like(x), op=op)
                rows.append((str(np.dtype(dtype)), op, in_place, comm.last_stats()["algorithm"],
                             got.tobytes() == expected.tobytes()))
    x = ins[comm.rank].astype(np.float32)
    avg = comm.all_reduce(x, np.empty_like(x), op="avg")
    rows.append(("float32", "avg", False, comm.last_stats()["algorithm"],
                 bool(np.array_equal(avg, (ins[0].astype(np.float32) + ins[1].astype(np.float32)) / 2))))
    return rows


def test_every_op_through_the_segments_matches_numpy(pool):
    for rows in pool.run(every_op_through_the_segments):
        assert len(rows) == 17 and all(alg == "direct_shm" and exact for *_, alg, exact in rows), rows


def late_peer_wake(comm, late_rank):
    """``late_rank`` comes 0.3 s late to two all_reduces through the segments, then
    one on time: each result, and whether the early rank slept and the late one rang."""
    import time

    rows = []
    for late in (True, True, False):
        x = np.arange(300_000, dtype=np.float32) + comm.rank
        comm.barrier()
        if late and comm.rank == late_rank:
            time.sleep(0.3)
        out = comm.all_reduce(x, np.empty_like(x))
        stats = comm.last_stats()
        rows.append((stats["algorithm"], stats["slept_for_peer"], stats["rang_peer"],
                     bool(np.array_equal(out, 2 * np.arange(300_000, dtype=np.float32) + 1))))
    return rows


@pytest.mark.parametrize("late_rank", [0, 1])
def test_a_sleeping_rank_is_rung_awake_by_its_late_peer(pool, late_rank):
    """The early rank stops polling after PEER_SPIN_S and sleeps on its planes'
    events; the late one sees FLAG_WAITING and rings. A doorbell that lands after
    its operation finished is taken by a later sleep (the second late call), and
    a call where both arrive together needs neither."""
    results = pool.run(late_peer_wake, late_rank)
    early, late = results[1 - late_rank], results[late_rank]
    for k in range(2):
        assert early[k] == ("direct_shm", True, False, True), early
        assert late[k] == ("direct_shm", False, True, True), late
    assert early[2][3] and late[2][3] and early[2][0] == "direct_shm"


def both_ways_without_fingerprints(comm):
    """Through the outboxes and by reads (where the pair reads) with fingerprints off: the meeting alone."""
    rows = []
    for n in (300_000, 1_500_000):
        x = np.arange(n, dtype=np.float32) * (comm.rank + 1)
        out = comm.all_reduce(x, np.empty_like(x))
        rows.append((comm.last_stats()["algorithm"], bool(np.array_equal(out, np.arange(n, dtype=np.float32) * 3))))
    return rows


def test_the_segments_meet_without_fingerprints():
    ranks = RankPool(2, env={"MPCCS_FINGERPRINT": "0"})
    try:
        for rows in ranks.run(both_ways_without_fingerprints):
            assert rows == [("direct_shm", True), ("direct_shm", True)], rows
    finally:
        ranks.close()


def always_sleeping(comm):
    """PEER_SPIN_S = 0: every rank that does not find its peer's fingerprint at its
    first look sleeps at once, so the two ranks race through the meeting's flags and
    doorbells on every call. Ranks arriving together may meet at their first look on
    every call on some hosts, so some calls arrive late in turn (test_lane's
    arrive_late_in_turn): the other sleeps and is rung. Returns (exact results, calls that slept, calls that rang)."""
    from mpccs import direct_ops

    direct_ops.PEER_SPIN_S = 0.0
    exact = slept = rang = 0
    try:
        for k in range(240):
            arrive_late_in_turn(comm, k)
            n = 300_000 if k % 4 else 1_500_000  # through the outboxes; every fourth by reads (where they work)
            x = np.arange(n, dtype=np.float32) + comm.rank + k
            out = comm.all_reduce(x, np.empty_like(x))
            exact += bool(np.array_equal(out, 2 * np.arange(n, dtype=np.float32) + 1 + 2 * k))
            stats = comm.last_stats()
            slept += stats["slept_for_peer"]
            rang += stats["rang_peer"]
    finally:
        direct_ops.PEER_SPIN_S = 200e-6
    return exact, slept, rang


def test_ranks_that_sleep_at_once_still_meet_every_time(pool):
    """The store-fence-load order on both sides: of two ranks arriving together one
    sees the other, or the one that sleeps is rung; no call hangs or goes wrong."""
    results = pool.run(always_sleeping, timeout=120)
    assert [r[0] for r in results] == [240, 240], results
    assert all(r[1] > 0 for r in results), results  # each rank took the sleeping path
    assert all(r[2] > 0 for r in results), results  # and rang the other


# -- a pair that does not read across processes: the outboxes in rounds ----------------
# (bytes, dtype, op, in place): one round, then 2, 3 and 6; odd counts give unequal halves
NO_READS_CALLS = [
    (2 * MIB + 4, "float32", "sum", False),
    (5 * MIB + 2, "float16", "max", True),
    (9 * MIB + 8, "int64", "prod", False),
    (24 * MIB, "float64", "avg", True),
]


def no_reads_calls(comm, policy):
    """NO_READS_CALLS under ``policy``, then a fixed split and an algorithm asked for:
    (algorithm, read across processes, exact) per call."""
    comm.set_path_policy(policy)
    out = []
    for case in NO_READS_CALLS:
        stats, exact = all_reduce_case(comm, *case)
        out.append((stats["algorithm"], "steps_us" in stats, exact))
    comm.set_path_policy(0.8)
    comm.all_reduce(np.ones(2 * MIB, np.float32))
    out.append(comm.last_stats()["algorithm"])
    comm.set_path_policy("up")
    comm.all_reduce(np.ones(2 * MIB, np.float32), algorithm="ring")
    out.append(comm.last_stats()["algorithm"])
    return comm._engine.shm is not None and comm._engine.shm.cma, out


@pytest.fixture(scope="module")
def no_reads_pool():
    """MPCCS_CMA=0, as in a container whose seccomp profile refuses process_vm_readv."""
    ranks = RankPool(2, env={"MPCCS_CMA": "0"})
    yield ranks
    ranks.close()


@pytest.mark.parametrize("policy", ["up", "adaptive"])
def test_a_pair_that_does_not_read_sends_larger_all_reduces_through_the_outboxes_in_rounds(no_reads_pool, policy):
    """From 2 MiB (above one round's 4 MiB too) the all_reduce goes through the
    outboxes, in rank order, bit-exact; a fixed split and an algorithm asked for do not."""
    for reads, out in no_reads_pool.run(no_reads_calls, policy, timeout=120):
        assert not reads
        assert out[:-2] == [("direct_shm", False, True)] * len(NO_READS_CALLS), out
        assert "direct_shm" not in out[-2:] and out[-1] == "ring", out
