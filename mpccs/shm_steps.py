"""The two-step collectives' block exchanges through shared-memory segments
(transports/shm.py) instead of UCX messages, for blocks up to
SHM_MAX_BLOCK_BYTES: a 2-rank all_reduce on the direct path
(engine.DirectShmAllReduceOp) and the two-step executor (two_step.py) where
both ranks declare it.

The same steps and the same geometry as the executor's messages (see
two_step.geometry): this rank's operand of its own block ``mine_in``, that
block's result ``mine_out``, its operand of the peer's block ``theirs_in``,
the peer's result ``theirs_out``.

1. This rank copies what it sends into its own outbox, ``theirs_in`` (or, for
   an all_gather alone, ``mine_in``), and posts FLAG_POSTED.
2. Once the peer has posted: reduce the peer's outbox with ``mine_in`` in rank
   order (rank 0's operand on the left) writing over the outbox, and copy the
   result to ``mine_out`` (all_gather alone: copy the peer's block to
   ``theirs_out``); post FLAG_TAKEN. The result stays in the peer's outbox,
   where the peer reads its copy of this block.
3. Once the peer has taken (it reduced this rank's outbox into the peer's
   block): copy that block to ``theirs_out`` (all_reduce); done.

Writing the reduction over the outbox, not into ``mine_out`` from two other
arrays, is what numpy does fastest here (two_step._incoming_buffer). An
outbox is written by its owner in step 1 and by the peer in step 2, and read
by both in steps 2 and 3; the owner writes it again only in its next
operation, after step 3 saw the peer take. Flags carry ``seq`` (the
operation's sequence number, from 1: the same on both ranks).
"""
from __future__ import annotations

import numpy as np

from .reduce import reduce_to
from .transports.shm import FLAG_POSTED, FLAG_TAKEN, OUTBOX_BYTES

SHM_MAX_BLOCK_BYTES = OUTBOX_BYTES
STEPS = ("reduce-scatter", "all-gather")


def fits(block_bytes: int) -> bool:
    return 0 < block_bytes <= SHM_MAX_BLOCK_BYTES


class ShmSteps:
    """One 2-rank operation's exchanges through the pair of segments; advance() until ``done``."""

    def __init__(self, pair, seq: int, rank: int, steps: tuple, geometry: tuple, op: str):
        self.pair, self.seq, self.rank, self.op = pair, seq, rank, op
        self.mine_in, self.mine_out, self.theirs_in, self.theirs_out = geometry
        self.reduces = steps[0] == STEPS[0]
        self.gathers = STEPS[1] in steps
        self.stage = 0  # 0: waiting for the peer's post; 1: for its take; 2: done
        sent = self.theirs_in if self.reduces else self.mine_in
        self.own_box = pair.own_box[:sent.nbytes].view(sent.dtype)
        np.copyto(self.own_box, sent)
        if not self.reduces and self.mine_out.ctypes.data != self.mine_in.ctypes.data:
            self.mine_out[...] = self.mine_in  # all_gather out of place: this rank's own block
        pair.post(FLAG_POSTED, seq)

    @property
    def done(self) -> bool:
        return self.stage == 2

    @property
    def waiting_for(self) -> str:
        return ("the peer's block in its segment", "the peer to take this rank's block", "nothing")[self.stage]

    @property
    def sent_bytes(self) -> int:
        return self.own_box.nbytes

    def advance(self) -> bool:
        """One non-blocking look at the peer's flags; True when a step moved."""
        moved = False
        if self.stage == 0:
            if not self.pair.peer_reached(FLAG_POSTED, self.seq):
                return False
            self._take_peer_block()
            self.pair.post(FLAG_TAKEN, self.seq)
            self.stage, moved = 1, True
        if self.stage == 1 and self.pair.peer_reached(FLAG_TAKEN, self.seq):
            if self.reduces and self.gathers:
                self.theirs_out[...] = self.own_box  # the peer's block, reduced there
            self.stage, moved = 2, True
        return moved

    def _take_peer_block(self) -> None:
        if self.reduces:
            box = self.pair.peer_box[:self.mine_in.nbytes].view(self.mine_in.dtype)  # the peer's part of my block
            left, right = (self.mine_in, box) if self.rank == 0 else (box, self.mine_in)
            reduce_to(box, left, right, self.op)
            self.mine_out[...] = box
        else:
            self.theirs_out[...] = self.pair.peer_box[:self.theirs_out.nbytes].view(self.theirs_out.dtype)
