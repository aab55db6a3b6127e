"""Tests of the pure algorithm layer (mpccs.algorithms): no I/O, no processes.

Every (collective, algorithm) is built for worlds 1..9, awkward counts and
1-3 channels, then checked four ways:

* static structure and hazard checks (check_schedule);
* exactly-once coverage: rank r's input is (1 << r) + (element index << 20)
  in int64 with op sum, so a missing or doubled contribution changes the
  low bits and a misplaced element changes the high bits;
* the same under execute_async (random order allowed by the per-rank rule,
  flows landing in chunks);
* for all_reduce, float32 random data gives bit-identical results on every
  rank.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpccs.algorithms import (
    ALGORITHMS,
    COLLECTIVES,
    MAX_FLOW_ID,
    Flow,
    Schedule,
    Stage,
    Topology,
    buffer_counts,
    build_schedule,
    check_hazards,
    check_schedule,
    check_structure,
    default_algorithm,
    describe,
    execute,
    execute_async,
    merge_local_schedules,
    reference,
    to_dot,
)

GLOBAL_CASES = [(c, a) for c, algos in ALGORITHMS.items() if c != "all_to_allv" for a in algos]
HIERARCHICAL_TOPOLOGIES = [
    Topology.blocks(4, 2),  # 2 domains x 2
    Topology.blocks(6, 2),  # 3 domains x 2
    Topology.blocks(6, 3),  # 2 domains x 3
    Topology.blocks(9, 3),
    Topology.blocks(4, 1),  # domains of one rank: just the cross-domain ring
    Topology((0, 1, 0, 1)),  # domains need not be consecutive ranks
    Topology((2, 0, 1, 2, 0, 1)),
]


def counts_for(world: int) -> list[int]:
    return sorted({0, 1, max(world - 1, 0), 7, 2003})


def input_count(collective: str, world: int, count: int) -> int:
    return world * count if collective in ("reduce_scatter", "all_to_all") else count


def mask_inputs(collective: str, world: int, count: int) -> list[np.ndarray]:
    n = input_count(collective, world, count)
    index = np.arange(n, dtype=np.int64) << 20
    return [index + (1 << r) for r in range(world)]


def assert_matches(outputs, expected, exact=True):
    for rank, (got, want) in enumerate(zip(outputs, expected)):
        if want is None:
            continue
        if exact:
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}")
        else:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"rank {rank}")


def verify(schedule: Schedule, root: int = 0, seed: int = 0) -> None:
    """All the checks every schedule must pass."""
    assert check_schedule(schedule) == []
    coll, p, n = schedule.collective, schedule.world, schedule.count
    inputs = mask_inputs(coll, p, n)
    expected = reference(coll, inputs, "sum", root=root)
    assert_matches(execute(schedule, inputs, "sum"), expected)
    assert_matches(execute_async(schedule, inputs, "sum", seed=seed), expected)
    if coll == "all_reduce":
        rng = np.random.default_rng(seed)
        floats = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
        outs = execute(schedule, floats, "sum")
        for out in outs:
            assert np.array_equal(out.view(np.int32), outs[0].view(np.int32)), "ranks differ bitwise"
        assert_matches(outs, reference(coll, floats, "sum"), exact=False)


def verify_channels_disjoint(schedule: Schedule) -> None:
    """Channel c's flows touch elements no other channel touches (per rank, buffer)."""
    owner: dict[tuple[int, str], np.ndarray] = {}
    for stage in schedule.stages:
        for f in stage.flows:
            for rank, buf, off in ((f.src, f.src_buf, f.src_off), (f.dst, f.dst_buf, f.dst_off)):
                if buf == "in":
                    continue
                marks = owner.setdefault((rank, buf), np.full(buffer_counts(schedule, rank)[buf], -1))
                region = marks[off:off + f.count]
                assert np.all((region == -1) | (region == stage.channel)), f"channels share {buf} on rank {rank}"
                region[:] = stage.channel


# -- every collective and algorithm -----------------------------------------------
@pytest.mark.parametrize("world", range(1, 10))
@pytest.mark.parametrize("collective,algorithm", GLOBAL_CASES)
def test_every_algorithm(collective, algorithm, world):
    root = world // 2
    topology = None
    if algorithm == "hierarchical":
        per = 2 if world % 2 == 0 and world >= 4 else 3 if world % 3 == 0 and world >= 6 else world
        topology = Topology.blocks(world, per)
    for count in counts_for(world):
        for channels in (1, 2, 3):
            schedule = build_schedule(collective, world, count, algorithm=algorithm, topology=topology,
                                      channels=channels, root=root)
            assert schedule.collective == collective and schedule.world == world
            verify(schedule, root=root, seed=world * 100 + count + channels)
            if channels > 1:
                verify_channels_disjoint(schedule)
            if world == 1 or count == 0:
                assert not list(schedule.flows())


@pytest.mark.parametrize("topology", HIERARCHICAL_TOPOLOGIES, ids=lambda t: str(t.domain_of))
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_hierarchical_topologies(collective, topology):
    world = topology.world
    domains = topology.domains()
    for count in (1, 5, 2003):
        for channels in (1, 2):
            schedule = build_schedule(collective, world, count, algorithm="hierarchical", topology=topology, channels=channels)
            assert schedule.algorithm == "hierarchical" and "fallback" not in schedule.meta
            verify(schedule)
    # Cross-domain flows only in the "inter" stages.
    schedule = build_schedule(collective, world, 2003, algorithm="hierarchical", topology=topology)
    for stage in schedule.stages:
        crosses = any(not topology.same_domain(f.src, f.dst) for f in stage.flows)
        assert crosses == stage.label.startswith("inter"), stage.label
    m, d = len(domains[0]), len(domains)
    expected = {"all_reduce": 2 * (m - 1) + 2 * (d - 1), "reduce_scatter": (m - 1) + (d - 1), "all_gather": (m - 1) + (d - 1)}
    assert len(schedule.stages) == expected[collective]


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_hierarchical_channels_take_turns_on_each_step(collective):
    # Step t of channel k waits for step t of channel k - 1 (a pipeline: channel 0
    # reaches its cross-domain phase first), and for nothing of a later channel.
    topology = Topology((0, 0, 1, 1))
    schedule = build_schedule(collective, 4, 4096, algorithm="hierarchical", topology=topology, channels=4)
    by_channel = {}
    for stage in schedule.stages:
        by_channel.setdefault(stage.channel, []).append(stage)
    assert sorted(by_channel) == [0, 1, 2, 3]
    steps = len(by_channel[0])
    assert all(len(stages) == steps for stages in by_channel.values())
    for k in range(1, 4):
        for t in range(steps):
            stage, before = by_channel[k][t], by_channel[k - 1][t]
            assert before.id in stage.deps, (k, t)
            assert all(schedule.stages[d].channel <= k for d in stage.deps)
    assert all(not any(schedule.stages[d].channel != 0 for d in st.deps) for st in by_channel[0])


@pytest.mark.parametrize("topology", [Topology.flat(4), Topology((0, 0, 0, 1)), Topology.blocks(5, 2)],
                         ids=["one-domain", "unequal", "unequal-blocks"])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_hierarchical_falls_back_to_ring(collective, topology):
    schedule = build_schedule(collective, topology.world, 9, algorithm="hierarchical", topology=topology)
    assert schedule.algorithm == "ring"
    assert "ring" in schedule.meta["fallback"]
    verify(schedule)


@pytest.mark.parametrize("collective,algorithm", [(c, a) for c, a in GLOBAL_CASES if c in ("all_reduce", "reduce")])
@pytest.mark.parametrize("op", ["prod", "min", "max"])
def test_other_ops(collective, algorithm, op):
    world, count = 6, 11
    rng = np.random.default_rng(7)
    if op == "prod":  # small integers so the product is exact
        inputs = [rng.integers(1, 4, count).astype(np.int64) for _ in range(world)]
    else:
        inputs = [rng.standard_normal(count) for _ in range(world)]
    topology = Topology.blocks(world, 3)
    schedule = build_schedule(collective, world, count, algorithm=algorithm, topology=topology, channels=2, root=1)
    assert_matches(execute(schedule, inputs, op), reference(collective, inputs, op, root=1))


@pytest.mark.parametrize("collective,algorithm", [(c, a) for c, a in GLOBAL_CASES
                                                  if c in ("all_reduce", "reduce_scatter", "all_gather", "reduce")])
def test_in_place(collective, algorithm):
    world, count = 6, 13
    schedule = build_schedule(collective, world, count, algorithm=algorithm, topology=Topology.blocks(world, 2),
                              channels=2, root=2)
    inputs = mask_inputs(collective, world, count)
    expected = reference(collective, inputs, "sum", root=2)
    assert_matches(execute(schedule, inputs, "sum", in_place=True), expected)
    assert_matches(execute_async(schedule, inputs, "sum", in_place=True, seed=3), expected)


def test_in_place_all_to_all_is_refused():
    schedule = build_schedule("all_to_all", 3, 2, algorithm="pairwise")
    with pytest.raises(ValueError, match="in-place"):
        execute(schedule, mask_inputs("all_to_all", 3, 2), in_place=True)


# -- all_to_allv ---------------------------------------------------------------------
def local_schedules(matrix, channels=1):
    world = len(matrix)
    return [
        build_schedule("all_to_allv", world, 0, algorithm="pairwise", channels=channels, rank=r,
                       send_counts=matrix[r], recv_counts=[matrix[j][r] for j in range(world)])
        for r in range(world)
    ]


def run_alltoallv(matrix, channels=1, seed=0):
    world = len(matrix)
    schedules = local_schedules(matrix, channels)
    for s in schedules:
        assert check_schedule(s) == [], describe(s)
        assert s.local_rank is not None
    merged = merge_local_schedules(schedules)
    assert check_schedule(merged) == []
    inputs = [np.arange(sum(matrix[r]), dtype=np.int64) + (r << 20) for r in range(world)]
    expected = reference("all_to_allv", inputs, send_counts=matrix)
    assert_matches(execute(schedules, inputs), expected)
    assert_matches(execute_async(schedules, inputs, seed=seed), expected)
    return schedules


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("channels", [1, 3])
def test_all_to_allv(world, channels):
    rng = np.random.default_rng(world * 10 + channels)
    matrix = rng.integers(0, 6, size=(world, world)).tolist()
    matrix[0] = [0] * world  # a rank that sends nothing, not even to itself
    schedules = run_alltoallv(matrix, channels, seed=world)
    # Stage ids and flow ids do not depend on the counts of the rank building them.
    for s in schedules:
        assert len(s.stages) == (world - 1) * channels
        for stage in s.stages:
            for f in stage.flows:
                assert f.id == (stage.channel * world + f.src) * world + f.dst


def test_all_to_allv_sides_agree_on_ids():
    matrix = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    views = local_schedules(matrix)
    where = {}
    for view in views:
        for stage in view.stages:
            for f in stage.flows:
                key = (f.src, f.dst)
                assert where.setdefault(key, (stage.id, f.id, f.count)) == (stage.id, f.id, f.count)
    assert len(where) == 6  # every ordered pair of distinct ranks, seen from both sides


def test_all_to_allv_mismatched_counts_are_caught():
    good = local_schedules([[1, 2], [3, 4]])
    bad = build_schedule("all_to_allv", 2, 0, algorithm="pairwise", rank=1, send_counts=[5, 4], recv_counts=[2, 4])
    with pytest.raises(ValueError, match="disagree"):
        merge_local_schedules([good[0], bad])


@settings(derandomize=True, max_examples=25, deadline=None)
@given(st.data())
def test_all_to_allv_random(data):
    world = data.draw(st.integers(1, 7))
    matrix = [[data.draw(st.integers(0, 9)) for _ in range(world)] for _ in range(world)]
    run_alltoallv(matrix, channels=data.draw(st.integers(1, 3)))


# -- random shapes ---------------------------------------------------------------------
@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.data())
def test_random_shapes(data):
    collective, algorithm = data.draw(st.sampled_from(GLOBAL_CASES))
    world = data.draw(st.integers(1, 12))
    count = data.draw(st.integers(0, 300))
    channels = data.draw(st.integers(1, 4))
    root = data.draw(st.integers(0, world - 1))
    segments = data.draw(st.none() | st.integers(1, 12))
    topology = None
    if algorithm == "hierarchical":
        per = data.draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
        order = data.draw(st.permutations(range(world)))
        domain_of = [0] * world
        for position, rank in enumerate(order):
            domain_of[rank] = position // per
        topology = Topology(tuple(domain_of))
    schedule = build_schedule(collective, world, count, algorithm=algorithm, topology=topology,
                              channels=channels, root=root, segments=segments)
    verify(schedule, root=root, seed=count)


# -- algorithm shapes ----------------------------------------------------------------
def stage_count(collective, algorithm, world, count=1000, **kw):
    return len(build_schedule(collective, world, count, algorithm=algorithm, **kw).stages)


def test_stage_counts():
    for p in (2, 3, 5, 8):
        assert stage_count("all_reduce", "ring", p) == 2 * (p - 1)
        assert stage_count("all_reduce", "ring", p, channels=3) == 3 * 2 * (p - 1)
        assert stage_count("reduce_scatter", "ring", p) == p - 1
        assert stage_count("all_gather", "ring", p) == p - 1
        assert stage_count("all_to_all", "pairwise", p) == p - 1
        lg = p.bit_length() - 1
        extra = 0 if p == 1 << lg else 2  # fold and unfold
        assert stage_count("all_reduce", "rhd", p) == 2 * lg + extra
        assert stage_count("all_reduce", "rd", p) == lg + extra
        assert stage_count("reduce_scatter", "rhd", p) == lg + extra
        assert stage_count("all_gather", "rd", p) == lg + extra
        ceil_lg = (p - 1).bit_length()
        assert stage_count("all_reduce", "tree", p) == 2 * ceil_lg
        assert stage_count("broadcast", "tree", p) == ceil_lg
        assert stage_count("reduce", "tree", p) == ceil_lg
        assert stage_count("broadcast", "pipeline", p, segments=4) == 4 * (p - 1)


def ancestors(schedule: Schedule) -> list[set[int]]:
    result: list[set[int]] = []
    for stage in schedule.stages:
        result.append(set(stage.deps).union(*(result[d] for d in stage.deps)))
    return result


@pytest.mark.parametrize("collective", ["broadcast", "reduce"])
def test_pipeline_overlaps_segments(collective):
    """Segment s on one link runs alongside segment s+1 on the link before it."""
    schedule = build_schedule(collective, 5, 40, algorithm="pipeline", segments=4, root=2)
    by_label = {st.label: st.id for st in schedule.stages}
    anc = ancestors(schedule)
    if collective == "broadcast":  # data flows from link k-1 to link k
        a, b = by_label["seg 0 link 1"], by_label["seg 1 link 0"]
    else:  # reduce flows from the far end: link k+1 feeds link k
        a, b = by_label["seg 0 link 1"], by_label["seg 1 link 2"]
    assert a not in anc[b] and b not in anc[a]
    # ... while each link still sends its segments in order.
    assert by_label["seg 0 link 1"] in anc[by_label["seg 1 link 1"]]


def test_all_to_all_steps_are_pairwise():
    world = 5
    schedule = build_schedule("all_to_all", world, 3, algorithm="pairwise")
    for k, stage in enumerate(schedule.stages, start=1):
        assert sorted((f.src, f.dst) for f in stage.flows) == [(r, (r + k) % world) for r in range(world)]


# -- the checkers catch broken schedules --------------------------------------------------
def test_hazard_checker_flags_missing_deps():
    schedule = build_schedule("all_reduce", 4, 8, algorithm="ring")
    stripped = replace(schedule, stages=tuple(replace(st, deps=()) for st in schedule.stages))
    assert check_structure(stripped) == []
    assert any("unordered" in p for p in check_hazards(stripped))


def test_hazard_checker_flags_conflicts_inside_a_stage():
    # Recursive doubling done naively: send and receive-reduce the same range.
    flows = (Flow(0, 0, 1, "out", 0, "out", 0, 4, True), Flow(1, 1, 0, "out", 0, "out", 0, 4, True))
    schedule = Schedule("all_reduce", "naive", 2, 4, (Stage(0, flows),))
    assert any("intra-stage" in p for p in check_hazards(schedule))


def test_hazard_checker_ignores_chains_through_uninvolved_ranks():
    """Rank 0 may treat stage 1 (no flow on it) as finished at once."""
    stages = (
        Stage(0, (Flow(0, 0, 1, "out", 0, "out", 0, 1),)),
        Stage(1, (Flow(1, 1, 2, "out", 0, "out", 0, 1),), deps=(0,)),
        Stage(2, (Flow(2, 2, 0, "out", 0, "out", 0, 1),), deps=(1,)),
    )
    schedule = Schedule("broadcast", "chain", 3, 1, stages, root=0)
    assert any("unordered" in p for p in check_hazards(schedule))
    fixed = replace(schedule, stages=stages[:2] + (replace(stages[2], deps=(0, 1)),))
    assert check_hazards(fixed) == []


def test_structure_checker_flags_bad_fields():
    stages = (
        Stage(0, (Flow(5, 0, 1, "out", 0, "out", 0, 0),), channel=1),  # zero count
        Stage(1, (Flow(5, 1, 0, "out", 0, "in", 0, 1),), deps=(1,)),  # duplicate id, self dep, writes in
        Stage(2, (Flow(MAX_FLOW_ID, 0, 1, "out", 3, "out", 0, 2),), channel=1, deps=(1,)),  # id too big, out of bounds
        Stage(3, (Flow(6, 0, 1, "out", 0, "out", 0, 1),), deps=(0,)),  # waits for a later channel
    )
    problems = check_structure(Schedule("all_reduce", "bad", 2, 4, stages, channels=2))
    text = "\n".join(problems)
    for needle in ("count 0", "duplicate", "deps", "buffers", "2**20", "outside", "depends on stage 0 of ch1"):
        assert needle in text, needle
    # Waiting for an earlier channel is how a pipeline's channels take turns (interleave(in_order=True)).
    assert not any("stage 2 (ch1) depends" in p for p in problems)


def test_async_executor_catches_missing_deps():
    schedule = build_schedule("all_reduce", 4, 8, algorithm="ring")
    stripped = replace(schedule, stages=tuple(replace(st, deps=()) for st in schedule.stages))
    inputs = mask_inputs("all_reduce", 4, 8)
    expected = reference("all_reduce", inputs)
    wrong = 0
    for seed in range(5):
        outs = execute_async(stripped, inputs, seed=seed)
        wrong += not all(np.array_equal(o, e) for o, e in zip(outs, expected))
    assert wrong > 0


# -- registry, arguments, default choice -------------------------------------------------
def test_algorithms_table():
    assert set(ALGORITHMS) == set(COLLECTIVES)
    assert ALGORITHMS["all_reduce"] == ("ring", "rhd", "rd", "tree", "hierarchical")


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="ring, rhd, rd, tree, hierarchical"):
        build_schedule("all_reduce", 4, 8, algorithm="bruck")
    with pytest.raises(ValueError, match="unknown collective"):
        build_schedule("allreduce", 4, 8, algorithm="ring")


@pytest.mark.parametrize("kwargs", [
    dict(world=0, count=1),
    dict(world=2, count=-1),
    dict(world=2, count=1, channels=0),
    dict(world=2, count=1.5),
    dict(world=3, count=1, topology=Topology.flat(4)),
])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        build_schedule("all_reduce", algorithm="ring", **kwargs)


def test_bad_root_and_v_arguments():
    with pytest.raises(ValueError, match="root"):
        build_schedule("broadcast", 3, 4, algorithm="tree", root=3)
    with pytest.raises(ValueError, match="needs"):
        build_schedule("all_to_allv", 2, 0, algorithm="pairwise")
    with pytest.raises(ValueError, match="itself"):
        build_schedule("all_to_allv", 2, 0, algorithm="pairwise", rank=0, send_counts=[1, 2], recv_counts=[2, 2])
    with pytest.raises(ValueError, match="2 entries"):
        build_schedule("all_to_allv", 2, 0, algorithm="pairwise", rank=0, send_counts=[1], recv_counts=[1, 2])
    with pytest.raises(ValueError, match="flow ids"):
        build_schedule("all_to_all", 1100, 1, algorithm="pairwise")


def test_avg_is_not_the_interpreters_job():
    schedule = build_schedule("all_reduce", 2, 2, algorithm="ring")
    with pytest.raises(ValueError, match="avg"):
        execute(schedule, mask_inputs("all_reduce", 2, 2), "avg")


def test_default_algorithm_rule():
    two_domains = Topology.blocks(8, 4)
    for collective in COLLECTIVES:
        for world in (1, 2, 3, 8, 12):
            for nbytes in (0, 100, 64 * 1024, 10 ** 6, 10 ** 9):
                topo = Topology.blocks(world, 4) if world % 4 == 0 else None
                assert default_algorithm(collective, world, nbytes, topo) in ALGORITHMS[collective]
    assert default_algorithm("all_reduce", 8, 1024) == "rd"
    assert default_algorithm("all_reduce", 8, 256 * 1024) == "rhd"
    assert default_algorithm("all_reduce", 6, 256 * 1024) == "ring"
    assert default_algorithm("all_reduce", 8, 64 << 20) == "ring"
    assert default_algorithm("all_reduce", 8, 64 << 20, two_domains) == "hierarchical"
    assert default_algorithm("broadcast", 8, 1024) == "tree"
    assert default_algorithm("reduce", 8, 64 << 20) == "pipeline"
    assert default_algorithm("all_to_allv", 8, 1) == "pairwise"


# -- rendering -------------------------------------------------------------------------------
def test_describe_and_dot():
    schedule = build_schedule("all_reduce", 3, 7, algorithm="ring", channels=2)
    text = describe(schedule)
    lines = text.splitlines()
    assert lines[0].startswith("all_reduce ring world=3 count=7 channels=2")
    stage_lines = [line for line in lines if line.startswith("stage ")]
    assert len(stage_lines) == len(schedule.stages)
    assert "reduce" in stage_lines[0] and "deps=[]" in stage_lines[0]
    assert "copy" in stage_lines[-1]
    dot = to_dot(schedule)
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    assert "cluster_ch1" in dot
    assert dot.count("->") >= sum(len(st.deps) for st in schedule.stages)
    local = build_schedule("all_to_allv", 2, 0, algorithm="pairwise", rank=0, send_counts=[1, 2], recv_counts=[1, 3])
    assert "out[?]" in describe(local) and "in[?:+3]" in describe(local)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int32", "uint8", "float64"])
def test_interpreter_dtypes(dtype):
    """One schedule serves every dtype: counts are elements, never bytes."""
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = ml_dtypes.bfloat16
    dtype = np.dtype(dtype)
    schedule = build_schedule("all_reduce", 4, 10, algorithm="ring", channels=2)
    inputs = [(np.arange(10) % 5 + r).astype(dtype) for r in range(4)]
    outs = execute(schedule, inputs, "sum", dtype=dtype)
    assert outs[0].dtype == dtype
    assert_matches(outs, reference("all_reduce", inputs, "sum"))
