"""The lane: a 2-rank collective whose every rank publishes at most
LANE_MAX_BYTES (all_reduce, reduce_scatter, all_gather, all_to_all,
broadcast, reduce, and the barrier) whole through the shared-memory
segments, with nothing but a copy, a fingerprint entry and a flag on its way
(transports/shm.py, "the lane").

Why: the 8-byte all_reduce is the latency figure, and on the direct path it
was ~30 pieces of Python of 1-15 us each (two UCX requests, a pooled buffer,
the engine's loop). Two processes exchanging 8 bytes by hand through a
shared page take ~7 us a call on the same host. From 8 KiB the direct
path's messages each took a UCX rendezvous (measured: transports/shm.py,
LANE_MAX_BYTES). The lane keeps what the direct path guarantees: the
fingerprint travels with the payload (a peer that called anything else gets
a MismatchError, in the segments or by its fingerprint message), a late or
lost peer hands the operation to the engine (its sleep, stall watch, aborts
and timeouts), async_op works, and the operation is counted like any other.

Two ways to run one, the same in memory: Lane.exchange, the common case
without an Operation (a blocking call, nothing else in flight, the peer
there within PEER_SPIN_S with the same fingerprint), and LaneOp for
everything else, which takes over an exchange that did not finish.

Each collective is what a rank publishes (direct_ops.peer_part) and what it
does with its peer's payload (combine): rank 0's operand always on the left
of a reduction, so both ranks' results are bit-identical to every other path's.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

import numpy as np

from . import direct_ops
from .direct_ops import SegmentMeetingOp, peer_part
from .errors import ProtocolError
from .fingerprint import Fingerprint
from .reduce import reduce_to
from .transports.shm import LANE_MAX_BYTES, LANE_SLOTS
from .windows import UP

LANE_COLLECTIVES = frozenset(("all_reduce", "barrier", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                              "reduce"))
_HALVES = ("reduce_scatter", "all_to_all")  # each rank publishes the block its peer owns
NO_WORDS = (0, 0)  # fingerprints off: the meeting alone
# Lane.exchange's outcomes: finished; nothing posted (the slot's last payload
# not yet read by the peer); posted but not finished (LaneOp takes it).
DONE, UNPOSTED, POSTED = range(3)
LANE_VIEWS_KEPT = 256  # slot views kept by Lane (call shapes of a loop: a few)


def takes_lane(pair, name: str, send: np.ndarray) -> bool:
    """Whether a 2-rank call goes through the lane: the segments open (on both
    ranks or neither) and what a rank of it publishes at most within the
    bound, a rank-independent size (a broadcast's root publishes the buffer,
    the other rank nothing: the bound applies to the buffer)."""
    if pair is None or name not in LANE_COLLECTIVES:
        return False
    return (send.nbytes // 2 if name in _HALVES else send.nbytes) <= LANE_MAX_BYTES


def combine(name: str, send: np.ndarray, out: np.ndarray, theirs: np.ndarray, op: str, rank: int, root) -> None:
    """This rank's result from its input and its peer's payload."""
    if name in ("all_reduce", "barrier") or (name == "reduce" and rank == root):
        left, right = (send, theirs) if rank == 0 else (theirs, send)
        reduce_to(out, left, right, op)
    elif name == "reduce_scatter":
        half = send.size // 2
        own = send[rank * half:(rank + 1) * half]
        left, right = (own, theirs) if rank == 0 else (theirs, own)
        reduce_to(out, left, right, op)
    elif name in ("all_gather", "all_to_all"):
        n, peer = theirs.size, 1 - rank
        out[peer * n:(peer + 1) * n] = theirs
        own = send[rank * n:(rank + 1) * n] if name == "all_to_all" else send
        if not np.may_share_memory(own, out):  # (an in-place all_gather's input is its own block already)
            out[rank * n:(rank + 1) * n] = own
    elif name == "broadcast" and rank != root:
        out[...] = theirs


def fingerprint_words(fingerprint: Optional[Fingerprint]) -> tuple[int, int]:
    return fingerprint.signed_words if fingerprint is not None else NO_WORDS


class Lane:
    """The lane's copies and reductions for one communicator, and its common
    case run without an Operation: publish, poll for the peer's entry for at
    most PEER_SPIN_S, combine from the peer's slot."""

    def __init__(self, pair, rank: int):
        self.pair, self.rank = pair, rank
        self.peers = (1 - rank,)
        self._views: dict = {}  # (slot, dtype, count) -> the slot views (ShmPair.lane_views)

    def parts(self, name: str, send: np.ndarray, root) -> tuple[np.ndarray, int]:
        """What this rank publishes for a call, and the element count it reads from its peer (peer_part)."""
        return peer_part(name, send, self.rank, root)

    def exchange(self, seq: int, name: str, send: np.ndarray, out: np.ndarray, op: str, root,
                 parts: tuple[np.ndarray, int], words: tuple[int, int], spin_s: float) -> int:
        """DONE (out holds the result), UNPOSTED or POSTED (module docstring); ``parts``:
        peer_part's; ``spin_s``: how long to poll for the peer (ShmPair.lane_met)."""
        pair = self.pair
        if not pair.lane_free(seq):
            return UNPOSTED
        posted, count = parts
        self.post(seq, posted, words)
        if not pair.lane_met(seq, count * send.itemsize, words, spin_s):
            return POSTED
        self.take(seq, name, send, out, op, root, count)
        return DONE

    def post(self, seq: int, payload: np.ndarray, words: tuple[int, int]) -> None:
        """Copy ``payload`` into operation ``seq``'s slot and publish it (ShmPair.lane_free first)."""
        self._views_of(seq, payload.dtype, payload.size)[0][...] = payload
        self.pair.post_lane(seq, payload.nbytes, words)

    def take(self, seq: int, name: str, send: np.ndarray, out: np.ndarray, op: str, root, count: int) -> None:
        """Once the peer's payload for ``seq`` (``count`` elements) is there and matched: combine, free its slot."""
        combine(name, send, out, self._views_of(seq, send.dtype, count)[1], op, self.rank, root)
        self.pair.lane_taken(seq)

    def _views_of(self, seq: int, dtype, count: int) -> tuple[np.ndarray, np.ndarray]:
        key = (seq % LANE_SLOTS, dtype, count)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= LANE_VIEWS_KEPT:
                self._views.clear()
            views = self._views[key] = self.pair.lane_views(seq, dtype, count)
        return views


class LaneOp(SegmentMeetingOp):
    """One 2-rank collective through the lane.

    Each rank puts what it publishes (peer_part) in its lane slot and its
    fingerprint in the ring after it (ShmPair.post_lane). Once the peer's
    entry for this operation is there and matches (SegmentMeetingOp: past
    PEER_SPIN_S it sleeps and looks for a fingerprint message), each combines
    from the peer's slot straight into its output and tells the peer it read
    the slot (FLAG_LANE_TAKEN + slot). A slot is written again only after
    that (ShmPair.lane_free), so a rank one operation ahead never overwrites
    what its peer has yet to read.
    ``posted``: Lane.exchange posted it already. ``lane``: the
    communicator's Lane, whose copies and views it shares.

    run_alone() drives it without the planes while it is alone in the engine
    (Engine.wait, the communicator's blocking call)."""

    algorithm = "direct_lane"

    def __init__(self, engine, seq, send: np.ndarray, out: np.ndarray, op: str,
                 fingerprint: Optional[Fingerprint], finalize: Optional[Callable] = None,
                 name: str = "all_reduce", *, lane: Lane, parts: tuple[np.ndarray, int], root=None,
                 posted: bool = False):
        super().__init__(engine, seq, send, out, op, fingerprint, finalize, name, segments=lane.pair, peers=lane.peers)
        self._posted, self._lane, self._words = posted, lane, fingerprint_words(fingerprint)
        self._payload, self._count = parts
        self.root = root
        self.bytes_per_plane[UP] = self._payload.nbytes
        self._post()

    def _post(self) -> bool:
        """Post the payload once the slot is free (its earlier payload read by the
        peer) and every lane operation built before this one posted: one posted
        out of turn would take the slot its predecessor waits for, which the peer
        frees only after reading that predecessor (Engine.lane_unposted)."""
        self._since = time.perf_counter()
        if self._posted:
            return True
        unposted = self.engine.lane_unposted
        if (unposted and unposted[0] is not self) or not self._pair.lane_free(self.seq):
            if self not in unposted:
                unposted.append(self)
            return False
        if unposted:
            unposted.pop(0)
        self._lane.post(self.seq, self._payload, self._words)
        self._posted = True
        return True

    def _advance(self) -> bool:
        if not self._posted and not self._post():
            return False
        moved = False
        if not self._met:
            if self._pair.lane_ready(self.seq, self._count * self.mine.itemsize, self._words):  # one look
                self._met = True
            elif not self._meet_peer():  # mismatches, sleep and doorbells
                return False
            else:
                self._check_peer_slot()
            self._lane.take(self.seq, self.name, self.mine, self.out, self.op, self.root, self._count)
            moved = True
        return self._finish_once_rung() or moved  # (a doorbell in flight is no progress: the stall watch sees it)

    def _check_peer_slot(self) -> None:
        """The peer's fingerprint matched (without fingerprints: the peer reached this
        operation): its slot must hold this operation's payload, of the size expected."""
        theirs, expected = self._pair.peer_lane(self.seq), self._count * self.mine.itemsize
        if theirs is None or theirs.size != expected:
            got = "another operation's" if theirs is None else f"{theirs.size} bytes"
            raise ProtocolError(f"rank {self.peer}'s lane slot for operation #{self.seq} holds {got}, not "
                                f"{expected} bytes", rank=self.engine.rank, peer=self.peer, op=self.name)

    def _let_go_of_arrays(self) -> None:
        super()._let_go_of_arrays()
        self._payload = None

    def _fail(self, exc: BaseException) -> None:
        if self in self.engine.lane_unposted:
            self.engine.lane_unposted.remove(self)
        super()._fail(exc)

    def run_alone(self) -> bool:
        """Spin on the peer's entry without the planes, for at most PEER_SPIN_S
        (as the engine's polling would) and not past a doorbell to ring (a UCX
        send: the engine's to progress). True once finished, with or without an
        error; else the engine takes it from here. Where the host has more
        ranks than cores each look gives the core away first: the rank it
        waits for may have none (3 ranks on 2 cores, async 8-byte calls and
        their waits: 95-150 -> 46-59 us, bench/results/group_lane_async_s29/)."""
        deadline = time.perf_counter() + direct_ops.PEER_SPIN_S
        yields = self.engine.oversubscribed
        while not self.finished and not self._doorbells:
            if yields:
                os.sched_yield()
            self.advance()
            if time.perf_counter() > deadline:
                break
        return self.finished

    @property
    def polls_memory(self) -> bool:
        """Until it meets its peer, and not asleep (met: it waits on a doorbell's send, a UCX event)."""
        return not self._met and not self._asleep

    def describe_stall(self) -> dict:
        waiting = ("the peer to read this rank's earlier lane payload" if not self._posted else
                   "the peer to reach this operation (its fingerprint in its segment)" if not self._met else
                   "the doorbell to the peer to go out")
        return {"stage": "direct lane", "peer": [self.peer], "plane": UP, "waiting_for": waiting}
