"""Reference executor, plain-numpy reference results, and static checkers.

This module is the oracle the engine and the simulator are compared with,
so it is written to be obviously right rather than fast:

* :func:`execute` runs every rank's part of a schedule with numpy: prologue,
  stages in id order (every flow of a stage reads its source as it was when
  the stage started, so a hazard inside a stage changes the result), then
  epilogue. It returns every rank's ``out``.
* :func:`execute_async` runs the same schedule in a random order that the
  per-rank dependency rule allows, flows cut into chunks that land at
  different times, and a stage with no flow on a rank counts as finished
  there at once (the most adversarial reading of the rule).
* :func:`reference` computes the expected result with ``np.*.reduce``.
* :func:`check_structure` and :func:`check_hazards` are static checks; they
  return a list of problems (empty when the schedule is sound).

Buffers that a schedule should write before reading (``out`` of copies,
``work``) start filled with a poison value (NaN, or a large negative
integer), so reading an unwritten element shows up in the result.
"""
from __future__ import annotations

import random
from collections import defaultdict
from itertools import accumulate
from typing import Optional, Sequence, Union

import numpy as np

from ._builder import MAX_FLOW_ID, split
from .schedule import BUFFERS, Flow, LocalCopy, Schedule, Stage

OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
_IN_PLACE = ("all_reduce", "reduce_scatter", "all_gather", "reduce", "broadcast")


# -- buffers -----------------------------------------------------------------
def buffer_counts(schedule: Schedule, rank: int) -> dict[str, int]:
    """Element counts of ``in``, ``out`` and ``work`` on ``rank``."""
    p, n, coll = schedule.world, schedule.count, schedule.collective
    if coll == "all_to_allv":
        meta = schedule.meta
        if schedule.local_rank is None:
            sizes = (meta["in_counts"][rank], meta["out_counts"][rank])
        else:
            sizes = (meta["in_count"], meta["out_count"]) if rank == schedule.local_rank else (0, 0)
    else:
        sizes = {
            "all_reduce": (n, n),
            "reduce_scatter": (p * n, n),
            "all_gather": (n, p * n),
            "all_to_all": (p * n, p * n),
            "broadcast": (n, n),
            "reduce": (n, n),
        }[coll]
    return {"in": sizes[0], "out": sizes[1], "work": schedule.work_count}


def _poison(dtype: np.dtype):
    """A value no correct schedule leaves behind in an output element."""
    if dtype.kind == "i":
        return np.iinfo(dtype).min // 3
    if dtype.kind == "u":
        return np.iinfo(dtype).max // 3
    if dtype.kind == "b":
        return True
    return np.nan


def _allocate(schedule: Schedule, rank: int, data, dtype, in_place: bool) -> dict[str, np.ndarray]:
    counts = buffer_counts(schedule, rank)
    coll, n = schedule.collective, schedule.count
    data = np.array(data, dtype=dtype, copy=True).reshape(-1)
    expected_in = n if coll == "broadcast" else counts["in"]
    if data.size != expected_in:
        raise ValueError(f"rank {rank}: input has {data.size} elements, {coll} needs {expected_in}")
    poison = _poison(data.dtype)
    work = np.full(counts["work"], poison, dtype=data.dtype)
    if coll == "broadcast":  # the engine binds in and out to one user buffer
        return {"in": data, "out": data, "work": work}
    if not in_place:
        return {"in": data, "out": np.full(counts["out"], poison, dtype=data.dtype), "work": work}
    if coll in ("all_reduce", "reduce"):
        return {"in": data, "out": data, "work": work}
    if coll == "reduce_scatter":  # out is this rank's block of in, as NCCL does it
        return {"in": data, "out": data[rank * n:(rank + 1) * n], "work": work}
    if coll == "all_gather":  # in is this rank's block of out
        out = np.full(counts["out"], poison, dtype=data.dtype)
        out[rank * n:(rank + 1) * n] = data
        return {"in": out[rank * n:(rank + 1) * n], "out": out, "work": work}
    raise ValueError(f"in-place {coll} is not supported (in-place variants exist for {', '.join(_IN_PLACE)})")


def _region(bufs, rank: int, buf: str, off: int, count: int) -> np.ndarray:
    view = bufs[rank][buf][off:off + count]
    if off < 0 or view.size != count:
        raise IndexError(f"rank {rank} {buf}[{off}:+{count}] is outside a buffer of {bufs[rank][buf].size}")
    return view


def _land(bufs, rank: int, buf: str, off: int, data: np.ndarray, reduce: bool, op) -> None:
    dst = _region(bufs, rank, buf, off, data.size)
    if reduce:
        op(dst, data, out=dst)  # dst = op(dst, incoming): the engine's operand order
    else:
        dst[...] = data


def _local_copies(bufs, copies: Sequence[LocalCopy]) -> None:
    for c in copies:
        data = _region(bufs, c.rank, c.src_buf, c.src_off, c.count).copy()
        _land(bufs, c.rank, c.dst_buf, c.dst_off, data, False, None)


def _op(op: str):
    if op == "avg":
        raise ValueError("avg is the engine's job: run sum, then divide")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; valid: {', '.join(OPS)}")
    return OPS[op]


# -- executors -----------------------------------------------------------------
def execute(
    schedule: Union[Schedule, Sequence[Schedule]],
    inputs: Sequence[np.ndarray],
    op: str = "sum",
    dtype=None,
    in_place: bool = False,
) -> list[np.ndarray]:
    """Run ``schedule`` for every rank; return each rank's ``out`` (a copy).

    A list of rank-local schedules (all_to_allv) is merged first.
    """
    schedule = _global(schedule)
    reduce_op = _op(op)
    bufs = [_allocate(schedule, r, inputs[r], dtype, in_place) for r in range(schedule.world)]
    _local_copies(bufs, schedule.prologue)
    for stage in sorted(schedule.stages, key=lambda s: s.id):
        # Read everything first: all flows of a stage see the state at its start.
        arrived = [(f, _region(bufs, f.src, f.src_buf, f.src_off, f.count).copy()) for f in stage.flows]
        for f, data in arrived:
            _land(bufs, f.dst, f.dst_buf, f.dst_off, data, f.reduce, reduce_op)
    _local_copies(bufs, schedule.epilogue)
    return [b["out"].copy() for b in bufs]


def execute_async(
    schedule: Union[Schedule, Sequence[Schedule]],
    inputs: Sequence[np.ndarray],
    op: str = "sum",
    dtype=None,
    in_place: bool = False,
    seed: int = 0,
    chunks: int = 2,
) -> list[np.ndarray]:
    """Run ``schedule`` in a random order the per-rank dependency rule allows.

    Each flow is cut into ``chunks`` pieces; a piece may move once the
    stage's dependencies have finished on both its ranks, and it reads its
    source when it moves. A stage finishes on a rank when every piece that
    touches the rank has moved; a stage without flows on a rank counts as
    finished there from the start. Raises RuntimeError on deadlock.
    """
    schedule = _global(schedule)
    reduce_op = _op(op)
    rng = random.Random(seed)
    bufs = [_allocate(schedule, r, inputs[r], dtype, in_place) for r in range(schedule.world)]
    _local_copies(bufs, schedule.prologue)

    ranks_of = {s.id: {r for f in s.flows for r in (f.src, f.dst)} for s in schedule.stages}
    dependents = defaultdict(list)
    for s in schedule.stages:
        for d in s.deps:
            dependents[d].append(s.id)
    # unmet[(s, r)]: deps of s that involve r and have not finished on r yet.
    unmet = {(s.id, r): sum(1 for d in s.deps if r in ranks_of[d]) for s in schedule.stages for r in ranks_of[s.id]}
    pieces = {s.id: [] for s in schedule.stages}
    left = defaultdict(int)  # (s, r) -> pieces touching r still to move
    for s in schedule.stages:
        for f in s.flows:
            for off, size in split(f.count, max(1, min(chunks, f.count))):
                pieces[s.id].append((f, off, size))
                left[(s.id, f.src)] += 1
                left[(s.id, f.dst)] += 1
    released: set[int] = set()
    ready: list = []

    def release(sid: int) -> None:
        for i, (f, off, size) in enumerate(pieces[sid]):
            key = (sid, i)
            if key not in released and unmet[(sid, f.src)] == 0 and unmet[(sid, f.dst)] == 0:
                released.add(key)
                ready.append((sid, f, off, size))

    def finish(sid: int, rank: int) -> None:
        for s in dependents[sid]:
            if (s, rank) in unmet:
                unmet[(s, rank)] -= 1
                if unmet[(s, rank)] == 0:
                    release(s)

    for s in schedule.stages:
        release(s.id)
    moved, total = 0, sum(len(v) for v in pieces.values())
    while ready:
        sid, f, off, size = ready.pop(rng.randrange(len(ready)))
        data = _region(bufs, f.src, f.src_buf, f.src_off + off, size).copy()
        _land(bufs, f.dst, f.dst_buf, f.dst_off + off, data, f.reduce, reduce_op)
        moved += 1
        for r in (f.src, f.dst):
            left[(sid, r)] -= 1
            if left[(sid, r)] == 0:
                finish(sid, r)
    if moved != total:
        raise RuntimeError(f"deadlock: {total - moved} of {total} flow pieces never became ready")
    _local_copies(bufs, schedule.epilogue)
    return [b["out"].copy() for b in bufs]


# -- rank-local schedules ------------------------------------------------------------
def _global(schedule) -> Schedule:
    if isinstance(schedule, Schedule):
        if schedule.local_rank is not None:
            raise ValueError("a rank-local schedule alone cannot run; pass every rank's schedule")
        return schedule
    return merge_local_schedules(schedule)


def merge_local_schedules(schedules: Sequence[Schedule]) -> Schedule:
    """Combine every rank's local view (all_to_allv) into one global schedule.

    Each flow takes its source offset from the sender's view and its
    destination offset from the receiver's; both views must list it, in the
    same stage, with the same count. Raises ValueError otherwise.
    """
    world = schedules[0].world
    if len(schedules) != world or [s.local_rank for s in schedules] != list(range(world)):
        raise ValueError("need one local schedule per rank, in rank order")
    shape = [(s.collective, s.algorithm, s.channels, [(st.id, st.deps, st.channel) for st in s.stages]) for s in schedules]
    if any(x != shape[0] for x in shape):
        raise ValueError("local schedules disagree on collective, algorithm, channels or stages")
    sends, recvs = {}, {}
    for s in schedules:
        for st in s.stages:
            for f in st.flows:
                side = sends if f.src == s.local_rank else recvs
                side[f.id] = (st.id, f)
    if set(sends) != set(recvs):
        lonely = sorted(set(sends) ^ set(recvs))
        raise ValueError(f"flows listed by only one side (send/recv counts disagree): ids {lonely[:8]}")
    stages = []
    for st in schedules[0].stages:
        flows = []
        for fid in sorted(i for i, (sid, _) in sends.items() if sid == st.id):
            (_, out), (rsid, inc) = sends[fid], recvs[fid]
            if rsid != st.id or (out.src, out.dst, out.count, out.reduce) != (inc.src, inc.dst, inc.count, inc.reduce):
                raise ValueError(f"flow {fid}: sender {out} and receiver {inc} disagree")
            flows.append(Flow(fid, out.src, out.dst, out.src_buf, out.src_off, inc.dst_buf, inc.dst_off, out.count, out.reduce))
        stages.append(Stage(st.id, tuple(flows), st.deps, st.channel, st.label))
    first = schedules[0]
    meta = {
        "in_counts": [s.meta["in_count"] for s in schedules],
        "out_counts": [s.meta["out_count"] for s in schedules],
        "send_counts": [s.meta["send_counts"] for s in schedules],
        "merged_from_local": True,
    }
    return Schedule(
        first.collective, first.algorithm, world, 0, tuple(stages),
        prologue=tuple(c for s in schedules for c in s.prologue),
        epilogue=tuple(c for s in schedules for c in s.epilogue),
        work_count=max(s.work_count for s in schedules), channels=first.channels, meta=meta,
    )


# -- reference results -----------------------------------------------------------
def reference(
    collective: str,
    inputs: Sequence[np.ndarray],
    op: str = "sum",
    root: int = 0,
    send_counts: Optional[Sequence[Sequence[int]]] = None,
) -> list[Optional[np.ndarray]]:
    """Expected ``out`` of every rank (None where the collective leaves it undefined).

    all_to_allv takes ``send_counts[i][j]``: elements rank i sends to rank j.
    """
    p = len(inputs)
    stacked = lambda: np.stack([np.asarray(x) for x in inputs])  # noqa: E731
    if collective == "all_reduce":
        total = _op(op).reduce(stacked(), axis=0)
        return [total.copy() for _ in range(p)]
    if collective == "reduce_scatter":
        total = _op(op).reduce(stacked(), axis=0)
        n = total.size // p
        return [total[i * n:(i + 1) * n].copy() for i in range(p)]
    if collective == "all_gather":
        gathered = np.concatenate([np.asarray(x) for x in inputs])
        return [gathered.copy() for _ in range(p)]
    if collective == "all_to_all":
        n = np.asarray(inputs[0]).size // p
        return [np.concatenate([np.asarray(inputs[j])[i * n:(i + 1) * n] for j in range(p)]) for i in range(p)]
    if collective == "all_to_allv":
        displ = [[0, *accumulate(row)][:-1] for row in send_counts]
        return [
            np.concatenate([np.asarray(inputs[j])[displ[j][i]:displ[j][i] + send_counts[j][i]] for j in range(p)])
            for i in range(p)
        ]
    if collective == "broadcast":
        return [np.asarray(inputs[root]).copy() for _ in range(p)]
    if collective == "reduce":
        total = _op(op).reduce(stacked(), axis=0)
        return [total if r == root else None for r in range(p)]
    raise ValueError(f"unknown collective {collective!r}")


# -- static checks -----------------------------------------------------------------
def check_structure(schedule: Schedule) -> list[str]:
    """Ids, dependencies, channels, flow fields and buffer bounds."""
    s = schedule
    problems: list[str] = []
    local = s.local_rank
    seen_flow_ids: set[int] = set()
    for pos, st in enumerate(s.stages):
        if st.id != pos:
            problems.append(f"stage at position {pos} has id {st.id}")
        if len(set(st.deps)) != len(st.deps) or any(not (0 <= d < st.id) for d in st.deps):
            problems.append(f"stage {st.id}: deps {st.deps} must be distinct lower ids")
        if not 0 <= st.channel < s.channels:
            problems.append(f"stage {st.id}: channel {st.channel} outside [0, {s.channels})")
        for d in st.deps:
            # A channel may wait for an earlier one (a pipeline's channels taking turns), never a later one.
            if 0 <= d < len(s.stages) and s.stages[d].channel > st.channel:
                problems.append(f"stage {st.id} (ch{st.channel}) depends on stage {d} of ch{s.stages[d].channel}")
        for f in st.flows:
            where = f"stage {st.id} flow {f.id}"
            if f.id in seen_flow_ids:
                problems.append(f"{where}: duplicate flow id")
            seen_flow_ids.add(f.id)
            if not 0 <= f.id < MAX_FLOW_ID:
                problems.append(f"{where}: id outside [0, 2**20)")
            if f.count <= 0:
                problems.append(f"{where}: count {f.count}")
            if not (0 <= f.src < s.world and 0 <= f.dst < s.world) or f.src == f.dst:
                problems.append(f"{where}: ranks {f.src}->{f.dst}")
                continue
            if f.src_buf not in BUFFERS or f.dst_buf not in BUFFERS or f.dst_buf == "in":
                problems.append(f"{where}: buffers {f.src_buf}->{f.dst_buf}")
                continue
            if local is not None and local not in (f.src, f.dst):
                problems.append(f"{where}: rank-local schedule of {local} lists a flow between others")
            if local is None or f.src == local:
                problems += _bounds(s, f.src, f.src_buf, f.src_off, f.count, where)
            if local is None or f.dst == local:
                problems += _bounds(s, f.dst, f.dst_buf, f.dst_off, f.count, where)
    for phase, copies in (("prologue", s.prologue), ("epilogue", s.epilogue)):
        for c in copies:
            where = f"{phase} copy on rank {c.rank}"
            if c.count <= 0 or c.dst_buf == "in" or c.src_buf not in BUFFERS or c.dst_buf not in BUFFERS:
                problems.append(f"{where}: {c}")
                continue
            problems += _bounds(s, c.rank, c.src_buf, c.src_off, c.count, where)
            problems += _bounds(s, c.rank, c.dst_buf, c.dst_off, c.count, where)
    return problems


def _bounds(schedule: Schedule, rank: int, buf: str, off: int, count: int, where: str) -> list[str]:
    size = buffer_counts(schedule, rank)[buf]
    if off < 0 or off + count > size:
        return [f"{where}: rank {rank} {buf}[{off}:+{count}] outside {size} elements"]
    return []


def _rank_ancestors(schedule: Schedule, involved: set[int]) -> dict[int, int]:
    """Stage -> bitmask of stages certainly finished on this rank before it starts.

    Only chains of dependencies through stages that involve the rank count.
    """
    ancestors: dict[int, int] = {}
    for st in schedule.stages:
        if st.id in involved:
            mask = 0
            for d in st.deps:
                if d in involved:
                    mask |= ancestors[d] | (1 << d)
            ancestors[st.id] = mask
    return ancestors


def check_hazards(schedule: Schedule) -> list[str]:
    """Conflicting accesses on a rank that the dependencies do not order.

    Two accesses conflict when they touch overlapping elements of the same
    buffer on the same rank and at least one writes (a reduce writes). Reads
    of ``in`` never conflict. Inside one stage every conflict is a hazard;
    across stages it is one unless one stage is an ancestor of the other on
    that rank. Prologue and epilogue copies must not conflict with each other.
    """
    s = schedule
    ranks = range(s.world) if s.local_rank is None else [s.local_rank]
    accesses: dict[int, list] = {r: [] for r in ranks}
    involved: dict[int, set[int]] = {r: set() for r in ranks}
    for st in s.stages:
        for f in st.flows:
            if f.src in accesses:
                involved[f.src].add(st.id)
                if f.src_buf != "in":
                    accesses[f.src].append((f.src_buf, f.src_off, f.src_off + f.count, st.id, False, f.id))
            if f.dst in accesses:
                involved[f.dst].add(st.id)
                accesses[f.dst].append((f.dst_buf, f.dst_off, f.dst_off + f.count, st.id, True, f.id))
    problems: list[str] = []
    for r in ranks:
        ancestors = _rank_ancestors(s, involved[r])
        for a, b in _overlapping_pairs(accesses[r]):
            if not (a[4] or b[4]):
                continue
            what = f"rank {r} {a[0]}[{max(a[1], b[1])}:{min(a[2], b[2])}] flows {a[5]} (stage {a[3]}) and {b[5]} (stage {b[3]})"
            if a[3] == b[3]:
                problems.append(f"intra-stage hazard: {what}")
            else:
                first, second = sorted((a[3], b[3]))
                if not (ancestors[second] >> first) & 1:
                    problems.append(f"unordered stages: {what}")
    for phase, copies in (("prologue", s.prologue), ("epilogue", s.epilogue)):
        per_rank = defaultdict(list)
        for i, c in enumerate(copies):
            if c.src_buf != "in":
                per_rank[c.rank].append((c.src_buf, c.src_off, c.src_off + c.count, i, False, i))
            per_rank[c.rank].append((c.dst_buf, c.dst_off, c.dst_off + c.count, i, True, i))
        for r, acc in per_rank.items():
            for a, b in _overlapping_pairs(acc):
                if (a[4] or b[4]) and a[3] != b[3]:
                    problems.append(f"{phase} copies {a[3]} and {b[3]} conflict on rank {r} {a[0]}")
    return problems


def _overlapping_pairs(accesses: list):
    """Pairs of (buf, lo, hi, ...) tuples that overlap, via a sorted sweep."""
    ordered = sorted(accesses, key=lambda a: (a[0], a[1]))
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b[0] != a[0] or b[1] >= a[2]:
                break
            yield a, b


def check_schedule(schedule: Schedule) -> list[str]:
    """Both static checks."""
    return check_structure(schedule) + check_hazards(schedule)
