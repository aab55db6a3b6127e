"""A 2-rank all_reduce's exchanges of halves through shared-memory segments
(transports/shm.py) instead of UCX messages, for halves up to
SHM_MAX_HALF_BYTES (direct_ops.DirectShmAllReduceOp, on the direct path).

The halves of the two-step executor (two_step.halves): this rank's operand
of the half it owns ``mine_in``, that half's result ``mine_out``, its operand
of the peer's half ``theirs_in``, the peer's result ``theirs_out``.

1. This rank copies ``theirs_in`` into its own outbox and posts FLAG_POSTED.
2. Once the peer has posted: reduce the peer's outbox with ``mine_in`` in rank
   order (rank 0's operand on the left) writing over the outbox, copy the
   result to ``mine_out``, post FLAG_TAKEN. The result stays in the peer's
   outbox, where the peer reads its copy of this half.
3. Once the peer has taken (it reduced this rank's outbox into the peer's
   half): copy that half to ``theirs_out``; done.

Writing the reduction over the outbox, not into ``mine_out`` from two other
arrays, is what numpy does fastest here (two_step._incoming_buffer). An
outbox is written by its owner in step 1 and by the peer in step 2, and read
by both in steps 2 and 3; the owner writes it again only in its next
operation, after step 3 saw the peer take. Flags carry ``seq`` (the
operation's sequence number, from 1: the same on both ranks).

The outbox's lines so pass between the two cores' caches every call. In the
launches where those caches are apart (docs/design.md, "The landing of an
in-place all_reduce") step 1's copy waits for each line to come back from the
peer: 430-440 us for a 1 MiB half against 27-29 in the other launches. There,
flushing the outbox before and after the copy (transports/cacheflush.py) took
a 2 MiB call to 0.46-0.47x its time, and elsewhere to 2.8-2.95x
(bench/results/outbox_flush_probe_s49/), so ``landing`` chooses from the
copy's time per byte against step 3's copy out (control/landing.py).

Only the all_reduce: four local passes over a half (copy in, reduce, two
copies out) pay against UCX's two exchanges and their sequencing, while a
reduce_scatter or all_gather on the direct path is one exchange straight
into the output, which the segments' two copies lost to (0.67-0.91x at
256 KiB-2 MiB, with both through these steps in bench/shm_ab.py, interleaved).
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from .control.landing import LandingChoices
from .reduce import reduce_to
from .transports import cacheflush
from .transports.shm import FLAG_POSTED, FLAG_TAKEN, OUTBOX_BYTES
from .two_step import halves

SHM_MAX_HALF_BYTES = OUTBOX_BYTES


def fits(half_bytes: int) -> bool:
    return 0 < half_bytes <= SHM_MAX_HALF_BYTES


class ShmSteps:
    """One 2-rank all_reduce's exchanges through the pair of segments; advance() until
    ``done``. ``landing``: whether step 1 flushes the outbox around its copy, per size
    of half (module docstring)."""

    def __init__(self, pair, seq: int, rank: int, src: np.ndarray, out: np.ndarray, op: str,
                 landing: Optional[LandingChoices] = None):
        self.pair, self.seq, self.rank, self.op = pair, seq, rank, op
        mine, theirs = halves(src.size, rank)
        self.mine_in, self.mine_out, self.theirs_in, self.theirs_out = src[mine], out[mine], src[theirs], out[theirs]
        self.stage = 0  # 0: waiting for the peer's post; 1: for its take; 2: done
        self.own_box = pair.own_box[:self.theirs_in.nbytes].view(src.dtype)
        self.landing = landing.for_bytes(self.own_box.nbytes) if landing is not None else None
        self.flushes = self.landing is not None and self.landing.flush_next(cacheflush.prepare)  # (not timed)
        start = time.perf_counter()
        if self.flushes:  # neither rank's stores into the outbox then wait for lines the other holds
            cacheflush.flush(self.own_box)
        np.copyto(self.own_box, self.theirs_in)
        if self.flushes:
            cacheflush.flush(self.own_box)
        self.copy_in_s = time.perf_counter() - start
        pair.post(FLAG_POSTED, seq)

    @property
    def done(self) -> bool:
        return self.stage == 2

    def abandon(self) -> None:
        """The operation failed: nothing to clear (the flags only grow, and the
        outbox is written again only by this rank's next operation)."""

    @property
    def waiting_for(self) -> str:
        return ("the peer's half in its segment", "the peer to take this rank's half", "nothing")[self.stage]

    def advance(self) -> bool:
        """One non-blocking look at the peer's flags; True when a step moved."""
        moved = False
        if self.stage == 0:
            if not self.pair.peer_reached(FLAG_POSTED, self.seq):
                return False
            self._reduce_own_half()
            self.pair.post(FLAG_TAKEN, self.seq)
            self.stage, moved = 1, True
        if self.stage == 1 and self.pair.peer_reached(FLAG_TAKEN, self.seq):
            start = time.perf_counter()
            self.theirs_out[...] = self.own_box  # the peer's half, reduced there
            if self.landing is not None:  # step 1's copy in against this copy out, per byte
                nbytes = max(1, self.own_box.nbytes)
                self.landing.record(self.flushes, self.copy_in_s / nbytes, (time.perf_counter() - start) / nbytes)
            self.stage, moved = 2, True
        return moved

    def _reduce_own_half(self) -> None:
        box = self.pair.peer_box[:self.mine_in.nbytes].view(self.mine_in.dtype)  # the peer's part of my half
        left, right = (self.mine_in, box) if self.rank == 0 else (box, self.mine_in)
        reduce_to(box, left, right, self.op)
        self.mine_out[...] = box
