"""Whether an in-place reduction can be retried without a copy of its input.

A protected operation hit by a plane failure runs again on the planes left
(docs/reliability.md). An in-place reduction has overwritten part of its
input by then, so the general way back is a copy of the input taken before
the first attempt. On shared memory that copy costs as much as moving the
bytes. This module decides, per schedule, whether a rule without any copy
gives the same result, bit for bit:

    *resume*: the retry runs the whole schedule again over the buffers as the
    failed attempt left them; a receiver applies each chunk of a reducing flow
    only to the element ranges that flow has not reduced in yet (on this
    rank, in any attempt); plain flows write as usual.

Every reduction is then applied exactly once, in schedule order. What can go
wrong is a send: flow f (rank r -> d, stage s) sends r's *current* range X,
and in the retry X holds, besides every write the schedule orders before s
(from either attempt), the failed attempt's writes that the schedule orders
after s. Such a later write g (q -> r, stage t) is harmless only if f is a
reducing flow that d had wholly reduced in before q could send g, so that d
ignores what f sends again:

    finish(d, s)  happens before  start(q, t)

in the engine's order of events, which is what a rank can know without any
message beyond the schedule's own (collective_op.CollectiveOp):

* start(x, a) follows finish(x, b) for every b in a.deps (a stage without
  flows on x finishes on x as soon as it starts);
* finish(x, a) follows start(x, a) and start(y, a) for every flow y -> x of
  a (its chunks are in and reduced). A send's completion proves nothing
  about delivery (tcp completes a send once the kernel has the bytes).

Ring, rhd and tree all_reduce satisfy it: a block is overwritten on a rank
only by its final value, sent after every reduction into it was done. The
recursive-doubling all_reduce sends partials it keeps overwriting and uses
work copies, so it keeps the input copy. Schedules with work buffers or
local copies other than the in-place identity (``out = in``) are refused:
a retry would re-run those copies from an input that is gone.

The proof (:func:`proven_resumable`) costs O(events^2) bits (events = ranks x
stages): 0.3 s for a 72-rank ring, 6 s with 4 channels, and schedules are
built per message size. So the engine asks :func:`resumable_in_place`, which
trusts the algorithms listed in ``RESUMABLE``; tests/test_resume.py proves
them for 2-12 ranks, 1-3 channels and uneven counts, and checks the proof
itself against a model of the engine.
"""
from __future__ import annotations

from .schedule import Flow, Schedule

# (collective, algorithm) whose in-place schedules pass proven_resumable
# wherever they are built (tests/test_resume.py keeps this list honest).
RESUMABLE = frozenset({("all_reduce", "ring"), ("all_reduce", "rhd"), ("all_reduce", "tree")})


def resumable_in_place(schedule: Schedule) -> bool:
    """True when an in-place call of ``schedule`` may be retried by *resume*.
    Asked on every protected in-place call; the prologue scan (~45 us at 72
    ranks) is cached in schedule.meta like the engine's other per-schedule facts."""
    known = schedule.meta.get("resumable_in_place")
    if known is None:
        known = (schedule.collective, schedule.algorithm) in RESUMABLE and _copies_allow_resume(schedule)
        schedule.meta["resumable_in_place"] = known
    return known


def proven_resumable(schedule: Schedule) -> bool:
    """The proof: local copies allow resume and no flow's source is overwritten unsafely."""
    return _copies_allow_resume(schedule) and not _unsafe_pairs(schedule, stop_at_first=True)


def unsafe_pairs(schedule: Schedule) -> list[tuple[Flow, Flow]]:
    """(f, g) pairs that break the rule: g overwrites what f reads, with no guarantee
    that f's receiver had reduced it in first (for explanations and tests)."""
    return _unsafe_pairs(schedule, stop_at_first=False)


def _copies_allow_resume(schedule: Schedule) -> bool:
    if schedule.work_count or schedule.epilogue or schedule.local_rank is not None:
        return False
    return all(c.src_buf == "in" and c.dst_buf == "out" and c.src_off == c.dst_off for c in schedule.prologue)


def _buffer(name: str) -> str:
    """In place, 'in' and 'out' are one buffer."""
    return "out" if name == "in" else name


def _unsafe_pairs(schedule: Schedule, stop_at_first: bool) -> list[tuple[Flow, Flow]]:
    index = {s.id: i for i, s in enumerate(schedule.stages)}
    stage_of = {f.id: s.id for s in schedule.stages for f in s.flows}
    ancestors = _stage_ancestors(schedule, index)
    order = _EventOrder(schedule, index)
    bad = []
    for rank in range(schedule.world):
        reads = [f for s in schedule.stages for f in s.flows if f.src == rank]
        writes = [g for s in schedule.stages for g in s.flows if g.dst == rank]
        for f in reads:
            s = stage_of[f.id]
            for g in writes:
                t = stage_of[g.id]
                if t == s or (ancestors[index[s]] >> index[t]) & 1 or not _overlap(f, g):
                    continue  # g is done before f reads (or touches other elements)
                if f.reduce and order.finish_before_start(f.dst, s, g.src, t):
                    continue
                bad.append((f, g))
                if stop_at_first:
                    return bad
    return bad


def _overlap(f: Flow, g: Flow) -> bool:
    """Does g's destination range overlap f's source range (both on one rank)?"""
    return (_buffer(f.src_buf) == _buffer(g.dst_buf)
            and f.src_off < g.dst_off + g.count and g.dst_off < f.src_off + f.count)


def _stage_ancestors(schedule: Schedule, index: dict) -> list[int]:
    """Per stage (by position), a bitset of the stages it depends on, transitively."""
    anc = [0] * len(schedule.stages)
    for i, s in enumerate(schedule.stages):
        bits = 0
        for d in s.deps:
            j = index[d]
            bits |= anc[j] | (1 << j)
        anc[i] = bits
    return anc


class _EventOrder:
    """Which stage finishes are known to precede which stage starts, per rank.

    Events are numbered rank * S + stage position; ``before_start[x][i]`` is the
    bitset of finish events that happen before start(x, stage i).
    """

    def __init__(self, schedule: Schedule, index: dict):
        stages, world = schedule.stages, schedule.world
        n = len(stages)
        self.n, self.index = n, index
        senders_to = [[set() for _ in range(world)] for _ in range(n)]
        for i, s in enumerate(stages):
            for f in s.flows:
                senders_to[i][f.dst].add(f.src)
        self.before_start = [[0] * n for _ in range(world)]
        before_finish = [[0] * n for _ in range(world)]
        for i, s in enumerate(stages):  # stages are listed after their deps
            for x in range(world):
                bits = 0
                for d in s.deps:
                    j = index[d]
                    bits |= before_finish[x][j] | (1 << (x * n + j))
                self.before_start[x][i] = bits
            for x in range(world):
                bits = self.before_start[x][i]
                for y in senders_to[i][x]:
                    bits |= self.before_start[y][i]
                before_finish[x][i] = bits

    def finish_before_start(self, d: int, s: int, q: int, t: int) -> bool:
        return bool((self.before_start[q][self.index[t]] >> (d * self.n + self.index[s])) & 1)
