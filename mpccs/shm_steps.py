"""A 2-rank all_reduce's exchanges of halves through shared-memory segments
(transports/shm.py) instead of UCX messages, SHM_MAX_HALF_BYTES of each half
per round (direct_ops.DirectShmAllReduceOp, on the direct path: one round up
to 4 MiB; on a pair that reads across processes up to direct_ops.OUTBOX_ROUNDS,
on one that does not to direct_ops.DIRECT_OUTBOX_MAX_BYTES).

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
operation's sequence number, from 1: the same on both ranks) x ROUND_SPAN +
the round.

Halves larger than the outbox go in rounds: round k carries the k-th of
``rounds`` equal shares of each half (the cut depends on the half alone, so
both ranks make it the same), and starts once round k - 1 finished here, its
step 3 having seen the peer take. So the outbox is reused exactly as by
consecutive operations, without their meeting: at 6-8 MiB two rounds ran
1.29-1.54x the reads' speed in place and 0.92-2.81x out of place
(bench/results/outbox_rounds_s53/).

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
from .transports.shm import FLAG_POSTED, FLAG_ROUND_TAKEN, OUTBOX_BYTES
from .two_step import halves

SHM_MAX_HALF_BYTES = OUTBOX_BYTES  # per round
ROUND_SPAN = 1 << 8  # FLAG_POSTED, FLAG_ROUND_TAKEN = seq x ROUND_SPAN + round


def fits(half_bytes: int) -> bool:
    return 0 < half_bytes <= SHM_MAX_HALF_BYTES


def rounds_for(larger_half_bytes: int) -> int:
    """The rounds through the outboxes of a call whose larger half holds these bytes."""
    return max(1, -(-larger_half_bytes // SHM_MAX_HALF_BYTES))


class ShmSteps:
    """One 2-rank all_reduce's exchanges through the pair of segments, in rounds of
    at most an outbox each (module docstring); advance() until ``done``.
    ``landing``: whether step 1 flushes the outbox around its copy, per size of
    half (module docstring)."""

    def __init__(self, pair, seq: int, rank: int, src: np.ndarray, out: np.ndarray, op: str,
                 landing: Optional[LandingChoices] = None):
        self.pair, self.seq, self.rank, self.op = pair, seq, rank, op
        self.src, self.out = src, out
        self.mine, self.theirs = halves(src.size, rank)
        # The same count on both ranks: from the larger half, whichever that is here.
        self.rounds = rounds_for((src.size - src.size // 2) * src.itemsize)
        if self.rounds >= ROUND_SPAN:
            raise ValueError(f"{src.nbytes} bytes need {self.rounds} rounds through the outboxes; "
                             f"at most {ROUND_SPAN - 1}")
        self.landing_choices = landing
        self.round = 0
        self.stage = 0  # 0: waiting for the peer's post; 1: for its take; 2: done
        self._copy_in()

    def _piece(self, half: slice, k: int) -> slice:
        """Round k's part of a half: the same cut on both ranks (it depends on the half alone)."""
        n = half.stop - half.start
        return slice(half.start + k * n // self.rounds, half.start + (k + 1) * n // self.rounds)

    def _flag(self) -> int:
        return self.seq * ROUND_SPAN + self.round

    def _copy_in(self) -> None:
        """Step 1 of this round: this rank's operand of its part of the peer's half into its outbox."""
        mine, theirs = self._piece(self.mine, self.round), self._piece(self.theirs, self.round)
        self.mine_in, self.mine_out = self.src[mine], self.out[mine]
        self.theirs_in, self.theirs_out = self.src[theirs], self.out[theirs]
        self.own_box = self.pair.own_box[:self.theirs_in.nbytes].view(self.src.dtype)
        choices = self.landing_choices
        self.landing = choices.for_bytes(self.own_box.nbytes) if choices is not None else None
        self.flushes = self.landing is not None and self.landing.flush_next(cacheflush.prepare)  # (not timed)
        start = time.perf_counter()
        if self.flushes:  # neither rank's stores into the outbox then wait for lines the other holds
            cacheflush.flush(self.own_box)
        np.copyto(self.own_box, self.theirs_in)
        if self.flushes:
            cacheflush.flush(self.own_box)
        self.copy_in_s = time.perf_counter() - start
        self.pair.post(FLAG_POSTED, self._flag())

    @property
    def done(self) -> bool:
        return self.stage == 2

    def abandon(self) -> None:
        """The operation failed: nothing to clear (the flags only grow, and the
        outbox is written again only by this rank's next operation)."""

    @property
    def waiting_for(self) -> str:
        what = ("the peer's half in its segment", "the peer to take this rank's half", "nothing")[self.stage]
        return what if self.rounds == 1 or self.done else f"{what} (round {self.round + 1} of {self.rounds})"

    def advance(self) -> bool:
        """One non-blocking look at the peer's flags; True when a step moved."""
        moved = False
        while self.stage < 2:
            if self.stage == 0:
                if not self.pair.peer_reached(FLAG_POSTED, self._flag()):
                    return moved
                self._reduce_own_half()
                self.pair.post(FLAG_ROUND_TAKEN, self._flag())
                self.stage, moved = 1, True
            if not self.pair.peer_reached(FLAG_ROUND_TAKEN, self._flag()):
                return moved
            self._copy_out()
            moved = True
            if self.round + 1 == self.rounds:
                self.stage = 2
            else:  # this outbox is free again: the peer took it (and this rank is done with the peer's)
                self.round, self.stage = self.round + 1, 0
                self._copy_in()
        return moved

    def _copy_out(self) -> None:
        """Step 3: the peer's half, reduced in this rank's outbox, to the output."""
        start = time.perf_counter()
        self.theirs_out[...] = self.own_box
        if self.landing is not None:  # step 1's copy in against this copy out, per byte
            nbytes = max(1, self.own_box.nbytes)
            self.landing.record(self.flushes, self.copy_in_s / nbytes, (time.perf_counter() - start) / nbytes)

    def _reduce_own_half(self) -> None:
        box = self.pair.peer_box[:self.mine_in.nbytes].view(self.mine_in.dtype)  # the peer's part of my half
        left, right = (self.mine_in, box) if self.rank == 0 else (box, self.mine_in)
        reduce_to(box, left, right, self.op)
        self.mine_out[...] = box
