"""A shared-memory segment per rank of a 2-rank job on one host: the block
exchanges of the two-step collectives without a UCX message (shm_steps.py),
and small collectives whole (the lane, below: lane_ops.py).

Why: on the scale-up plane UCX moves a 1 MiB block with a rendezvous (a
request, a cross-process read by the receiver, an acknowledgement) and each
send or receive costs ~5-20 us of Python and UCX. Through a segment that both
processes map, a block takes a copy into the sender's segment, a flag, and
the receiver works on it in place (2-rank float32 all_reduce, hand-written,
interleaved with mpccs on the same machine: 146 against 251 us at 1 MiB, 311
against 481 at 2 MiB; on par at 4 MiB and slower from 8, where UCX's single
cross-process copy beats two local ones).

Layout of each rank's segment: a header page of int64 flags (FLAG_*), each
written by its owner only, then the lane (below), then the outbox of
OUTBOX_BYTES. A flag holds the sequence number of the last operation that
reached that point; they only grow, so a waiter tests ``>=`` and a failed
operation leaves nothing a later one could mistake. Publication relies on x86-64's store order (a flag
written after the data it announces is never seen before that data), so the
segments are opened on x86-64 only; the one exception to that order, the
non-temporal stores a large memcpy may use, cannot pass a locked
instruction, which post() executes (an uncontended lock) before the flag.

The ranks meet at the start of a direct-path operation
(direct_ops.DirectShmAllReduceOp) by a ring of FP_RING fingerprint entries
after the slot table (entry seq % FP_RING: the operation's two fingerprint
words, then its sequence number, written last; a waiter tests ``==``) and a
flag, FLAG_WAITING, the operation for which this rank stopped polling and
sleeps on the planes' events until the peer rings (a UCX message). A ring,
not one entry: a rank that reads nothing of its peer's (a broadcast's root)
may look for the reader's entry after the reader finished and published its
next operation's. Each side stores its own entry or flag, then fences, then
loads the other's (Dekker's order): at least one of two ranks arriving
together sees the other's.

The lane (after the header, LANE_SLOTS slots of LANE_SLOT_BYTES) carries a
small 2-rank collective whole (lane_ops.py): slot seq %
LANE_SLOTS holds the payload, then the operation's sequence number and byte
count, and the fingerprint ring entry published after them says it is there.
A rank writes a slot again only once its peer's FLAG_LANE_TAKEN + slot shows
it read what the slot held (lane_free). One flag per slot: operations in
flight together may read their slots out of order (one waits for its slot
while the next, in the other slot, goes ahead), but one slot's payloads are
read in the order they were written, so its flag only grows.

The header also holds this rank's process id and, for the direct path's
cross-memory reads (cma_steps.py), a table of SLOTS slots of SLOT_WORDS
words: the addresses of one operation's buffers and the sequence numbers of
the steps it reached (slot seq % SLOTS; a stale slot holds another sequence
number, so a waiter tests ``==``).

Set-up (open_pair): each rank creates its segment in /dev/shm under a name
of its own, the names go through the bootstrap store, each maps its peer's
and lets that peer's pid read its memory (cma.allow_reads_by: Yama), and once
both have (a second exchange) each tries one cross-memory read of a cookie in
its peer's header; once both have (a third, which carries the outcomes) each
unlinks its own: a crash leaves no file behind, the mappings live as long as
the processes.
"""
from __future__ import annotations

import mmap
import os
import platform
import secrets
import threading
import time
from typing import Optional

import numpy as np

from . import cma

OUTBOX_BYTES = 2 << 20  # the largest block exchanged this way (shm_steps.SHM_MAX_BLOCK_BYTES)
HEADER_BYTES = 4096
FLAG_POSTED = 0  # seq x ROUND_SPAN + round: my part of that round is in my outbox (shm_steps.py)
FLAG_TAKEN = 1  # I am done with my peer's outbox (pipe_steps.py)
FLAG_CHUNKS = 2  # seq x CHUNK_SPAN + the chunks of my part in my outbox (pipe_steps.py)
FLAG_WAITING = 3  # I sleep until you ring for seq
FLAG_LANE_TAKEN = 4  # + slot: I have read your payload of operation seq in that lane slot
FLAG_PIPE_SHAPE = 6  # the shape of the call whose chunks I post (pipe_steps.py)
FLAG_ROUND_TAKEN = 7  # seq x ROUND_SPAN + round: I am done with my peer's outbox in that round (shm_steps.py)
FLAG_CHUNKS_TAKEN = 11  # seq x CHUNK_SPAN + the chunks of my peer's part I took (pipe_steps.py)
# The lane: two slots, so that a rank one operation ahead of its peer need not wait to post.
# The largest payload (lane_ops.takes_lane chooses the calls). 2 ranks, default planes,
# float32, the lane against the paths it replaced (the direct path's UCX messages below
# 384 KiB, the outboxes' halves from there), us. Five calls back to back after a barrier,
# three alternating rounds (bench/results/lane_s27/, lane_bound_s27/): 11-29 / 42-64 at 8 B,
# 20-24 / 103-125 at 8 KiB, 33-39 / 107-134 at 64 KiB, 67-76 / 152-167 at 256 KiB,
# 115-132 / 189-195 at 383 KiB, 93-104 / 120-132 at 384 KiB (the halves), 128-138 / 131-141
# at 448 KiB, 160-180 / 139-151 at 512 KiB, 379-392 / 271-298 at 1 MiB. One call per
# barrier (mpccs-perf, policy 'up', two runs) the lane still won at 512 KiB-1 MiB
# (149-167 / 171-195, 296-299 / 322-335), but a loop's calls come back to back.
LANE_MAX_BYTES = 384 << 10
LANE_META_BYTES = 64  # a slot's first words: the sequence number of the payload in it, its byte count
LANE_SLOTS, LANE_SLOT_BYTES = 2, LANE_META_BYTES + LANE_MAX_BYTES
LANE_AT = HEADER_BYTES
# Slot k's meta words, as int64 words of the segment: from LANE_META_AT + k x LANE_SLOT_WORDS.
LANE_META_AT, LANE_SLOT_WORDS = LANE_AT // 8, LANE_SLOT_BYTES // 8
OUTBOX_AT = LANE_AT + -(-LANE_SLOTS * LANE_SLOT_BYTES // 4096) * 4096  # page aligned
SEGMENT_BYTES = OUTBOX_AT + OUTBOX_BYTES
# Header words: the owner's pid, a random cookie and the cookie's address in the owner's process
# (what the peer's cross-memory read at set-up tries: reads_cookie_of).
WORD_PID, WORD_COOKIE, WORD_COOKIE_AT = 8, 9, 10
SLOTS_AT, SLOTS, SLOT_WORDS = 16, 32, 8  # the slot table: header words [16, 16 + 32 * 8)
# The fingerprint ring: header words [272, 272 + 32 * 3); an entry's words: the fingerprint's two, its seq.
FP_RING_AT, FP_RING, FP_WORDS = SLOTS_AT + SLOTS * SLOT_WORDS, 32, 3
# A slot's words: the input's and the output's address, the call's shape, then the steps reached (cma_steps.py).
SLOT_SRC, SLOT_OUT, SLOT_SHAPE, SLOT_POSTED, SLOT_REDUCED, SLOT_DONE = range(6)
SHM_DIR = "/dev/shm"


def supported() -> bool:
    """x86-64 (store order: see the module docstring) with a /dev/shm to map from."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


class ShmPair:
    """This rank's segment and its peer's, both mapped. ``cma``: both ranks may
    read each other's memory (transports/cma.py), tried at set-up."""

    def __init__(self, own: mmap.mmap, peer: mmap.mmap, cma: bool = False):
        self._maps = (own, peer)
        self.cma = cma
        own_header, peer_header = _header(own), _header(peer)
        self.own_flags, self.peer_flags = own_header[:16], peer_header[:16]  # (words 8-10: WORD_*)
        ring = slice(FP_RING_AT, FP_RING_AT + FP_RING * FP_WORDS)
        self.own_fp = own_header[ring].reshape(FP_RING, FP_WORDS)
        self.peer_fp = peer_header[ring].reshape(FP_RING, FP_WORDS)
        self.peer_pid = int(peer_header[WORD_PID])
        self.own_slots = own_header[SLOTS_AT:SLOTS_AT + SLOTS * SLOT_WORDS].reshape(SLOTS, SLOT_WORDS)
        self.peer_slots = peer_header[SLOTS_AT:SLOTS_AT + SLOTS * SLOT_WORDS].reshape(SLOTS, SLOT_WORDS)
        self.own_box = np.ndarray(OUTBOX_BYTES, np.uint8, own, OUTBOX_AT)
        self.peer_box = np.ndarray(OUTBOX_BYTES, np.uint8, peer, OUTBOX_AT)
        self.own_lane_box, self.peer_lane_box = _lane_box(own), _lane_box(peer)
        # Both segments as int64 words: one word through a memoryview costs ~60
        # ns against 120-270 through numpy (lane_ops.Lane: the 8-byte all_reduce).
        self.own_words, self.peer_words = memoryview(own).cast("q"), memoryview(peer).cast("q")
        self._fence = threading.Lock()
        # Map every page now (writing this rank's outbox, reading the peer's):
        # not on the first large operations, and resident memory steps up once at
        # start-up instead of creeping by 4 MiB as ever larger calls first touch it.
        self.own_box[::mmap.PAGESIZE] = 0
        int(self.peer_box[::mmap.PAGESIZE].sum())
        self.own_lane_box[:, ::mmap.PAGESIZE] = 0
        int(self.peer_lane_box[:, ::mmap.PAGESIZE].sum())

    def post(self, flag: int, seq: int) -> None:
        """Publish ``seq`` in one of this rank's flags, after every store before it (module docstring)."""
        self._fence_stores()
        self.own_flags[flag] = seq

    def post_fingerprint(self, words: np.ndarray, seq: int) -> None:
        """Publish this rank's fingerprint (two uint64 words) for operation ``seq``
        in its ring entry; fenced after too: the caller loads the peer's FLAG_WAITING next."""
        entry = self.own_fp[seq % FP_RING]
        entry[:2] = words.view(np.int64)
        self._fence_stores()
        entry[2] = seq
        self._fence_stores()

    def peer_fingerprint(self, seq: int) -> Optional[np.ndarray]:
        """The peer's fingerprint for operation ``seq`` (its two words as bytes), or None
        while its entry holds another operation's. The entry stays for FP_RING of the
        peer's operations; it is at most one ahead (it meets this rank's entry in each)."""
        entry = self.peer_fp[seq % FP_RING]
        if int(entry[2]) != seq:
            return None
        return entry[:2].view(np.uint8)

    def post_waiting(self, seq: int) -> None:
        """Tell the peer that this rank sleeps until it rings for operation ``seq``;
        fenced after: the caller loads the peer's fingerprint entry next."""
        self.post(FLAG_WAITING, seq)
        self._fence_stores()

    def peer_waiting(self, seq: int) -> bool:
        return int(self.peer_flags[FLAG_WAITING]) == seq

    def post_slot(self, slot: int, word: int, seq: int) -> None:
        """Publish ``seq`` in a word of one of this rank's slots, after every store before it."""
        self._fence_stores()
        self.own_slots[slot, word] = seq

    def lane_free(self, seq: int) -> bool:
        """Whether operation ``seq``'s lane slot may be written: empty, or its
        payload read by the peer (its FLAG_LANE_TAKEN + slot reached the slot's seq)."""
        slot = seq % LANE_SLOTS
        held = self.own_words[LANE_META_AT + slot * LANE_SLOT_WORDS]
        return held == 0 or self.peer_words[FLAG_LANE_TAKEN + slot] >= held

    def lane_views(self, seq: int, dtype, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Operation ``seq``'s lane slot, this rank's and the peer's, as ``count`` elements of ``dtype``."""
        slot, nbytes = seq % LANE_SLOTS, count * np.dtype(dtype).itemsize
        return self.own_lane_box[slot, :nbytes].view(dtype), self.peer_lane_box[slot, :nbytes].view(dtype)

    def post_lane(self, seq: int, nbytes: int, words: tuple[int, int]) -> None:
        """Publish the payload the caller put in operation ``seq``'s slot
        (lane_views; lane_free first): the slot's meta words, then the
        fingerprint entry (``words``: Fingerprint.signed_words), its seq last,
        fenced before and after as in post_fingerprint."""
        own = self.own_words
        meta = LANE_META_AT + seq % LANE_SLOTS * LANE_SLOT_WORDS
        own[meta], own[meta + 1] = seq, nbytes
        entry = FP_RING_AT + seq % FP_RING * FP_WORDS
        own[entry], own[entry + 1] = words
        self._fence_stores()
        own[entry + 2] = seq
        self._fence_stores()

    def lane_met(self, seq: int, nbytes: int, words: tuple[int, int], spin_s: float) -> bool:
        """Poll for at most ``spin_s`` for the peer's lane payload of operation
        ``seq``: True once it is there with the same fingerprint words and byte
        count and the peer is not asleep waiting for a doorbell; False on
        anything else (lane_ops.LaneOp sorts that out)."""
        peer = self.peer_words
        entry = FP_RING_AT + seq % FP_RING * FP_WORDS
        deadline = time.perf_counter() + spin_s
        spins = 0
        while peer[entry + 2] != seq:
            spins += 1
            if not spins & 63 and time.perf_counter() > deadline:  # (the clock costs twice a look)
                return False
        return self.lane_ready(seq, nbytes, words)

    def lane_ready(self, seq: int, nbytes: int, words: tuple[int, int]) -> bool:
        """One look for what lane_met polls for."""
        peer = self.peer_words
        entry = FP_RING_AT + seq % FP_RING * FP_WORDS
        meta = LANE_META_AT + seq % LANE_SLOTS * LANE_SLOT_WORDS
        return (peer[entry + 2] == seq and peer[entry] == words[0] and peer[entry + 1] == words[1]
                and peer[meta] == seq and peer[meta + 1] == nbytes and peer[FLAG_WAITING] != seq)

    def peer_lane(self, seq: int) -> Optional[np.ndarray]:
        """The peer's lane payload of operation ``seq`` (a view of its slot's bytes), once
        its fingerprint entry for ``seq`` is there; None if its slot holds another
        operation's (the peer took another path for ``seq``)."""
        meta = LANE_META_AT + seq % LANE_SLOTS * LANE_SLOT_WORDS
        if self.peer_words[meta] != seq:
            return None
        return self.peer_lane_box[seq % LANE_SLOTS, :self.peer_words[meta + 1]]

    def lane_taken(self, seq: int) -> None:
        """Tell the peer its lane payload of ``seq`` was read (no fence: on x86-64 a
        store is never seen before the loads ahead of it)."""
        self.own_words[FLAG_LANE_TAKEN + seq % LANE_SLOTS] = seq

    def _fence_stores(self) -> None:
        with self._fence:  # acquiring and releasing an uncontended lock: locked instructions
            pass

    def peer_reached(self, flag: int, seq: int) -> bool:
        return int(self.peer_flags[flag]) >= seq

    def close(self) -> None:
        self.own_flags = self.peer_flags = self.own_fp = self.peer_fp = None
        self.own_box = self.peer_box = self.own_slots = self.peer_slots = None
        self.own_lane_box = self.peer_lane_box = None
        for words in (self.own_words, self.peer_words):
            words.release()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view someone still holds: the mapping goes with the process
                pass


def _header(segment: mmap.mmap) -> np.ndarray:
    return np.ndarray(HEADER_BYTES // 8, np.int64, segment, 0)


def _lane_box(segment: mmap.mmap) -> np.ndarray:
    """A segment's lane: each slot's payload bytes (its meta words before them)."""
    return np.ndarray((LANE_SLOTS, LANE_SLOT_BYTES), np.uint8, segment, LANE_AT)[:, LANE_META_BYTES:]


def create_segment(prefix: str, nbytes: int) -> tuple[str, mmap.mmap]:
    """A new segment of ``nbytes`` in /dev/shm under a name of this process's own,
    mapped. Its pages are reserved first (posix_fallocate): a /dev/shm too small
    for them (containers often get 64 MiB) then fails here with ENOSPC, and the
    ranks go on without the segments, instead of a SIGBUS when a page is first
    touched (the set-up touches every page)."""
    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        return name, mmap.mmap(fd, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def map_segment(name: str, nbytes: int) -> mmap.mmap:
    """Another rank's segment, by the name it published."""
    if not name or "/" in name:
        raise OSError(f"bad segment name {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    """Remove a segment's name once every rank mapped it (or none will): a crash leaves no file behind."""
    if name:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def _create_own() -> tuple[str, mmap.mmap]:
    name, segment = create_segment("mpccs", SEGMENT_BYTES)
    write_cookie(segment)
    return name, segment


def write_cookie(segment: mmap.mmap) -> None:
    """This process's pid, a random cookie and the cookie's address here, in a
    segment's header (what a peer's cross-memory read at set-up tries)."""
    header = _header(segment)
    header[WORD_PID] = os.getpid()
    header[WORD_COOKIE] = secrets.randbits(62) + 1
    header[WORD_COOKIE_AT] = header.ctypes.data + WORD_COOKIE * 8
    del header  # (a view left would keep close() from unmapping it)


def reads_cookie_of(peer: mmap.mmap) -> bool:
    """Whether a cross-memory read of the peer's cookie, at its address in the
    peer's process, gives what the peer wrote there (transports/cma.py: the
    kernel's ptrace rule, a pid namespace between the two, a libc without
    process_vm_readv all make it fail)."""
    if not cma.available():
        return False
    pid, cookie, address = (int(w) for w in _header(peer)[[WORD_PID, WORD_COOKIE, WORD_COOKIE_AT]])
    got = np.zeros(1, np.int64)
    try:
        cma.read_into(got, pid, address)
    except OSError:
        return False
    return int(got[0]) == cookie


def open_pair(store, rank: int, timeout_s: float, willing: bool, cma_willing: bool = True) -> Optional[ShmPair]:
    """Map this rank's segment and its peer's (ranks 0 and 1), or None on both
    ranks when either cannot or is not ``willing`` (its options, its planes):
    every rank learns the other's outcome first, so both must call this. The
    pair reads by CMA where both ranks are ``cma_willing`` and their tries worked."""
    own, name, error = None, "", "not willing"
    if willing:
        try:
            name, own = _create_own()
            error = ""
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    store.set(f"shm/name/{rank}", name.encode())
    peer_name = store.gather("shm/name", 2, timeout_s)[1 - rank].decode()
    peer = None
    if own is not None and peer_name:
        try:
            peer = map_segment(peer_name, SEGMENT_BYTES)
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    if peer is not None and cma_willing:
        cma.allow_reads_by(int(_header(peer)[WORD_PID]))
    # Both have let the other read (where Yama asks for it) before either tries.
    store.set(f"shm/mapped/{rank}", b"1")
    store.gather("shm/mapped", 2, timeout_s)
    outcome = (b"1c" if cma_willing and reads_cookie_of(peer) else b"1") if peer is not None else error.encode() or b"0"
    store.set(f"shm/ok/{rank}", outcome)
    both = store.gather("shm/ok", 2, timeout_s)
    unlink_segment(name)
    if all(v.startswith(b"1") for v in both):
        return ShmPair(own, peer, cma=all(v == b"1c" for v in both))
    for m in (own, peer):
        if m is not None:
            m.close()
    return None
