"""Every collective against a numpy reference, on live ranks over real UCX planes.

The dimensions (collective x algorithm, world, size, dtype, op, in-place,
policy) are covered pairwise; one pool of ranks per world shape is kept alive
for the whole module.
"""
import contextlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

from collective_cases import (DTYPES, REDUCING, check, dtype_of, expected_output, input_size, is_float,
                              make_input, output_size)
from mpccs.algorithms import ALGORITHMS
from mpccs.transports import shm
from mpccs.transports.shm_group import blocks_bound, lane_bound
from pairwise import all_pairs
from rankpool import RankPool

WORLDS = {"1": (1, None), "2": (2, None), "3": (3, None), "4": (4, None), "2x2": (4, lambda r: f"d{r // 2}")}
SIZES = {"zero": 0, "one": 1, "odd": 1001, "mid": 65537, "large": None}  # large: 16 MiB of data
LARGE_BYTES = 16 << 20
PLANS = [(c, a) for c, algos in ALGORITHMS.items() if c != "all_to_allv" for a in algos]
OPS = ["sum", "prod", "min", "max", "avg"]
POLICIES = ["up", "out", 0.5, "adaptive"]


def valid(case) -> bool:
    collective, _ = case["plan"]
    if case["op"] == "avg" and not is_float(case["dtype"]):
        return False
    if collective not in REDUCING and case["op"] != "sum":
        return False  # op is meaningless there; keep one value so pairs stay honest
    if case["inplace"] and collective not in ("all_reduce", "reduce"):
        return False
    if case["size"] == "large" and case["world"] in ("3", "4", "2x2") and collective == "all_to_all":
        return False
    return True


CASES = all_pairs(
    {"plan": PLANS, "world": list(WORLDS), "size": list(SIZES), "dtype": DTYPES, "op": OPS,
     "inplace": [False, True], "policy": POLICIES},
    valid,
)
# hierarchical needs several domains: make sure it also runs where it applies
CASES += [
    {"plan": (c, "hierarchical"), "world": "2x2", "size": s, "dtype": "float32", "op": "sum", "inplace": False, "policy": p}
    for c in ("all_reduce", "reduce_scatter", "all_gather") for s, p in (("odd", 0.5), ("large", "adaptive"))
]


@pytest.fixture(scope="module")
def pools():
    started = {}

    def get(world_name):
        if world_name not in started:
            size, domain = WORLDS[world_name]
            started[world_name] = RankPool(size, env={"MPCCS_DOMAIN": domain} if domain else None)
        return started[world_name]

    yield get
    for pool in started.values():
        pool.close()


def count_for(case) -> int:
    if case["size"] != "large":
        return SIZES[case["size"]]
    return LARGE_BYTES // dtype_of(case["dtype"]).itemsize // WORLDS[case["world"]][0]


def run_case(comm, case, seed, root=0):
    collective, algorithm = case["plan"]
    name, op, world, rank = case["dtype"], case["op"], comm.size, comm.rank
    count = count_for(case)
    root = root % world
    comm.set_path_policy(case["policy"])
    inputs = [make_input(name, input_size(collective, world, count), r, seed, op) for r in range(world)]
    send = inputs[rank].copy()
    recv = np.full(output_size(collective, world, count), 99, dtype=dtype_of(name))
    kw = {"algorithm": algorithm}
    if collective == "all_reduce":
        got = comm.all_reduce(send, op=op, **kw) if case["inplace"] else comm.all_reduce(send, recv, op=op, **kw)
    elif collective == "reduce_scatter":
        got = comm.reduce_scatter(send, recv, op=op, **kw)
    elif collective == "all_gather":
        got = comm.all_gather(send, recv, **kw)
    elif collective == "all_to_all":
        got = comm.all_to_all(send, recv, **kw)
    elif collective == "broadcast":
        got = comm.broadcast(send, root=root, **kw)
    else:
        got = comm.reduce(send, None if case["inplace"] else recv, op=op, root=root, **kw)
    expected = expected_output(collective, inputs, op, name, rank, root, count)
    if expected is None:
        return None
    if collective == "reduce_scatter":  # the bound depends on the block this rank owns
        inputs = [x[rank * count:(rank + 1) * count] for x in inputs]
    return check(np.asarray(got).reshape(-1), expected, inputs, op, name, world, collective in REDUCING)


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "-".join(
    str(v) if not isinstance(v, tuple) else "/".join(v) for v in CASES[i].values()))
def test_collective_matches_reference(pools, index):
    case = CASES[index]
    pool = pools(case["world"])
    results = pool.run(run_case, case, seed=index, root=index, timeout=120)
    failures = {r: msg for r, msg in enumerate(results) if msg}
    assert not failures, f"{case}: {failures}"


def all_policies_bitwise(comm, algorithm, n):
    x = make_input("float32", n, comm.rank, 77, "sum")
    results = []
    for policy in ("up", "out", 0.5, 0.8, "adaptive"):
        comm.set_path_policy(policy)
        results.append(comm.all_reduce(x.copy(), algorithm=algorithm).tobytes())
        # Out of place the prologue copy is deferred (reductions read the input
        # directly): the bits must not change, nor the input.
        before = x.copy()
        results.append(comm.all_reduce(x, np.empty_like(x), algorithm=algorithm).tobytes())
        assert np.array_equal(x, before)
    return results


@pytest.mark.parametrize("algorithm", ALGORITHMS["all_reduce"])
def test_results_bit_identical_across_policies_and_ranks(pools, algorithm):
    per_rank = pools("3").run(all_policies_bitwise, algorithm, 300_001)
    reference = per_rank[0][0]
    for rank_results in per_rank:
        assert all(r == reference for r in rank_results)


def split_carries_both_planes(comm, n):
    comm.set_path_policy(0.5)
    x = np.arange(n, dtype=np.int64) * (comm.rank + 1)
    comm.all_reduce(x, algorithm="ring")
    expected = np.arange(n, dtype=np.int64) * sum(range(1, comm.size + 1))
    return comm.last_stats()["bytes_per_plane"], bool(np.array_equal(x, expected))


def test_fixed_half_split_uses_both_planes_and_stays_exact(pools):
    for bpp, exact in pools("2").run(split_carries_both_planes, 4 << 20):
        assert exact
        assert bpp["up"] > 0 and bpp["out"] > 0
        assert abs(bpp["up"] / (bpp["up"] + bpp["out"]) - 0.5) < 0.05


@contextlib.contextmanager
def readds_off(comm):
    """No probe re-adds 'out' while inside (readd_margin 1: no probe is ever that
    fast): for tests of what operations do once 'out' is dropped, not of the probes'
    verdicts, which VM noise can sway (a probe that looked like a gain kept 'out'
    in use for a whole run once in a fresh-clone CI)."""
    config = comm._engine.controller.config
    saved, config.readd_margin = config.readd_margin, 1.0
    try:
        yield
    finally:
        config.readd_margin = saved


def settled_adaptive_run(comm, n_ops):
    """Adaptive all_reduces on the default planes, where 'out' (tcp on the same
    cores) never pays: what each operation did and whether it was exact.

    A fresh communicator starts with 'out' dropped, and re-adds are off
    (readds_off: 0 of 40 operations settled once in a fresh-clone CI)."""
    comm.set_path_policy("adaptive")
    ctl = comm._engine.controller
    with readds_off(comm):
        x = np.arange(1 << 19, dtype=np.float32) * (comm.rank + 1)
        expected = np.arange(1 << 19, dtype=np.float32) * sum(range(1, comm.size + 1))
        out = []
        for _ in range(n_ops):
            y = np.empty_like(x)
            comm.all_reduce(x, y)
            st = comm.last_stats()
            snap = ctl.snapshot()
            out.append({"exact": bool(np.array_equal(y, expected)), "policy": st["policy"],
                        "planned": st["stages"][0]["split"].get("policy") == "adaptive",
                        "out_bytes": st["bytes_per_plane"]["out"], "waived": st["protection_waived"],
                        "protected": st["protected"],
                        # Why the controller did (not) settle: for a failure's message.
                        "epoch": comm._epoch, "state": snap["ranks"].get(str(comm.rank)),
                        "peers_dropped": snap["remote_dropped"], "up_rate": ctl._exported_up_rate,
                        "events": st.get("events", [])})
        return out


def test_settled_adaptive_runs_as_up_and_skips_the_done_round():
    pool = RankPool(2, env={"MPCCS_SHM": "0"})  # (with the segments open, 2 MiB would go direct)
    try:
        per_rank = pool.run(settled_adaptive_run, 40)
    finally:
        pool.close()
    for ops in per_rank:
        assert all(o["exact"] and o["policy"] == "adaptive" for o in ops)
        settled = [o for o in ops if not o["planned"]]
        # Between probes nothing is decided, and nothing touches 'out' ... Not
        # every operation between probes: the probe epochs (4, 16, 32) and the
        # two after each (a repeat, and the operation in which a peer's re-add
        # would be heard of) are planned, and so is the operation before each.
        assert len(settled) >= len(ops) // 2, "\n".join(map(str, ops))
        assert all(o["out_bytes"] == 0 for o in settled)
        # ... so no rank may carry bytes on a failable plane: no DONE round.
        assert all(o["waived"] and not o["protected"] for o in settled)
        # Probes and the operations around them are still planned by the controller.
        assert any(o["planned"] for o in ops)


def waiver_agreement_run(comm, n_ops):
    """Adaptive broadcasts (a chain: the root never hears from the last rank)
    between all_reduces (every rank exchanges with every rank) on 3 ranks.
    Re-adds are off meanwhile (readds_off): on this shared pool, 'out' kept in
    use for the whole run would leave no operation to waive."""
    comm.set_path_policy("adaptive")
    seen = {"broadcast": set(), "all_reduce": set()}
    with readds_off(comm):
        for i in range(n_ops):
            x = np.full(1 << 21, float(comm.rank == i % comm.size), np.float32)
            comm.broadcast(x, root=i % comm.size)
            assert (x == 1).all()
            seen["broadcast"].add(comm.last_stats()["protection_waived"])
            y = np.ones(1 << 21, np.float32)  # 8 MiB: large enough for 'adaptive' to consider 'out' on 3 ranks
            comm.all_reduce(y, algorithm="ring")  # the DAG (the group reads would take it: no DONE round)
            assert (y == comm.size).all()
            seen["all_reduce"].add(comm.last_stats()["protection_waived"])
    return {k: sorted(v) for k, v in seen.items()}


def test_exchanges_with_everyone_only_where_every_pair_moves_data():
    from mpccs.algorithms import ALGORITHMS as BUILDERS
    from mpccs.algorithms.registry import build_schedule
    from mpccs.collective_op import exchanges_with_everyone
    assert exchanges_with_everyone(build_schedule("all_reduce", 3, 999, algorithm="ring"))
    assert exchanges_with_everyone(build_schedule("all_to_all", 4, 999, algorithm="pairwise"))
    assert exchanges_with_everyone(build_schedule("all_reduce", 2, 999, algorithm="ring"))
    # A broadcast tree or chain: the root never exchanges with the farthest rank.
    for algorithm in BUILDERS["broadcast"]:
        if algorithm != "hierarchical":
            assert not exchanges_with_everyone(build_schedule("broadcast", 4, 999, algorithm=algorithm)), algorithm


def test_done_round_waived_only_where_every_rank_hears_every_declaration(pools):
    # A rank that waived while another kept its DONE round would leave that one
    # waiting for ever (found by the 3-rank soak): the pool's timeout would fail this.
    for seen in pools("3").run(waiver_agreement_run, 24):
        assert seen["broadcast"] == [False]  # a chain: the root cannot hear the last rank's declaration
        assert True in seen["all_reduce"]  # a ring of 3 reaches everyone: waived once settled


def async_in_flight(comm):
    comm.set_path_policy(0.5)
    n = comm.size
    xs = [np.full(50_000 + i, comm.rank + i, np.int32) for i in range(4)]
    gathered = np.zeros(n * 1000, np.float64)
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    works.append(comm.all_gather(np.full(1000, float(comm.rank)), gathered, async_op=True))
    for w in reversed(works):
        w.wait()
    ok = all((x == sum(r + i for r in range(n))).all() for i, x in enumerate(xs))
    return ok and bool((gathered.reshape(n, -1) == np.arange(n)[:, None]).all())


def test_several_async_operations_complete_in_any_order(pools):
    assert pools("3").run(async_in_flight) == [True, True, True]


def direct_all_gather_paths(comm):
    """all_gather takes the direct path small and medium (out of place and in
    place), the DAG from the bound up; results exact either way."""
    p, me = comm.size, comm.rank
    out = {}
    with path_policy(comm, "adaptive"):
        for name, n in (("small", 3), ("medium", 50_001), ("largest", GATHER_BOUND[0] // 4),
                        ("above", GATHER_BOUND[1] // 4)):
            expected = np.concatenate([np.arange(n, dtype=np.float32) + 10 * r for r in range(p)])
            got = comm.all_gather(np.arange(n, dtype=np.float32) + 10 * me, np.empty(n * p, np.float32))
            out[name] = (bool(np.array_equal(got, expected)), comm.last_stats()["algorithm"])
            whole = np.zeros(n * p, np.float32)
            whole[me * n:(me + 1) * n] = np.arange(n) + 10 * me
            comm.all_gather(whole[me * n:(me + 1) * n], whole)
            out[name + "_in_place"] = (bool(np.array_equal(whole, expected)), comm.last_stats()["algorithm"])
    out["pair_reads"] = _pair_reads(comm)
    return out


def _pair_reads(comm) -> bool:
    """2 ranks whose segments read across processes: blocks from 512 KiB are read (DirectShmBlocksOp)."""
    return comm._engine.shm is not None and comm._engine.shm.cma


# (largest block on the direct path, smallest above it), 2 and 3 ranks: a ring
# all_gather sends one block per stage, which the engine may split from
# min_multipath_bytes (1 MiB).
GATHER_BOUND = ((1 << 20) - 4, 1 << 20)


def _small_path(world: str, nbytes: int, blocks: bool = False) -> str:
    """Where a small or medium direct call whose ranks each publish ``nbytes`` at
    most runs (where the segments open: x86-64 with /dev/shm): 2 ranks on one
    host take the lane (lane_ops.py), 3 to 8 the group lane within its bound
    (group_lane_ops.py; ``blocks``: a reduce_scatter's, all_gather's or
    all_to_all's, the larger), else messages."""
    if not shm.supported():
        return "direct"
    bound = (blocks_bound if blocks else lane_bound)(int(world))
    return "direct_lane" if world == "2" or nbytes <= bound else "direct"


@pytest.mark.parametrize("world", ["2", "3"])
def test_all_gather_direct_paths(pools, world):
    for r in pools(world).run(direct_all_gather_paths):
        largest = ("direct_shm" if r["pair_reads"] else "direct") if world == "2" else \
            _small_path(world, GATHER_BOUND[0])
        for case, path in (("small", _small_path(world, 3 * 4)), ("medium", _small_path(world, 50_001 * 4)),
                           ("largest", largest)):
            assert r[case] == (True, path) and r[case + "_in_place"] == (True, path), r
        assert r["above"][0] and r["above"][1] != "direct" and r["above_in_place"][0], r


SMALL_BLOCKS = {"empty": 0, "small": 3, "medium": 50_001}  # elements a rank sends each peer


def direct_block_paths(comm):
    """reduce_scatter and all_to_all (block j to rank j) take the direct path
    small and medium, in rank order (bit-identical), the DAG from the bound up."""
    p, me = comm.size, comm.rank
    out = {}
    with path_policy(comm, "adaptive"):
        for name, n in (*SMALL_BLOCKS.items(), ("largest", GATHER_BOUND[0] // 4),
                        ("above", GATHER_BOUND[1] // 4)):
            send = _order_sensitive(me, n * p)
            expected = _rank_order_sum(p, n * p)[me * n:(me + 1) * n]
            got = comm.reduce_scatter(send, np.empty(n, np.float32))
            out["rs", name] = (got.tobytes() == expected.tobytes(), comm.last_stats()["algorithm"])
            whole = send.copy()
            comm.reduce_scatter(whole, whole[me * n:(me + 1) * n])  # in place: rank 2 needs a copy of its block
            out["rs_in_place", name] = (whole[me * n:(me + 1) * n].tobytes() == expected.tobytes(),
                                        comm.last_stats()["algorithm"])
            blocks = np.arange(n * p, dtype=np.float32) + 1000 * me
            got = comm.all_to_all(blocks, np.empty(n * p, np.float32))
            expected = np.concatenate([np.arange(me * n, (me + 1) * n, dtype=np.float32) + 1000 * r for r in range(p)])
            out["a2a", name] = (bool(np.array_equal(got, expected)), comm.last_stats()["algorithm"])
    out["group_reads"] = getattr(comm._group, "cma", False)
    out["pair_reads"] = _pair_reads(comm)
    return out


@pytest.mark.parametrize("world", ["2", "3"])
def test_reduce_scatter_and_all_to_all_direct_paths(pools, world):
    for r in pools(world).run(direct_block_paths):
        for kind in ("rs", "rs_in_place", "a2a"):
            for case in ("empty", "small", "medium", "largest"):
                # The largest blocks (3 MiB of input on 3 ranks): a reduce_scatter within the group
                # lane's bound for blocks (4 MiB), an all_to_all above its own (2 MiB: read across
                # processes where the group may); on 2 ranks read across processes where the pair may.
                largest = ("direct_shm" if r["pair_reads"] else "direct") if world == "2" else \
                    _small_path(world, GATHER_BOUND[0] * 3, blocks=True)
                if world == "3" and kind == "a2a":
                    largest = "group_reads" if r["group_reads"] else "direct"
                path = largest if case == "largest" else _small_path(world, SMALL_BLOCKS[case] * 4 * int(world),
                                                                     blocks=True)
                assert r[kind, case] == (True, path), (kind, case, r[kind, case])
            assert r[kind, "above"][0] and r[kind, "above"][1] != "direct", (kind, r[kind, "above"])


def direct_broadcast_paths(comm):
    """broadcast takes the direct path small and medium from every root, the DAG above the budget."""
    out = {}
    with path_policy(comm, "adaptive"):
        for name, n in (("small", 3), ("medium", 50_001), ("above", (2 << 20) // 4 + 1)):
            for root in range(comm.size):
                expected = np.arange(n, dtype=np.float32) + root
                buf = expected.copy() if comm.rank == root else np.zeros(n, np.float32)
                comm.broadcast(buf, root=root)
                out[name, root] = (bool(np.array_equal(buf, expected)), comm.last_stats()["algorithm"])
    return out


def direct_reduce_paths(comm):
    """reduce takes the direct path small and medium to every root, in rank order
    (bit-identical), in place or not; non-roots keep their input."""
    p, me = comm.size, comm.rank
    out = {}
    with path_policy(comm, "adaptive"):
        for name, n in (("small", 3), ("medium", 50_001), ("above", (2 << 20) // 4 + 1)):
            expected = _rank_order_sum(p, n).tobytes()
            for root in range(p):
                got = comm.reduce(_order_sensitive(me, n), np.empty(n, np.float32) if me == root else None, root=root)
                algorithm = comm.last_stats()["algorithm"]
                mine = _order_sensitive(me, n)
                comm.reduce(mine, root=root)  # in place on the root: rank 2 as root copies its input first
                kept = mine.tobytes() == (expected if me == root else _order_sensitive(me, n).tobytes())
                out[name, root] = ((got.tobytes() == expected) if me == root else got is None, kept, algorithm)
    return out


@pytest.mark.parametrize("world", ["2", "3"])
def test_reduce_direct_paths(pools, world):
    for r in pools(world).run(direct_reduce_paths):
        for root in range(int(world)):
            small, medium = _small_path(world, 3 * 4), _small_path(world, 50_001 * 4)
            assert r["small", root] == (True, True, small) and r["medium", root] == (True, True, medium), r
            assert r["above", root][:2] == (True, True) and r["above", root][2] != "direct", r


@pytest.mark.parametrize("world", ["2", "3"])
def test_broadcast_direct_paths(pools, world):
    for r in pools(world).run(direct_broadcast_paths):
        for root in range(int(world)):
            small, medium = _small_path(world, 3 * 4), _small_path(world, 50_001 * 4)
            assert r["small", root] == (True, small) and r["medium", root] == (True, medium), r
            assert r["above", root][0] and r["above", root][1] != "direct", r


def async_collectives_in_order(comm):
    """Async collectives on the DAG engine run one at a time, in call order:
    each one's first stage starts only after the one before finished (the
    controller measures each alone), and waiting on the last drives the others."""
    comm.set_path_policy(0.5)
    n = comm.size
    xs = [np.full(200_000, comm.rank + i, np.float32) for i in range(3)]
    works = [comm.all_reduce(x, async_op=True, algorithm="ring") for x in xs]
    sends = [comm.all_gather(x[:1000], np.empty(1000 * n, np.float32), async_op=True, algorithm="ring")
             for x in xs[:1]]
    (works + sends)[-1].wait()  # the last one: the three all_reduces must finish first
    finished = [w.is_completed() for w in works]
    for w in works:
        w.wait()
    stats = [w.stats() for w in works + sends]
    spans = [(s["t_start_wall"], min(st["t_start_wall"] for st in s["stages"]),
              max(st["t_start_wall"] + st["duration_s"] for st in s["stages"])) for s in stats]
    ordered = all(spans[k + 1][1] >= spans[k][2] - 1e-4 for k in range(len(spans) - 1))
    correct = all((x == sum(r + i for r in range(n))).all() for i, x in enumerate(xs))
    return finished, ordered, correct


def test_async_collectives_run_one_at_a_time_in_call_order(pools):
    for finished, ordered, correct in pools("2").run(async_collectives_in_order):
        assert finished == [True, True, True]
        assert ordered and correct


def small_async_same_size(comm, segments):
    # Same-size direct all_reduces share a buffer pool: in flight at once each
    # needs its own buffers, and reused ones must not leak the last call's data
    # (through the group lane's segments: two slots taken in turn).
    with shm_segments(comm, segments):
        return _small_async_same_size(comm)


def _small_async_same_size(comm):
    n = comm.size
    before = comm.metrics().get('operations_total{op="all_reduce"}', 0)
    xs = [np.full(16, comm.rank * 10 + i, np.int64) for i in range(6)]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    for w in works[::-1]:
        w.wait()
    in_flight = all((x == sum(r * 10 + i for r in range(n))).all() for i, x in enumerate(xs))
    again = [comm.all_reduce(np.full(16, comm.rank + i, np.int64))[0] for i in range(3)]
    counted = comm.metrics()['operations_total{op="all_reduce"}'] - before
    return in_flight, again, counted, comm.last_stats()["algorithm"]


@pytest.mark.parametrize("segments", [False, True])
def test_small_async_all_reduces_of_one_size_keep_their_own_buffers(pools, segments):
    for in_flight, again, counted, algorithm in pools("3").run(small_async_same_size, segments):
        assert in_flight
        assert again == [3, 6, 9]
        assert counted == 9 and algorithm == (_small_path("3", 128) if segments else "direct")


def reused_buffers_alternating_ops(comm):
    """Small direct calls of one size share pooled buffers that keep the
    fingerprint they last sent (written again only when it differs): ops,
    dtypes and roots alternating over one buffer size still compute right."""
    me, p = comm.rank, comm.size
    got = []
    for i in range(12):
        x = np.array([me + i, -me], np.float32)
        op = ("sum", "max", "min")[i % 3]
        comm.all_reduce(x, op=op)
        got.append(x.tolist())
        y = np.array([me + i], np.int64)  # 8 bytes again: the same buffer size, another dtype
        comm.all_reduce(y, op=op)
        got.append(y.tolist())
        z = np.array([me, i], np.float32)
        comm.broadcast(z, root=i % p)
        got.append(z.tolist())
    return got


def test_pooled_direct_buffers_follow_each_calls_fingerprint(pools):
    for world in ("2", "3"):
        p = int(world)
        expected = []
        for i in range(12):
            ranks = range(p)
            fold = (sum, max, min)[i % 3]
            expected.append([float(fold(r + i for r in ranks)), float(fold(-r for r in ranks))])
            expected.append([fold(r + i for r in ranks)])
            expected.append([float(i % p), float(i)])
        for got in pools(world).run(reused_buffers_alternating_ops):
            assert got == expected


def direct_blocks_every_dtype(comm, segments=False, nbytes=700 << 10):
    """Medium all_reduces of ~``nbytes`` on the direct blocks path (``segments``: through
    the shared-memory segments where the pool has them, else with them closed), every
    supported dtype, in and out of place: (dtype, op, in place, algorithm, exact) per call."""
    from mpccs.reduce import supported_dtypes

    p, out = comm.size, []
    with path_policy(comm, "adaptive"), shm_segments(comm, segments):
        for dt in supported_dtypes():
            n = nbytes // dt.itemsize + 1  # odd: blocks of unequal length
            ins = [((np.arange(n) % 3) + (r % 2)).astype(dt) for r in range(p)]  # exact in every dtype
            for op, fold in (("sum", np.add), ("max", np.maximum)):
                expected = ins[0]
                for part in ins[1:]:
                    expected = fold(expected, part).astype(dt)
                for in_place in (False, True):
                    x = ins[comm.rank].copy()
                    got = x if in_place else np.empty_like(x)
                    comm.all_reduce(x, None if in_place else got, op=op)
                    out.append((str(dt), op, in_place, comm.last_stats()["algorithm"],
                                got.tobytes() == expected.tobytes()))
    return out


@pytest.mark.parametrize("world", ["2", "3"])
def test_direct_blocks_are_exact_in_every_dtype(pools, world):
    for rows in pools(world).run(direct_blocks_every_dtype):
        assert rows and all(algorithm == "direct_blocks" and exact for *_, algorithm, exact in rows), rows


@pytest.mark.skipif(not shm.supported(), reason="shared-memory segments need x86-64 and /dev/shm")
@pytest.mark.parametrize("nbytes,algorithm", [(300 << 10, "direct_lane"), (700 << 10, "direct_shm")])
def test_shared_memory_paths_are_exact_in_every_dtype(pools, nbytes, algorithm):
    """2 ranks on one host: the segments are open and carry the medium all_reduce,
    whole through the lane up to 384 KiB (LaneOp), as halves through the
    outboxes above (DirectShmAllReduceOp), bit for bit the same results as the messages."""
    for rows in pools("2").run(direct_blocks_every_dtype, True, nbytes):
        assert rows and all(alg == algorithm and exact for *_, alg, exact in rows), rows


def all_to_allv_case(comm, seed):
    n, rank = comm.size, comm.rank
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 5000, (n, n))  # counts[i][j]: elements rank i sends to rank j
    send = np.concatenate([np.full(counts[rank][j], rank * 100 + j, np.int32) for j in range(n)])
    recv = np.zeros(counts[:, rank].sum(), np.int32)
    comm.all_to_allv(send, counts[rank], recv, counts[:, rank])
    expected = np.concatenate([np.full(counts[i][rank], i * 100 + rank, np.int32) for i in range(n)])
    return bool(np.array_equal(recv, expected))


@pytest.mark.parametrize("world", ["2", "3"])
def test_all_to_allv_uneven_blocks(pools, world):
    assert all(pools(world).run(all_to_allv_case, 5))


def bad_collective_calls(comm):
    kinds = []
    x = np.zeros(8, np.float32)
    z = np.zeros(8 * comm.size + 8, np.float32)
    calls = [
        lambda: comm.all_reduce(np.zeros(8, np.int32), op="avg"),
        lambda: comm.all_reduce(x, np.zeros(9, np.float32)),
        lambda: comm.all_reduce(x, np.zeros(8, np.float64)),
        lambda: comm.all_reduce(x, op="median"),
        lambda: comm.all_reduce(np.zeros((4, 4), np.float32)[:, ::2]),
        lambda: comm.all_gather(x, np.zeros(8, np.float32)),
        lambda: comm.reduce_scatter(x, np.zeros(3, np.float32)),
        lambda: comm.broadcast(x, root=comm.size),
        lambda: comm.all_reduce(x, algorithm="butterfly"),
        lambda: comm.all_reduce(np.zeros(4, np.complex64)),
        # overlapping send and recv that are not an in-place form
        lambda: comm.all_reduce(z[0:8], z[4:12]),
        lambda: comm.all_gather(z[1:9], z[: 8 * comm.size]),
        lambda: comm.all_to_all(x, x),
        lambda: comm.reduce_scatter(z[: 8 * comm.size], z[2:10]),
    ]
    for call in calls:
        try:
            call()
            kinds.append("no error")
        except (ValueError, TypeError) as exc:
            kinds.append(type(exc).__name__ if type(exc) in (ValueError, TypeError) else "ValueError")
    # the communicator is still usable
    y = np.ones(4, np.float32)
    comm.all_reduce(y)
    return kinds, float(y[0])


def test_bad_input_is_rejected_before_anything_is_sent(pools):
    for kinds, value in pools("2").run(bad_collective_calls):
        assert kinds == ["TypeError", "ValueError", "TypeError", "ValueError", "ValueError", "ValueError",
                         "ValueError", "ValueError", "ValueError", "TypeError"] + ["ValueError"] * 4
        assert value == 2.0


def test_bfloat16_is_checked_without_importing_ml_dtypes_first():
    # ml_dtypes' extension is half of ``import mpccs``: it loads only with a bfloat16 array's owner
    code = ("import sys, numpy as np, mpccs\n"
            "from mpccs.arrays import check_array\n"
            "assert 'ml_dtypes' not in sys.modules, 'ml_dtypes imported by mpccs'\n"
            "check_array(np.ones(2, np.float32), 'x')\n"
            "try:\n"
            "    check_array(np.ones(2, np.complex64), 'x')\n"
            "except TypeError as exc:\n"
            "    assert 'complex64' in str(exc) and 'bfloat16' in str(exc), exc\n"
            "else:\n"
            "    raise AssertionError('complex64 accepted')\n"
            "assert 'ml_dtypes' not in sys.modules, 'ml_dtypes imported by a check'\n"
            "import ml_dtypes\n"
            "assert check_array(np.ones((2, 3), ml_dtypes.bfloat16), 'x').shape == (6,)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def in_place_forms(comm):
    n = 3000  # above the direct path: the DAG's prologue and schedule run
    x = np.arange(n, dtype=np.float32) + comm.rank
    comm.all_reduce(x, x)  # the same array twice: in place
    expected = sum(np.arange(n, dtype=np.float32) + r for r in range(comm.size))
    g = np.zeros(n * comm.size, np.float32)
    g[comm.rank * n:(comm.rank + 1) * n] = comm.rank + 1
    comm.all_gather(g[comm.rank * n:(comm.rank + 1) * n], g)  # send is this rank's block of recv
    s = np.arange(n * comm.size, dtype=np.float32) * (comm.rank + 1)
    block = s[comm.rank * n:(comm.rank + 1) * n]
    comm.reduce_scatter(s, block)  # recv is this rank's block of send
    rs_expected = sum(np.arange(n * comm.size, dtype=np.float32) * (r + 1)
                      for r in range(comm.size))[comm.rank * n:(comm.rank + 1) * n]
    return (bool(np.array_equal(x, expected)), bool(np.array_equal(g, np.repeat(np.arange(1, comm.size + 1), n))),
            bool(np.array_equal(block, rs_expected)))


def test_in_place_forms_of_all_reduce_all_gather_and_reduce_scatter(pools):
    assert pools("2").run(in_place_forms) == [(True, True, True)] * 2


def random_shape_all_reduce(comm, shape, name):
    x = make_input(name, int(np.prod(shape)), comm.rank, 3, "sum").reshape(shape)
    inputs = [make_input(name, x.size, r, 3, "sum") for r in range(comm.size)]
    got = comm.all_reduce(x)
    return check(got.reshape(-1), expected_output("all_reduce", inputs, "sum", name, comm.rank, 0, x.size),
                 inputs, "sum", name, comm.size, True)


@given(shape=st.lists(st.integers(0, 40), min_size=1, max_size=3), name=st.sampled_from(DTYPES))
def test_random_shapes_property(pools, shape, name):
    assert pools("2").run(random_shape_all_reduce, tuple(shape), name) == [None, None]


@contextlib.contextmanager
def shm_segments(comm, keep: bool):
    """Run a case with the pool rank's shared-memory segments closed to it unless
    ``keep`` (every rank of the case switches alike), and give them back after."""
    pair, group = comm._engine.shm, comm._group
    if not keep:
        comm._engine.shm = comm._group = None
    try:
        yield
    finally:
        comm._engine.shm, comm._group = pair, group


@contextlib.contextmanager
def path_policy(comm, policy):
    """Run a case under ``policy`` and restore the pool rank's policy after it."""
    before = comm.path_policy
    comm.set_path_policy(policy)
    try:
        yield
    finally:
        comm.set_path_policy(before)


def _order_sensitive(rank: int, n: int) -> np.ndarray:
    """float32 values whose sum depends on the order of additions."""
    return np.resize(np.array([1e8, 1.0, -1e8, 3.5], np.float32), n) * (rank + 1) + np.float32(rank) / 3


def _rank_order_sum(size: int, n: int) -> np.ndarray:
    expected = _order_sensitive(0, n)
    for r in range(1, size):
        expected += _order_sensitive(r, n)
    return expected


def direct_all_reduce_paths(comm):
    """Which path each size takes, and the results: small (inline payload),
    medium (payload as its own message, out of place and in place) and just
    over the medium bound, under 'adaptive' and 'up'; medium under a fixed split."""
    medium_n = (64 << 10) // 4 + 3
    out = {}
    policy = comm.path_policy
    try:
        for name in ("adaptive", "up"):
            comm.set_path_policy(name)
            small = comm.all_reduce(_order_sensitive(comm.rank, 4), np.empty(4, np.float32))
            out[name, "small"] = (small.tobytes(), comm.last_stats()["algorithm"])
            medium = comm.all_reduce(_order_sensitive(comm.rank, medium_n), np.empty(medium_n, np.float32))
            out[name, "medium"] = (medium.tobytes(), comm.last_stats()["algorithm"])
            in_place = _order_sensitive(comm.rank, medium_n)
            comm.all_reduce(in_place)  # rank 2 reduces third: it needs a copy of its input
            out[name, "medium_in_place"] = (in_place.tobytes(), comm.last_stats()["algorithm"])
            blocks_n = (768 << 10) // 4 + 3  # a reduce-scatter and an all-gather of (unequal) blocks
            blocks = comm.all_reduce(_order_sensitive(comm.rank, blocks_n), np.empty(blocks_n, np.float32))
            out[name, "blocks"] = (blocks.tobytes(), comm.last_stats()["algorithm"])
            in_place = _order_sensitive(comm.rank, blocks_n)
            comm.all_reduce(in_place)
            out[name, "blocks_in_place"] = (in_place.tobytes(), comm.last_stats()["algorithm"])
            largest, over = DIRECT_BOUND[comm.size]
            below = comm.all_reduce(np.ones(largest // 4, np.float32))
            out[name, "largest"] = (float(below[0]), comm.last_stats()["algorithm"])
            above = comm.all_reduce(np.ones(over // 4, np.float32))
            out[name, "above"] = (float(above[0]), comm.last_stats()["algorithm"])
        comm.set_path_policy(0.8)
        comm.all_reduce(np.ones(medium_n, np.float32))
        out["fixed", "medium"] = comm.last_stats()["algorithm"]
    finally:
        comm.set_path_policy(policy)
    return out


# (largest float32 all_reduce on the direct path, smallest above it). 2 ranks:
# from 2 MiB the tuner's priors plan both planes and the ring sends 1 MiB per
# stage, which the engine may split (min_multipath_bytes); 3 ranks: two copies
# of 1 MiB per rank fill DIRECT_MEDIUM_BUDGET (2 MiB).
DIRECT_BOUND = {2: ((2 << 20) - 4, 2 << 20), 3: (1 << 20, (1 << 20) + 4)}


@pytest.mark.parametrize("world", ["2", "3"])
def test_all_reduce_direct_paths_reduce_in_rank_order(pools, world):
    results = pools(world).run(direct_all_reduce_paths)
    p = int(world)
    small_expected = _rank_order_sum(p, 4).tobytes()
    medium_expected = _rank_order_sum(p, (64 << 10) // 4 + 3).tobytes()
    # On one host through the segments (where they open: x86-64 with /dev/shm): 2 ranks whole
    # through the lane up to 384 KiB, as halves above; 3 whole through the group lane up to 256 KiB
    small_path, medium_path = _small_path(world, 4 * 4), _small_path(world, (64 << 10) + 3 * 4)
    segments = p == 2 and shm.supported()
    for r in results:
        for policy in ("adaptive", "up"):
            assert r[policy, "small"] == (small_expected, small_path)  # bit-identical everywhere: rank order 0..p-1
            assert r[policy, "medium"] == (medium_expected, medium_path)
            assert r[policy, "medium_in_place"] == (medium_expected, medium_path)
            blocks_expected = _rank_order_sum(p, (768 << 10) // 4 + 3).tobytes()  # from DIRECT_BLOCKS_MIN_BYTES
            halves = "direct_shm" if segments else "direct_blocks"
            blocks_path = halves if p == 2 else _small_path(world, (768 << 10) + 3 * 4)
            assert r[policy, "blocks"] == (blocks_expected, blocks_path)
            assert r[policy, "blocks_in_place"] == (blocks_expected, blocks_path)  # rank 2 copies its block
            assert r[policy, "largest"] == (float(p), halves if p == 2 else _small_path(world, DIRECT_BOUND[p][0]))
            assert r[policy, "above"][0] == float(p) and r[policy, "above"][1] != "direct"
        assert r["fixed", "medium"] != "direct"  # a split policy keeps the DAG (both planes)


def paths_while_the_policy_alternates(comm):
    """A 16 KiB all_reduce under up, out, adaptive, up, out, adaptive: the path each
    call takes (and its result), and whether a policy set again found its answers kept."""
    n = 4096
    expected = np.full(n, sum(range(1, comm.size + 1)), np.float32)
    before = comm.path_policy
    seen, kept = [], []
    try:
        for policy in ("up", "out", "adaptive") * 2:
            comm.set_path_policy(policy)
            kept.append(len(comm._direct_answers) > 0)  # answers found on setting it
            got = comm.all_reduce(np.full(n, comm.rank + 1, np.float32), np.empty(n, np.float32))
            seen.append((policy, comm.last_stats()["algorithm"], bool(np.array_equal(got, expected))))
    finally:
        comm.set_path_policy(before)
    return seen, kept


def test_each_policy_keeps_its_own_call_answers_when_the_policy_alternates(pools):
    # 'out' never takes the direct path above its small bound (it must not ride the
    # control plane), 'up' and 'adaptive' do: answers kept per policy must not leak.
    for seen, kept in pools("2").run(paths_while_the_policy_alternates):
        first, second = seen[:3], seen[3:]
        assert first == second, seen
        assert all(exact for _, _, exact in seen), seen
        paths = {policy: algorithm for policy, algorithm, _ in first}
        assert paths["up"] == paths["adaptive"] and paths["up"].startswith("direct"), paths
        assert not paths["out"].startswith("direct"), paths
        assert kept[3:] == [True] * 3, kept  # set again: its answers were kept


def pipelined_all_reduces(comm, calls):
    """Adaptive 16 MiB all_reduces (float32): per call (algorithm, channels, the share of the
    in-domain stages' bytes on 'out', controller events, the rates those stages were split at)."""
    n = LARGE_BYTES // 4
    x = (np.arange(n, dtype=np.float32) % 7) * (comm.rank + 1)
    want = (np.arange(n, dtype=np.float32) % 7) * sum(r + 1 for r in range(comm.size))
    seen = []
    for _ in range(calls):
        y = np.empty_like(x)
        comm.all_reduce(x, y)
        assert np.array_equal(y, want)
        stats = comm.last_stats()
        intra = [s for s in stats["stages"] if s["label"].startswith("intra")]
        in_domain_out = sum(s["bytes_per_plane"]["out"] for s in intra) / sum(
            sum(s["bytes_per_plane"].values()) for s in intra)
        events = [e.get("event") for e in stats.get("events", ()) if e.get("kind") == "controller"]
        split_at = {str(s["split"].get("split_rates_Bps")) for s in intra if s.get("split")}
        seen.append((stats["algorithm"], stats["channels"], in_domain_out, events, split_at))
    return seen


def plan_rate_agreements(comm, calls):
    """``calls`` adaptive 4 MiB all_reduces (float32), the first three in flight together:
    (every result exact, the plan-rate events, the rates planned by at the end)."""
    n = (4 << 20) // 4
    x = (np.arange(n, dtype=np.float32) % 5) * (comm.rank + 1)
    want = (np.arange(n, dtype=np.float32) % 5) * sum(r + 1 for r in range(comm.size))
    outs = [np.empty_like(x) for _ in range(calls)]
    works = [comm.all_reduce(x, outs[i], async_op=True) for i in range(3)]
    records = []
    for i in range(3, calls):  # the fourth call agrees while the first three may still run
        comm.all_reduce(x, outs[i])
        records.append(comm.last_stats())
    for work in works:
        work.wait()
    records += [work.stats() for work in works]
    events = [e for r in records for e in r.get("events", ()) if e.get("kind") == "plan_rates"]
    return all(np.array_equal(y, want) for y in outs), events, comm.plan_rates, comm.plan_rate_calls


def test_ranks_in_two_domains_agree_on_measured_plan_rates_at_the_same_call():
    # 2 domains of 2 on loopback, no rates stated: at the fourth call of 4 MiB or more every
    # rank contributes its measured rates and all take the lower median; the plan is rebuilt from
    # them only where they are 1.5x or more off the priors, the same way on every rank (a
    # plan that differed would fail the calls' fingerprints). Which way it goes depends on
    # the machine; that every rank goes the same way, with exact results, does not.
    from mpccs.control.plan_rates import agree, replan_rates

    pool = RankPool(4, env={"MPCCS_DOMAIN": lambda r: f"d{r // 2}"})
    try:
        results = pool.run(plan_rate_agreements, 8, timeout=240)
    finally:
        pool.close()
    assert all(exact for exact, _, _, _ in results)
    # every call counted on every rank (mpccs-perf --settle runs the start-up where this advances)
    assert [calls for _, _, _, calls in results] == [8] * 4
    first = [events[0] for _, events, _, _ in results]
    assert all(len(events) in (1, 2) for _, events, _, _ in results), results  # at call 4 (and 8 if incomplete)
    assert len({str(e["agreed_Bps"]) for e in first}) == 1, first
    agreed = first[0]["agreed_Bps"]
    assert (agreed, first[0]["highest_Bps"]) == agree([e["measured_Bps"] for e in first]), first
    measured_everywhere = all(v > 0 for v in agreed.values())
    for e in first:
        assert e["by_rank_Bps"] == {p: [f["measured_Bps"][p] for f in first] for p in ("up", "out")}, first
        assert e["highest_Bps"] == first[0]["highest_Bps"]
        # pipelined stages split at the agreed rates from here on, where every rank measured both planes
        assert e["pipelined_split_Bps"] == (agreed if measured_everywhere else None), first
        assert e["planned_Bps"] == {"up": 5e9, "out": 0.7e9}  # the priors
    replanned = replan_rates(agreed, first[0]["planned_Bps"]) is not None
    assert all(e["replanned"] == replanned for e in first)
    rates = [r for _, _, r, _ in results]
    assert all(r == rates[0] for r in rates), rates
    if replanned or any(len(ev) == 2 and ev[1]["replanned"] for _, ev, _, _ in results):
        assert rates[0]["source"] == "measured" and rates[0]["up"] > 0 and rates[0]["out"] > 0
    else:
        assert rates[0] == {"source": "priors", "up": 5e9, "out": 0.7e9}


def plan_rates_by_policy(comm, policies):
    """One 8 MiB all_reduce (float32) under each of ``policies`` in turn: (every result
    exact, the plan-rate events, the calls counted)."""
    n = (8 << 20) // 4
    x = (np.arange(n, dtype=np.float32) % 5) * (comm.rank + 1)
    want = (np.arange(n, dtype=np.float32) % 5) * sum(r + 1 for r in range(comm.size))
    exact, events = True, []
    for policy in policies:
        comm.set_path_policy(policy)
        y = comm.all_reduce(x, np.empty_like(x))
        exact = exact and np.array_equal(y, want)
        events += [e for e in comm.last_stats().get("events", ()) if e.get("kind") == "plan_rates"]
    return exact, events, comm.plan_rate_calls


def test_only_adaptive_calls_feed_the_plan_rate_meter():
    # Calls under another policy count for the agreement clock (the same calls on every rank)
    # but measure nothing: under 'up' a plane carries a load no split of 'adaptive' gives it
    # and reads 0.5-2.5x its rate (Communicator._measure_plan_rates). The agreement at the
    # fourth call, after four calls under 'up' and 0.5, finds no rank with a sample; the
    # adaptive calls after it are measured, and the next agreement, four calls later (the
    # first found a plane unmeasured), has their samples.
    pool = RankPool(4, env={"MPCCS_DOMAIN": lambda r: f"d{r // 2}"})
    try:
        results = pool.run(plan_rates_by_policy, ["up", "up", 0.5, "up"] + ["adaptive"] * 4, timeout=240)
    finally:
        pool.close()
    assert all(exact for exact, _, _ in results)
    assert [calls for _, _, calls in results] == [8] * 4
    for _, events, _ in results:
        assert len(events) == 2, events  # at calls 4 and 8
        assert events[0]["measured_Bps"] == {"up": 0.0, "out": 0.0}, events[0]
        assert events[0]["pipelined_split_Bps"] is None, events[0]
        assert events[1]["measured_Bps"]["out"] > 0, events[1]  # the cross-domain steps at least


def test_stated_rates_split_a_pipelined_hierarchical_all_reduce_from_the_first_call():
    # 2 domains of 2 with 1:1 stated rates: the tuner plans the 8-channel hierarchical
    # all_reduce multipath (with the default priors, 7:1, it keeps it on one plane) and 'out'
    # starts in use, so the first call already puts in-domain bytes on it. Its in-domain
    # stages are split at the stated rates (PathController.split_pipelined_at), not at what
    # the stages measure here (shared memory against tcp on loopback): about a quarter of their
    # bytes on 'out' in every call. Every result is exact and no controller event (drop, check) comes
    # from these stages, which are not judged.
    pool = RankPool(4, env={"MPCCS_DOMAIN": lambda r: f"d{r // 2}", "MPCCS_PLANE_RATES": "up=1gbit,out=1gbit"})
    stated = str({"up": 125e6, "out": 125e6})
    try:
        for seen in pool.run(pipelined_all_reduces, 8, timeout=180):
            assert all((alg, channels) == ("hierarchical", 8) for alg, channels, _, _, _ in seen), seen
            assert all(0.2 <= in_domain_out <= 0.3 for _, _, in_domain_out, _, _ in seen), seen
            assert all(split_at == {stated} for _, _, _, _, split_at in seen), seen
            assert not any(events for _, _, _, events, _ in seen), seen
    finally:
        pool.close()
