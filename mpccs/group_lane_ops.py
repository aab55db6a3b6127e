"""The group lane: a collective of a 3- to 8-rank job on one host whose input
is within shm_group.lane_bound (1 MiB on 3 ranks, 680 KiB on 4; a
reduce_scatter's, all_gather's, all_to_all's: shm_group.blocks_bound, 4 MiB
and 2.67 MiB), whole
through segments every rank maps (transports/shm_group.py): the N-rank form
of the 2-rank lane (lane_ops.py).

Why: on N ranks the direct path sends N - 1 UCX messages per rank and call
and each costs tens of microseconds of Python and UCX; through the segments a
call is one copy into the rank's own slot, a fingerprint entry, and reads of
the other ranks' slots (bench/results/group_lane_s29/).

Every rank publishes its whole input (a broadcast's non-root ranks: nothing)
and takes what it needs from every other rank's slot, so one rule serves
every collective: a reduction folds the slots in rank order 0..p-1, as the
direct path does (direct_ops.DirectAllReduceOp), so results are bit-identical
to every other path's; its own operand comes from its own slot, a copy, so
in-place calls read nothing they have overwritten. A rank marks each peer's
slot read once it combined, and writes its slot again only once every peer
read it (ShmGroup.lane_free).

The same two ways to run as the 2-rank lane: GroupLane.exchange without an
Operation (a blocking call, nothing else in flight, every peer there within
PEER_SPIN_S with the same fingerprint), and GroupLaneOp, which takes over an
exchange that did not finish: it meets each peer as it arrives, sleeps past
PEER_SPIN_S (FLAG_WAITING) until a peer rings, rings each peer it finds
asleep, and fails on a peer's fingerprint message (a peer that called
something else).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np

from . import wire
from .direct_ops import DirectShmAllReduceOp, StartedSteps
from .errors import ProtocolError, TransportError
from .fingerprint import Fingerprint
from .group_read_steps import GROUP_READ_COLLECTIVES, GroupReadSteps
from .lane_ops import DONE, POSTED, UNPOSTED, LANE_VIEWS_KEPT, LaneOp, fingerprint_words
from .operation import check_fingerprint
from .reduce import reduce_into, reduce_to
from .transports.shm_group import LANE_SLOTS
from .windows import UP

# The group reads' largest input (takes_group_reads).
GROUP_READS_MAX_BYTES = 256 << 20
# An all_to_all's rank copies its whole input into its slot and reads one block of each peer's, so
# against the reads (one block of each peer's, across processes) its margin is the thinnest: lane /
# reads 1.11-1.46x at 1-2 MiB, 0.82-0.97x at 3-4 MiB on 3 ranks (bench/results/group_reads_s30/lane_blocks_ab/).
GROUP_ALL_TO_ALL_LANE_BYTES = 2 << 20

GROUP_LANE_COLLECTIVES = frozenset(("all_reduce", "barrier", "reduce_scatter", "all_gather", "all_to_all",
                                    "broadcast", "reduce"))
_FOLDS = ("all_reduce", "barrier")
_BLOCKS = ("reduce_scatter", "all_gather", "all_to_all")


def takes_group_lane(group, name: str, nbytes: int) -> bool:
    """Whether a call of 3+ ranks goes through the group lane: the segments open
    (on every rank or none) and the input within their bound (lane_bound_of;
    ``nbytes``: the input's, a rank-independent size: a broadcast's buffer on every rank)."""
    return group is not None and name in GROUP_LANE_COLLECTIVES and nbytes <= lane_bound_of(group, name)


def lane_bound_of(group, name: str) -> int:
    """The group lane's largest input for collective ``name``: a reduce_scatter's, all_gather's or
    all_to_all's (ranks take blocks of each other's slots) is the larger (transports/shm_group.py),
    an all_to_all's at most GROUP_ALL_TO_ALL_LANE_BYTES."""
    if name == "all_to_all":
        return min(GROUP_ALL_TO_ALL_LANE_BYTES, group.blocks_bytes)
    return group.blocks_bytes if name in _BLOCKS else group.lane_bytes


def published(name: str, send: np.ndarray, rank: int, root) -> np.ndarray:
    """What ``rank`` publishes: its whole input, or nothing (a broadcast's non-root rank)."""
    return send[:0] if name == "broadcast" and rank != root else send


def combine(name: str, slots: list, out: np.ndarray, op: str, rank: int, root) -> None:
    """This rank's result from every rank's payload (``slots[r]``: rank r's, this rank's own included)."""
    size = len(slots)
    if name in _FOLDS or (name == "reduce" and rank == root):
        _fold(out, slots, op)
    elif name == "reduce_scatter":
        n = out.size
        _fold(out, [s[rank * n:(rank + 1) * n] for s in slots], op)
    elif name == "all_gather":
        n = slots[0].size
        for r, theirs in enumerate(slots):
            out[r * n:(r + 1) * n] = theirs
    elif name == "all_to_all":
        n = out.size // size
        for r, theirs in enumerate(slots):
            out[r * n:(r + 1) * n] = theirs[rank * n:(rank + 1) * n]
    elif name == "broadcast" and rank != root:
        out[...] = slots[root]


def _fold(out: np.ndarray, operands: list, op: str) -> None:
    """out = ((x0 op x1) op x2) ...: the direct path's order (its result bit for bit)."""
    reduce_to(out, operands[0], operands[1], op)
    for x in operands[2:]:
        reduce_into(out, x, op)


class CallShape(NamedTuple):
    """What one call shape (collective, dtype, count, root) reads and writes in one
    slot, built once: each rank's byte count and each rank's slot as an array."""

    byte_counts: tuple
    slots: list


class GroupLane:
    """The group lane's copies and reductions for one communicator, and its common
    case without an Operation: publish, poll every peer's entry for at most
    ``spin_s``, combine from the slots."""

    def __init__(self, group, rank: int):
        self.pair, self.rank = group, rank  # (``pair``: what LaneOp calls the segments)
        self.peers = group.peers
        # (collective, dtype, count, root, slot) -> CallShape: a loop's calls have a few shapes,
        # and building one per call was ~3 us of a 3-rank 8-byte call's ~17 us of work a rank.
        self._shapes: dict = {}

    def shape(self, seq: int, name: str, send: np.ndarray, root) -> CallShape:
        key = (name, send.dtype, send.size, root, seq % LANE_SLOTS)
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= LANE_VIEWS_KEPT:
                self._shapes.clear()
            counts = [published(name, send, r, root).size for r in range(self.pair.size)]
            shape = self._shapes[key] = CallShape(
                tuple(c * send.itemsize for c in counts),
                [self.pair.slot_view(r, seq, send.dtype, c) for r, c in enumerate(counts)])
        return shape

    def parts(self, name: str, send: np.ndarray, root) -> tuple[np.ndarray, int]:
        """What this rank publishes for a call, and its element count (the 2-rank Lane's form)."""
        payload = published(name, send, self.rank, root)
        return payload, payload.size

    def exchange(self, seq: int, name: str, send: np.ndarray, out: np.ndarray, op: str, root,
                 parts: tuple[np.ndarray, int], words: tuple[int, int], spin_s: float) -> int:
        """DONE (out holds the result), UNPOSTED or POSTED (lane_ops' outcomes); ``parts``: parts()'s."""
        group, payload = self.pair, parts[0]
        if not group.lane_free(seq):
            return UNPOSTED
        shape = self.shape(seq, name, send, root)
        shape.slots[self.rank][...] = payload
        group.post_lane(seq, payload.nbytes, words)
        if not group.met_all(seq, shape.byte_counts, words, spin_s):
            return POSTED
        combine(name, shape.slots, out, op, self.rank, root)
        group.lane_taken(seq)
        return DONE

    def post(self, seq: int, payload: np.ndarray, words: tuple[int, int]) -> None:
        """Copy ``payload`` into operation ``seq``'s slot and publish it (ShmGroup.lane_free
        first; LaneOp's posting in turn: the exchange above copies through its CallShape)."""
        self.pair.slot_view(self.rank, seq, payload.dtype, payload.size)[...] = payload
        self.pair.post_lane(seq, payload.nbytes, words)

    def take(self, seq: int, name: str, send: np.ndarray, out: np.ndarray, op: str, root) -> None:
        """Once every peer's payload for ``seq`` is there and matched: combine, mark every slot read."""
        combine(name, self.shape(seq, name, send, root).slots, out, op, self.rank, root)
        self.pair.lane_taken(seq)


class GroupMeeting:
    """Meeting every peer of a group in its segments (SegmentMeetingOp's meeting
    for N ranks): each peer's fingerprint entry for this operation, matched as
    it arrives; the peers found asleep rung; past PEER_SPIN_S, this rank sleeps
    and looks for doorbells and fingerprint messages from the peers not met
    yet. Mixed into a SegmentMeetingOp built with the group's ``segments`` and
    ``peers``; ``_not_met`` starts as every peer."""

    def _meet_peers(self) -> bool:
        """True once every peer's fingerprint for this operation is there and matched."""
        self._meet_arrived()
        if self._not_met and not self._asleep and self._past_spin():
            self._pair.post_waiting(self.seq)
            self._asleep = True
            self._meet_arrived()  # (one may have come between the look and the flag)
        if self._not_met:
            if self._asleep:
                self._look_for_messages(tuple(self._not_met))
            return False
        self._met = True
        return True

    def _meet_arrived(self) -> None:
        group, seq = self._pair, self.seq
        for peer in list(self._not_met):
            theirs = group.peer_fingerprint(peer, seq)
            if theirs is None:
                continue
            if self.fingerprint is not None:
                check_fingerprint(self, theirs, peer, self.peers, self.wire_seq)
            self._check_slot_of(peer)
            self._not_met.remove(peer)
            if group.peer_waiting(peer, seq):
                self._ring(peer)

    def _check_slot_of(self, peer: int) -> None:
        """What else must hold once ``peer``'s fingerprint matched (nothing here)."""


class GroupLaneOp(GroupMeeting, LaneOp):
    """One group-lane call as an Operation: LaneOp's posting in turn, running
    alone and failing, with a meeting of every peer (module docstring)."""

    def __init__(self, engine, seq, send: np.ndarray, out: np.ndarray, op: str,
                 fingerprint: Optional[Fingerprint], finalize: Optional[Callable] = None,
                 name: str = "all_reduce", *, lane: GroupLane, parts: tuple[np.ndarray, int], root=None,
                 posted: bool = False):
        self._byte_counts = lane.shape(seq, name, send, root).byte_counts
        self._not_met = list(lane.peers)
        super().__init__(engine, seq, send, out, op, fingerprint, finalize, name, lane=lane, parts=parts,
                         root=root, posted=posted)

    def _advance(self) -> bool:
        if not self._posted and not self._post():
            return False
        moved = False
        if not self._met:
            if not self._meet_peers():
                return False
            self._lane.take(self.seq, self.name, self.mine, self.out, self.op, self.root)
            moved = True
        return self._finish_once_rung() or moved

    def _check_slot_of(self, peer: int) -> None:
        """``peer``'s fingerprint matched (or fingerprints are off): its slot must
        hold this operation's payload, of the size expected."""
        got, expected = self._pair.peer_slot_bytes(peer, self.seq), self._byte_counts[peer]
        if got != expected:
            held = "another operation's" if got is None else f"{got} bytes"
            raise ProtocolError(f"rank {peer}'s lane slot for operation #{self.seq} holds {held}, not "
                                f"{expected} bytes", rank=self.engine.rank, peer=peer, op=self.name)

    def describe_stall(self) -> dict:
        waiting = ("the peers to read this rank's earlier lane payload" if not self._posted else
                   f"ranks {self._not_met} to reach this operation (their fingerprints in their segments)"
                   if not self._met else "the doorbells to the peers to go out")
        return {"stage": "direct lane", "peer": list(self._not_met) or list(self.peers), "plane": UP,
                "waiting_for": waiting}


def takes_group_reads(group, name: str, nbytes: int) -> bool:
    """Whether a call of 3+ ranks reads across processes (group_read_steps.py):
    the segments open with reads (on every rank or none), the collective one
    of GROUP_READ_COLLECTIVES and its input above the group lane's bound, up
    to GROUP_READS_MAX_BYTES (``nbytes``: the input's, the same on every rank)."""
    return (group is not None and group.cma and name in GROUP_READ_COLLECTIVES
            and lane_bound_of(group, name) < nbytes <= GROUP_READS_MAX_BYTES)


class GroupReadsOp(GroupMeeting, DirectShmAllReduceOp):
    """A 3- to 8-rank all_reduce, reduce_scatter, all_gather or all_to_all above
    the group lane's bound, read across processes (group_read_steps.py): the
    ranks meet in the group's segments (GroupMeeting) before the steps read
    anything of a peer's, and take the segments in turn, as the 2-rank
    DirectShmAllReduceOp does; a blocking call alone runs its steps without an
    operation first (direct_ops.run_steps_alone)."""

    algorithm = "group_reads"

    def __init__(self, engine, seq, send: np.ndarray, out: np.ndarray, op: str, world: int,
                 fingerprint: Optional[Fingerprint], finalize: Optional[Callable] = None,
                 name: str = "all_reduce", *, group, started: Optional[StartedSteps] = None):
        self._not_met = list(group.peers)
        super().__init__(engine, seq, send, out, op, world, fingerprint, finalize, name, started=started,
                         segments=group, peers=group.peers)
        if self._met:  # (run alone, it met every peer)
            self._not_met = []

    @staticmethod
    def peer_bytes(name: str, send: np.ndarray, rank: int, root, world: int) -> int:
        """What a rank's steps read from its peers."""
        return read_bytes(name, send.nbytes, world)

    @classmethod
    def publish(cls, group, engine, seq: int, name: str, send: np.ndarray, out: np.ndarray, op: str,
                fingerprint: Optional[Fingerprint], root):
        """Publish this rank's fingerprint in the group's ring, then post its steps; the steps."""
        group.post_fingerprint(seq, fingerprint_words(fingerprint))
        rank = engine.rank

        def error(message: str, step: str, peer: int) -> TransportError:
            return TransportError(message, rank=rank, plane=UP, peer=peer, op=name, stage=f"group reads {step}")
        return GroupReadSteps(group, wire.attempt_seq(seq, 0), rank, name, send, out, op,
                              lambda n: engine.kept_scratch("direct_shm", n), error)

    def _meet_peer(self) -> bool:
        return self._meet_peers()

    def describe_stall(self) -> dict:
        if self._steps is None:
            waiting = "an earlier operation to let go of the segments"
        elif not self._met:
            waiting = f"ranks {self._not_met} to reach this operation (their fingerprints in their segments)"
        else:
            waiting = self._steps.waiting_for
        peers = self._not_met if not self._met else getattr(self._steps, "waiting", None)
        return {"stage": f"group reads {self._steps.step if self._steps is not None else ''}".rstrip(),
                "peer": list(peers or self.peers), "plane": UP, "waiting_for": waiting}


def read_bytes(name: str, nbytes: int, world: int) -> int:
    """The bytes one rank of ``world`` reads from its peers in a call whose input is ``nbytes``."""
    if name == "all_reduce":
        return 2 * (nbytes - nbytes // world)
    if name == "all_gather":
        return nbytes * (world - 1)
    return nbytes - nbytes // world  # reduce_scatter, all_to_all: the peers' parts of one block each
