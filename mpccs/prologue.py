"""A schedule's prologue copies, made only where they are still needed.

Many schedules start with a bulk local copy: an out-of-place ring all-reduce
copies its whole input into the output, then reduces arriving blocks into it
and finally overwrites the rest with gathered blocks. Made up front, that copy
is a full extra pass over memory before the first byte moves (about 30% of a
2-rank all-reduce of 8 MiB here). Deferred, almost all of it disappears:

* a flow that *sends* from a range still waiting for its copy sends from the
  copy's source instead (the same bytes; only copies from ``in`` are deferred,
  and only when no written buffer aliases it: an in-place call's input changes
  during the operation, so its copies are made up front as before);
* a flow that *reduces into* such a range computes ``op(source, incoming)``
  straight into the destination, one pass instead of copy-then-reduce, with
  the operands in the same order (results stay bit-identical);
* a flow that *overwrites* such a range makes its copy pointless;
* a range no flow of the operation writes on this rank (an all_gather's or
  all_to_all's own block) is copied in slices while the rank waits on the
  network (``copy_early``): made at the end, it was 7 ms of a 2-rank 64 MiB
  all_gather after the last byte arrived;
* whatever is still pending when the stages are done is copied then (before
  the epilogue, which may read it), except into the scratch buffer ``work``
  where the epilogue does not read it: a ring reduce-scatter's prologue copies
  its whole input into ``work``, and the blocks it only ever sends from were
  copied there at the end for nobody (32 MiB of a 2-rank 64 MiB call, 8-13 ms
  of its ~100 on the testbed).

A flow that covers a pending range only partly materialises the overlap
first and then runs as usual. The schedule's dependencies already forbid two
concurrent stages from touching one range on a rank with a write, so the
deferral never reorders a read against a write.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

import numpy as np

from .arrays import copy_into, may_share_memory, same_start
from .windows import missing_ranges

EARLY_COPY_BYTES = 1 << 20  # one slice of copy_early: ~0.2 ms here, short next to a progress round's wait


# Allocated per operation (CollectiveOp._begin_attempt) and read by nobody
# after its epilogue.
SCRATCH_BUFFERS = frozenset({"work"})


def _stable_sources(buffers: dict) -> set:
    """Buffers no stage writes during the operation: ``in``, unless an
    in-place call made it the output (or it overlaps any written buffer)."""
    src = buffers.get("in")
    if src is None or any(may_share_memory(src, buffers[b]) for b in buffers if b != "in"):
        return set()
    return {"in"}


def merged_ranges(ranges: Iterable[tuple[str, int, int]]) -> dict[str, list[tuple[int, int]]]:
    """(buf, lo, hi) ranges -> buf -> sorted disjoint (lo, hi), touching ones merged."""
    by_buf: dict[str, list[tuple[int, int]]] = {}
    for buf, lo, hi in sorted(ranges):
        if hi <= lo:
            continue
        merged = by_buf.setdefault(buf, [])
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return by_buf


class DeferredCopies:
    """Pending ``dst_buf[lo:hi] = src_buf[src_lo:...]`` copies of one rank.

    ``written``: the ranges the rank's incoming flows write (merged_ranges);
    pending ranges outside them are what ``copy_early`` may make at any time."""

    def __init__(self, copies: Iterable, rank: int, buffers: dict,
                 written: Optional[Mapping[str, list[tuple[int, int]]]] = None):
        self._buffers = buffers
        # dst_buf -> list of [lo, hi, src_buf, src_lo], disjoint
        self._pending: dict[str, list[list]] = {}
        stable = _stable_sources(buffers)
        for c in copies:
            if c.rank != rank or c.count == 0:
                continue
            src = buffers[c.src_buf][c.src_off : c.src_off + c.count]
            dst = buffers[c.dst_buf][c.dst_off : c.dst_off + c.count]
            if same_start(src, dst):
                continue  # in place: nothing to copy
            if c.src_buf in stable:
                self._pending.setdefault(c.dst_buf, []).append([c.dst_off, c.dst_off + c.count, c.src_buf, c.src_off])
            else:
                copy_into(dst, src)  # the source may change during the operation: copy now
        self._early = [] if written is None else [  # not into scratch: there most of it is for nobody (flush)
            (buf, a, b) for buf, entries in self._pending.items() if buf not in SCRATCH_BUFFERS
            for lo, hi, _, _ in entries for a, b in missing_ranges(written.get(buf, []), lo, hi)]

    def __bool__(self) -> bool:
        return any(self._pending.values())

    def source_of(self, buf: str, lo: int, hi: int) -> Optional[np.ndarray]:
        """The bytes ``buf[lo:hi]`` will hold, when all of it is one pending copy's."""
        for plo, phi, src_buf, src_lo in self._pending.get(buf, ()):
            if plo <= lo and hi <= phi:
                start = src_lo + (lo - plo)
                return self._buffers[src_buf][start : start + (hi - lo)]
        return None

    def overlaps(self, buf: str, lo: int, hi: int) -> bool:
        return any(plo < hi and lo < phi for plo, phi, _, _ in self._pending.get(buf, ()))

    def materialize(self, buf: str, lo: int, hi: int) -> None:
        """Make the pending copies that overlap ``buf[lo:hi]`` (all of each overlap)."""
        self._take(buf, lo, hi, copy=True)

    def discard(self, buf: str, lo: int, hi: int) -> None:
        """``buf[lo:hi]`` is about to be written whole: its pending copies are moot."""
        self._take(buf, lo, hi, copy=False)

    def copy_early(self, max_bytes: int) -> bool:
        """Make up to ``max_bytes`` of the pending copies no flow will write over
        (the engine calls it when a progress round moved nothing); whether any."""
        while self._early:
            buf, lo, hi = self._early[-1]
            if not self.overlaps(buf, lo, hi):
                self._early.pop()  # made since (a partial overlap, the end) or never pending here
                continue
            step = max(1, max_bytes // self._buffers[buf].itemsize)
            if hi - lo <= step:
                self._early.pop()
            else:
                self._early[-1] = (buf, lo + step, hi)
                hi = lo + step
            self.materialize(buf, lo, hi)
            return True
        return False

    def flush(self, scratch_reads: Iterable[tuple[str, int, int]] = ()) -> None:
        """Make every pending copy into a buffer the caller sees; into a scratch
        buffer only the overlap with ``scratch_reads`` ((buf, lo, hi): what the
        epilogue reads), the rest is dropped."""
        for buf in list(self._pending):
            if buf in SCRATCH_BUFFERS:
                for read_buf, lo, hi in scratch_reads:
                    if read_buf == buf:
                        self._take(buf, lo, hi, copy=True)
                self._pending[buf] = []
            else:
                self._take(buf, 0, np.iinfo(np.int64).max, copy=True)

    def _take(self, buf: str, lo: int, hi: int, copy: bool) -> None:
        entries = self._pending.get(buf)
        if not entries:
            return
        kept = []
        for plo, phi, src_buf, src_lo in entries:
            a, b = max(plo, lo), min(phi, hi)
            if a >= b:
                kept.append([plo, phi, src_buf, src_lo])
                continue
            if copy:
                start = src_lo + (a - plo)
                copy_into(self._buffers[buf][a:b], self._buffers[src_buf][start : start + (b - a)])
            if plo < a:
                kept.append([plo, a, src_buf, src_lo])
            if b < phi:
                kept.append([b, phi, src_buf, src_lo + (b - plo)])
        self._pending[buf] = kept
