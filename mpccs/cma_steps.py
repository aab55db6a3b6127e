"""A 2-rank all_reduce, reduce_scatter, all_gather, all_to_all, broadcast or
reduce whose blocks each rank reads straight from its peer's buffers (cross-memory attach: transports/cma.py),
paced by flags in the shared-memory segments' slot tables (transports/shm.py).

Why: UCX moves a block on the scale-up plane by rendezvous (a request, the
receiver's cross-process read, an acknowledgement), and posting and reaping
those requests costs Python and UCX time per call. Here a block is one
process_vm_readv (the same single copy UCX's cma transport makes) and a flag.
The direct path's 2-rank all_reduce above what the outboxes carry in rounds
(direct_ops.DIRECT_CMA_FROM_BYTES, DirectShmAllReduceOp) and its
reduce_scatter, all_gather and all_to_all of 512 KiB-128 MiB blocks and broadcast
of 2-128 MiB (DirectShmBlocksOp; below, and a reduce of any size to 256 MiB, the
pipe: pipe_steps.py) run so.

The blocks are those of two_step._geometry (all_to_all: _blocks): this rank's
operand of the block it owns ``mine_in``, that block's result ``mine_out``, its
operand of the peer's block ``theirs_in``, the peer's block of the output
``theirs_out``.
Each operation uses slot ``seq % SLOTS`` of both tables; a rank writes only
its own table:

1. post the addresses of its input and output and the call's shape (the
   collective and the input's size), then POSTED = seq;
2. once the peer posted the same shape: read the peer's operand of the block
   this rank owns (all_gather, all_to_all: the peer's block for this rank) from
   the peer's input, reduce it with its own operand in rank order (rank 0's on
   the left) into its output (or place it, and copy its own block), then
   REDUCED = seq ("my block is final, and I am done reading your
   input");
3. all_reduce only: once the peer reduced, read the peer's block of the output
   from the peer's output, then DONE = seq ("done reading your output");
4. done once the peer posted the last flag of its own steps (REDUCED, or DONE
   for an all_reduce): from then on the peer reads nothing of ours.

A broadcast or reduce has one reader (the rank that is not the root of a
broadcast, the root of a reduce): it takes step 2 and is done, as the other
reads nothing of its memory; the other posts (step 1) and is done on the
reader's REDUCED.

A rank never writes into its peer's memory, so nothing a failed or confused
peer does can reach this rank's buffers. A peer that called another
operation is never read from: its fingerprint, compared in the segments
before these steps advance (direct_ops.DirectShmAllReduceOp), brings the
MismatchError, and the shape in its slot must match besides. After each
read the reader checks that the peer's slot still shows the step it read
at: a rank whose operation fails clears its slot (abandon) before its caller
hears of it and may reuse the buffers, so a read that raced that reuse
fails instead of completing with what it read. The operations that run
these steps take the segments in turn (Engine.shm_holder),
so a rank has one operation in its slot table at a time; the slots rotate so
that a peer still in a failed operation finds that operation's slot cleared,
not its successor's.
"""
from __future__ import annotations

import errno
import time
from typing import Callable, Optional

import numpy as np

from .errors import TransportError
from .control.landing import LandingChoices
from .reduce import reduce_to
from .transports import cacheflush, cma
from .transports.shm import SLOT_DONE, SLOT_OUT, SLOT_POSTED, SLOT_REDUCED, SLOT_SHAPE, SLOT_SRC, SLOTS
from .two_step import STEPS, _geometry, _split_at, halves

# A reduction reads the peer's operand this much at a time and reduces each part
# before reading the next, so that the part is still in cache when it is reduced:
# in place through a buffer the engine keeps (so memory stays bounded whatever the
# call's size), out of place into the output for blocks up to
# READ_PARTS_MAX_OUT_BYTES (larger ones whole). 2 ranks, float32 all_reduce,
# interleaved (bench/read_parts.py, bench/results/read_parts/): in place
# 1.10-1.31x at 4-64 MiB against 8 MiB parts (the kept buffer's bound before);
# out of place 1.03-1.06x at 4-32 MiB against the whole block, 0.99x at 64 MiB
# (32 MiB halves), and a reduce_scatter's 32 MiB blocks 0.90-0.95x (256 KiB
# parts 0.99-1.03, 1 MiB 0.98-1.02 at 4-16 MiB); reducing from the kept buffer
# into a third array (out of place) lost, 0.86-0.93x.
READ_PART_BYTES = 512 << 10
READ_PARTS_MAX_OUT_BYTES = 16 << 20
SHAPE_CODES = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "all_to_all": 4, "broadcast": 5, "reduce": 6}
# What each phase waits for: the peer's flags.
PEER_POSTED, PEER_REDUCED, PEER_DONE, FINISHED = range(4)
# The steps' timeline (CmaSteps.marks), kept for calls whose input holds at least TIMELINE_FROM_BYTES:
# six clock reads cost ~0.7 us, under 1% of such a call (~80 us and up); smaller ones (a reduce_scatter's
# 512 KiB blocks) keep none.
TIMELINE_FROM_BYTES = 2 << 20
# Each mark ends an interval, named here (step_times_us).
INTERVALS = {"peer_posted": "wait_post", "read": "first_step", "peer_reduced": "wait_reduced", "landed": "landing",
             "done": "wait_finish"}  # (the wait for the peer's last flag: DONE, or REDUCED where there is no landing)


class CmaSteps:
    """One 2-rank call's steps (module docstring), posted at once; advance() until
    ``done``. ``scratch(nbytes)``: where an in-place block lands before it is
    reduced; ``error(message, step)`` makes the exception a failed step raises
    (naming rank, plane, peer, step). ``landing``: whether an in-place
    all_reduce flushes the lines its second read lands in, per size of landing
    (control/landing.py)."""

    def __init__(self, pair, seq: int, rank: int, collective: str, src: np.ndarray, out: np.ndarray, op: str,
                 scratch: Callable[[int], np.ndarray], error: Callable[[str, str], TransportError], root: int = 0,
                 landing: Optional[LandingChoices] = None):
        self.pair, self.seq, self.rank, self.op = pair, seq, rank, op
        self.slot = seq % SLOTS
        self.steps, geometry = _blocks(collective, src, out, rank)
        self.mine_in, self.mine_out, self.theirs_in, self.theirs_out = geometry
        self.reduces = collective in ("all_reduce", "reduce_scatter", "reduce")
        # Who reads: both ranks, but for a broadcast (the rank that is not the root) and a reduce (the root).
        readers = {"broadcast": 1 - root, "reduce": root}.get(collective)
        self.reads = readers in (None, rank)
        self.peer_reads = readers in (None, 1 - rank)
        self.src_offset, self.out_offset = _read_offsets(collective, src, out, rank)
        self.shape = SHAPE_CODES[collective] << 56 | root << 48 | src.nbytes
        self.scratch, self.error = scratch, error
        self.peer_out = 0
        # In place, the peer read this rank's operand of its block from where its result lands (_land_result).
        self.landing = (landing.for_bytes(self.theirs_out.nbytes)
                        if landing is not None and collective == "all_reduce" and np.may_share_memory(src, out)
                        else None)
        self._first_reads_s = 0.0  # the first step's reads (into the kept buffer): the landing's reference
        own = pair.own_slots[self.slot]
        own[SLOT_SRC], own[SLOT_OUT], own[SLOT_SHAPE] = src.ctypes.data, out.ctypes.data, self.shape
        pair.post_slot(self.slot, SLOT_POSTED, seq)
        self.phase = PEER_POSTED if self.reads else PEER_REDUCED
        # (name, perf_counter) as each step ends: where a call's time went (step_times_us), the record of a
        # host's slow spells (docs/design.md); None below TIMELINE_FROM_BYTES
        self.marks = [("posted", time.perf_counter())] if src.nbytes >= TIMELINE_FROM_BYTES else None

    @property
    def done(self) -> bool:
        return self.phase == FINISHED

    @property
    def step(self) -> str:
        """The step under way (the one a failure names): the first until its read and reduction are made."""
        return self.steps[0] if self.phase == PEER_POSTED else self.steps[-1]

    def advance(self) -> bool:
        """One non-blocking look at the peer's flags; True when a step moved."""
        peer, seq = self.pair.peer_slots[self.slot], self.seq
        moved = False
        if self.phase == PEER_POSTED:
            if peer[SLOT_POSTED] != seq or peer[SLOT_SHAPE] != self.shape:
                return False
            self._mark("peer_posted")
            self._first_step(int(peer[SLOT_SRC]), int(peer[SLOT_OUT]))
            self._mark("read")
            if not self.peer_reads:  # a broadcast's or reduce's reader: nothing of it is read
                self.phase = FINISHED
                return True
            moved = True
        if self.phase == PEER_REDUCED:
            if peer[SLOT_REDUCED] != seq:
                return moved
            if len(self.steps) == 1:  # the peer is done with this rank's input
                self._finish()
                return True
            self._mark("peer_reduced")
            self._land_result()
            self._mark("landed")
            self.pair.post_slot(self.slot, SLOT_DONE, seq)
            self.phase, moved = PEER_DONE, True
        if self.phase == PEER_DONE and peer[SLOT_DONE] == seq:
            self._finish()
            return True
        return moved

    def _finish(self) -> None:
        self.phase = FINISHED
        self._mark("done")

    def _mark(self, name: str) -> None:
        """A step ended now (the timeline, where the call keeps one)."""
        if self.marks is not None:
            self.marks.append((name, time.perf_counter()))

    def step_times_us(self) -> Optional[dict]:
        """How long each step took and each wait for the peer lasted, in microseconds, so far
        (None: a call below TIMELINE_FROM_BYTES keeps no timeline)."""
        return None if self.marks is None else step_times_us(self.marks)

    def abandon(self) -> None:
        """The operation failed: clear the slot before the caller hears of it (a
        peer still reading then fails its check instead of taking what the caller
        may now write). Every read here was synchronous: nothing is left in flight."""
        if self.phase != FINISHED:
            clear_slot(self.pair, self.slot)
        self.phase = FINISHED

    @property
    def waiting_for(self) -> str:
        return {PEER_POSTED: "the peer to post its buffers",
                PEER_REDUCED: f"the peer to finish its {self.steps[0]} read",
                PEER_DONE: f"the peer to finish its {STEPS[1]} read",
                FINISHED: "nothing"}[self.phase]

    def _first_step(self, peer_src: int, peer_out: int) -> None:
        self.peer_out = peer_out
        if self.reduces:  # all_reduce, reduce_scatter, a reduce's root
            self._read_and_reduce(peer_src + self.src_offset)
        else:  # all_gather, all_to_all, broadcast: the peer's block into its place, this rank's into its own
            self._read(self.theirs_out, peer_src + self.src_offset, SLOT_POSTED)
            if self.mine_out.ctypes.data != self.mine_in.ctypes.data:  # not in place
                self.mine_out[...] = self.mine_in
        self.pair.post_slot(self.slot, SLOT_REDUCED, self.seq)
        self.phase = PEER_REDUCED

    def _read_and_reduce(self, address: int) -> None:
        """The peer's operand of this rank's block, READ_PART_BYTES at a time, each part
        reduced with this rank's own before the next: in place through the kept
        buffer into its own operand (which is its output), out of place read into
        the output and reduced there (a block above READ_PARTS_MAX_OUT_BYTES whole)."""
        mine, itemsize = self.mine_in, self.mine_in.itemsize
        in_place = np.may_share_memory(mine, self.mine_out)
        whole = not in_place and mine.nbytes > READ_PARTS_MAX_OUT_BYTES
        step = mine.size if whole else max(1, READ_PART_BYTES // itemsize)
        dest = mine if in_place else self.mine_out
        scratch = self.scratch(min(mine.nbytes, step * itemsize)).view(mine.dtype) if in_place else None
        # Each part's address from one base (cma.read_at), not from numpy per part.
        land_at, stride = (scratch.ctypes.data, 0) if in_place else (dest.ctypes.data, step * itemsize)
        timed = self.landing is not None
        for k, lo in enumerate(range(0, mine.size, step)):
            part = dest[lo:lo + step]
            incoming = part if scratch is None else scratch[:part.size]
            start = time.perf_counter() if timed else 0.0
            self._read_at(land_at + k * stride, part.nbytes, address + lo * itemsize, SLOT_POSTED)
            if timed:
                self._first_reads_s += time.perf_counter() - start
            self._reduce(part, mine[lo:lo + step], incoming)

    def _land_result(self) -> None:
        """Read the peer's block of an all_reduce's output into this rank's. In place,
        flush the lines it lands in first where ``landing`` says so, and tell it how
        long the landing took per byte against the first step's reads."""
        address, landing = self.peer_out + self.out_offset, self.landing
        if landing is None:
            self._read(self.theirs_out, address, SLOT_REDUCED)
            return
        flushes = landing.flush_next(cacheflush.prepare)  # (numba's first load, not timed)
        start = time.perf_counter()
        if flushes:
            cacheflush.flush(self.theirs_out)
        self._read(self.theirs_out, address, SLOT_REDUCED)
        landing.record(flushes, (time.perf_counter() - start) / max(1, self.theirs_out.nbytes),
                       self._first_reads_s / max(1, self.mine_in.nbytes))

    def _reduce(self, out: np.ndarray, own: np.ndarray, incoming: np.ndarray) -> None:
        """out = in_0 op in_1: rank 0's operand on the left, as on every path."""
        left, right = (own, incoming) if self.rank == 0 else (incoming, own)
        reduce_to(out, left, right, self.op)

    def _read(self, dst: np.ndarray, address: int, word: int) -> None:
        """One cross-memory read from the peer into ``dst``; then check that the peer
        still stands at the step the read relied on (module docstring)."""
        self._read_at(dst.ctypes.data, dst.nbytes, address, word)

    def _read_at(self, local_address: int, nbytes: int, address: int, word: int) -> None:
        """_read to an address in this process (``nbytes`` there)."""
        try:
            cma.read_at(local_address, nbytes, self.pair.peer_pid, address)
        except OSError as exc:
            what = f"cross-memory read of {nbytes} bytes failed: {exc}"
            if exc.errno == errno.ESRCH:  # its process exited: an abort need not tell it
                err = self.error(f"rank(s) [{1 - self.rank}] are gone (their processes exited): {what}", self.step)
                err.lost_ranks = (1 - self.rank,)
                raise err from exc
            raise self.error(what, self.step) from exc
        if self.pair.peer_slots[self.slot, word] != self.seq:
            raise self.error("the peer left the operation while this rank read its buffers", self.step)


def step_times_us(marks: list) -> dict:
    """CmaSteps.marks as {interval: microseconds} (INTERVALS): the waits for the peer's post,
    its REDUCED and its last flag, the first step (reads and reduction) and an all_reduce's landing."""
    return {INTERVALS[name]: (t - t_before) * 1e6 for (_, t_before), (name, t) in zip(marks, marks[1:])}


def clear_slot(segments, slot: int) -> None:
    """A failed operation's slot, cleared (its steps' abandon): a peer reading
    this rank's buffers on the strength of a step then fails its check."""
    for word in (SLOT_POSTED, SLOT_REDUCED, SLOT_DONE):
        segments.post_slot(slot, word, 0)


def _blocks(collective: str, src: np.ndarray, out: np.ndarray, rank: int):
    """(steps, (mine_in, mine_out, theirs_in, theirs_out)): two_step._geometry's,
    an all_to_all's (blocks of both buffers, placed like an all_gather's), and a
    broadcast's or reduce's (one block, the whole buffer: the reader's operand
    and output, the other's input)."""
    if collective == "all_to_all":
        mine, theirs = _split_at(src.size // 2, src.size, rank)
        return STEPS[1:], (src[mine], out[mine], src[theirs], out[theirs])
    if collective == "broadcast":  # placed whole; nothing of this rank's own to copy
        return (collective,), (src[:0], out[:0], src, out)
    if collective == "reduce":  # the root's operand and output (a rank that is not the root reads nothing)
        return (collective,), (src, out, src, out[:0])
    return _geometry(collective, src, out, rank)


def _read_offsets(collective: str, src: np.ndarray, out: np.ndarray, rank: int) -> tuple[int, int]:
    """Where this rank's reads start in its peer's input and output, in bytes
    (the layouts are the same on both ranks): the peer's operand of the block
    this rank owns (all_gather: the peer's whole input; all_to_all: the peer's
    block for this rank), and the peer's block of an all_reduce's output. From
    the slices _blocks cuts (cheaper than asking numpy for the views' addresses)."""
    if collective == "all_reduce":
        mine, theirs = halves(src.size, rank)
        return mine.start * src.itemsize, theirs.start * out.itemsize
    if collective == "reduce_scatter":
        return (out.size if rank else 0) * src.itemsize, 0
    if collective == "all_to_all":
        return (src.size // 2 if rank else 0) * src.itemsize, 0
    return 0, 0  # all_gather, broadcast, reduce: the peer's whole input
