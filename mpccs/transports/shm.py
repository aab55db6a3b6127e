"""A shared-memory segment per rank of a 2-rank job on one host: the block
exchanges of the two-step collectives without a UCX message (shm_steps.py).

Why: on the scale-up plane UCX moves a 1 MiB block with a rendezvous (a
request, a cross-process read by the receiver, an acknowledgement) and each
send or receive costs ~5-20 us of Python and UCX. Through a segment that both
processes map, a block takes a copy into the sender's segment, a flag, and
the receiver works on it in place (2-rank float32 all_reduce, hand-written,
interleaved with mpccs on the same machine: 146 against 251 us at 1 MiB, 311
against 481 at 2 MiB; on par at 4 MiB and slower from 8, where UCX's single
cross-process copy beats two local ones).

Layout of each rank's segment: a header page of int64 flags (FLAG_*), each
written by its owner only, then the outbox of OUTBOX_BYTES. A flag holds the
sequence number of the last operation that reached that point; they only
grow, so a waiter tests ``>=`` and a failed operation leaves nothing a later
one could mistake. Publication relies on x86-64's store order (a flag
written after the data it announces is never seen before that data), so the
segments are opened on x86-64 only; the one exception to that order, the
non-temporal stores a large memcpy may use, cannot pass a locked
instruction, which post() executes (an uncontended lock) before the flag.

Set-up (open_pair): each rank creates its segment in /dev/shm under a name
of its own, the names go through the bootstrap store, each maps its peer's,
and once both have (a second exchange) each unlinks its own: a crash leaves
no file behind, the mappings live as long as the processes.
"""
from __future__ import annotations

import mmap
import os
import platform
import secrets
import threading
from typing import Optional

import numpy as np

OUTBOX_BYTES = 2 << 20  # the largest block exchanged this way (shm_steps.SHM_MAX_BLOCK_BYTES)
HEADER_BYTES = 4096
FLAG_POSTED, FLAG_TAKEN = 0, 1  # my block is in my outbox / I am done with my peer's outbox
SHM_DIR = "/dev/shm"


def supported() -> bool:
    """x86-64 (store order: see the module docstring) with a /dev/shm to map from."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


class ShmPair:
    """This rank's segment and its peer's, both mapped."""

    def __init__(self, own: mmap.mmap, peer: mmap.mmap):
        self._maps = (own, peer)
        self.own_flags = np.ndarray(8, np.int64, own, 0)
        self.peer_flags = np.ndarray(8, np.int64, peer, 0)
        self.own_box = np.ndarray(OUTBOX_BYTES, np.uint8, own, HEADER_BYTES)
        self.peer_box = np.ndarray(OUTBOX_BYTES, np.uint8, peer, HEADER_BYTES)
        self._fence = threading.Lock()
        # Map every page now (writing this rank's outbox, reading the peer's):
        # not on the first large operations, and resident memory steps up once at
        # start-up instead of creeping by 4 MiB as ever larger calls first touch it.
        self.own_box[::mmap.PAGESIZE] = 0
        int(self.peer_box[::mmap.PAGESIZE].sum())

    def post(self, flag: int, seq: int) -> None:
        """Publish ``seq`` in one of this rank's flags, after every store before it (module docstring)."""
        with self._fence:  # acquiring and releasing an uncontended lock: locked instructions
            pass
        self.own_flags[flag] = seq

    def peer_reached(self, flag: int, seq: int) -> bool:
        return int(self.peer_flags[flag]) >= seq

    def close(self) -> None:
        self.own_flags = self.peer_flags = self.own_box = self.peer_box = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view someone still holds: the mapping goes with the process
                pass


def _create_own() -> tuple[str, mmap.mmap]:
    name = f"mpccs-{os.getpid()}-{secrets.token_hex(6)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, HEADER_BYTES + OUTBOX_BYTES)
        return name, mmap.mmap(fd, HEADER_BYTES + OUTBOX_BYTES)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _map_peer(name: str) -> mmap.mmap:
    if not name or "/" in name:
        raise OSError(f"bad segment name {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, HEADER_BYTES + OUTBOX_BYTES)
    finally:
        os.close(fd)


def open_pair(store, rank: int, timeout_s: float, willing: bool) -> Optional[ShmPair]:
    """Map this rank's segment and its peer's (ranks 0 and 1), or None on both
    ranks when either cannot or is not ``willing`` (its options, its planes):
    every rank learns the other's outcome first, so both must call this."""
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
            peer = _map_peer(peer_name)
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    store.set(f"shm/ok/{rank}", b"1" if peer is not None else error.encode() or b"0")
    both = store.gather("shm/ok", 2, timeout_s)
    if name:
        try:
            os.unlink(os.path.join(SHM_DIR, name))  # both mapped it, or neither will
        except FileNotFoundError:
            pass
    if all(v == b"1" for v in both):
        return ShmPair(own, peer)
    for m in (own, peer):
        if m is not None:
            m.close()
    return None
