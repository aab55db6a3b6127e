"""A 2-rank reduce_scatter, all_gather, all_to_all, broadcast or reduce whose
part (direct_ops.peer_part: what the peer needs of this rank) goes through the
shared-memory outboxes (transports/shm.py) in chunks: its owner copies each
chunk in and posts it, and the peer copies it out into its output (or reduces
it there with its own operand) as soon as it is posted, while the owner copies
the next. The pipe: direct_ops.DirectPipeBlocksOp, for a broadcast's buffer above the
lane's bound and within the outbox, a reduce's to 256 MiB round the outbox
(PIPE_MAX_BYTES), and, on a pair that does not read across processes, an
all_gather's block up to 768 KiB, a broadcast's buffer to 4 MiB and a
reduce_scatter's block to 128 MiB.

Why: a broadcast's or reduce's buffer there went as one UCX message (below 1 MiB)
or as one cross-memory read of the peer's buffer (cma_steps.py), either way a
copy the reader makes alone while the other rank waits. Through the outbox the
two ranks split it: the owner copies chunk k + 1 in while the peer copies (or
reduces) chunk k out, each chunk still in cache, every outbox page mapped at
set-up. Where both ranks copy anyway (all_gather, all_to_all, reduce_scatter)
the outbox only adds a pass over every byte, and the reads win; the steps take
those collectives too, so that the measurement can be repeated
(bench/results/pipe_s32/; docs/design.md, "The pipe").

One operation (``seq``, from 1, the same on both ranks; the ranks met in the
segments before either takes anything: direct_ops.SegmentMeetingOp):

1. this rank writes its call's shape in FLAG_PIPE_SHAPE, then copies its part
   into its outbox PIPE_CHUNK_BYTES at a time, each chunk followed by
   FLAG_CHUNKS = seq x CHUNK_SPAN + the chunks posted so far (so the flag only
   grows across operations, like every flag of the segments). A part larger
   than the outbox goes round it: chunk k in place k mod ``ring``, posted once
   the peer took chunk k - ``ring`` (its FLAG_CHUNKS_TAKEN);
2. between its own chunks, and after them, it takes each chunk the peer has
   posted (once: the shapes agree) up to as many as it posted itself: the peer's
   chunk into its place in the output, or reduced there with this rank's
   operand of the same range in rank order (rank 0's on the left, as on every
   path), and its own block's copy of that range; then FLAG_CHUNKS_TAKEN =
   seq x CHUNK_SPAN + the peer's chunks taken whole;
3. once it took the whole of the peer's part: FLAG_TAKEN = seq ("done with your
   outbox");
4. done once the peer's FLAG_TAKEN reached seq as well (its outbox is written
   again only by its next operation); a rank that posted nothing (a
   broadcast's reader, a reduce's root) waits for nothing more.

The operations through the outboxes take the segments in turn
(Engine.shm_holder), so an outbox holds one operation's part at a time.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .cma_steps import SHAPE_CODES
from .errors import TransportError
from .reduce import reduce_to
from .transports.shm import FLAG_CHUNKS, FLAG_CHUNKS_TAKEN, FLAG_PIPE_SHAPE, FLAG_TAKEN, LANE_MAX_BYTES, OUTBOX_BYTES

# The largest part that goes through the pipe, per collective: the rooted ones to
# the outbox's size on every pair; all_gather, on a pair that does not read across
# processes, to where its messages win. 2 ranks, float32, this checkout against the
# paths before it (UCX messages below 1 MiB, reads from there), alternating
# processes, 5 rounds (bench/results/pipe_s32/): reduce 1.20-1.53x at 512 KiB-2 MiB,
# broadcast 0.97x at 512 KiB and 1.06-1.16x at 768 KiB-2 MiB (one rank copies in
# while the other copies out; the reads leave the whole copy to the reader);
# all_gather 1.13x at 512 KiB, 1.02 at 768 KiB against the messages, but 0.83-0.84x
# against reading its blocks (the reads from 512 KiB: direct_ops.DIRECT_CMA_BLOCK_BYTES),
# and 0.73-0.77x at 1-2 MiB. all_to_all (0.71-0.94x) and reduce_scatter (0.74-0.86x)
# lost everywhere: both ranks copy all the time, and the outbox adds a pass over
# every byte.
# Above the outbox's size the parts go round it. A reduce, interleaved in one
# launch, three launches each: against the reads 1.21-5.40x at 4 MiB, 0.80-1.85x
# at 16, 0.92-1.44x at 64, 1.97-3.81x at 256 MiB (bench/results/pipe_ring_s53/);
# on a pair that does not read (a container that refuses process_vm_readv:
# MPCCS_CMA=0 MPCCS_UP_TLS=posix,sysv,self) against the DAG's tree over UCX
# 2.2-4.7x at 4-256 MiB (bench/results/outbox_no_reads_s53/). A broadcast lost
# from 16 MiB (against the reads 0.91x at 16 MiB and 0.22x at 64; against the
# tree 0.28-0.52x at 16-64 MiB, 1.29-1.51x at 4 MiB): the reader's copies out of
# lines the root had just written ran at ~2 GB/s. A reduce_scatter, on a pair
# that does not read, against the direct messages, the two-step executor or the
# ring over UCX: 1.15-1.77x at 512 KiB-128 MiB blocks (all_gather 0.56-0.69x and
# all_to_all 0.64-0.71x at 2-32 MiB: copies only, as the broadcast).
PIPE_MAX_BYTES = {"broadcast": OUTBOX_BYTES, "reduce": 256 << 20}
PIPE_MAX_BYTES_WITHOUT_READS = {**PIPE_MAX_BYTES, "broadcast": 4 << 20, "all_gather": 768 << 10,
                                "reduce_scatter": 128 << 20}
# The outbox's pages stay in the writer's cache while the peer reads them: 128 KiB
# chunks copied 1.06-1.25x faster than 256-512 KiB ones at 512 KiB-2 MiB (both
# ranks' steps in one process); 32-64 KiB lost to the per-chunk cost.
PIPE_CHUNK_BYTES = 128 << 10
CHUNK_SPAN = 1 << 16  # FLAG_CHUNKS = seq x CHUNK_SPAN + chunks: more than a part has chunks


def takes(collective: str, block_bytes: int, reads: bool) -> bool:
    """Whether a 2-rank call whose part is ``block_bytes`` (comm._block_bytes:
    the same on both ranks) goes through the pipe: above the lane's bound (the
    lane takes those whole), within PIPE_MAX_BYTES (``reads``: the pair reads
    across processes, ShmPair.cma; else PIPE_MAX_BYTES_WITHOUT_READS)."""
    bounds = PIPE_MAX_BYTES if reads else PIPE_MAX_BYTES_WITHOUT_READS
    return LANE_MAX_BYTES < block_bytes <= bounds.get(collective, 0)


class PipeSteps:
    """One 2-rank call's chunks through the outboxes (module docstring), the first
    posted at once; advance() until ``done``. ``part``: what this rank posts
    (direct_ops.peer_part), ``count``: the elements it takes from its peer;
    ``error(message, step)`` makes the exception a failed step raises (naming
    rank, plane, peer, step)."""

    step = "pipe"

    def __init__(self, pair, seq: int, rank: int, collective: str, src: np.ndarray, out: np.ndarray, op: str,
                 part: np.ndarray, count: int, error: Callable[[str, str], TransportError], root: int = 0):
        self.pair, self.seq, self.rank, self.op, self.error = pair, seq, rank, op, error
        self.shape = SHAPE_CODES[collective] << 56 | root << 48 | src.nbytes
        self.chunk = max(1, PIPE_CHUNK_BYTES // src.itemsize)
        self.ring = OUTBOX_BYTES // (self.chunk * src.itemsize)  # chunks the outbox holds
        self.part, self.count = part, count
        ring_bytes = self.ring * self.chunk * src.itemsize
        self.own_box = pair.own_box[:min(part.nbytes, ring_bytes)].view(src.dtype)
        self.peer_box = pair.peer_box[:min(count * src.itemsize, ring_bytes)].view(src.dtype)
        self.dest, self.operand, self.own_copy = _placement(collective, src, out, rank, count)
        self.posted = self.taken = 0  # elements of this rank's part posted, of the peer's taken
        self.base = seq * CHUNK_SPAN
        self.shape_checked = False
        self.took_all = False
        self.done = False
        pair.own_flags[FLAG_PIPE_SHAPE] = self.shape  # (fenced by the first chunk's post)
        self._post_chunk()

    def advance(self) -> bool:
        """Post this rank's next chunk, take what the peer posted; True when anything moved."""
        if self.done:
            return False
        moved = False
        if self.posted < self.part.size and self._room_for_next():
            self._post_chunk()
            moved = True
        moved |= self._take_posted()
        if not self.took_all and self.taken == self.count:
            self.pair.post(FLAG_TAKEN, self.seq)
            self.took_all = moved = True
        if self.took_all and self.posted == self.part.size and (
                not self.part.size or self.pair.peer_reached(FLAG_TAKEN, self.seq)):
            self.done = moved = True
        return moved

    def abandon(self) -> None:
        """The operation failed: nothing to clear (the flags only grow, and the
        outbox is written again only by this rank's next operation)."""
        self.done = True

    @property
    def waiting_for(self) -> str:
        if self.taken < self.count:
            return f"the peer's chunk at element {self.taken} of {self.count} in its outbox"
        if self.posted < self.part.size:
            return f"the peer to take chunks of this rank's outbox (posted to element {self.posted})"
        return "the peer to take this rank's part" if not self.done else "nothing"

    def _room_for_next(self) -> bool:
        """Whether the outbox place of this rank's next chunk is free: the peer took
        the chunk ``ring`` before it (a part within the outbox never waits)."""
        k = self.posted // self.chunk
        return k < self.ring or int(self.pair.peer_flags[FLAG_CHUNKS_TAKEN]) - self.base > k - self.ring

    def _box_at(self, element: int) -> int:
        """Where a part's element lies in its outbox: chunk k in place k mod ``ring``."""
        return element // self.chunk % self.ring * self.chunk + element % self.chunk

    def _post_chunk(self) -> None:
        lo, hi = self.posted, min(self.posted + self.chunk, self.part.size)
        if hi > lo:
            at = self._box_at(lo)
            self.own_box[at:at + hi - lo] = self.part[lo:hi]
            self.pair.post(FLAG_CHUNKS, self.base + -(-hi // self.chunk))  # the chunks posted so far
        self.posted = hi

    def _take_posted(self) -> bool:
        """Take every chunk of the peer's part it has posted (at most as many as
        this rank posted: an in-place call's part is out of the way first)."""
        chunks = int(self.pair.peer_flags[FLAG_CHUNKS]) - self.base
        if chunks <= 0 or self.taken == self.count:
            return False
        if not self.shape_checked:
            self._check_shape()
        ready = min(chunks * self.chunk, self.count)
        if self.part.size:
            ready = min(ready, self.posted)
        if ready <= self.taken:
            return False
        lo = self.taken
        while lo < ready:  # chunk by chunk: places in the peer's outbox wrap round
            end = min((lo // self.chunk + 1) * self.chunk, ready)
            at = self._box_at(lo)
            self._combine(lo, end, self.peer_box[at:at + end - lo])
            lo = end
        self.taken = ready
        whole = ready // self.chunk if ready < self.count else -(-ready // self.chunk)
        self.pair.post(FLAG_CHUNKS_TAKEN, self.base + whole)
        return True

    def _check_shape(self) -> None:
        """The peer posted chunks of this operation: of the same call (the fingerprint
        says so too, where fingerprints are on), or its part is not what this rank takes."""
        theirs = int(self.pair.peer_flags[FLAG_PIPE_SHAPE])
        if theirs != self.shape:
            raise self.error(f"the peer's call has shape {theirs:#x} in its segment, this rank's {self.shape:#x}: "
                             "not the same collective, root and size", self.step)
        self.shape_checked = True

    def _combine(self, lo: int, hi: int, theirs: np.ndarray) -> None:
        if self.operand is not None:
            own = self.operand[lo:hi]
            left, right = (own, theirs) if self.rank == 0 else (theirs, own)
            reduce_to(self.dest[lo:hi], left, right, self.op)
            return
        self.dest[lo:hi] = theirs
        if self.own_copy is not None:
            own_in, own_out = self.own_copy
            own_out[lo:hi] = own_in[lo:hi]


def _placement(collective: str, src: np.ndarray, out: np.ndarray, rank: int, count: int):
    """(dest, operand, own_copy): where the peer's part goes (its ``count`` elements),
    this rank's operand it is reduced with (None: placed), and this rank's own
    block's (input, output) to copy range by range (None: nothing to copy, or in place)."""
    peer = 1 - rank
    if collective == "reduce_scatter":
        return out, src[rank * count:(rank + 1) * count], None
    if collective == "reduce":
        return (out, src, None) if count else (out[:0], None, None)  # the root reduces; the other takes nothing
    if collective == "broadcast":
        return out[:count], None, None  # the reader places the whole buffer; the root takes nothing
    dest = out[peer * count:(peer + 1) * count]  # all_gather, all_to_all
    own_in = src if collective == "all_gather" else src[rank * count:(rank + 1) * count]
    own_out = out[rank * count:(rank + 1) * count]
    return dest, None, None if np.may_share_memory(own_in, own_out) else (own_in, own_out)

