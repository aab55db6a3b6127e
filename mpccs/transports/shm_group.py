"""A shared-memory segment per rank of a 3- to 8-rank job on one host, every
rank mapping every other's: the group lane, small collectives whole
(group_lane_ops.py), the N-rank form of the 2-rank lane (shm.py).

Why: on N ranks the direct path sends N - 1 UCX messages per rank and call,
tens of microseconds of Python and UCX each; 3-4 ranks sharing this VM's 2
cores took 82-184 us per 8-byte all_reduce and 164-460 us at 16-64 KiB
(bench/results/group_lane_s29/). Through segments every rank maps, a call is
a copy into the rank's own slot, a fingerprint entry, and reads of the
others' slots: 1.9-4.9x faster.

Layout of each rank's segment: a header page of int64 words, each written by
its owner only, then LANE_SLOTS slots, each LANE_META_BYTES of meta words (the
payload's operation sequence number and byte count) and then room for the
lane's larger bound (blocks_bound: it depends on the number of ranks). Header words:
FLAG_WAITING (the operation for which the owner stopped polling and sleeps
until a peer rings: shm.py), the fingerprint ring (as shm.py's: entry seq %
FP_RING holds the fingerprint's two words, then seq, written last), and the
taken table: word TAKEN_AT + j x LANE_SLOTS + k holds the last operation
whose payload in rank j's slot k the owner read (its own slot too). A rank
writes slot k again only once every rank's entry for it, its own included,
reached what the slot holds (lane_free).
Words WORD_PID, WORD_COOKIE, WORD_COOKIE_AT (as shm.py's) hold the owner's
pid and what the set-up's cross-memory read tries; from READS_AT, the reads'
slot table (group_read_steps.py): SLOTS slots of SLOT_WORDS words, shm.py's
layout (the buffers' addresses, the call's shape, the steps reached).
Publication relies on x86-64's store order and an uncontended lock as the
fence, as shm.py says.

Set-up (open_group) follows shm.open_pair: each rank creates its segment in
/dev/shm, the names go through the bootstrap store, each maps the others',
lets any process of its user read its memory where Yama asks (every peer
reads it: cma.allow_reads_by_any, as Open MPI's shared-memory transport
does), and once all have, tries one cross-memory read of every peer's
cookie; every rank learns every outcome (all or none use the group; the
reads only where every try worked), each unlinks its own: a crash leaves
no file behind.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Optional

import numpy as np

from . import cma
from .shm import (SLOT_WORDS, SLOTS, WORD_PID, create_segment, map_segment, reads_cookie_of, unlink_segment,
                  write_cookie)

GROUP_MAX_RANKS = 8  # comm.DIRECT_MAX_RANKS: the group lane replaces the direct path's messages
HEADER_BYTES = 4096
FLAG_WAITING = 3
FP_RING_AT, FP_RING, FP_WORDS = 16, 32, 3  # header words [16, 112)
LANE_SLOTS = 2  # a rank one operation ahead of the slowest peer need not wait to post
TAKEN_AT = FP_RING_AT + FP_RING * FP_WORDS  # [112, 112 + 8 x 2)
READS_AT = 128  # the reads' slot table: header words [128, 128 + 32 x 8)
# The largest input a rank publishes (group_lane_ops.takes_group_lane) for an all_reduce, broadcast,
# reduce or barrier: every rank reads and folds every other's whole input, (N - 1) x the input, at
# most GROUP_LANE_BUDGET_BYTES a call (as the direct path's medium messages: comm.DIRECT_MEDIUM_BUDGET)
# and at most GROUP_LANE_MAX_BYTES: 1 MiB on 3 ranks, 680 KiB on 4, 292 KiB on 8. Against the direct
# path, 3 ranks: 2.9x at 512 KiB, 2.0x at 1 MiB; 4 ranks: 2.9x at 512 KiB, 0.74x at 1 MiB, which this
# budget leaves to the direct path (bench/results/group_lane_bound_s29/).
GROUP_LANE_MAX_BYTES = 1 << 20
GROUP_LANE_BUDGET_BYTES = 2 << 20
# ... and for a reduce_scatter, all_gather or all_to_all, whose ranks take one block of each peer's
# slot (all_gather: all of it, as it must), the larger bound min(4 MiB, 8 MiB / (N - 1)): 4 MiB on 3
# ranks, 2.67 MiB on 4, 1.14 MiB on 8. Against reading the blocks across processes (the group reads,
# ~9 GB/s a reader here against 35-41 for a copy in one process), the lane at 1-2 MiB on 4 ranks:
# all_gather 1.35-2.0x, all_to_all 1.6-2.1x, reduce_scatter 1.1-2.2x; at 3-4 MiB on 3 ranks 1.04-1.39x
# (bench/results/group_reads_s30/lane_blocks_ab/). Slots hold this bound: a process maps 2 x it per rank.
GROUP_BLOCKS_MAX_BYTES = 4 << 20
GROUP_BLOCKS_BUDGET_BYTES = 8 << 20
LANE_META_BYTES = 64
LANE_AT = HEADER_BYTES


def lane_bound(size: int) -> int:
    """The group lane's largest all_reduce (broadcast, reduce) input on ``size`` ranks (a multiple of the page size)."""
    return min(GROUP_LANE_MAX_BYTES, GROUP_LANE_BUDGET_BYTES // (size - 1) // 4096 * 4096)


def blocks_bound(size: int) -> int:
    """The group lane's largest reduce_scatter, all_gather or all_to_all input on ``size`` ranks: its slots' size."""
    return min(GROUP_BLOCKS_MAX_BYTES, GROUP_BLOCKS_BUDGET_BYTES // (size - 1) // 4096 * 4096)


def segment_bytes(size: int) -> int:
    return LANE_AT + LANE_SLOTS * (LANE_META_BYTES + blocks_bound(size))


class ShmGroup:
    """Every rank's segment, mapped (``maps[r]``: rank r's). ``yields``: poll
    loops give the core away between looks (more ranks on this host than cores).
    ``cma``: every rank may read every other's memory (transports/cma.py), tried at set-up."""

    def __init__(self, maps: list, rank: int, yields: bool = False, cma: bool = False):
        self._maps = maps
        self.rank, self.size, self.yields, self.cma = rank, len(maps), yields, cma
        self.lane_bytes = lane_bound(self.size)  # the largest all_reduce input a rank publishes
        self.blocks_bytes = blocks_bound(self.size)  # ... reduce_scatter, all_gather, all_to_all input
        slot_bytes = LANE_META_BYTES + self.blocks_bytes
        # Slot k's meta words, as int64 words of a segment: from _meta_at + k x _slot_words.
        self._meta_at, self._slot_words = LANE_AT // 8, slot_bytes // 8
        self.peers = tuple(r for r in range(self.size) if r != rank)
        # One word through a memoryview costs ~60 ns against 120-270 through numpy (shm.py).
        self.words = [memoryview(m).cast("q") for m in maps]
        self.own = self.words[rank]
        headers = [np.ndarray(HEADER_BYTES // 8, np.int64, m, 0) for m in maps]
        self.pids = [int(h[WORD_PID]) for h in headers]
        # The reads' slot tables (group_read_steps.py), every rank's: slots[r][slot, word].
        self.slots = [h[READS_AT:READS_AT + SLOTS * SLOT_WORDS].reshape(SLOTS, SLOT_WORDS) for h in headers]
        self.own_slots = self.slots[rank]
        self.boxes = [np.ndarray((LANE_SLOTS, slot_bytes), np.uint8, m, LANE_AT)[:, LANE_META_BYTES:]
                      for m in maps]
        self._fence = threading.Lock()
        for box in self.boxes:  # map every page now (shm.ShmPair: resident memory steps up once)
            if box is self.boxes[rank]:
                box[:, ::mmap.PAGESIZE] = 0
            else:
                int(box[:, ::mmap.PAGESIZE].sum())

    # -- this rank's side ---------------------------------------------------
    def lane_free(self, seq: int) -> bool:
        """Whether operation ``seq``'s slot may be written: empty, or its payload read
        by every rank, this one included: a reduction takes its own operand from its
        own slot (group_lane_ops.combine), and an async call posted while this rank's
        earlier call in the same slot had not combined yet overwrote that operand
        (a 3-rank sum read 5 where 3 was due, 1 in ~15 runs of the async test)."""
        slot = seq % LANE_SLOTS
        held = self.own[self._meta_at + slot * self._slot_words]
        taken = TAKEN_AT + self.rank * LANE_SLOTS + slot
        return held == 0 or all(words[taken] >= held for words in self.words)

    def slot_view(self, owner: int, seq: int, dtype, count: int) -> np.ndarray:
        """Rank ``owner``'s slot for operation ``seq`` as ``count`` elements of ``dtype``."""
        nbytes = count * np.dtype(dtype).itemsize
        return self.boxes[owner][seq % LANE_SLOTS, :nbytes].view(dtype)

    def post_lane(self, seq: int, nbytes: int, words: tuple[int, int]) -> None:
        """Publish the payload the caller put in operation ``seq``'s slot: its meta
        words, then the fingerprint entry, its seq last, fenced before and after
        (the caller looks at the peers' FLAG_WAITING next: shm.py, Dekker's order)."""
        meta = self._meta_at + seq % LANE_SLOTS * self._slot_words
        self.own[meta], self.own[meta + 1] = seq, nbytes
        self.post_fingerprint(seq, words)

    def post_fingerprint(self, seq: int, words: tuple[int, int]) -> None:
        """Publish this rank's fingerprint entry for operation ``seq`` (alone: the
        reads, group_read_steps.py), its seq last, fenced before and after."""
        own, entry = self.own, FP_RING_AT + seq % FP_RING * FP_WORDS
        own[entry], own[entry + 1] = words
        self._fence_stores()
        own[entry + 2] = seq
        self._fence_stores()

    def post_slot(self, slot: int, word: int, seq: int) -> None:
        """Publish ``seq`` in a word of one of this rank's read slots, after every store before it."""
        self._fence_stores()
        self.own_slots[slot, word] = seq

    def post_waiting(self, seq: int) -> None:
        """This rank sleeps until a peer rings for operation ``seq``; fenced after:
        the caller looks at the peers' entries next."""
        self._fence_stores()
        self.own[FLAG_WAITING] = seq
        self._fence_stores()

    def lane_taken(self, seq: int) -> None:
        """Tell every rank, this one included, that this rank read its payload of
        ``seq`` (no fence: x86-64 never shows a store before the loads ahead of it)."""
        own, slot = self.own, seq % LANE_SLOTS
        for p in range(self.size):
            own[TAKEN_AT + p * LANE_SLOTS + slot] = seq

    # -- the peers' ---------------------------------------------------------
    def peer_fingerprint(self, peer: int, seq: int) -> Optional[np.ndarray]:
        """``peer``'s fingerprint words for ``seq`` as bytes, or None while its entry holds another operation's."""
        entry = FP_RING_AT + seq % FP_RING * FP_WORDS
        theirs = self.words[peer]
        if theirs[entry + 2] != seq:
            return None
        return np.array([theirs[entry], theirs[entry + 1]], np.int64).view(np.uint8)

    def peer_ready(self, peer: int, seq: int, nbytes: int, words: tuple[int, int]) -> bool:
        """``peer``'s payload of ``seq`` is there, with these fingerprint words and
        byte count, and the peer is not asleep waiting for a doorbell."""
        theirs = self.words[peer]
        entry = FP_RING_AT + seq % FP_RING * FP_WORDS
        meta = self._meta_at + seq % LANE_SLOTS * self._slot_words
        return (theirs[entry + 2] == seq and theirs[entry] == words[0] and theirs[entry + 1] == words[1]
                and theirs[meta] == seq and theirs[meta + 1] == nbytes and theirs[FLAG_WAITING] != seq)

    def peer_slot_bytes(self, peer: int, seq: int) -> Optional[int]:
        """The byte count of ``peer``'s payload of ``seq``, or None if its slot holds another operation's."""
        theirs = self.words[peer]
        meta = self._meta_at + seq % LANE_SLOTS * self._slot_words
        return theirs[meta + 1] if theirs[meta] == seq else None

    def peer_waiting(self, peer: int, seq: int) -> bool:
        return self.words[peer][FLAG_WAITING] == seq

    def met_all(self, seq: int, nbytes: tuple, words: tuple[int, int], spin_s: float) -> bool:
        """Poll for at most ``spin_s`` until every peer's payload of ``seq`` is
        there (``nbytes[r]``: rank r's byte count); True once all are, matched
        and awake; False on anything else (group_lane_ops.GroupLaneOp sorts it out)."""
        deadline = time.perf_counter() + spin_s
        entry = FP_RING_AT + seq % FP_RING * FP_WORDS + 2
        for peer in self.peers:
            theirs, spins = self.words[peer], 0
            while theirs[entry] != seq:
                spins += 1
                if self.yields:
                    os.sched_yield()  # the rank we wait for may have no core
                if not spins & 15 and time.perf_counter() > deadline:
                    return False
            if not self.peer_ready(peer, seq, nbytes[peer], words):
                return False
        return True

    def _fence_stores(self) -> None:
        with self._fence:  # an uncontended lock: a locked instruction (shm.py)
            pass

    def close(self) -> None:
        self.boxes, self.slots, self.own_slots = [], [], None
        for words in self.words:
            words.release()
        self.words, self.own = [], None
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view someone still holds: the mapping goes with the process
                pass


def open_group(store, rank: int, size: int, timeout_s: float, willing: bool, yields: bool = False,
               cma_willing: bool = True) -> Optional[ShmGroup]:
    """Map every rank's segment, or None on every rank when any cannot or is not
    ``willing``: each learns all outcomes first, so every rank must call this.
    The group reads across processes where every rank is ``cma_willing`` and
    every rank's tries worked."""
    own, name, error = None, "", "not willing"
    if willing:
        try:
            name, own = create_segment("mpccs-g", segment_bytes(size))
            write_cookie(own)
            error = ""
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    store.set(f"shmg/name/{rank}", name.encode())
    names = [v.decode() for v in store.gather("shmg/name", size, timeout_s)]
    maps: list = []
    if own is not None and all(names):
        try:
            for r, n in enumerate(names):
                maps.append(own if r == rank else map_segment(n, segment_bytes(size)))
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            for m in maps:
                if m is not own:
                    m.close()
            maps = []
    if maps and cma_willing:
        cma.allow_reads_by_any()
    # Every rank has let the others read (where Yama asks for it) before any tries.
    store.set(f"shmg/mapped/{rank}", b"1")
    store.gather("shmg/mapped", size, timeout_s)
    reads = bool(maps) and cma_willing and all(reads_cookie_of(m) for r, m in enumerate(maps) if r != rank)
    store.set(f"shmg/ok/{rank}", (b"1c" if reads else b"1") if maps else error.encode() or b"0")
    outcomes = store.gather("shmg/ok", size, timeout_s)
    unlink_segment(name)
    if maps and all(v.startswith(b"1") for v in outcomes):
        return ShmGroup(maps, rank, yields, cma=all(v == b"1c" for v in outcomes))
    for m in maps or ([own] if own is not None else []):
        m.close()
    return None
