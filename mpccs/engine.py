"""Drives every operation in flight on the planes.

One rank's engine is single-threaded: whoever waits on a ``Work`` drives
``Engine.progress()``, which advances every operation in flight (so several
operations may be outstanding and complete in any order). No progress thread:
on small machines a busy-polling thread starves the ranks themselves. The
operations: collective_op.CollectiveOp (DAGs), direct_ops (one message per
peer), p2p_ops (send / receive).
"""
from __future__ import annotations

import os
import select
import time
from typing import Callable, Optional

import numpy as np

from . import wire
from .collective_op import CollectiveOp
from .direct_ops import DIRECT_POOL_BYTES, DIRECT_POOL_PER_SIZE, DIRECT_POOL_SIZES, DirectBuffers, DirectLayout
from .errors import MismatchError, MpccsError, OperationTimeout, TransportError
from .flows import DecisionCache, Splitter
from .health import PlaneHealth
from .operation import Operation
from .p2p_ops import P2P_INBOX_BYTES, P2P_INBOXES_KEPT
from .windows import OUT, UP, Pacer

ABORT_REASON_MAX = 1024
IDLE_SPINS_BEFORE_YIELD = 16
# Where this host runs more ranks than this rank may use cores, a waiting rank
# spins on a core that the rank it waits for needs: it yields at its first idle
# round instead. All_reduce on 2 cores, four alternating rounds, us a call
# against 16 idle rounds first: 8 B 260-337 / 344-413 (3 ranks), 303-402 /
# 411-527 (4 ranks); 1 MiB 1.07-1.53x at 4 ranks (bench/results/oversubscribed_s28/).
IDLE_SPINS_BEFORE_YIELD_OVERSUBSCRIBED = 1
SCRATCH_POOL_BYTES = 8 << 20  # reduction chunks kept for reuse: the default windows' worth (up + out)
IDLE_SPINS_BEFORE_SLEEP = 256  # then block on the planes' event fds ...
IDLE_SLEEP_S = 0.001  # ... for at most this long (bounds the cost of a missed wake-up)
ABORT_POLL_AFTER_S = 0.005  # look for peers' aborts only once an operation stalls this long
ABORT_FLUSH_S = 0.5  # how long a rank that aborts keeps progressing to get its abort messages out
ALONE_SPINS = 4  # progress rounds Engine._spin_alone gives a direct operation before the general loop
CONTROL_POLL_S = 0.002  # progress() looks for failover notices and pings this often
LIVENESS_AFTER_S = 0.5  # and for peers whose process is gone once it stalls this long


class Engine:
    def __init__(self, rank: int, comm_id: int, planes: dict, controller=None,
                 plane_timeout_s: float = 1.0, reprobe_s: float = 5.0, out_pacer: Optional[Pacer] = None):
        self.rank = rank
        self.comm_id = comm_id
        self.planes = planes  # name -> Plane (only the enabled ones)
        self.controller = controller
        self.active: list[Operation] = []
        self._scratch: dict[int, list[np.ndarray]] = {}
        self._scratch_pooled = 0  # bytes held by _scratch
        self._trash = np.empty(1 << 20, dtype=np.uint8)
        self._abort_sends: list = []
        self._poller = None
        self.idle_spins_before_yield = IDLE_SPINS_BEFORE_YIELD  # (share_cores)
        self.oversubscribed = False  # more ranks on this host than this rank's cores (share_cores)
        self.decisions = DecisionCache()
        self.liveness: Optional[Callable[[], list]] = None  # returns ranks known to be gone
        self.health = PlaneHealth(rank, comm_id, planes, plane_timeout_s, reprobe_s)
        self.failover_notices: dict[int, tuple] = {}  # attempt seq -> (plane, reason, sender)
        self._failovers_sent: set[int] = set()  # attempts this rank already announced
        self._ctrl_sends: list = []
        self._parked: list = []
        self._next_control_poll = 0.0
        self._direct_pool: dict[tuple, list] = {}  # DirectBuffers by DirectBuffers.key
        self._kept_scratch: dict[str, np.ndarray] = {}  # see kept_scratch()
        self.shm = None  # transports.shm.ShmPair of a 2-rank job on one host (the communicator opens it)
        self.landing = None  # control.landing.LandingChoices of the pair's in-place all_reduce (the communicator's)
        self.outbox_landing = None  # ... and of its all_reduce through the outboxes (shm_steps.py)
        self._p2p_inboxes: list[np.ndarray] = []  # see p2p_inbox()
        self.shm_holder: Optional[Operation] = None  # the operation whose steps use the segments now
        self.lane_unposted: list[Operation] = []  # lane operations built but not posted yet, in order (lane_ops)
        self._direct_pool_bytes = 0
        self._last_direct: Optional[DirectBuffers] = None  # see give_direct_buffers()
        self.fp_capacity: dict[int, int] = {}  # fp_blob_capacity by world size
        self.direct_layouts: dict[tuple, "DirectLayout"] = {}  # see DirectAllReduceOp._layout
        # QoS rate cap: paces this rank's borrowed chunks on 'out' (every operation, every policy).
        self.out_pacer = out_pacer

    def pacer_for(self, plane_name: str, splitter: "Splitter", peer: int) -> Optional[Pacer]:
        """The pacer a chunk to ``peer`` on ``plane_name`` waits for: borrowed bytes only
        ('out' while 'up' reaches the peer too); a flow between domains has no other plane
        and never waits."""
        if self.out_pacer is None or plane_name != OUT or not splitter.reach(peer)[0]:
            return None
        return self.out_pacer

    def direct_buffers(self, inline: int, capacity: int, npeers: int, separate: int) -> "DirectBuffers":
        last = self._last_direct
        if last is not None and last.key == (inline, capacity, npeers, separate):
            self._last_direct = None
            return last
        pool = self._direct_pool.get((inline, capacity, npeers, separate))
        if pool:
            self._direct_pool_bytes -= pool[-1].nbytes
            return pool.pop()
        describe = next(iter(self.planes.values())).descriptor
        return DirectBuffers(inline, capacity, npeers, separate, describe)

    def give_direct_buffers(self, buffers: "DirectBuffers") -> None:
        """Keep a few per size; sizes are many (any count up to the direct limit), so the
        oldest size goes first, and the pool holds at most DIRECT_POOL_BYTES. The
        last buffers given back wait apart, outside the pool, for the next call:
        a loop of one call shape takes and gives them back without touching it."""
        if self._last_direct is None:
            self._last_direct = buffers
            return
        pool = self._direct_pool.pop(buffers.key, [])
        if len(pool) < DIRECT_POOL_PER_SIZE:
            pool.append(buffers)
            self._direct_pool_bytes += buffers.nbytes
        self._direct_pool[buffers.key] = pool  # most recently used last
        while len(self._direct_pool) > DIRECT_POOL_SIZES or self._direct_pool_bytes > DIRECT_POOL_BYTES:
            oldest = self._direct_pool.pop(next(iter(self._direct_pool)))
            self._direct_pool_bytes -= sum(b.nbytes for b in oldest)

    def planes_to(self, peer: int) -> list:
        return [p for p in self.planes.values() if p.reaches(peer)]

    def park(self, request, buffer) -> None:
        """Keep a request abandoned on a failed plane, and its buffer, alive until UCX lets go."""
        self._parked = [(r, b) for r, b in self._parked if not r.completed]
        self._parked.append((request, buffer))

    def planes_from(self, peer: int) -> list:
        """Where a receiver looks for a peer's chunks: every plane it ever knew
        the peer on, down ones included (the peer may have rejoined already)."""
        return [p for p in self.planes.values() if p.knows(peer)]

    def control_plane(self, peer: int):
        """Small control messages take the lowest-latency live plane reaching the peer."""
        for name in (UP, OUT):
            plane = self.planes.get(name)
            if plane is not None and name not in self.health.down and plane.reaches(peer):
                return plane
        raise TransportError("no live plane reaches this peer", rank=self.rank, peer=peer)

    # -- small control messages (completion agreement, failover) ------------
    def send_ctrl(self, peer: int, seq: int, kind: int, payload: bytes = b"\0") -> None:
        buf = np.frombuffer(payload, dtype=np.uint8).copy()
        tag = wire.make_tag(wire.KIND_CTRL, self.comm_id, seq, self.rank, kind)
        self._ctrl_sends = [(r, b) for r, b in self._ctrl_sends if not r.completed]
        self._ctrl_sends.append((self.control_plane(peer).send(peer, buf, tag), buf))

    def take_ctrl(self, seq: int, kind: int) -> list[tuple[int, bytes]]:
        """(sender, payload) of every control message of this type and seq that arrived."""
        tag = wire.make_tag(wire.KIND_CTRL, self.comm_id, seq, 0, kind)
        got = []
        for plane in self.planes.values():
            while True:
                probe = plane.probe(tag, wire.ctrl_any_sender_mask())
                if probe is None:
                    break
                got.append((wire.split_tag(probe.sender_tag.value)[3], plane.take(probe)))
        return got

    def drain(self, seq: int) -> bool:
        """Discard every chunk and DONE of a failed attempt that reached any plane."""
        tag = wire.make_tag(wire.KIND_COLL, self.comm_id, seq, 0, 0)
        moved = False
        for plane in self.planes.values():
            while True:
                probe = plane.probe(tag, wire.stream_any_chunk_mask())
                if probe is None:
                    break
                self.discard(plane, probe)
                moved = True
        return bool(self.take_ctrl(seq, wire.CTRL_DONE)) or moved

    # -- plane failover --------------------------------------------------------
    def can_take_over(self, failed: str, peers) -> bool:
        """Another live plane reaches every peer, so an attempt can run again without ``failed``."""
        planes = [p for n, p in self.planes.items() if n != failed and n not in self.health.down]
        return any(all(p.reaches(q) for q in peers) for p in planes)

    def fail_plane(self, name: str, reason: str, seq: int, peers) -> None:
        """Mark a plane down here and tell every rank that attempt ``seq`` must stop."""
        self.health.mark_down(name, reason, time.perf_counter())
        if seq in self._failovers_sent:
            return
        if len(self._failovers_sent) > 64:
            self._failovers_sent.clear()
        self._failovers_sent.add(seq)
        payload = (name + "\0" + reason[:ABORT_REASON_MAX]).encode()
        for peer in peers:
            try:
                self.send_ctrl(peer, seq, wire.CTRL_FAILOVER, payload)
            except TransportError:
                pass  # no live plane reaches it: its own watchdog will fire

    def poll_failovers(self) -> None:
        tag = wire.make_tag(wire.KIND_CTRL, self.comm_id, 0, 0, wire.CTRL_FAILOVER)
        for plane in self.planes.values():
            while True:
                probe = plane.probe(tag, wire.ctrl_any_seq_mask())
                if probe is None:
                    break
                _, _, seq, sender, _ = wire.split_tag(probe.sender_tag.value)
                name, _, reason = plane.take(probe).decode(errors="replace").partition("\0")
                self.failover_notices[seq] = (name[:64], f"rank {sender}: {reason[:ABORT_REASON_MAX]}", sender)

    def scratch(self, nbytes: int) -> np.ndarray:
        size = 1 << max(12, (nbytes - 1).bit_length())
        pool = self._scratch.get(size)
        if pool:
            self._scratch_pooled -= size
            return pool.pop()
        return np.empty(size, dtype=np.uint8)

    def p2p_inbox(self) -> np.ndarray:
        """A receive buffer for a point-to-point header with up to P2P_INLINE_MAX_BYTES inside."""
        return self._p2p_inboxes.pop() if self._p2p_inboxes else np.empty(P2P_INBOX_BYTES, dtype=np.uint8)

    def give_p2p_inbox(self, inbox: np.ndarray) -> None:
        """Back to the pool once its receive completed (a failed one's may still be written: dropped)."""
        if len(self._p2p_inboxes) < P2P_INBOXES_KEPT:
            self._p2p_inboxes.append(inbox)

    def kept_scratch(self, user: str, nbytes: int) -> np.ndarray:
        """The buffer an in-place block lands in, one per ``user`` that runs one
        operation at a time ("two_step": the two-step executor, collectives run one
        at a time; "direct_shm": the direct operations through the segments, which
        take turns), kept at the largest size asked (at most 8 MiB: two_step.
        MAX_HALF_BYTES; cma_steps.READ_PART_BYTES). Pooled chunks of that
        size were often gone to the DAG's chunks in between, and a fresh buffer per
        call faulted its pages in under the receive (a 4 MiB half took 2.5x as long
        as into a warm buffer)."""
        buf = self._kept_scratch.get(user)
        if buf is None or buf.nbytes < nbytes:
            buf = self._kept_scratch[user] = np.empty(max(1, nbytes), dtype=np.uint8)
        return buf[:nbytes]

    def forget_kept_scratch(self, user: str) -> None:
        """A failed call parked it: UCX may still write there, so the next call gets its own."""
        self._kept_scratch.pop(user, None)

    def release_scratch(self, buf: np.ndarray) -> None:
        """Keep the chunk for reuse within SCRATCH_POOL_BYTES. Chunk sizes vary
        with the operation, so an unbounded pool per size kept the high-water
        mark of every size ever used (16 MiB after a soak, reached at a random
        operation: resident memory stepped up by half of that long after warm-up);
        beyond the budget a chunk goes back to the allocator."""
        if self._scratch_pooled + buf.nbytes > SCRATCH_POOL_BYTES:
            return
        self._scratch.setdefault(buf.nbytes, []).append(buf)
        self._scratch_pooled += buf.nbytes

    def discard(self, plane, probe) -> None:
        """Receive a rejected message into a trash buffer so its sender completes."""
        n = int(probe.length)
        if n > self._trash.nbytes:
            self._trash = np.empty(n, dtype=np.uint8)
        req = plane.recv_probed(self._trash[:n], probe)
        deadline = time.perf_counter() + 5
        while not req.completed and time.perf_counter() < deadline:
            plane.progress()

    # -- aborts: one rank's failure reaches every rank of the operation ----
    def broadcast_abort(self, peers, seq: int, reason: str) -> None:
        """Tell peers that operation #seq failed here, with the reason (best effort).

        The messages are progressed out before this returns (at most
        ABORT_FLUSH_S): a send UCX could not post at once (a full shared-memory
        FIFO) leaves only when this rank's worker progresses again, and an
        aborted rank may never drive an operation again, leaving its peer
        blocked until its own no-progress timeout (seen once in CI: a
        point-to-point receiver waited 30 s for an abort its sender had posted)."""
        payload = np.frombuffer(reason.encode()[:ABORT_REASON_MAX], dtype=np.uint8).copy()
        tag = wire.make_tag(wire.KIND_CTRL, self.comm_id, seq, self.rank, wire.CTRL_ABORT)
        for peer in peers:
            if peer == self.rank:
                continue
            try:
                self._abort_sends.append((self.control_plane(peer).send(peer, payload, tag), payload))
            except (TransportError, Exception):  # a dead plane cannot carry it; the peer's watchdog will
                pass
        self._flush_abort_sends(time.perf_counter() + ABORT_FLUSH_S)

    def _flush_abort_sends(self, deadline: float) -> None:
        pending = [item for item in self._abort_sends if not item[0].completed]
        while pending and time.perf_counter() < deadline:
            self.progress_planes()
            pending = [item for item in pending if not item[0].completed]
        self._abort_sends = pending  # kept alive until UCX lets go

    def poll_aborts(self) -> Optional[MpccsError]:
        """An abort a peer sent for any operation of this communicator, as an error."""
        tag = wire.make_tag(wire.KIND_CTRL, self.comm_id, 0, 0, wire.CTRL_ABORT)
        for plane in self.planes.values():
            probe = plane.probe(tag, wire.ctrl_any_seq_mask())
            if probe is None:
                continue
            _, _, seq, sender, _ = wire.split_tag(probe.sender_tag.value)
            reason = plane.take(probe)[:ABORT_REASON_MAX].decode(errors="replace")
            cls = MismatchError if "called" in reason else TransportError
            err = cls(f"rank {sender} aborted operation #{seq}: {reason}")
            err.peers_told = True  # the sender told every rank
            return err
        return None

    def _watch_planes(self, op: Operation, stalled: float, now: float) -> None:
        """While a protected collective stalls, find a plane that went silent
        (progress() answers heartbeats and learns of failovers meanwhile)."""
        if (isinstance(op, CollectiveOp) and op.protected and op.phase == "run"
                and stalled > self.health.timeout_s):
            verdict = self.health.check(op.fp_peers, now, key=(op.seq, op.attempt))
            if verdict is not None:
                plane, peer = verdict
                op.plane_failed(plane, f"no answer on plane {plane!r} from rank {peer} for "
                                       f"{self.health.timeout_s:g} s while another plane answered")

    def _lost_peers(self, op: Operation) -> Optional[TransportError]:
        """A stalled operation checks whether a peer's process is gone (see Communicator liveness)."""
        if self.liveness is None:
            return None
        lost = self.liveness()
        if not lost:
            return None
        stall = op.describe_stall()
        err = TransportError(
            f"rank(s) {lost} are gone (their processes exited) while {op.name} #{op.seq} waited on {stall}",
            rank=self.rank, peer=lost if len(lost) > 1 else lost[0], op=op.name, stage=stall.get("stage"),
            plane=stall.get("plane"),
        )
        err.lost_ranks = tuple(lost)
        return err

    def submit(self, op: Operation) -> Operation:
        self.active.append(op)
        if op.posts_when_built:
            return op  # an advance now would find its receives not yet completed (~1 us of an 8-byte call)
        if isinstance(op, CollectiveOp):
            op.on_finish.append(self._fail_collectives_behind)
        if self._collective_ahead(op) is None:
            op.advance()
            if op.finished:
                self.active.remove(op)
        return op

    def _fail_collectives_behind(self, failed: Operation) -> None:
        """A collective that fails leaves its peers mid-schedule (or aborted):
        the collectives queued behind it could only stall, so they fail now,
        naming it (their peers learn of it from the first failure's abort)."""
        if failed.error is None or failed not in self.active:
            return
        behind = self.active[self.active.index(failed) + 1:]
        for op in behind:
            if isinstance(op, CollectiveOp) and not op.finished:
                err = TransportError(f"{op.name} #{op.seq} did not start: {failed.name} #{failed.seq}, called "
                                     f"before it, failed: {failed.error}", rank=self.rank, op=op.name)
                err.peers_told = getattr(failed.error, "peers_told", False)
                op._fail(err)

    def _collective_ahead(self, op: Operation) -> Optional["CollectiveOp"]:
        """The oldest unfinished collective submitted before ``op`` (a collective), or None.

        Collectives run one at a time, in the order they were called (as on a
        NCCL stream): several in flight at once (a training loop's async gradient
        buckets) would share the planes, every stage would measure a fraction of
        each plane, and the controller, judging a probe of 'out' against 'up'
        alone in that crowd, dropped 'out' for good (the testbed step-time run:
        99% on 'up', 0.99x). One at a time costs no bandwidth (the planes were
        the bottleneck) and finishes the oldest first. Point-to-point and direct
        operations are not held."""
        if not isinstance(op, CollectiveOp):
            return None
        for other in self.active:
            if other is op:
                return None
            if isinstance(other, CollectiveOp) and not other.finished:
                return other
        return None

    def share_cores(self, oversubscribed: bool) -> None:
        """Whether this host runs more ranks than this rank has cores (the communicator
        counts them): a waiting rank then yields at its first idle round."""
        self.oversubscribed = oversubscribed
        self.idle_spins_before_yield = IDLE_SPINS_BEFORE_YIELD_OVERSUBSCRIBED if oversubscribed \
            else IDLE_SPINS_BEFORE_YIELD

    def sleep_until_event(self, timeout_s: float) -> None:
        """Block until a plane has an event (or timeout); returns at once if one is pending."""
        planes = list(self.planes.values())
        if not all(plane.arm() for plane in planes):
            return
        if self._poller is None:
            self._poller = select.poll()
            for plane in planes:
                self._poller.register(plane.fileno(), select.POLLIN)
        self._poller.poll(timeout_s * 1000)

    def progress_planes(self) -> None:
        for plane in self.planes.values():
            plane.progress()

    def progress(self) -> bool:
        self.progress_planes()
        moved = False
        now = time.perf_counter()
        if now >= self._next_control_poll and self.active:
            # Cheap, rate-limited: operations driven only by Work.is_completed()
            # (never by wait()) still learn that a peer failed a plane over, and
            # still answer heartbeats.
            self._next_control_poll = now + CONTROL_POLL_S
            self.health.serve()
            self.poll_failovers()
            if self._parked:  # let go of buffers once UCX released their requests
                self._parked = [(r, b) for r, b in self._parked if not r.completed]
        collective_running = False
        for op in list(self.active):
            if isinstance(op, CollectiveOp):
                if collective_running:
                    op.last_progress = now  # queued behind an earlier collective (wait() drives that one)
                    continue
                collective_running = True
            moved |= op.advance()
            if op.finished:
                self.active.remove(op)
                if isinstance(op, CollectiveOp):
                    collective_running = False  # the next one may start in this pass
        return moved

    def wait(self, op: Operation, timeout_s: float) -> None:
        """Drive progress until op finishes; raise its error or a no-progress timeout.
        Collectives queued ahead of op are driven first, each under its own
        no-progress watch (their errors stay theirs, raised by their own wait)."""
        if op.posts_when_built and len(self.active) == 1 and self.active[0] is op:
            self._spin_alone(op)
        while not op.finished:
            ahead = self._collective_ahead(op)
            if ahead is None:
                break
            self._drive(ahead, timeout_s)
        self._drive(op, timeout_s)
        if op.error is not None:
            raise op.error

    def _spin_alone(self, op: Operation) -> None:
        """The first progress rounds of an operation alone in the engine, that
        posted everything when built (a direct one), drive it alone: what
        progress() does but for the operations it need not look at (~1 us of
        an 8-byte all_reduce). Not past a due control poll, nor past
        ALONE_SPINS rounds: then _drive takes over, with its stall watch. Only
        the planes its messages use (a tcp plane's progress is ~1 us of nothing
        for an operation on shared memory)."""
        if op.run_alone():
            self.active.remove(op)
            return
        planes = op.spin_planes or tuple(self.planes.values())
        for _ in range(ALONE_SPINS):
            for plane in planes:
                plane.progress()
            if op.advance() and op.finished:
                self.active.remove(op)
                return
            if time.perf_counter() >= self._next_control_poll:
                return

    def _drive(self, op: Operation, timeout_s: float) -> None:
        next_abort_poll = next_liveness = 0.0
        idle = 0
        while not op.finished:
            if self.progress():
                idle = 0
            else:
                idle += 1
                if idle > IDLE_SPINS_BEFORE_SLEEP and not any(o.polls_memory for o in self.active):
                    self.sleep_until_event(IDLE_SLEEP_S)
                elif idle > self.idle_spins_before_yield:
                    # Ranks may share cores (2-core machines, oversubscribed
                    # tests): give the peer we wait for a chance to run.
                    os.sched_yield()
            if op.finished:
                break
            now = time.perf_counter()
            stalled = op.stalled_for(now)
            if stalled > ABORT_POLL_AFTER_S and now >= next_abort_poll:
                next_abort_poll = now + ABORT_POLL_AFTER_S
                self._watch_planes(op, stalled, now)
                error = self.poll_aborts()
                if error is None and stalled > LIVENESS_AFTER_S and now >= next_liveness:
                    next_liveness = now + LIVENESS_AFTER_S
                    error = self._lost_peers(op)
                if error is not None:
                    op._fail(error)
                    if op in self.active:
                        self.active.remove(op)
                    break
            if stalled > timeout_s:
                stall = op.describe_stall()
                err = OperationTimeout(
                    f"{op.name} #{op.seq} made no progress for {timeout_s:g} s; waiting on {stall}",
                    rank=self.rank, plane=stall.get("plane"), peer=stall.get("peer"), op=op.name,
                    stage=stall.get("stage"),
                )
                op._fail(err)
                if op in self.active:
                    self.active.remove(op)
                break
