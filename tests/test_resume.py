"""The resume rule for in-place retries (mpccs.algorithms.resume), checked
against an independent model of the engine's execution.

The model runs a schedule the way CollectiveOp does (stages start when their
deps finished on that rank, sends read the source range when posted, a chunk
lands only once its receiver started the stage, a stage finishes once its sends
completed and its chunks are in), with a random interleaving, stops it at a
random point as a plane failure does (chunks in flight are lost; on the live
plane a plain chunk may still land, a reducing one is dropped unreduced),
then retries the whole schedule over the buffers as left, reducing each range
of a flow at most once. Every element counts which ranks' inputs it holds, so
a lost, doubled or stale contribution shows. Where ``resumable_in_place``
accepts a schedule, every trial must match the failure-free run; for a
schedule it refuses, the model must find a trial that does not.
"""
import random

import numpy as np
import pytest

from mpccs.algorithms import build_schedule
from mpccs.algorithms.resume import RESUMABLE, proven_resumable, resumable_in_place, unsafe_pairs
from mpccs.algorithms.schedule import Flow, Schedule, Stage


def _buf(name):
    return "out" if name == "in" else name  # in place


class Model:
    """One attempt of a schedule over shared per-rank buffers."""

    def __init__(self, schedule, buffers, rng, reduced, chunks):
        self.s, self.buffers, self.rng, self.reduced = schedule, buffers, rng, reduced
        self.chunks = chunks  # pieces per flow in this attempt
        world = schedule.world
        self.deps_left = [{st.id: len(st.deps) for st in schedule.stages} for _ in range(world)]
        self.dependents = {}
        for st in schedule.stages:
            for d in st.deps:
                self.dependents.setdefault(d, []).append(st.id)
        self.stage = {st.id: st for st in schedule.stages}
        self.started = [set() for _ in range(world)]
        self.finished = [set() for _ in range(world)]
        self.pending_sends = {}  # (rank, stage) -> sends not completed
        self.pending_recvs = {}  # (rank, stage) -> chunks not landed
        self.in_flight = []  # (flow, stage id, lo, hi, payload)
        self.unacked = []  # (rank, stage id)
        for x in range(world):
            for st in schedule.stages:
                if not st.deps:
                    self._start(x, st.id)

    def _start(self, x, sid):
        self.started[x].add(sid)
        flows = self.stage[sid].flows
        outs = [f for f in flows if f.src == x]
        ins = [f for f in flows if f.dst == x]
        for f in outs:
            for lo, hi in self._pieces(f.count):
                src = self.buffers[x][_buf(f.src_buf)]
                self.in_flight.append((f, sid, lo, hi, src[f.src_off + lo : f.src_off + hi].copy()))
                self.unacked.append((x, sid))
        self.pending_sends[(x, sid)] = sum(len(self._pieces(f.count)) for f in outs)
        self.pending_recvs[(x, sid)] = sum(len(self._pieces(f.count)) for f in ins)
        self._maybe_finish(x, sid)

    def _pieces(self, count):
        k = max(1, min(self.chunks, count))
        edges = [count * i // k for i in range(k + 1)]
        return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]

    def _maybe_finish(self, x, sid):
        if sid in self.finished[x] or self.pending_sends[(x, sid)] or self.pending_recvs[(x, sid)]:
            return
        self.finished[x].add(sid)
        for nxt in self.dependents.get(sid, ()):
            self.deps_left[x][nxt] -= 1
            if self.deps_left[x][nxt] == 0:
                self._start(x, nxt)

    def land(self, item):
        f, sid, lo, hi, payload = item
        dst = self.buffers[f.dst][_buf(f.dst_buf)]
        if f.reduce:
            done = self.reduced.setdefault(f.id, np.zeros(f.count, bool))
            fresh = ~done[lo:hi]
            dst[f.dst_off + lo : f.dst_off + hi][fresh] += payload[fresh]
            done[lo:hi] = True
        else:
            dst[f.dst_off + lo : f.dst_off + hi] = payload
        self.pending_recvs[(f.dst, sid)] -= 1
        self._maybe_finish(f.dst, sid)

    def step(self) -> bool:
        """One random event: a chunk lands or a send completes. False when nothing is left."""
        ready = [i for i, item in enumerate(self.in_flight) if item[1] in self.started[item[0].dst]]
        if not ready and not self.unacked:
            return False
        if self.unacked and (not ready or self.rng.random() < 0.4):
            x, sid = self.unacked.pop(self.rng.randrange(len(self.unacked)))
            self.pending_sends[(x, sid)] -= 1
            self._maybe_finish(x, sid)
        else:
            self.land(self.in_flight.pop(self.rng.choice(ready)))
        return True

    def fail(self) -> None:
        """The plane dies: each chunk in flight is lost, or lands on the live plane
        during the quiesce (a plain one writes its range, a reducing one is dropped)."""
        for f, sid, lo, hi, payload in self.in_flight:
            if sid in self.started[f.dst] and not f.reduce and self.rng.random() < 0.5:
                self.buffers[f.dst][_buf(f.dst_buf)][f.dst_off + lo : f.dst_off + hi] = payload


def initial_buffers(schedule, size):
    return [{"out": np.eye(schedule.world, dtype=np.int64)[[r] * size]} for r in range(schedule.world)]


def run(schedule, size, seed, fail_after=None):
    rng = random.Random(seed)
    buffers = initial_buffers(schedule, size)
    reduced = {}
    first = Model(schedule, buffers, rng, reduced, chunks=rng.randint(1, 3))
    steps = 0
    while first.step():
        steps += 1
        if fail_after is not None and steps == fail_after:
            first.fail()
            retry = Model(schedule, buffers, rng, reduced, chunks=rng.randint(1, 3))
            while retry.step():
                pass
            break
    return [b["out"] for b in buffers], steps


def trials(schedule, size, seeds):
    """(seed, failure step, ranks whose buffer differs from the failure-free run) for each trial."""
    reference, total = run(schedule, size, seed=0)
    out = []
    for seed in seeds:
        fail_after = random.Random(seed).randint(1, max(1, total - 1))
        got, _ = run(schedule, size, seed, fail_after)
        out.append((seed, fail_after, [r for r in range(schedule.world) if not np.array_equal(got[r], reference[r])]))
    return out


CASES = [(alg, world, channels) for alg in ("ring", "rhd", "tree") for world in (2, 3, 4, 5, 8)
         for channels in (1, 2)]


@pytest.mark.parametrize("algorithm,world,channels", CASES)
def test_accepted_all_reduce_schedules_retry_exactly(algorithm, world, channels):
    size = 13 * world  # uneven blocks on purpose
    schedule = build_schedule("all_reduce", world, size, algorithm=algorithm, channels=channels)
    assert resumable_in_place(schedule) and proven_resumable(schedule)
    reference, _ = run(schedule, size, seed=0)
    assert all(np.array_equal(buf, np.ones((size, world), np.int64)) for buf in reference)  # the model itself
    wrong = [t for t in trials(schedule, size, range(60)) if t[2]]
    assert not wrong, f"resume gave other results than a clean run (seed, failure step, ranks): {wrong[:5]}"


@pytest.mark.parametrize("collective,algorithm", sorted(RESUMABLE))
def test_every_listed_algorithm_is_proven_wherever_it_is_built(collective, algorithm):
    # The engine trusts RESUMABLE instead of running the proof per message size.
    for world in range(2, 13):
        for channels in (1, 2, 3):
            for count in (1, world - 1, 7 * world + 3):  # empty blocks, uneven blocks
                schedule = build_schedule(collective, world, count, algorithm=algorithm, channels=channels)
                assert proven_resumable(schedule), (world, channels, count, unsafe_pairs(schedule)[:2])


def overwriting_schedule():
    """Rank 0 reduces its range into rank 1; later rank 2 overwrites rank 0's range.
    Nothing orders rank 1's reduction before rank 2's send."""
    n = 8
    return Schedule("all_reduce", "handmade", 3, n, stages=(
        Stage(0, (Flow(0, 0, 1, "out", 0, "out", 0, n, reduce=True),)),
        Stage(1, (Flow(1, 2, 0, "out", 0, "out", 0, n),), deps=(0,)),
    ))


def test_a_refused_schedule_does_go_wrong_under_resume():
    schedule = overwriting_schedule()
    assert not proven_resumable(schedule) and not resumable_in_place(schedule)
    assert [(f.id, g.id) for f, g in unsafe_pairs(schedule)] == [(0, 1)]
    assert any(t[2] for t in trials(schedule, 8, range(60))), "the model never exercised the unsafe order"


def test_resume_refuses_work_buffers_and_copies():
    rd = build_schedule("all_reduce", 4, 64, algorithm="rd")
    assert rd.work_count and not resumable_in_place(rd) and not proven_resumable(rd)
    tree_reduce = build_schedule("reduce", 4, 64, algorithm="tree", root=1)
    assert not resumable_in_place(tree_reduce) and not proven_resumable(tree_reduce)


@pytest.mark.parametrize("done,lo,hi,expected", [
    ([], 0, 10, [(0, 10)]),
    ([(0, 10)], 0, 10, []),
    ([(2, 4), (6, 8)], 0, 10, [(0, 2), (4, 6), (8, 10)]),
    ([(6, 8), (2, 4)], 3, 7, [(4, 6)]),  # unsorted, straddling
    ([(0, 5), (3, 9)], 0, 10, [(9, 10)]),  # overlapping records
    ([(20, 30)], 0, 10, [(0, 10)]),
])
def test_missing_ranges(done, lo, hi, expected):
    from mpccs.windows import missing_ranges

    assert missing_ranges(done, lo, hi) == expected
