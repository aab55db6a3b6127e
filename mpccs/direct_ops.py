"""The direct path: small and medium collectives as one message per peer
(comm._direct says which calls take it), and the 2-rank medium all_reduce
through the shared-memory segments."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import numpy as np

from . import wire
from .cma_steps import CmaSteps, step_times_us
from .errors import ProtocolError, TransportError
from .fingerprint import Fingerprint
from .operation import FP_BYTES, Operation, check_fingerprint
from .pipe_steps import PipeSteps
from .reduce import reduce_into, reduce_to
from .shm_steps import SHM_MAX_HALF_BYTES, ShmSteps
from .telemetry import wall
from .windows import OUT, UP

DIRECT_MAX_BYTES = 4096  # a payload at most this large rides in the fingerprint message; always direct
# A medium collective takes the direct path too where the DAG would run it on
# the control plane alone (comm._direct): at most this many bytes sent per
# rank, (p - 1) x the input. 2 ranks, default planes: 2.4-2.8x faster than the
# DAG at 8-32 KiB, 1.5-1.9x at 128 KiB-1.5 MiB (bench/direct_ab.py); at 4 MiB
# the ring, which moves half the bytes, won.
DIRECT_MEDIUM_BUDGET = 2 << 20
# A medium all_reduce at least this large runs as a reduce-scatter and an
# all-gather of blocks (DirectBlocksAllReduceOp) rather than one full
# exchange: a fraction of the bytes and the reduction for twice the messages.
# 2 ranks, default planes, time of the full exchange over the blocks
# (bench/results/direct_blocks/): 0.67-0.68x at 256 KiB, 0.93-0.97x at 512 KiB,
# 1.06-1.09x at 768 KiB, 1.09-1.12x at 1 MiB, 1.19-1.21x from 1.5 MiB. Above
# DIRECT_MAX_BYTES: the payload never rides inline.
DIRECT_BLOCKS_MIN_BYTES = 640 << 10
# From here a 2-rank all_reduce on the direct path takes the shared-memory
# segments where they are open (shm_steps.py). bench/results/shm/, two runs,
# time without / with them: 1.05-1.08x at 384 KiB, 1.10-1.18x at 512 KiB,
# 1.12-1.20x at 768 KiB-1.5 MiB, 1.04-1.05x below 2 MiB; at 256 KiB 0.95-1.01x
# over four runs. The lane (lane_ops.py) takes the calls up to its bound (384 KiB, inclusive) first.
DIRECT_SHM_MIN_BYTES = 384 << 10
# Above this, where the pair allows cross-memory reads, the halves are read from
# the peer's buffers (cma_steps.py) instead of copied through the outboxes, up to
# DIRECT_CMA_MAX_BYTES: a 2-rank all_reduce of that size takes the direct path on
# such a pair (comm._direct_by_cma). Up to it the halves go through the outboxes
# (shm_steps.py), in OUTBOX_ROUNDS rounds at most. On the AMD host of the
# fifty-second and fifty-third sessions, interleaved in one launch
# (bench/outbox_reads_ab.py), the reads' time over the outboxes': 1.56-4.03x at
# 3-4 MiB (one round) in and out of place; at 8 MiB (two rounds) 1.29-1.40x in
# place and 0.92-2.16x out of place, at 16 MiB 0.98-1.09x / 0.91-2.46x, at 32-64
# MiB 0.72-0.85x (three launches each; bench/results/outbox_rounds_s53/). Against
# MPICH in alternating rounds 4 MiB went from 0.70-0.90x (reads) to 1.39-2.12x
# (bench/results/outbox_4m_s52/). A read pins the peer's pages every call, which
# costs most where page walks do (reads from huge pages ran 1.4-2.0x faster:
# bench/results/hostmem_s31/). Earlier hosts found the two even or the reads up to
# 1.15x faster at 4 MiB (the twenty-fifth session: even; before, medians of three
# with synchronised starts: outboxes 342-365 us at 2 MiB, 675-694 at 4; by reads
# 353-361 / 586-624, 1062-1090 at 8 MiB, 1958-2050 at 16). Above, against the
# DAG's ring: 5.3-5.8 ms against 12.8-13.5 at 32 MiB, 12.5-13.2 / 22.4-24.1 at 64,
# 31 / 44-70 at 128, 62 / 88-91 at 256 (the bound: the largest size measured).
OUTBOX_ROUNDS = 2
DIRECT_CMA_FROM_BYTES = 2 * OUTBOX_ROUNDS * SHM_MAX_HALF_BYTES
# On a pair with the segments open that does not read across processes (a
# container whose seccomp profile refuses process_vm_readv, MPCCS_CMA=0), a
# 2-rank all_reduce from DIRECT_SHM_MIN_BYTES up to this goes through the
# outboxes in as many rounds as it takes (comm._direct_by_outboxes).
DIRECT_OUTBOX_MAX_BYTES = 256 << 20
DIRECT_CMA_MAX_BYTES = 256 << 20
# A 2-rank reduce_scatter, all_gather or all_to_all with blocks in this range,
# or broadcast or reduce of a buffer in it, takes the direct path on such a pair
# too, each rank reading the block it needs straight into its output
# (DirectShmBlocksOp), up to half the all_reduce's bound. From 512 KiB: against
# the direct path's messages (bench/results/cma_blocks_s31/, this checkout against
# one bounded at 1 MiB, alternating processes, 4-5 rounds, three runs) the reads
# were 1.16-1.46x faster for all_gather and all_to_all at 512-768 KiB blocks,
# 1.02-1.19x for reduce_scatter, 1.05-1.28x for broadcast, 1.07-1.08x for reduce;
# at 256 KiB 0.86-0.87x (noise-level, and the lane takes most calls there). An
# earlier measurement (before blocking calls ran their steps without an
# Operation) had the messages ahead below 1 MiB. A broadcast or reduce up to 2 MiB
# takes the pipe first (pipe_steps.py: 1.06-1.53x the reads). With 32 MiB blocks
# (medians of five, two interleaved rounds, not committed) against the DAG:
# reduce_scatter 7.9-8.4 ms against 36-40 (ring), all_gather 9.1-9.7 / 19-21
# (ring), all_to_all 10.3-10.4 / 21 (pairwise), broadcast 3.0-3.4 / 8.6-8.7 and
# reduce 6.9-7.0 / 25-27 (tree).
DIRECT_CMA_BLOCK_BYTES = (512 << 10, 128 << 20)
# How long a rank that took the segments polls for its peer's fingerprint there
# before it sleeps on the planes' events (DirectShmAllReduceOp).
PEER_SPIN_S = 200e-6
_NO_FINGERPRINT = np.zeros(2, np.uint64)  # fingerprints off: the meeting alone
_DOORBELL = np.ones(1, np.uint8)  # what a doorbell carries: nothing that matters (sends only read it)
DIRECT_POOL_PER_SIZE = 4  # reusable DirectBuffers kept per size (operations in flight at once)
DIRECT_POOL_SIZES = 32  # sizes kept
DIRECT_POOL_BYTES = 32 << 20  # and at most this much memory in them (medium buffers are up to ~2 MiB)
DIRECT_LAYOUTS_KEPT = 1024  # direct operations' layouts kept per engine (DirectAllReduceOp._layout)


class DirectAllReduceOp(Operation):
    """An all_reduce as one message per peer, fingerprint in front.

    For a few bytes the DAG engine's per-stage work (cursors, probes, windows)
    and a separate fingerprint message cost more than the data: here every rank
    sends its whole input behind its fingerprint to every other rank, in one
    control message, and reduces what it received in rank order 0..p-1 (the
    same order on every rank, so results are bit-identical everywhere). p - 1
    messages per rank: meant for small worlds and payloads (DIRECT_MAX_BYTES).
    The message uses the fingerprint's tag, so a peer that called something
    else (the DAG path included) still gets a MismatchError, not a hang.

    A medium payload (above DIRECT_MAX_BYTES) goes as a second message under
    its own tag (CTRL_DIRECT_DATA), straight from the caller's array: the
    fingerprint message stays small enough for any fingerprint receive, and a
    peer's payload is looked at only after its fingerprint matched, so a size
    mismatch is a MismatchError rather than a truncated receive.
    """

    algorithm = "direct"
    stats_are_light = True
    posts_when_built = True

    def __init__(self, engine, seq, send: np.ndarray, out: np.ndarray, op: str, world: int,
                 fingerprint: Optional[Fingerprint], finalize: Optional[Callable] = None,
                 name: str = "all_reduce"):
        super().__init__(engine, seq)
        self.name = name
        self.op, self.out, self.finalize, self.fingerprint = op, out, finalize, fingerprint
        self.wire_seq = wire.attempt_seq(seq, 0)
        me = engine.rank
        self.mine = self._own_input(send, out, me, world)
        nbytes = self.mine.nbytes  # what every message carries: the input, or one block of it
        layout = engine.direct_layouts.get(self._layout_key(world, nbytes))
        if layout is None:
            layout = self._layout(world, nbytes)
        self.others = layout.others
        self._buffers = buffers = engine.direct_buffers(*layout.buffer_key)
        if buffers.fingerprint is not fingerprint:  # pooled buffers keep the fingerprint they last sent
            buffers.payload[:FP_BYTES] = fingerprint.encode().view(np.uint8) if fingerprint is not None else 0
            buffers.fingerprint = fingerprint
        if layout.inline_sends:
            buffers.payload[FP_BYTES:] = send.view(np.uint8)
        self._sends, self._recvs, self._got = [], [], {}
        self._data_recvs = {}
        self._landed = {}  # peer -> the view of out its medium payload arrives in (_landing)
        if layout.medium:
            self._post_medium(send, world, layout)
            return
        for row, peer in enumerate(layout.others):
            plane = engine.control_plane(peer)
            self._post_fingerprint(row, peer, plane, layout)
            if layout.sends_to[row]:
                self.bytes_per_plane[plane.name] += nbytes

    def _post_fingerprint(self, row: int, peer: int, plane, layout: "DirectLayout") -> None:
        """This rank's fingerprint message to ``peer`` (row ``row`` of the layout), and the receive of the peer's."""
        seq, buffers = wire.seq_bits(self.wire_seq), self._buffers
        if plane not in self.spin_planes:
            self.spin_planes += (plane,)
        self._sends.append(plane.send(peer, buffers.payload, layout.send_tag | seq, buffers.payload_desc))
        self._recvs.append((plane.recv(buffers.rows[row], layout.recv_tags[row] | seq, desc=buffers.row_descs[row]),
                            peer, row, plane, False))

    def _layout_key(self, world: int, nbytes: int) -> tuple:
        return type(self), world, nbytes, self.mine.itemsize, getattr(self, "root", None)

    def _layout(self, world: int, nbytes: int) -> "DirectLayout":
        """What this kind of operation sends and receives for one world and
        payload size: the same on every call of one shape (a training loop's),
        so built once per engine; the constructor was ~14 us of a ~30 us
        8-byte all_reduce before."""
        others = tuple(r for r in range(world) if r != self.engine.rank)
        sends_to = tuple(self._sends_to(peer) for peer in others)
        # Different blocks to different peers cannot share one inline payload: their own messages
        # (empty blocks: nothing to send but the fingerprint).
        medium = nbytes > DIRECT_MAX_BYTES or (self.per_peer and nbytes > 0)
        inline = 0 if medium else nbytes  # in each fingerprint message that carries a payload
        inline_sends = inline if any(sends_to) else 0
        capacity = FP_BYTES + max(inline, fp_blob_capacity(self.engine, world))
        fp_tag = wire.make_tag(wire.KIND_CTRL, self.engine.comm_id, 0, 0, wire.CTRL_FINGERPRINT)  # | seq_bits
        layout = DirectLayout(others, sends_to, tuple(self._receives_from(peer) for peer in others), medium,
                              inline_sends, (inline_sends, capacity, len(others), self._received_bytes() if medium else 0),
                              fp_tag | wire.mid_bits(self.engine.rank),
                              tuple(fp_tag | wire.mid_bits(peer) for peer in others))
        if len(self.engine.direct_layouts) >= DIRECT_LAYOUTS_KEPT:
            self.engine.direct_layouts.clear()  # payload sizes are many; a loop uses a few
        self.engine.direct_layouts[self._layout_key(world, nbytes)] = layout
        return layout

    def _post_medium(self, send: np.ndarray, world: int, layout: "DirectLayout") -> None:
        """Post a medium operation's messages: each fingerprint message, then the
        payload under its own tag, straight from the caller's array."""
        engine, me, nbytes = self.engine, self.engine.rank, self.mine.nbytes
        data_tag = wire.make_tag(wire.KIND_CTRL, engine.comm_id, self.wire_seq, 0, wire.CTRL_DIRECT_DATA)
        for row, peer in enumerate(layout.others):
            plane = engine.control_plane(peer)
            self._post_fingerprint(row, peer, plane, layout)
            if layout.sends_to[row]:
                data = _block(send, peer, world) if self.per_peer else send
                self._sends.append(plane.send(peer, data.view(np.uint8), data_tag | wire.mid_bits(me)))
                self.bytes_per_plane[plane.name] += nbytes
            if layout.receives_from[row]:
                self._data_recvs[peer] = self._post_payload_recv(plane, peer, row, data_tag, send, world)

    def _post_payload_recv(self, plane, peer: int, row: int, tag: int, send: np.ndarray, world: int):
        """The receive of ``peer``'s medium payload: into the caller's output where
        _landing allows, else into this peer's pooled row."""
        landing = self._landing(peer, send, world)
        if landing is None:
            return plane.recv(self._buffers.data[row], tag | wire.mid_bits(peer), desc=self._buffers.data_descs[row])
        self._landed[peer] = landing
        return plane.recv(landing.view(np.uint8), tag | wire.mid_bits(peer))

    def _landing(self, peer: int, send: np.ndarray, world: int) -> Optional[np.ndarray]:
        """Where ``peer``'s medium payload may arrive straight in the output, or None.

        A reduction lands the first operand in rank order that is not this
        rank's own (rank 1's on rank 0, rank 0's elsewhere) on the output, out of
        place only, so that the first combine writes over one of its operands:
        numpy's ufuncs ran 2.4-2.7x faster so than into a third array here (float32
        sum of 1 MiB: 44 against 118 us), and a copy first costs what it saves.
        The received bytes are exactly the row's; a peer whose fingerprint does
        not match may have written the output by the time the MismatchError is
        raised, as an error leaves the output undefined anyway."""
        first_other = 1 if self.engine.rank == 0 else 0
        if peer != first_other or np.may_share_memory(send, self.out):
            return None
        return self.out

    def _received_bytes(self) -> int:
        """What one peer's payload message brings (medium: its own receive buffer per peer)."""
        return self.mine.nbytes

    per_peer = False  # every peer gets the whole input (True: block j of it goes to rank j)
    reduces = True  # what arrives is reduced into out (False: placed)

    def _sends_to(self, peer: int) -> bool:
        return True  # a payload, not only the fingerprint

    def _receives_from(self, peer: int) -> bool:
        return True

    def _own_input(self, send: np.ndarray, out: np.ndarray, me: int, world: int) -> np.ndarray:
        """What this rank combines of its own (its block of the input when blocks
        go per peer). Ranks 0 and 1 reduce theirs first (out = in0 op in1,
        element by element), so only a later rank reducing in place needs a copy
        of it; what is placed is never overwritten before it is read.
        may_share_memory: bounds only, 5x cheaper than shares_memory; a false
        positive costs a copy."""
        mine = _block(send, me, world) if self.per_peer else send
        return mine.copy() if self.reduces and me >= 2 and np.may_share_memory(mine, out) else mine

    def _advance(self) -> bool:
        moved = self._take_arrivals()
        if self._recvs or not all(r.completed for r in self._sends):
            return moved
        for req in self._sends:
            req.check_error()
        self._combine()
        self._complete()
        return True

    def _take_arrivals(self) -> bool:
        """Accept what arrived: each peer's fingerprint message, then (medium) its
        payload, looked at only once its fingerprint matched."""
        moved = False
        still = []
        for item in self._recvs:
            req, peer, row, plane, is_data = item
            if not req.completed:
                still.append(item)
                continue
            moved = True
            self._accept(req, peer, row, plane, is_data)
            if not is_data and peer in self._data_recvs:
                still.append((self._data_recvs.pop(peer), peer, row, plane, True))  # now its payload
        self._recvs = still
        return moved

    def _complete(self) -> None:
        """Every request completed: the buffers go back for the next call (never
        after a failure, where UCX may still hold them)."""
        self.engine.give_direct_buffers(self._buffers)
        self._got = self._buffers = None
        if self.finalize is not None:
            self.finalize()
        self._finish()

    def _let_go_of_arrays(self) -> None:
        self.mine = self.out = self.finalize = None
        self._landed, self._data_recvs, self._sends = {}, {}, []

    def _check_arrival(self, req, peer: int, plane, stage=None) -> None:
        """A completed receive's error, as a TransportError naming the plane and the peer."""
        try:
            req.check_error()
        except Exception as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}", rank=self.engine.rank, plane=plane.name,
                                 peer=peer, op=self.name, stage=stage) from None

    def _accept(self, req, peer: int, row: int, plane, is_data: bool) -> None:
        self._check_arrival(req, peer, plane)
        if is_data:
            landed = self._landed.get(peer)
            self._got[peer] = landed if landed is not None else self._buffers.data[row].view(self.mine.dtype)
            return
        buf = self._buffers.rows[row]
        if self.fingerprint is not None:
            check_fingerprint(self, buf, peer, self.others, self.wire_seq)
        if peer not in self._data_recvs and self._receives_from(peer):
            self._got[peer] = buf[FP_BYTES:FP_BYTES + self.mine.nbytes].view(self.mine.dtype)

    def _fail(self, exc: BaseException) -> None:
        # Receives still posted (a mismatched peer's payload never comes) and
        # sends in flight keep their buffers alive until UCX lets go.
        pending = [item[0] for item in self._recvs] + list(self._data_recvs.values()) + self._sends
        for req in pending:
            if not req.completed:
                self.engine.park(req, (self._buffers, self.mine, self.out))
        super()._fail(exc)

    def _combine(self) -> None:
        got, me = self._got, self.engine.rank
        got[me] = self.mine  # 1-D, like the received parts (arrays.check_array)
        reduce_to(self.out, got[0], got[1], self.op)  # no copy of got[0] first: same order, one pass
        for r in range(2, len(got)):
            reduce_into(self.out, got[r], self.op)

    def describe_stall(self) -> dict:
        waiting = sorted({peer for _, peer, _, _, _ in self._recvs})
        return {"stage": 0, "peer": waiting, "plane": sorted({item[3].name for item in self._recvs}) or "control",
                "waiting_for": f"the message of ranks {waiting}"}

    def stats(self) -> dict:
        out = super().stats()
        out.update(algorithm=self.algorithm, channels=1, policy="direct", stages=[])
        return out


class DirectBlocksAllReduceOp(DirectAllReduceOp):
    """A medium all_reduce as a reduce-scatter then an all-gather of blocks,
    behind the direct path's fingerprint messages: each rank sends rank j
    block j of its input, reduces its own block over every rank's part in rank
    order 0..p-1 (the full exchange's order: its result, bit for bit), then
    sends that block to every other rank, straight into their outputs. On 2
    ranks these are the two-step executor's exchanges of halves, without its
    agreement round: like the rest of the direct path every rank takes it from
    the configuration and the call alone. Each rank sends 2 (p - 1) / p of its
    input and reduces one block, where the full exchange (DirectAllReduceOp)
    sends (p - 1) inputs and reduces p, for twice the messages; it replaces it
    from DIRECT_BLOCKS_MIN_BYTES.

    The receives of the reduced blocks are posted at the start, into the
    output: a peer sends its block only after it matched this rank's
    fingerprint and took this rank's part of that block, so even in place
    nothing still to be sent is overwritten, and a mismatched peer sends none.
    """

    algorithm = "direct_blocks"

    def __init__(self, engine, seq, send: np.ndarray, out: np.ndarray, op: str, world: int,
                 fingerprint: Optional[Fingerprint], finalize: Optional[Callable] = None,
                 name: str = "all_reduce"):
        n = send.size
        self._blocks = [slice(j * n // world, (j + 1) * n // world) for j in range(world)]  # of input and output
        self._in_place = np.may_share_memory(send, out)
        self._gather_recvs: list = []  # (request, peer, plane): the peers' reduced blocks
        self._reduced = False
        super().__init__(engine, seq, send, out, op, world, fingerprint, finalize, name)

    def _own_input(self, send: np.ndarray, out: np.ndarray, me: int, world: int) -> np.ndarray:
        return send  # only this rank's own block may need a copy (_reduce_own_block)

    def _received_bytes(self) -> int:
        return self.mine[self._blocks[self.engine.rank]].nbytes  # a peer's part of the block this rank owns

    def _landing(self, peer: int, send: np.ndarray, world: int) -> Optional[np.ndarray]:
        """The first other operand of the block this rank owns, in its output (see the base class)."""
        landing = super()._landing(peer, send, world)
        return None if landing is None else landing[self._blocks[self.engine.rank]]

    def _post_medium(self, send: np.ndarray, world: int, layout: "DirectLayout") -> None:
        engine, me = self.engine, self.engine.rank
        part_tag = wire.make_tag(wire.KIND_CTRL, engine.comm_id, self.wire_seq, 0, wire.CTRL_DIRECT_PART)
        reduced_tag = wire.make_tag(wire.KIND_CTRL, engine.comm_id, self.wire_seq, 0, wire.CTRL_DIRECT_REDUCED)
        self._reduced_tag = reduced_tag | wire.mid_bits(me)
        planes = [engine.control_plane(peer) for peer in layout.others]
        self._planes = planes
        for row, (peer, plane) in enumerate(zip(layout.others, planes)):
            self._post_fingerprint(row, peer, plane, layout)
            self._data_recvs[peer] = self._post_payload_recv(plane, peer, row, part_tag, send, world)
            block = self.out[self._blocks[peer]]
            self._gather_recvs.append((plane.recv(block.view(np.uint8), reduced_tag | wire.mid_bits(peer)),
                                       peer, plane))
        for peer, plane in zip(layout.others, planes):
            part = send[self._blocks[peer]]
            self._sends.append(plane.send(peer, part.view(np.uint8), part_tag | wire.mid_bits(me)))
            self.bytes_per_plane[plane.name] += part.nbytes

    def _advance(self) -> bool:
        moved = self._take_arrivals()
        if self._recvs:
            return moved
        if not self._reduced:
            self._reduce_own_block()
            moved = True
        if not all(r.completed for r, _, _ in self._gather_recvs) or not all(r.completed for r in self._sends):
            return moved
        for req, peer, plane in self._gather_recvs:
            self._check_arrival(req, peer, plane, stage="direct blocks: reduced block")
        for req in self._sends:
            req.check_error()
        self._complete()
        return True

    def _reduce_own_block(self) -> None:
        """out[own] = in_0 op in_1 op ... in_(p-1) over this rank's block, then that block to every peer."""
        me = self.engine.rank
        own = self._blocks[me]
        mine = self.mine[own]
        if me >= 2 and self._in_place:
            mine = mine.copy()  # reduced into after ranks 0 and 1: the output overwrites it first
        parts = [mine if r == me else self._got[r] for r in range(len(self._blocks))]
        result = self.out[own]
        reduce_to(result, parts[0], parts[1], self.op)
        for part in parts[2:]:
            reduce_into(result, part, self.op)
        for peer, plane in zip(self.others, self._planes):
            self._sends.append(plane.send(peer, result.view(np.uint8), self._reduced_tag))
            self.bytes_per_plane[plane.name] += result.nbytes
        self._reduced = True

    def _fail(self, exc: BaseException) -> None:
        for req, _, _ in self._gather_recvs:
            if not req.completed:
                self.engine.park(req, self.out)  # it writes into the caller's output
        super()._fail(exc)

    def describe_stall(self) -> dict:
        if self._recvs or not self._gather_recvs:
            return super().describe_stall()
        waiting = [peer for req, peer, _ in self._gather_recvs if not req.completed]
        return {"stage": 1, "peer": waiting, "plane": sorted({p.name for p in self._planes}),
                "waiting_for": f"the reduced blocks of ranks {waiting}" if waiting
                else "the peers to take this rank's messages"}


class SegmentMeetingOp(Operation):
    """A 2-rank operation whose ranks meet in the shared-memory segments, not by
    UCX messages (those cost 25-36 us of a 1-8 MiB call; without them 1.03-1.29x
    faster: bench/results/meeting_ab/): each publishes its fingerprint there
    before anything of it can be read, and looks at its peer's before it reads
    anything of the peer's, so a peer that called another operation through the
    segments is never read from and both ranks get a MismatchError. A peer that
    called something else (the DAG, a direct message) sends a fingerprint
    message instead: a rank that has not met its peer within PEER_SPIN_S stops
    polling, posts FLAG_WAITING, sleeps on the planes' events and looks for
    that message each time it wakes (a mismatch then, told to the peer by an
    abort). A peer that arrives and sees FLAG_WAITING rings (CTRL_DOORBELL), so
    a late peer costs neither spinning nor a sleep's timeout. In the normal case
    no UCX message moves at all.

    Subclasses publish their part (``_since``: when) and call _meet_peer()
    until it is True, then move their bytes and finish with _finish_once_rung()
    (DirectShmAllReduceOp: steps over the outboxes or reads across processes;
    lane_ops.LaneOp: one slot)."""

    stats_are_light = True
    posts_when_built = True

    def __init__(self, engine, seq, send: np.ndarray, out: np.ndarray, op: str,
                 fingerprint: Optional[Fingerprint], finalize: Optional[Callable], name: str, *,
                 segments=None, peers: Optional[tuple] = None):
        super().__init__(engine, seq)
        self.name, self.op, self.out, self.finalize, self.fingerprint = name, op, out, finalize, fingerprint
        self.mine = send
        self.wire_seq = wire.attempt_seq(seq, 0)
        # ``peers``: every rank it meets (a group lane's: group_lane_ops.py); 2 ranks by default.
        self.peers = peers if peers is not None else (1 - engine.rank,)
        self.peer = self.peers[0]
        self.spin_planes = tuple(dict.fromkeys(engine.control_plane(p) for p in self.peers))
        # The segments this call was chosen for (the engine's may change later).
        self._pair = segments if segments is not None else engine.shm
        self._met = False  # the peer's fingerprint for this operation is in its segment and matched
        self._asleep = False  # this rank posted FLAG_WAITING: it sleeps on the planes' events
        self._since = 0.0  # when this rank published its part
        self._doorbells = []  # rung for the peer (their sends)

    def _finish_once_rung(self) -> bool:
        """Its bytes moved: finish once every doorbell this rank rang went out (False while one is in flight)."""
        if not all(r.completed for r in self._doorbells):
            return False
        for req in self._doorbells:
            req.check_error()
        self._release()
        if self.finalize is not None:
            self.finalize()
        self._finish()
        return True

    def _meet_peer(self) -> bool:
        """True once the peer's fingerprint for this operation is in its segment
        and matched ours (MismatchError where it differs); until then, past
        PEER_SPIN_S, sleep and look for a fingerprint message (class docstring)."""
        pair, seq = self._pair, self.seq
        theirs = pair.peer_fingerprint(seq)
        if theirs is None and not self._asleep and self._past_spin():
            pair.post_waiting(seq)
            self._asleep = True
            theirs = pair.peer_fingerprint(seq)  # (it may have come between the look and the flag)
        if theirs is None:
            if self._asleep:
                self._look_for_messages()
            return False
        if self.fingerprint is not None:
            check_fingerprint(self, theirs, self.peer, (self.peer,), self.wire_seq)
        self._met = True
        if pair.peer_waiting(seq):
            self._ring()
        return True

    def _past_spin(self) -> bool:
        """PEER_SPIN_S has passed since this rank published its part: time to sleep."""
        return time.perf_counter() - self._since > PEER_SPIN_S

    def _ring(self, peer: Optional[int] = None) -> None:
        peer = self.peer if peer is None else peer
        plane = self.engine.control_plane(peer)
        tag = wire.make_tag(wire.KIND_CTRL, self.engine.comm_id, self.wire_seq, self.engine.rank, wire.CTRL_DOORBELL)
        self._doorbells.append(plane.send(peer, _DOORBELL, tag))

    def _look_for_messages(self, peers: Optional[tuple] = None) -> None:
        """While asleep: take the doorbells that woke this rank (stale ones from an
        earlier operation too), and fail on a fingerprint message from a peer
        (``peers``: those not met yet; default: the one peer)."""
        engine = self.engine
        for peer in (self.peers if peers is None else peers):
            bell = wire.make_tag(wire.KIND_CTRL, engine.comm_id, 0, peer, wire.CTRL_DOORBELL)
            fp_tag = wire.make_tag(wire.KIND_CTRL, engine.comm_id, self.wire_seq, peer, wire.CTRL_FINGERPRINT)
            for plane in engine.planes_from(peer):
                while (probe := plane.probe(bell, wire.ctrl_any_seq_mask())) is not None:
                    plane.take(probe)
                probe = plane.probe(fp_tag, wire.FULL_MASK) if self.fingerprint is not None else None
                if probe is not None:
                    self._fail_on_message(np.frombuffer(plane.take(probe), np.uint8), peer)

    def _fail_on_message(self, message: np.ndarray, peer: int) -> None:
        """``peer`` sent a fingerprint message for this operation: it called
        something that does not run through the segments."""
        if message.size < FP_BYTES:
            raise ProtocolError(f"malformed fingerprint message of {message.size} bytes", rank=self.engine.rank,
                                peer=peer, op=self.name)
        check_fingerprint(self, message, peer, self.peers, self.wire_seq)  # raises: the algorithms differ
        raise ProtocolError(f"rank {peer} sent a fingerprint message for operation #{self.seq}, which this "
                            "rank runs through the shared-memory segments", rank=self.engine.rank, peer=peer,
                            op=self.name)

    def _let_go_of_arrays(self) -> None:
        self.mine = self.out = self.finalize = None

    def _release(self) -> None:
        """Let go of what it held in the segments besides its part (DirectShmAllReduceOp: the outboxes' turn)."""

    def _fail(self, exc: BaseException) -> None:
        self._release()
        for req in self._doorbells:
            if not req.completed:
                self.engine.park(req, _DOORBELL)
        super()._fail(exc)

    def stats(self) -> dict:
        out = super().stats()
        out.update(algorithm=self.algorithm, channels=1, policy="direct", stages=[],
                   slept_for_peer=self._asleep, rang_peer=bool(self._doorbells))
        return out


class StartedSteps(NamedTuple):
    """A call's steps through the segments, posted by DirectShmAllReduceOp.publish
    before any operation existed (run_steps_alone), for the operation that takes
    them over: ``met`` whether the peer's fingerprint was found and matched,
    ``since`` when this rank published its fingerprint."""

    steps: object  # ShmSteps or CmaSteps
    met: bool
    since: float


class DirectShmAllReduceOp(SegmentMeetingOp):
    """A 2-rank all_reduce of halves through the shared-memory segments
    (shm_steps.py; above DIRECT_CMA_FROM_BYTES, where the pair allows it, read
    across processes: cma_steps.py): the direct blocks' reduce-scatter and
    all-gather with a copy and a flag in place of each message. Chosen like the
    rest of the direct path, from the configuration and the call alone
    (comm._run_direct): every rank opened the segments or none did
    (transports/shm.open_pair). The ranks meet as SegmentMeetingOp says, before
    the steps read anything of the peer's. A blocking call with nothing else in
    flight runs its steps without an operation first (run_steps_alone); one
    built then takes them over where they stopped (``started``).

    One outbox per rank: operations in flight together (async_op) take the
    segments in turn, in the order they were submitted (the same on both
    ranks): an operation starts its steps once the one before it finished
    here, which was once the peer had taken everything from this outbox."""

    algorithm = "direct_shm"
    root = 0  # (DirectShmBlocksOp's broadcast and reduce have one)

    def __init__(self, engine, seq, send: np.ndarray, out: np.ndarray, op: str, world: int,
                 fingerprint: Optional[Fingerprint], finalize: Optional[Callable] = None,
                 name: str = "all_reduce", *, started: Optional[StartedSteps] = None, segments=None,
                 peers: Optional[tuple] = None):
        super().__init__(engine, seq, send, out, op, fingerprint, finalize, name, segments=segments, peers=peers)
        # (self.mine: the steps read each half before anything writes over it)
        self._steps = None
        self._marks = None  # the steps' timeline once they are let go (CmaSteps.marks; ShmSteps keep none)
        if started is None:
            self._start_steps()
        else:
            self.engine.shm_holder = self
            self._steps, self._met, self._since = started
        self.bytes_per_plane[UP] = self.peer_bytes(name, send, engine.rank, self.root, world)

    @staticmethod
    def peer_bytes(name: str, send: np.ndarray, rank: int, root, world: int) -> int:
        """What a rank's steps move to or from its peer, as counted per plane: its
        part of the peer's half, then the peer's copy of its own."""
        return send.nbytes

    @classmethod
    def publish(cls, pair, engine, seq: int, name: str, send: np.ndarray, out: np.ndarray, op: str,
                fingerprint: Optional[Fingerprint], root):
        """Publish this rank's fingerprint in the segments, then post its steps; the steps."""
        pair.post_fingerprint(fingerprint.encode() if fingerprint is not None else _NO_FINGERPRINT, seq)
        return cls.post_steps(pair, engine, seq, name, send, out, op, root)

    @classmethod
    def post_steps(cls, pair, engine, seq: int, name: str, send: np.ndarray, out: np.ndarray, op: str, root):
        """This rank's steps, posted: through the outboxes, or read across processes (``reads``)."""
        if not cls.reads(pair, send):
            return ShmSteps(pair, seq, engine.rank, send, out, op, landing=engine.outbox_landing)
        return CmaSteps(pair, wire.attempt_seq(seq, 0), engine.rank, name, send, out, op,
                        lambda n: engine.kept_scratch("direct_shm", n), _step_error(engine.rank, name), root,
                        landing=engine.landing)

    @staticmethod
    def reads(pair, send: np.ndarray) -> bool:
        """Read the halves across processes (else through the outboxes)."""
        return pair.cma and send.nbytes > DIRECT_CMA_FROM_BYTES

    def _start_steps(self) -> bool:
        """Take the segments if no earlier operation holds them (Engine.shm_holder),
        publish the fingerprint and post this rank's steps."""
        if self.engine.shm_holder is not None:
            return False
        self.engine.shm_holder = self
        self._steps = self.publish(self._pair, self.engine, self.seq, self.name, self.mine, self.out, self.op,
                                   self.fingerprint, self.root)
        self._since = time.perf_counter()
        return True

    def _advance(self) -> bool:
        if self._steps is None and not self._start_steps():
            return False
        moved = False
        if not self._met:
            if not self._meet_peer():
                return False
            moved = True
        moved |= self._steps.advance()
        if not self._steps.done:
            return moved
        return self._finish_once_rung() or moved

    @property
    def polls_memory(self) -> bool:
        """While it runs its steps, and for PEER_SPIN_S while it waits for its peer
        to arrive; not asleep (a late peer, uneven work between collectives,
        costs no spinning) nor queued behind an earlier operation."""
        return self._steps is not None and (self._met or not self._asleep)

    def _let_go_of_arrays(self) -> None:
        super()._let_go_of_arrays()
        self._marks = getattr(self._steps, "marks", None)  # the steps' timeline outlives them (stats)
        self._steps = None

    def stats(self) -> dict:
        out = super().stats()
        marks = getattr(self._steps, "marks", None) if self._steps is not None else self._marks
        if marks is not None:
            out["steps_us"] = step_times_us(marks)
        return out

    def _release(self) -> None:
        if self.engine.shm_holder is self:
            self.engine.shm_holder = None

    def _fail(self, exc: BaseException) -> None:
        if self._steps is not None:
            self._steps.abandon()
        super()._fail(exc)

    def describe_stall(self) -> dict:
        if self._steps is None:
            waiting = "an earlier operation to let go of the segments"
        elif not self._met:
            waiting = "the peer to reach this operation (its fingerprint in its segment)"
        else:
            waiting = self._steps.waiting_for
        return {"stage": "direct shm", "peer": [self.peer], "plane": UP, "waiting_for": waiting}


class DirectShmBlocksOp(DirectShmAllReduceOp):
    """A 2-rank reduce_scatter, all_gather, all_to_all, broadcast or reduce of
    blocks in DIRECT_CMA_BLOCK_BYTES on a pair that reads across processes: each
    rank reads the block it needs from its peer's input straight into its output
    (cma_steps.py; a reduction reduces it there with its own operand in rank
    order; a broadcast's or reduce's one reader reads the whole buffer), meeting
    its peer in the segments and taking them in turn like the all_reduce."""

    def __init__(self, engine, seq, send: np.ndarray, out: np.ndarray, op: str, world: int,
                 fingerprint: Optional[Fingerprint], finalize: Optional[Callable] = None,
                 name: str = "reduce_scatter", root: int = 0, *, started: Optional[StartedSteps] = None):
        self.root = root
        super().__init__(engine, seq, send, out, op, world, fingerprint, finalize, name, started=started)

    @staticmethod
    def peer_bytes(name: str, send: np.ndarray, rank: int, root, world: int) -> int:
        return peer_part(name, send, rank, root)[0].nbytes  # what the peer reads

    @staticmethod
    def reads(pair, send: np.ndarray) -> bool:
        return True  # chosen only where the pair reads (comm._direct_by_cma)


class DirectPipeBlocksOp(DirectShmBlocksOp):
    """DirectShmBlocksOp's collectives with a part above the lane's bound and within
    the outbox (pipe_steps.takes): each rank's part goes through its outbox in
    chunks that the peer copies or reduces out while the next is copied in
    (pipe_steps.py), on any pair with the segments open, reads or not."""

    algorithm = "direct_pipe"

    @classmethod
    def post_steps(cls, pair, engine, seq: int, name: str, send: np.ndarray, out: np.ndarray, op: str, root):
        part, count = peer_part(name, send, engine.rank, root)
        return PipeSteps(pair, seq, engine.rank, name, send, out, op, part, count, _step_error(engine.rank, name),
                         root)


def _step_error(rank: int, name: str) -> Callable[[str, str], TransportError]:
    """What a failed step through the segments raises: naming the rank, plane, peer and step."""
    def error(message: str, step: str) -> TransportError:
        return TransportError(message, rank=rank, plane=UP, peer=1 - rank, op=name, stage=f"direct shm {step}")
    return error


def run_steps_alone(pair, seq: int, steps, fingerprint: Optional[Fingerprint],
                    peers: Optional[tuple] = None, yields: bool = False) -> tuple[bool, bool]:
    """A blocking call's steps through the segments, published with nothing else
    in flight, run here without an operation (the Operation, the engine and the
    record cost a 1-4 MiB call ~40 us: bench/results/steps_alone_s28/): the
    peer's fingerprint (``peers``: a group's, every peer's in turn: ShmGroup),
    then the steps, each wait at most PEER_SPIN_S.
    (done, met): not done, DirectShmAllReduceOp(started=...) takes them over -
    a peer not there yet (its sleep and doorbells), a fingerprint that differs
    (its MismatchError), a peer asleep (the doorbell to ring), a step that
    waits longer (its stall watch). A failed read raises here, its steps as
    they stood. ``yields``: each look gives the core away first (more ranks on
    this host than cores: the rank it waits for may have none)."""
    for peer in (None,) if peers is None else peers:
        def look():
            return pair.peer_fingerprint(seq) if peer is None else pair.peer_fingerprint(peer, seq)
        deadline = time.perf_counter() + PEER_SPIN_S
        while (theirs := look()) is None:
            if yields:
                os.sched_yield()
            if time.perf_counter() > deadline:
                return False, False
        asleep = pair.peer_waiting(seq) if peer is None else pair.peer_waiting(peer, seq)
        if (fingerprint is not None and theirs.tobytes() != fingerprint.raw) or asleep:
            return False, False
    deadline = time.perf_counter() + PEER_SPIN_S
    while not steps.done:
        if steps.advance():
            deadline = time.perf_counter() + PEER_SPIN_S
            continue
        if yields:
            os.sched_yield()
        if time.perf_counter() > deadline:
            return False, True
    return True, True


class LightRecord:
    """What last_stats() shows for a call run without an operation (run_steps_alone,
    lane_ops.Lane.exchange): the keys of SegmentMeetingOp.stats(), built only when asked.
    Also what the Work of an async call that finished at once holds: an
    operation finished without error, as Work and Engine.wait read one."""

    __slots__ = ("name", "seq", "nbytes", "t_start", "t_end", "algorithm", "marks")
    finished, error, posts_when_built = True, None, False

    def __init__(self, name: str, seq: int, nbytes: int, t_start: float, t_end: float, algorithm: str,
                 marks: Optional[list] = None):
        self.name, self.seq, self.nbytes, self.t_start, self.t_end = name, seq, nbytes, t_start, t_end
        self.algorithm, self.marks = algorithm, marks  # marks: the steps' timeline (cma_steps.CmaSteps.marks)

    @property
    def bytes_per_plane(self) -> dict:
        return {UP: self.nbytes, OUT: 0}

    def stats(self) -> dict:
        out = {"op": self.name, "seq": self.seq, "duration_s": self.t_end - self.t_start,
               "t_start_wall": wall(self.t_start), "bytes_per_plane": self.bytes_per_plane,
               "algorithm": self.algorithm, "channels": 1, "policy": "direct", "stages": [],
               "slept_for_peer": False, "rang_peer": False}
        if self.marks is not None:
            out["steps_us"] = step_times_us(self.marks)
        return out


class DirectReduceScatterOp(DirectAllReduceOp):
    """A reduce_scatter as one message per peer: block j of the input to rank j,
    the blocks received reduced in rank order like the direct all_reduce. A
    ring sends the same (p - 1) blocks per rank, in p - 1 DAG stages."""

    per_peer = True


class DirectAllGatherOp(DirectAllReduceOp):
    """An all_gather as one message per peer: the same messages as the direct
    all_reduce (each rank's block to every other rank, behind its fingerprint),
    placed instead of reduced. A ring all_gather sends each rank the same
    (p - 1) blocks, in p - 1 stages of the DAG engine."""

    reduces = False

    def _landing(self, peer: int, send: np.ndarray, world: int) -> Optional[np.ndarray]:
        """Every peer's block straight into its place in the output, unless the
        input overlaps the output elsewhere than in this rank's own block (where
        an in-place all_gather keeps it; an in-place all_to_all sends from every
        block it receives into)."""
        n = self.mine.size
        own = self.out[self.engine.rank * n:(self.engine.rank + 1) * n]
        if np.may_share_memory(send, self.out) and not (send.ctypes.data == own.ctypes.data and send.size == n):
            return None
        return self.out[peer * n:(peer + 1) * n]

    def _combine(self) -> None:
        n = self.mine.size
        for peer, part in self._got.items():
            if peer not in self._landed:
                self.out[peer * n:(peer + 1) * n] = part
        own = self.out[self.engine.rank * n:(self.engine.rank + 1) * n]
        if own.ctypes.data != self.mine.ctypes.data:  # not in place
            own[...] = self.mine


class DirectAllToAllOp(DirectAllGatherOp):
    """An all_to_all as one message per peer (block j to rank j), placed."""

    per_peer = True


class _RootedDirectOp(DirectAllReduceOp):
    """A direct operation with a root (broadcast, reduce)."""

    def __init__(self, *args, root: int = 0, **kwargs):
        self.root = root
        super().__init__(*args, **kwargs)


class DirectReduceOp(_RootedDirectOp):
    """A reduce as one message from every other rank to the root, reduced there
    in rank order like the direct all_reduce; the root sends the others its
    fingerprint alone, so they learn of a mismatch too."""

    def _sends_to(self, peer: int) -> bool:
        return self.engine.rank != self.root and peer == self.root

    def _receives_from(self, peer: int) -> bool:
        return self.engine.rank == self.root

    def _combine(self) -> None:
        if self.engine.rank == self.root:
            super()._combine()


class DirectBroadcastOp(_RootedDirectOp):
    """A broadcast as one message from the root to every other rank; the
    others send the root their fingerprint alone, so it learns of a mismatch
    too. A pipelined broadcast sends the same bytes in many DAG stages."""

    reduces = False

    def _sends_to(self, peer: int) -> bool:
        return self.engine.rank == self.root

    def _receives_from(self, peer: int) -> bool:
        return peer == self.root

    def _landing(self, peer: int, send: np.ndarray, world: int) -> Optional[np.ndarray]:
        """The root's payload straight into the output (a rank that receives sends none)."""
        return self.out

    def _combine(self) -> None:
        if self.engine.rank != self.root and self.root not in self._landed:
            self.out[...] = self._got[self.root]


def peer_part(collective: str, send: np.ndarray, rank: int, root) -> tuple[np.ndarray, int]:
    """What a rank of a 2-rank call gives its peer, and how many elements of the
    peer's it takes: the block the peer owns or is sent (reduce_scatter,
    all_to_all); a broadcast's root the buffer, the other rank nothing; a
    reduce's other rank its input, the root nothing; else the whole input.
    The lane publishes it (lane_ops.py); DirectShmBlocksOp's peer reads it."""
    if collective in ("reduce_scatter", "all_to_all"):
        half = send.size // 2
        return send[(1 - rank) * half:(2 - rank) * half], half
    if collective == "broadcast":
        return (send, 0) if rank == root else (send[:0], send.size)
    if collective == "reduce":
        return (send[:0], send.size) if rank == root else (send, 0)
    return send, send.size  # all_reduce, barrier, all_gather


def _block(send: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Block ``rank`` of ``send`` cut into ``world`` equal blocks (reduce_scatter, all_to_all)."""
    n = send.size // world
    return send[rank * n:(rank + 1) * n]


@dataclass(frozen=True)
class DirectLayout:
    """A direct operation's messages for one call shape (DirectAllReduceOp._layout_key),
    on one rank: kept on the engine (Engine.direct_layouts)."""

    others: tuple  # the peers, in rank order: row i of the buffers is others[i]
    sends_to: tuple  # per row: a payload goes to that peer (else the fingerprint alone)
    receives_from: tuple  # per row: a payload comes from that peer
    medium: bool  # payloads travel in messages of their own, after the fingerprint messages
    inline_sends: int  # payload bytes in this rank's fingerprint message
    buffer_key: tuple  # Engine.direct_buffers' arguments
    send_tag: int  # this rank's fingerprint message, but for its sequence number (wire.seq_bits)
    recv_tags: tuple  # per row: the peer's fingerprint message, but for its sequence number


class DirectBuffers:
    """A direct all_reduce's message buffers and their UCX descriptors, reused
    from call to call (Engine.direct_buffers): allocating and describing them
    was ~4 us of a ~30 us 8-byte all_reduce. ``payload``: the fingerprint and
    an inline input; ``rows``: one fingerprint receive per peer; ``data``: one
    medium payload receive per peer (zero columns for an inline one)."""

    __slots__ = ("key", "payload", "rows", "data", "payload_desc", "row_descs", "data_descs", "nbytes", "fingerprint")

    def __init__(self, inline: int, capacity: int, npeers: int, separate: int, describe: Callable):
        self.key = (inline, capacity, npeers, separate)
        self.payload = np.empty(FP_BYTES + inline, dtype=np.uint8)
        self.rows = np.empty((npeers, capacity), dtype=np.uint8)
        self.data = np.empty((npeers, separate), dtype=np.uint8)
        self.payload_desc = describe(self.payload)
        self.row_descs = [describe(row) for row in self.rows]
        self.data_descs = [describe(row) for row in self.data] if separate else []
        self.nbytes = self.payload.nbytes + self.rows.nbytes + self.data.nbytes
        self.fingerprint = False  # the Fingerprint (or None) written in payload; False: nothing yet


def fp_blob_capacity(engine, world: int) -> int:
    """Bytes a fingerprint message may carry after the fingerprint: piggybacked
    estimates, or a direct all_reduce's payload (so either kind of message fits
    the other's receive, and a mismatch between them is reported, not truncated).
    Kept on the engine: every small all_reduce asks."""
    capacity = engine.fp_capacity.get(world)
    if capacity is None:
        blob = 1 + engine.controller.blob_capacity(world - 1) if engine.controller is not None else 0  # + declaration
        capacity = engine.fp_capacity[world] = max(blob, DIRECT_MAX_BYTES)
    return capacity
