"""Shared machinery for the algorithm builders.

Algorithms only say *what moves, in which order*: a list of stages, each a
list of :class:`Move` (a flow without an id). :class:`ScheduleBuilder` turns
that into a :class:`~mpccs.algorithms.schedule.Schedule`:

* zero-count moves are dropped, and so are stages left empty (their explicit
  successors inherit their dependencies instead);
* flow ids are assigned (sequentially unless a move carries its own id);
* dependencies are *derived from buffer conflicts, per rank*: a stage depends
  on the last stage that wrote an element range it reads or writes on some
  rank (RAW, WAW) and on the stages that read a range since it was last
  written (WAR). Reads of ``in`` are never tracked (it is read-only). Extra
  ordering that is not a data dependency (a pipeline's segments on one link,
  the steps of a pairwise exchange) is passed explicitly with ``after=``.

Ordering is reasoned about conservatively: on rank r, stage b is known to be
after stage a only through a chain of dependencies whose every stage involves
r. (An engine may treat a stage that has no flow on r as finished on r at
once, so a chain through it proves nothing on r.) Derived dependencies that
are implied that way are pruned, so plans stay readable.

Two moves of one stage that conflict on a rank are a bug in the algorithm and
raise ``AssertionError`` here, long before an engine could corrupt data.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence

from .schedule import Flow, LocalCopy, Schedule, Stage, Topology

MAX_FLOW_ID = 1 << 20  # flow ids travel in a 20-bit field of the wire tag
# Offset on the far side of a flow in a rank-local schedule (all_to_allv): the
# building rank does not know it; the peer's own schedule carries it.
REMOTE_OFFSET = -1
# Beyond this many (rank, stage) participations the builder stops pruning
# redundant dependencies: the per-rank ancestor sets would cost too much
# memory. Dependencies stay correct, only some implied ones remain listed.
_PRUNE_LIMIT = 300_000

Extent = tuple[int, int]  # (offset, count) in elements


def split(n: int, k: int) -> list[Extent]:
    """Cut ``n`` elements into ``k`` consecutive parts as evenly as possible.

    The first ``n % k`` parts get one extra element; parts may be empty.
    """
    base, extra = divmod(n, k)
    parts, off = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        parts.append((off, size))
        off += size
    return parts


def coalesce(extents: Iterable[Extent]) -> tuple[Extent, ...]:
    """Sort extents, drop empty ones and merge those that touch."""
    merged: list[list[int]] = []
    for off, size in sorted(e for e in extents if e[1] > 0):
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1][1] += size
        else:
            merged.append([off, size])
    return tuple((off, size) for off, size in merged)


def pow2_floor(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


class Move(NamedTuple):
    """A flow before it has an id (see :class:`~.schedule.Flow`)."""

    src: int
    dst: int
    src_buf: str
    src_off: int
    dst_buf: str
    dst_off: int
    count: int
    reduce: bool = False
    id: Optional[int] = None  # set only where ids must be predictable


def moves_over(src: int, dst: int, buf: str, extents: Iterable[Extent], *, reduce: bool = False) -> list[Move]:
    """Moves of the same element ranges of ``buf`` from ``src`` to ``dst``."""
    return [Move(src, dst, buf, off, buf, off, size, reduce) for off, size in coalesce(extents)]


@dataclass(frozen=True)
class Spec:
    """Validated arguments of :func:`~.registry.build_schedule`."""

    collective: str
    algorithm: str
    world: int
    count: int
    topology: Topology
    channels: int = 1
    root: int = 0
    send_counts: Optional[tuple[int, ...]] = None
    recv_counts: Optional[tuple[int, ...]] = None
    rank: Optional[int] = None
    segments: Optional[int] = None

    def channel_slices(self) -> list[Extent]:
        """Channel c's part of ``count`` elements (its slice of every block)."""
        return split(self.count, self.channels)


Step = tuple[str, list[Move]]  # (label, moves) of one stage


class _Cells:
    """Disjoint element intervals of one (rank, buffer) with their history.

    Each cell is ``[start, end, last_writer, readers_since_last_write]``.
    """

    __slots__ = ("starts", "cells")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.cells: list[list] = []

    def _cut(self, x: int) -> None:
        i = bisect_right(self.starts, x) - 1
        if i >= 0:
            cell = self.cells[i]
            if cell[0] < x < cell[1]:
                self.cells.insert(i + 1, [x, cell[1], cell[2], list(cell[3])])
                self.starts.insert(i + 1, x)
                cell[1] = x

    def cover(self, lo: int, hi: int) -> list[list]:
        """The cells exactly covering [lo, hi), creating blank ones in gaps."""
        self._cut(lo)
        self._cut(hi)
        i = bisect_left(self.starts, lo)
        covered, pos = [], lo
        while pos < hi:
            if i < len(self.cells) and self.cells[i][0] == pos:
                covered.append(self.cells[i])
                pos = self.cells[i][1]
            else:
                nxt = self.cells[i][0] if i < len(self.cells) and self.cells[i][0] < hi else hi
                blank = [pos, nxt, None, []]
                self.cells.insert(i, blank)
                self.starts.insert(i, pos)
                covered.append(blank)
                pos = nxt
            i += 1
        return covered


class ScheduleBuilder:
    """Accumulates prologue, stages and epilogue; see the module docstring."""

    def __init__(
        self,
        spec: Spec,
        *,
        algorithm: Optional[str] = None,
        work_count: int = 0,
        keep_empty: bool = False,
        track: bool = True,
        local_rank: Optional[int] = None,
        meta: Optional[dict] = None,
    ) -> None:
        self.spec = spec
        self.algorithm = algorithm or spec.algorithm
        self.work_count = work_count
        self.keep_empty = keep_empty  # rank-local schedules need stable stage ids
        self.track = track  # off where offsets are not all known (REMOTE_OFFSET)
        self.local_rank = local_rank
        self.meta = dict(meta or {})
        self.prologue_copies: list[LocalCopy] = []
        self.epilogue_copies: list[LocalCopy] = []
        self.stages: list[Stage] = []
        self._ranks_of: list[frozenset[int]] = []  # ranks each stage touches
        self._cells: dict[tuple[int, str], _Cells] = {}
        self._ancestors: dict[int, dict[int, int]] = {}  # rank -> stage -> bitmask
        self._participations = 0
        self._prune = True
        self._used_ids: set[int] = set()
        self._next_id = 0

    # -- local copies -------------------------------------------------------
    def prologue(self, rank: int, src_buf: str, src_off: int, dst_buf: str, dst_off: int, count: int) -> None:
        if count > 0:
            self.prologue_copies.append(LocalCopy(rank, src_buf, src_off, dst_buf, dst_off, count))

    def epilogue(self, rank: int, src_buf: str, src_off: int, dst_buf: str, dst_off: int, count: int) -> None:
        if count > 0:
            self.epilogue_copies.append(LocalCopy(rank, src_buf, src_off, dst_buf, dst_off, count))

    # -- stages -------------------------------------------------------------
    def stage(self, moves: Iterable[Move], *, channel: int = 0, label: str = "", after: Iterable[Sequence[int]] = ()) -> tuple[int, ...]:
        """Append a stage; return a handle for ``after=`` of later stages.

        The handle is the stage's id, or, for a stage dropped because it had
        no non-empty move, the dependencies it would have had.
        """
        moves = [m for m in moves if m.count > 0]
        explicit = sorted({d for handle in after for d in handle})
        if not moves and not self.keep_empty:
            return tuple(explicit)
        sid = len(self.stages)
        ranks = frozenset(r for m in moves for r in (m.src, m.dst))
        derived = self._derive_deps(sid, moves) if self.track else {}
        deps = self._prune_deps(ranks, derived, explicit)
        flows = tuple(self._flow(m) for m in moves)
        self.stages.append(Stage(sid, flows, tuple(deps), channel, label))
        self._ranks_of.append(ranks)
        self._record_ancestors(sid, ranks, deps)
        return (sid,)

    def steps(self, steps: Iterable[Step], *, channel: int = 0) -> None:
        """Append consecutive stages of one channel (deps are derived)."""
        for label, moves in steps:
            self.stage(moves, channel=channel, label=label)

    def interleave(self, per_channel: Sequence[Sequence[Step]], *, in_order: bool = False) -> None:
        """Append step t of every channel before step t+1 of any channel.

        Ids then follow time, which helps an engine that posts in id order.
        With ``in_order`` step t of channel c also waits for step t of channel
        c - 1: a pipeline whose channels take turns on each step instead of
        all sharing the links at once (algorithms.hierarchical).
        """
        longest = max((len(steps) for steps in per_channel), default=0)
        for t in range(longest):
            previous: tuple[int, ...] = ()
            for channel, steps in enumerate(per_channel):
                if t < len(steps):
                    label, moves = steps[t]
                    previous = self.stage(moves, channel=channel, after=[previous] if in_order else (),
                                          label=f"{label} ch{channel}" if len(per_channel) > 1 else label)

    def build(self) -> Schedule:
        spec = self.spec
        return Schedule(
            collective=spec.collective,
            algorithm=self.algorithm,
            world=spec.world,
            count=spec.count,
            stages=tuple(self.stages),
            prologue=tuple(self.prologue_copies),
            epilogue=tuple(self.epilogue_copies),
            work_count=self.work_count,
            channels=spec.channels,
            root=spec.root if spec.collective in ("broadcast", "reduce") else None,
            local_rank=self.local_rank,
            meta=self.meta,
        )

    # -- internals ----------------------------------------------------------
    def _flow(self, m: Move) -> Flow:
        if m.id is not None:
            fid = m.id
        else:
            while self._next_id in self._used_ids:
                self._next_id += 1
            fid = self._next_id
        if fid in self._used_ids:
            raise AssertionError(f"duplicate flow id {fid}")
        if not 0 <= fid < MAX_FLOW_ID:
            raise ValueError(f"schedule too large: flow id {fid} does not fit in 20 bits; use fewer channels/segments")
        self._used_ids.add(fid)
        return Flow(fid, m.src, m.dst, m.src_buf, m.src_off, m.dst_buf, m.dst_off, m.count, m.reduce)

    def _accesses(self, moves: list[Move]):
        """(rank, buffer, lo, hi, is_write) of every tracked access."""
        for m in moves:
            if m.src == m.dst:
                raise AssertionError(f"flow from rank {m.src} to itself: {m}")
            if m.dst_buf == "in":
                raise AssertionError(f"flow writes the read-only input: {m}")
            if m.src_buf != "in":
                yield m.src, m.src_buf, m.src_off, m.src_off + m.count, False
            yield m.dst, m.dst_buf, m.dst_off, m.dst_off + m.count, True

    def _derive_deps(self, sid: int, moves: list[Move]) -> dict[int, set[int]]:
        """Per rank, the earlier stages this one conflicts with there."""
        found: dict[int, set[int]] = {}
        for rank, buf, lo, hi, write in self._accesses(moves):
            cells = self._cells.setdefault((rank, buf), _Cells())
            deps = found.setdefault(rank, set())
            for cell in cells.cover(lo, hi):
                writer, readers = cell[2], cell[3]
                if writer == sid or (write and sid in readers):
                    raise AssertionError(f"stage {sid} conflicts with itself on rank {rank} {buf}[{lo}:{hi}]")
                if write:
                    # Readers since the last write already wait for that writer.
                    deps.update(readers if readers else ([writer] if writer is not None else []))
                    cell[2], cell[3] = sid, []
                else:
                    if writer is not None:
                        deps.add(writer)
                    readers.append(sid)
        return found

    def _prune_deps(self, ranks: frozenset[int], derived: dict[int, set[int]], explicit: list[int]) -> list[int]:
        keep = {d for d in explicit if not (self._ranks_of[d] & ranks)}
        for rank in ranks:
            candidates = set(derived.get(rank, ()))
            candidates.update(d for d in explicit if rank in self._ranks_of[d])
            if not self._prune:
                keep |= candidates
                continue
            anc = self._ancestors.get(rank, {})
            for d in candidates:
                if not any((anc.get(other, 0) >> d) & 1 for other in candidates if other != d):
                    keep.add(d)
        return sorted(keep)

    def _record_ancestors(self, sid: int, ranks: frozenset[int], deps: list[int]) -> None:
        if not self._prune:
            return
        self._participations += len(ranks)
        if self._participations > _PRUNE_LIMIT:
            self._prune = False
            self._ancestors.clear()
            return
        for rank in ranks:
            anc = self._ancestors.setdefault(rank, {})
            mask = 0
            for d in deps:
                if rank in self._ranks_of[d]:
                    mask |= anc.get(d, 0) | (1 << d)
            anc[sid] = mask
