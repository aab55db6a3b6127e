"""An all_reduce, reduce_scatter, all_gather or all_to_all of a 3- to 8-rank
job on one host above the group lane's bound, each rank reading what it needs
straight from the other ranks' buffers (cross-memory attach: transports/cma.py),
paced by flags in the group's segments (transports/shm_group.py): the N-rank
form of the 2-rank reads (cma_steps.py).

Why: above the group lane's bound (680 KiB on 4 ranks) these calls ran the
DAG's ring or recursive halving-doubling over UCX, one rendezvous per chunk:
4 ranks, 1 MiB all_reduce 1.7 ms against MPICH's 0.9; 3 ranks, 2 MiB 2.1 ms
against 0.9. Here a block is one process_vm_readv per peer and a flag.

Rank r owns block r of the buffer (bounds: page-aligned, as even as that
allows). Each operation uses slot ``seq % SLOTS`` of every rank's read table;
a rank writes only its own:

1. post the addresses of its input and output and the call's shape (the
   collective and the input's size), then POSTED = seq;
2. once every peer posted the same shape: a reduction folds block r of
   every rank's input in rank order, ((x0 op x1) op x2) ..., the group
   lane's and the direct path's order, so the result is theirs bit for bit,
   reading each peer's operand READ_PART_BYTES at a time; an all_gather reads
   each peer's input into its place, an all_to_all each peer's block for
   this rank, each peer's as soon as that peer posted (nothing waits on the
   others); then REDUCED = seq ("my block is final, and I am done reading
   your input");
3. all_reduce only: from each peer whose REDUCED = seq, read that peer's
   block of its output into this rank's, then DONE = seq ("done reading your
   output");
4. done once every peer posted the last flag of its own steps (REDUCED, or
   DONE for an all_reduce): no peer reads anything of ours from then on.

A rank never writes into another's memory. As cma_steps.py: the ranks meet
first (their fingerprints in the segments: group_lane_ops.GroupReadsOp), the
shape in a peer's slot must match, after each read the reader checks that
the peer still stands at the step the read relied on (a failed rank clears
its slot before its caller hears of it: abandon), and operations take the
segments in turn (Engine.shm_holder), so a rank has one of them in its
slot table at a time.
"""
from __future__ import annotations

import errno
from typing import Callable

import numpy as np

from .cma_steps import READ_PART_BYTES, SHAPE_CODES, clear_slot
from .errors import TransportError
from .reduce import reduce_into
from .transports import cma
from .transports.shm import SLOT_DONE, SLOT_OUT, SLOT_POSTED, SLOT_REDUCED, SLOT_SHAPE, SLOT_SRC, SLOTS

GROUP_READ_COLLECTIVES = frozenset(("all_reduce", "reduce_scatter", "all_gather", "all_to_all"))
BLOCK_ALIGN_BYTES = 4096
# What each phase waits for: every peer's flag.
PEERS_POSTED, PEERS_REDUCED, PEERS_DONE, FINISHED = range(4)
_WAITING_FOR = {PEERS_POSTED: "to post their buffers", PEERS_REDUCED: "to finish their first step's reads",
                PEERS_DONE: "to finish reading the reduced blocks"}


def block_bounds(count: int, itemsize: int, size: int) -> list[int]:
    """Element offsets of the ``size`` blocks of an all_reduce's buffer (block r:
    [bounds[r], bounds[r + 1])): each starts on a BLOCK_ALIGN_BYTES boundary where
    the buffer allows, so every read and reduction runs over whole pages."""
    align = max(1, BLOCK_ALIGN_BYTES // itemsize)
    bounds = [min(count, -(-count * r // size) // align * align) for r in range(size)]
    return bounds + [count]


class GroupReadSteps:
    """One call's steps (module docstring), posted at once; advance() until
    ``done``. ``scratch(nbytes)``: a buffer the reads land in before they are
    reduced; ``error(message, step, peer)`` makes the exception a failed step
    raises (naming rank, plane, peer, step)."""

    def __init__(self, group, seq: int, rank: int, collective: str, src: np.ndarray, out: np.ndarray, op: str,
                 scratch: Callable[[int], np.ndarray], error: Callable[[str, str, int], TransportError]):
        self.group, self.seq, self.rank, self.op, self.collective = group, seq, rank, op, collective
        self.slot = seq % SLOTS
        self.src, self.out, self.scratch, self.error = src, out, scratch, error
        self.shape = SHAPE_CODES[collective] << 56 | src.nbytes
        self.steps = ("reduce_scatter", "all_gather") if collective == "all_reduce" else (collective,)
        self.bounds = block_bounds(src.size, src.itemsize, group.size) if collective == "all_reduce" else None
        self.gathers = collective in ("all_gather", "all_to_all")  # read from each peer as it posts
        # Peers in the order this rank reads them: from rank + 1 on, so that the ranks'
        # reads spread over every rank's memory instead of all starting at one.
        self.order = [(rank + k) % group.size for k in range(1, group.size)]
        self.waiting = list(self.order)  # peers not at the flag the phase waits for
        self.peer_src, self.peer_out = {}, {}
        own = group.own_slots[self.slot]
        own[SLOT_SRC], own[SLOT_OUT], own[SLOT_SHAPE] = src.ctypes.data, out.ctypes.data, self.shape
        group.post_slot(self.slot, SLOT_POSTED, seq)
        self.phase = PEERS_POSTED

    @property
    def done(self) -> bool:
        return self.phase == FINISHED

    @property
    def step(self) -> str:
        """The step under way (the one a failure names)."""
        return self.steps[0] if self.phase <= PEERS_POSTED else self.steps[-1]

    @property
    def waiting_for(self) -> str:
        if self.phase == FINISHED:
            return "nothing"
        return f"ranks {self.waiting} {_WAITING_FOR[self.phase]}"

    def advance(self) -> bool:
        """One non-blocking look at the peers' flags; True when a step moved."""
        moved = False
        if self.phase == PEERS_POSTED:
            posted = self._take_posted()
            if self.gathers:  # each peer's block as it posts: nothing waits on the others
                for peer in posted:
                    self._place_from(peer)
            if self.waiting:
                return bool(posted)
            self._first_step()
            self.group.post_slot(self.slot, SLOT_REDUCED, self.seq)
            self.phase, self.waiting, moved = PEERS_REDUCED, list(self.order), True
        if self.phase == PEERS_REDUCED:
            moved |= self._take_reduced()
            if self.waiting:
                return moved
            if self.collective != "all_reduce":  # every peer is done with this rank's input
                self.phase = FINISHED
                return True
            self.group.post_slot(self.slot, SLOT_DONE, self.seq)
            self.phase, self.waiting = PEERS_DONE, list(self.order)
        if self.phase == PEERS_DONE:
            slots, seq = self.group.slots, self.seq
            self.waiting = [p for p in self.waiting if slots[p][self.slot, SLOT_DONE] != seq]
            if not self.waiting:
                self.phase = FINISHED
                return True
        return moved

    def abandon(self) -> None:
        """The operation failed: clear the slot before the caller hears of it (a
        peer still reading then fails its check instead of taking what the caller
        may now write). Every read here was synchronous: nothing is left in flight."""
        if self.phase != FINISHED:
            clear_slot(self.group, self.slot)
        self.phase = FINISHED

    # -- the steps --------------------------------------------------------------
    def _take_posted(self) -> list:
        """Note the buffers of each peer that posted this call since the last look; those peers."""
        slots, seq, posted = self.group.slots, self.seq, []
        for peer in list(self.waiting):
            theirs = slots[peer][self.slot]
            if theirs[SLOT_POSTED] != seq:
                continue
            if theirs[SLOT_SHAPE] != self.shape:
                raise self.error(f"rank {peer} posted another call's shape in its read slot "
                                 f"({int(theirs[SLOT_SHAPE]):#x}, not {self.shape:#x})", self.step, peer)
            self.peer_src[peer], self.peer_out[peer] = int(theirs[SLOT_SRC]), int(theirs[SLOT_OUT])
            self.waiting.remove(peer)
            posted.append(peer)
        return posted

    def _first_step(self) -> None:
        src, out, rank, size = self.src, self.out, self.rank, self.group.size
        if self.collective == "all_reduce":
            bounds = self.bounds
            self._fold(out[bounds[rank]:bounds[rank + 1]], bounds[rank])
        elif self.collective == "reduce_scatter":
            self._fold(out, rank * out.size)
        elif self.collective == "all_gather":  # (the peers' blocks are in place: _place_from)
            n = src.size
            self._copy_own(out[rank * n:(rank + 1) * n], src)
        else:  # all_to_all
            n = out.size // size
            self._copy_own(out[rank * n:(rank + 1) * n], src[rank * n:(rank + 1) * n])

    def _place_from(self, peer: int) -> None:
        """An all_gather's or all_to_all's read of ``peer``'s block for this rank into its place."""
        out, n = self.out, self.out.size // self.group.size
        offset = 0 if self.collective == "all_gather" else self.rank * n * self.src.itemsize
        self._read(out[peer * n:(peer + 1) * n], peer, self.peer_src[peer] + offset, SLOT_POSTED)

    def _fold(self, dest: np.ndarray, start: int) -> None:
        """dest = block [start, start + dest.size) of every rank's input folded in
        rank order, READ_PART_BYTES at a time: operand 0 into dest, then each
        next one reduced into it (reduce_into: dest on the left), each peer's
        read into the scratch first. In place (dest is this rank's own operand)
        the own part is kept in the scratch before operand 0 lands over it."""
        src, rank, itemsize = self.src, self.rank, self.src.itemsize
        own = src[start:start + dest.size]
        in_place = np.may_share_memory(own, dest)
        step = max(1, READ_PART_BYTES // itemsize)
        part_bytes = min(dest.size, step) * itemsize
        scratch = self.scratch(2 * part_bytes).view(src.dtype)
        landing, kept = scratch[:part_bytes // itemsize], scratch[part_bytes // itemsize:]
        offset = start * itemsize
        for lo in range(0, dest.size, step):
            part, mine = dest[lo:lo + step], own[lo:lo + step]
            if in_place and rank:
                kept[:mine.size] = mine
                mine = kept[:mine.size]
            at = offset + lo * itemsize
            if rank:
                self._read(part, 0, self.peer_src[0] + at, SLOT_POSTED)
            elif not in_place:
                part[...] = mine
            for r in range(1, self.group.size):
                if r == rank:
                    reduce_into(part, mine, self.op)
                    continue
                incoming = landing[:part.size]
                self._read(incoming, r, self.peer_src[r] + at, SLOT_POSTED)
                reduce_into(part, incoming, self.op)

    def _copy_own(self, dest: np.ndarray, block: np.ndarray) -> None:
        if dest.ctypes.data != block.ctypes.data:
            dest[...] = block

    def _take_reduced(self) -> bool:
        """Take note of each peer that reduced; an all_reduce reads that peer's
        block of its output. True when one moved."""
        slots, seq, bounds, moved = self.group.slots, self.seq, self.bounds, False
        for peer in list(self.waiting):
            if slots[peer][self.slot, SLOT_REDUCED] != seq:
                continue
            if bounds is not None:
                lo, hi = bounds[peer], bounds[peer + 1]
                self._read(self.out[lo:hi], peer, self.peer_out[peer] + lo * self.out.itemsize, SLOT_REDUCED)
            self.waiting.remove(peer)
            moved = True
        return moved

    def _read(self, dst: np.ndarray, peer: int, address: int, word: int) -> None:
        """One cross-memory read from ``peer`` into ``dst``; then check that the
        peer still stands at the step the read relied on (module docstring)."""
        try:
            cma.read_at(dst.ctypes.data, dst.nbytes, self.group.pids[peer], address)
        except OSError as exc:
            what = f"cross-memory read of {dst.nbytes} bytes from rank {peer} failed: {exc}"
            if exc.errno == errno.ESRCH:  # its process exited: an abort need not tell it
                err = self.error(f"rank(s) [{peer}] are gone (their processes exited): {what}", self.step, peer)
                err.lost_ranks = (peer,)
                raise err from exc
            raise self.error(what, self.step, peer) from exc
        if self.group.slots[peer][self.slot, word] != self.seq:
            raise self.error(f"rank {peer} left the operation while this rank read its buffers", self.step, peer)
