"""The two-step executor (mpccs/two_step.py): 2-rank all_reduces on 'up' alone
as two messages each way, agreed between the ranks in their fingerprint messages.

Runs on live ranks over real UCX planes (one pool for the module); what each
call ran on comes from last_stats()["algorithm"]. The pools run with the
pair's shared-memory segments closed (MPCCS_SHM=0): with them these 2-rank
all_reduces take the direct path through the outboxes or by reads
(test_shm.py, test_cma.py), which is where the executor runs.
"""
import contextlib
import dataclasses

import numpy as np
import pytest

from collective_cases import dtype_of
from rankpool import RankPool
from test_collectives import readds_off

MIB = 1 << 20


def _pool():
    return RankPool(2, env={"MPCCS_SHM": "0"})


@pytest.fixture(scope="module")
def pool():
    p = _pool()
    yield p
    p.close()


@contextlib.contextmanager
def options(comm, **changes):
    saved = comm.options
    comm.options = dataclasses.replace(saved, **changes)
    try:
        yield
    finally:
        comm.options = saved


def inputs(rank: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    dt = dtype_of(dtype)
    if dt.kind in "iu":
        return rng.integers(1, 5, n).astype(dt)  # small: products of two stay exact
    return rng.standard_normal(n).astype(dt)


def reference(n: int, dtype: str, op: str) -> np.ndarray:
    a, b = inputs(0, n, dtype), inputs(1, n, dtype)
    ufunc = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    out = ufunc(a, b)  # rank 0's operand first, as every executor reduces
    if op == "avg":
        out = (out.astype(np.float32) / 2).astype(out.dtype) if out.dtype.itemsize < 4 else out / 2
    return out


# (bytes, dtype, op, in place): odd element counts give the ranks unequal halves
CALLS = [
    (2 * MIB, "float32", "sum", True),
    (2 * MIB + 4, "float32", "avg", False),
    (3 * MIB + 2, "float16", "sum", True),
    (4 * MIB, "bfloat16", "max", False),
    (5 * MIB + 8, "int64", "prod", True),
    (8 * MIB, "float64", "min", False),
    (16 * MIB, "float32", "sum", True),
]


def all_reduce_case(comm, nbytes: int, dtype: str, op: str, in_place: bool) -> tuple[dict, bool]:
    """One (bytes, dtype, op, in place) all_reduce of inputs(): (its last_stats, exact
    against reference()); out of place, the input must come back unchanged."""
    n = nbytes // dtype_of(dtype).itemsize
    x = inputs(comm.rank, n, dtype)
    got = x if in_place else np.full_like(x, 7)
    comm.all_reduce(x, None if in_place else got, op=op)
    if not in_place:
        assert np.array_equal(x, inputs(comm.rank, n, dtype)), "the input changed out of place"
    return comm.last_stats(), got.tobytes() == reference(n, dtype, op).tobytes()


def calls_under(comm, policy):
    """Each of CALLS under ``policy``: (executor, exact) per call."""
    comm.set_path_policy(policy)
    out = []
    with readds_off(comm):
        for case in CALLS:
            stats, exact = all_reduce_case(comm, *case)
            out.append((stats["algorithm"], exact))
    return out


def test_two_step_runs_up_calls_bit_exactly(pool):
    for per_rank in pool.run(calls_under, "up"):
        assert per_rank == [("two_step", True)] * len(CALLS)


def test_settled_adaptive_calls_take_the_two_step_executor(pool):
    # A fresh pool has 'out' dropped from the start (tcp on the same cores never
    # pays); calls between probes run on 'up' alone, so on the two-step executor.
    # Probes and the calls around them keep the DAG: both must stay exact.
    for per_rank in pool.run(calls_under, "adaptive"):
        assert all(exact for _, exact in per_rank), per_rank
        assert ("two_step", True) in per_rank, per_rank


def stats_of_one_call(comm):
    comm.set_path_policy("up")
    x = np.ones(MIB, np.float32)  # 4 MiB
    comm.all_reduce(x)
    st = comm.last_stats()
    return x[0], st["algorithm"], [s["label"] for s in st["stages"]], st["bytes_per_plane"]


def test_two_step_reports_its_steps_and_bytes(pool):
    for value, algorithm, labels, per_plane in pool.run(stats_of_one_call):
        assert (value, algorithm, labels) == (2.0, "two_step", ["reduce-scatter", "all-gather"])
        assert per_plane == {"up": 4 * MIB, "out": 0}  # half the input each step, all on 'up'


def mixed_offers(comm, declined_by):
    """One rank does not offer the two-step executor: both must run the DAG."""
    comm.set_path_policy("up")
    x = np.arange(MIB, dtype=np.float32)
    with options(comm, two_step=comm.rank != declined_by):
        comm.all_reduce(x)
    return comm.last_stats()["algorithm"], bool(np.array_equal(x, 2 * np.arange(MIB, dtype=np.float32)))


@pytest.mark.parametrize("declined_by", [0, 1])
def test_both_ranks_fall_back_to_the_dag_unless_both_offer(pool, declined_by):
    results = pool.run(mixed_offers, declined_by)
    assert results[0] == results[1] and results[0][1], results
    assert results[0][0] != "two_step"


def where_it_is_not_offered(comm):
    x = np.ones(MIB, np.float32)
    seen = {}
    comm.set_path_policy("up")
    comm.all_reduce(x, algorithm="ring")  # an algorithm asked for runs as asked
    seen["algorithm asked"] = comm.last_stats()["algorithm"]
    comm.set_path_policy(0.8)  # a split puts bytes on 'out'
    comm.all_reduce(x)
    seen["fixed split"] = comm.last_stats()["algorithm"]
    comm.set_path_policy("up")
    comm.all_reduce(np.ones(9 * MIB, np.float32))  # halves over two_step.MAX_HALF_BYTES
    seen["over the bound"] = comm.last_stats()["algorithm"]
    comm.broadcast(np.ones(MIB, np.float32), root=0)
    seen["another collective"] = comm.last_stats()["algorithm"]
    return seen


def test_two_step_only_where_every_byte_goes_on_up_and_nothing_else_is_asked(pool):
    for seen in pool.run(where_it_is_not_offered):
        assert "two_step" not in seen.values(), seen
        assert seen["algorithm asked"] == "ring"


def peer_absent(comm):
    """Rank 0 calls, rank 1 does not: the no-progress timeout names what is missing."""
    import mpccs

    comm.set_path_policy("up")
    if comm.rank == 1:
        return None
    with options(comm, timeout_s=1.0):
        try:
            comm.all_reduce(np.ones(MIB, np.float32))
        except mpccs.OperationTimeout as exc:
            return str(exc)
    return "completed"


def test_a_missing_peer_times_out_naming_the_agreement_it_waits_for():
    pool = _pool()  # the case leaves a call half done: a pool of its own
    try:
        message, _ = pool.run(peer_absent)
    finally:
        pool.close()
    assert message is not None and "fingerprint messages of ranks [1]" in message, message


def async_two_steps(comm):
    """Several two-step calls in flight at once (a training loop's gradient buckets):
    they share the engine's one receive buffer, which only works one at a time."""
    comm.set_path_policy("up")
    xs = [np.full(MIB // 2 + 1024 * i, float(comm.rank + i), np.float32) for i in range(4)]  # 2 MiB and up
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    for work in reversed(works):  # waited for in any order
        work.wait()
    algorithms = {w.stats()["algorithm"] for w in works}
    exact = all(np.array_equal(x, np.full_like(x, 1.0 + 2 * i)) for i, x in enumerate(xs))
    return algorithms, exact


def test_async_two_step_calls_complete_exactly_in_any_order(pool):
    for algorithms, exact in pool.run(async_two_steps):
        assert algorithms == {"two_step"} and exact


def test_a_failed_two_step_parks_every_buffer_ucx_may_still_touch():
    # Parked without its buffer, a receive still posted into the caller's output
    # (or a send still reading its input) could outlive the array it names.
    from types import SimpleNamespace

    from mpccs.two_step import STEPS, TwoStepExecutor

    class Req:
        def __init__(self, completed):
            self.completed = completed

    forgotten = []
    engine = SimpleNamespace(forget_kept_scratch=lambda user: forgotten.append(user == "two_step"))
    ex = object.__new__(TwoStepExecutor)
    ex.op = SimpleNamespace(engine=engine)
    ex.steps = STEPS  # an all_reduce: both steps
    ex.incoming, ex.theirs_out, ex.theirs_in, ex.mine_out = (np.zeros(4) for _ in range(4))
    ex.recv_rs, ex.recv_ag, ex.send_rs, ex.send_ag = Req(True), Req(False), Req(False), None
    parked = ex.pending()
    assert [b is ex.theirs_out for _, b in parked] == [True, False] and parked[1][1] is ex.theirs_in
    assert not forgotten  # the engine's receive buffer was written already: the next call may have it
    ex.recv_rs = Req(False)
    assert ex.pending()[0][1] is ex.incoming and forgotten == [True]  # still being written: the next call gets its own


# (block bytes, dtype, op, in place): blocks from the direct path's bound (1 MiB) up
BLOCK_CALLS = [
    (MIB, "float32", "sum", False),
    (MIB + 4, "float16", "max", True),
    (3 * MIB, "int32", "prod", False),
    (8 * MIB, "float64", "avg", True),
]


def block_calls(comm, policy):
    """reduce_scatter and all_gather of BLOCK_CALLS under ``policy``: (collective, executor, exact)."""
    comm.set_path_policy(policy)
    out = []
    with readds_off(comm):
        for nbytes, dtype, op, in_place in BLOCK_CALLS:
            m = nbytes // dtype_of(dtype).itemsize
            x = inputs(comm.rank, 2 * m, dtype)
            expected = reference(2 * m, dtype, op)[comm.rank * m:(comm.rank + 1) * m]
            got = x[comm.rank * m:(comm.rank + 1) * m] if in_place else np.full(m, 7, x.dtype)
            comm.reduce_scatter(x, got, op=op)
            out.append(("reduce_scatter", comm.last_stats()["algorithm"], got.tobytes() == expected.tobytes()))
            mine = inputs(comm.rank, m, dtype)
            gathered = np.full(2 * m, 7, mine.dtype)
            if in_place:
                gathered[comm.rank * m:(comm.rank + 1) * m] = mine
                comm.all_gather(gathered[comm.rank * m:(comm.rank + 1) * m], gathered)
            else:
                comm.all_gather(mine, gathered)
            whole = np.concatenate([inputs(0, m, dtype), inputs(1, m, dtype)])
            out.append(("all_gather", comm.last_stats()["algorithm"], gathered.tobytes() == whole.tobytes()))
    return out


@pytest.mark.parametrize("policy", ["up", "adaptive"])
def test_reduce_scatter_and_all_gather_blocks_take_one_step_exactly(pool, policy):
    for per_rank in pool.run(block_calls, policy):
        assert all(exact for _, _, exact in per_rank), per_rank
        if policy == "up":
            assert {algorithm for _, algorithm, _ in per_rank} == {"two_step"}, per_rank
        else:  # between probes; probes and the calls around them keep the DAG
            assert any(algorithm == "two_step" for _, algorithm, _ in per_rank), per_rank


def test_the_offer_rides_after_the_fingerprint_words_in_one_kept_message():
    """The two-step offer's message is the fingerprint's words and one declaration
    byte, built once per byte value (a training loop repeats the same call)."""
    from mpccs import collective_op, fingerprint, operation

    fp = fingerprint.make("all_reduce", "sum", np.float32, "ring", None, 1 << 20, 1 << 19)
    offer = fp.with_declaration(collective_op.DECLARES_TWO_STEP)
    assert offer.tobytes() == fp.raw + bytes((collective_op.DECLARES_TWO_STEP,))
    assert len(fp.raw) == operation.FP_BYTES
    assert fp.with_declaration(collective_op.DECLARES_TWO_STEP) is offer
    other = fp.with_declaration(collective_op.DECLARES_SAFE | collective_op.DECLARES_TWO_STEP)
    assert other is not offer and int(other[operation.FP_BYTES]) == collective_op.DECLARES_SAFE | collective_op.DECLARES_TWO_STEP
    assert fingerprint.Fingerprint.decode(offer[:operation.FP_BYTES].view(np.uint64)) == fp


def exports_with_one_rank_planning(comm, planning_rank: int, n_ops: int = 40):
    """Adaptive 2 MiB calls where ``planning_rank`` never counts a call as settled
    (it plans and exports every time) and its peer does as usual: (estimate
    exports, settled calls, every result exact) at this rank."""
    comm.set_path_policy("adaptive")
    ctl = comm._engine.controller
    counts = {"export_estimates": 0, "note_settled_operation": 0}
    for name in counts:
        def counted(*args, _name=name, _method=getattr(ctl, name), **kwargs):
            counts[_name] += 1
            return _method(*args, **kwargs)
        setattr(ctl, name, counted)  # instance attributes: removed below
    if comm.rank == planning_rank:
        ctl.settled = lambda *args, **kwargs: False
    exact = []
    try:
        with readds_off(comm):
            n = MIB // 2
            for _ in range(n_ops):
                x = inputs(comm.rank, n, "float32")
                comm.all_reduce(x)
                exact.append(x.tobytes() == reference(n, "float32", "sum").tobytes())
    finally:
        for name in (*counts, "settled"):
            ctl.__dict__.pop(name, None)
    return counts["export_estimates"], counts["note_settled_operation"], all(exact)


def test_settled_calls_send_no_estimates_and_mix_with_a_peer_that_plans(pool):
    """A settled call's fingerprint message carries no estimates (note_settled_operation
    instead of an export); a peer that plans the same calls (a check of its own, say)
    merges nothing from it and both stay exact."""
    (exports0, settled0, exact0), (exports1, settled1, exact1) = pool.run(exports_with_one_rank_planning, 1)
    assert exact0 and exact1
    assert settled1 == 0 and exports1 == 40  # the planning rank exports every call
    assert settled0 > 20 and exports0 + settled0 == 40  # the other mostly settled: each call one or the other
