"""A collective as a coflow DAG of chunk transfers on both planes.

Per stage, every outgoing flow is cut into chunks (``windows.FlowCursor``):
'up' takes chunks from the head, 'out' from the tail, each plane keeps at most
its window of bytes in flight, and where the policy allows it a plane that
runs ahead steals unstarted chunks from the other's end. The receiver probes
both planes for the flow's tag prefix, reads the chunk index from the sender's
tag, validates it (index in range, not seen before, exact length) and places
the chunk by its offset: copied flows land directly in the destination,
reduced flows land in a scratch chunk and are folded in as ``dst = op(dst,
chunk)`` while later chunks are still on the wire. Which plane carried a
chunk never changes the order of operands, so results are bit-identical under
every path policy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from . import wire
from .algorithms.overlap import companion_flows
from .algorithms.schedule import Flow, Schedule, Stage
from .arrays import copy_into, empty_like_memory, same_start
from .direct_ops import fp_blob_capacity
from .errors import PlaneFailure, ProtocolError, TransportError
from .flows import MIN_CHUNK_BYTES, MIN_SAMPLE_BYTES, InFlow, OutFlow, Splitter, StagePlan, StageRun
from .operation import FP_BYTES, Operation, check_fingerprint
from .prologue import EARLY_COPY_BYTES, DeferredCopies, merged_ranges
from .reduce import reduce_into, reduce_to
from .telemetry import wall
from .two_step import TwoStepExecutor
from .windows import OUT, UP, chunk_range, flow_chunk_elems, flow_min_chunks, missing_ranges

# QUIESCED payloads: how the sender retries (CollectiveOp._check_retry_modes)
RETRY_RESTART = b"\0"  # from intact (or restored) inputs
RETRY_RESUME = b"\1"  # over its buffers as left, each range reduced once
# A byte after the fingerprint carries the sender's declarations (0: none).
# Under 'adaptive': whether it may put bytes of this operation on a failable
# plane (no declaration, e.g. a peer on a fixed policy, reads as "may").
# DECLARES_TWO_STEP: it would run the operation on the two-step executor
# (two_step.py), which both ranks then do only if both declare it.
DECLARES_SAFE, DECLARES_CARRY, DECLARES_TWO_STEP = 1, 2, 4


@dataclass(frozen=True)
class LocalPlan:
    """What one rank needs of a schedule, computed once per (schedule, rank)."""

    peers_out: tuple
    peers_in: tuple
    # Fingerprints go both ways between every pair that exchanges data, so
    # a rank that only sends (a broadcast root) still learns of a mismatch.
    fp_peers: tuple
    dep_counts: dict
    dependents: dict
    stage_by_id: dict
    initial_ready: tuple
    written: dict  # buffer -> sorted disjoint (lo, hi) element ranges the rank's incoming flows write


def exchanges_with_everyone(schedule: Schedule) -> bool:
    """Every rank exchanges data (and so fingerprints) with every other rank:
    then what each rank declares in its fingerprint message reaches every
    rank, and all of them can agree on it (CollectiveOp._resolve_protection).
    False for rank-local schedules (all_to_allv), whose peers differ by rank."""
    key = "exchanges_with_everyone"
    known = schedule.meta.get(key)
    if known is None:
        world = schedule.world
        pairs = {(f.src, f.dst) for f in schedule.flows()}
        known = schedule.local_rank is None and all(
            (a, b) in pairs or (b, a) in pairs for a in range(world) for b in range(a + 1, world))
        schedule.meta[key] = known
    return known


def local_plan(schedule: Schedule, rank: int) -> LocalPlan:
    key = ("local_plan", rank)
    plan = schedule.meta.get(key)
    if plan is None:
        flows = list(schedule.flows())
        peers_out = tuple(sorted({f.dst for f in flows if f.src == rank}))
        peers_in = tuple(sorted({f.src for f in flows if f.dst == rank}))
        dependents: dict[int, list[int]] = {}
        for stage in schedule.stages:
            for d in stage.deps:
                dependents.setdefault(d, []).append(stage.id)
        plan = LocalPlan(
            peers_out, peers_in, tuple(sorted(set(peers_out) | set(peers_in))),
            {s.id: len(s.deps) for s in schedule.stages}, dependents,
            {s.id: s for s in schedule.stages}, tuple(s.id for s in schedule.stages if not s.deps),
            merged_ranges((f.dst_buf, f.dst_off, f.dst_off + f.count) for f in flows if f.dst == rank),
        )
        schedule.meta[key] = plan
    return plan


def _probing(plan, rank: int) -> bool:
    """Whether ``rank`` probed a dropped plane in the stage ``plan`` describes. A
    rank's plan records its own mode only (its peers' entries are modelled), but
    ranks probe together, in the operations of a shared epoch grid
    (docs/controller.md, Re-probe), so a probing rank's peers probe too."""
    reason = plan.reason if plan is not None else {}
    return reason.get("ranks", {}).get(str(rank), {}).get("mode") == "probe"


def _busy_time(intervals: list) -> tuple[int, float, float]:
    """(bytes, busy seconds, last arrival) of a plane's arrival spans [(start, end, bytes, sender)]:
    the bytes over the time any of the spans was open (their union), the rate of the link they share."""
    spans = [(start, end) for start, end, _, _ in intervals]
    begin, reach = min(start for start, _ in spans), max(end for _, end in spans)
    busy = (reach - begin) - sum(end - start for start, end in missing_ranges(spans, begin, reach))
    return sum(nbytes for _, _, nbytes, _ in intervals), busy, reach


class CollectiveOp(Operation):
    def __init__(self, engine, seq, schedule: Schedule, buffers: dict, dtype, op: str,
                 splitter: Splitter, chunk_bytes: int, name: str, finalize: Optional[Callable] = None,
                 fingerprint=None, protected: bool = False, snapshot: Optional[np.ndarray] = None,
                 input_unsaved: bool = False, epoch: Optional[int] = None,
                 carries_failable: Optional[bool] = None, whole_flows: bool = False,
                 resume_in_place: bool = False, two_step: bool = False, settled: bool = False,
                 plane_meter=None):
        super().__init__(engine, seq)
        # control.plan_rates.PlaneRateMeter where the call is measured for the plan rates (comm), else None
        self.plane_meter = plane_meter
        self._meter_spans: dict = {}  # plane -> [(start, end, bytes, sender)] of every stage (plane_meter)
        # Failover (docs/reliability.md): a protected operation completes only
        # once every rank has all its data (the DONE round), so no rank has
        # handed its buffers back while another may still need a retry; on a
        # plane failure every rank quiesces the attempt and runs it again on
        # the planes left, from its intact inputs (``snapshot`` restores an
        # in-place input) or, with ``resume_in_place``, over the buffers as
        # the attempt left them, each range of a reducing flow reduced in
        # once over all attempts (algorithms/resume.py says when that is exact).
        self.protected = protected
        self.resume_in_place = resume_in_place
        self.reduced_ranges: dict[int, list] = {}  # flow id -> [(lo, hi)] reduced in (resume only)
        # False: this rank promised (in its fingerprint message) to send nothing
        # on a failable plane, and keeps the promise by sending on 'up' only.
        # When every rank promised so, no plane failure can touch the
        # operation and the DONE round is waived (_resolve_protection).
        self.carries_failable = carries_failable
        self.protection_waived = False
        self._peer_carries: set = set()
        # The two-step executor (two_step.py) replaces the stages when this rank
        # offers it (``two_step``: comm decides where it may) and its peer does too;
        # an offering rank sends nothing until it has read the peer's offer.
        self.offers_two_step = two_step
        self._peers_two_step: set = set()
        self.two_step: Optional[TwoStepExecutor] = None
        self.snapshot = snapshot
        self.input_unsaved = input_unsaved  # in place, no copy taken: a failure cannot be retried
        self.epoch = epoch  # the controller's shared clock (comm: multipath-eligible adaptive operations)
        self.settled = settled  # 'adaptive' with nothing to decide (controller.settled): no estimates sent
        self.attempt = 0
        self.wire_seq = wire.attempt_seq(seq, 0)
        self.phase = "run"  # run -> (finish) -> done; quiesce -> run on a plane failure
        self.failover: Optional[dict] = None
        self.events: list[dict] = []
        self.others = tuple(r for r in range(schedule.world) if r != engine.rank)
        self.name = name
        self.fingerprint = fingerprint  # mpccs.fingerprint.Fingerprint, or None (checks off)
        self.schedule = schedule
        self.buffers = buffers  # "in"/"out" -> typed 1-D arrays; "work" is allocated with the stages
        self.dtype = np.dtype(dtype)
        self.op = op
        self.splitter = splitter
        self.itemsize = self.dtype.itemsize
        self.plan_chunk_elems = max(1, chunk_bytes // self.itemsize)
        # A rank on one plane cuts flows into chunks of up to plan_chunk_elems and no
        # finer (1 chunk min); one that splits keeps at least 4 per flow for both planes.
        self.flow_min_chunks = flow_min_chunks(whole_flows)
        # senders that cut another way (from their fingerprints): src -> (chunk elems, min chunks)
        self.peer_chunking: dict[int, tuple[int, int]] = {}
        self.min_chunk_elems = max(1, MIN_CHUNK_BYTES // self.itemsize)
        self.finalize = finalize
        rank = engine.rank
        self.rank = rank
        self.stage_log: list[dict] = []
        self._prepare()

    # -- setup ------------------------------------------------------------
    def _prepare(self) -> None:
        local = local_plan(self.schedule, self.rank)
        self.peers_out, self.peers_in, self.fp_peers = local.peers_out, local.peers_in, local.fp_peers
        self.verified = set(self.fp_peers) if self.fingerprint is None else set()
        self._fp_sends, self._fp_recvs = [], []
        if self.fingerprint is not None and self.fp_peers:
            self._exchange_fingerprints()
        if self.offers_two_step:
            # The stages' state waits for the executor's choice (_choose_executor);
            # what a failover notice meanwhile looks at exists.
            self.active, self.in_chunks, self.out_chunks = [], [], []
        else:
            self._begin_attempt()

    def _begin_attempt(self) -> None:
        """Fresh per-attempt state; the inputs are intact here (first run or restored)."""
        if self.schedule.work_count and "work" not in self.buffers:
            # Here, not at construction: a two-step operation never needs it (a 2-rank
            # reduce_scatter's is twice its output: 2 MiB of mapping per call at 1 MiB).
            work = empty_like_memory(self.buffers["in"], self.schedule.work_count, self.dtype)  # device views too
            self.buffers = {**self.buffers, "work": work}
        local = local_plan(self.schedule, self.rank)
        self.active: list[StageRun] = []
        self.out_chunks: list = []  # (req, outflow, plane, nbytes, t_post, stagerun)
        self.in_chunks: list = []  # (req, inflow, index, scratch, stagerun, plane, nbytes)
        self.last_look = 0.0  # when _post_receives last ran (see StageRun.delivery_samples)
        self.inflight = {UP: 0, OUT: 0}
        self.window = dict(self.splitter.window_bytes)
        self.stages_done = 0
        self._port_intervals: dict = {}  # plane -> [(start, end, bytes, sender)] (pipelined schedules)
        self._plan_memo: dict = {}
        self.remaining_deps = dict(local.dep_counts)
        self.dependents = local.dependents
        self.stage_by_id = local.stage_by_id
        self.deferred = DeferredCopies(self.schedule.prologue, self.rank, self.buffers, written=local.written)
        self.ready = list(local.initial_ready)

    def _exchange_fingerprints(self) -> None:
        """Send ours to, and expect theirs from, every peer this rank exchanges data with.

        Under 'adaptive' the message also carries this rank's path estimates
        (the controller's export, 14 bytes per path it measured): piggybacked on
        a message every operation sends anyway, one operation behind, so every
        rank decides from the same numbers without an extra round trip. A
        settled operation sends its declaration without them: nothing decides
        from estimates until an operation around the next probe, and those are
        never settled, so they export afresh (controller.note_settled_operation).
        """
        engine, cid, me = self.engine, self.engine.comm_id, self.rank
        payload = self.fingerprint.encode().view(np.uint8)
        controller = engine.controller
        self._fp_blob_cap = 0
        offer = DECLARES_TWO_STEP if self.offers_two_step else 0
        if controller is not None and self.splitter.name == "adaptive":
            declared = (DECLARES_SAFE if self.carries_failable is False else DECLARES_CARRY) | offer
            if self.settled:
                controller.note_settled_operation()
                payload = self.fingerprint.with_declaration(declared)
            else:
                # A promise to send on 'up' only is made where 'out' may not be used (comm._run).
                blob = controller.export_estimates(time.perf_counter(), self.epoch,
                                                   False if self.carries_failable is False else None)
                # One bytes join (numpy's concatenate of three arrays cost ~4 us here).
                payload = np.frombuffer(bytearray(self.fingerprint.raw + bytes((declared,)) + blob), dtype=np.uint8)
            self._fp_blob_cap = controller.blob_capacity(self.schedule.world - 1)  # what peers may send
        elif offer:
            payload = self.fingerprint.with_declaration(offer)
        self._fp_payload = payload
        for peer in self.fp_peers:
            tag = wire.make_tag(wire.KIND_CTRL, cid, self.wire_seq, me, wire.CTRL_FINGERPRINT)
            self._fp_sends.append(engine.control_plane(peer).send(peer, payload, tag))
        self._fp_bufs = np.zeros((len(self.fp_peers), FP_BYTES + fp_blob_capacity(engine, self.schedule.world)),
                                 dtype=np.uint8)
        for row, peer in enumerate(self.fp_peers):
            tag = wire.make_tag(wire.KIND_CTRL, cid, self.wire_seq, peer, wire.CTRL_FINGERPRINT)
            req = engine.control_plane(peer).recv(self._fp_bufs[row], tag)
            self._fp_recvs.append((req, peer, row))

    def _check_fingerprints(self) -> bool:
        if not self._fp_recvs:
            return False
        still, before = [], len(self._fp_recvs)
        for req, peer, row in self._fp_recvs:
            if not req.completed:
                still.append((req, peer, row))
                continue
            try:
                req.check_error()
            except Exception as exc:  # e.g. longer than any fingerprint: truncated
                raise ProtocolError(f"malformed fingerprint message: {type(exc).__name__}: {exc}",
                                    rank=self.rank, peer=peer, op=self.name) from None
            theirs = check_fingerprint(self, self._fp_bufs[row], peer, self.fp_peers, self.seq)
            mine = self.fingerprint
            if theirs is not None and (theirs.chunk_log2, theirs.whole_flows) != (mine.chunk_log2, mine.whole_flows):
                self._follow_senders_chunking(peer, 1 << theirs.chunk_log2, theirs.whole_flows)
            declared = int(self._fp_bufs[row][FP_BYTES])
            if declared & DECLARES_TWO_STEP:
                self._peers_two_step.add(peer)
            if self._fp_blob_cap:
                if not declared & DECLARES_SAFE:
                    self._peer_carries.add(peer)
                self._merge_estimates(peer, self._fp_bufs[row][FP_BYTES + 1:])
            self.verified.add(peer)
        self._fp_recvs = still
        if not still:
            self._resolve_protection()
        return len(still) < before

    def _follow_senders_chunking(self, peer: int, chunk_bytes: int, whole_flows: bool) -> None:
        """The peer cuts its flows otherwise than we do (a sender on one plane only cuts
        whole flows of up to 1 MiB, comm._chunking_for): its flows to us are cut the same
        way here. No chunk of the peer has been claimed yet (claims wait for this check)."""
        self.peer_chunking[peer] = (max(1, chunk_bytes // self.itemsize), flow_min_chunks(whole_flows))
        for run in self.active:
            for inflow in run.ins:
                if inflow.peer == peer:
                    inflow.recut(self._flow_chunk_elems(inflow.flow))

    def _flow_chunk_elems(self, f: Flow) -> int:
        """A flow's chunk length as its sender cuts it: this rank's chunking for its own
        flows, a peer's (from its fingerprint) where it differs."""
        plan, min_chunks = self.peer_chunking.get(f.src, (self.plan_chunk_elems, self.flow_min_chunks))
        return flow_chunk_elems(f.count, plan, self.min_chunk_elems, min_chunks)

    def _resolve_protection(self) -> None:
        """Waive the DONE round when every rank declared it sends nothing on a
        failable plane: a plane failure cannot touch this operation then. Only
        where every rank exchanges fingerprints with every other rank (the DONE
        round's peers): a rank that heard from only some of them could not know
        what the others declared, keep its DONE round and wait forever for a
        rank that waived its own (a 3-rank broadcast chain did, in the soak)."""
        if (self.protected and self.carries_failable is False and self._fp_blob_cap
                and not self._peer_carries and exchanges_with_everyone(self.schedule)):
            self.protected = False
            self.protection_waived = True
            self.resume_in_place = False  # no retry can come: nothing to record

    def _merge_estimates(self, peer: int, buf: np.ndarray) -> None:
        controller = self.engine.controller
        n = controller.blob_length(buf)  # the header, read in place: most messages carry no blob
        if n == 0:
            return  # the peer runs another policy, or is settled, this operation: nothing to merge
        try:
            controller.merge_estimates(peer, bytes(buf[:n]))
        except ValueError as exc:
            raise ProtocolError(f"malformed path estimates: {exc}", rank=self.rank, peer=peer, op=self.name) from None

    def _run_copies(self, copies) -> None:
        for c in copies:
            if c.rank != self.rank or c.count == 0:
                continue
            src = self.buffers[c.src_buf][c.src_off : c.src_off + c.count]
            dst = self.buffers[c.dst_buf][c.dst_off : c.dst_off + c.count]
            if not same_start(src, dst):
                copy_into(dst, src)

    def _start_ready_stages(self) -> bool:
        started = False
        while self.ready:
            sid = self.ready.pop()
            self._start_stage(self.stage_by_id[sid])
            started = True
        return started

    def _start_stage(self, stage: Stage) -> None:
        now = time.perf_counter()
        mine_out = [f for f in stage.flows if f.src == self.rank]
        mine_in = [f for f in stage.flows if f.dst == self.rank]
        if not mine_out and not mine_in:
            self._stage_complete(stage.id)
            return
        comm_id = self.engine.comm_id
        plan = None
        outs = []
        if mine_out:
            sized = [(f, f.count * self.itemsize) for f in mine_out]
            others = [(f, f.count * self.itemsize) for f in stage.flows if f.src != self.rank]
            companions = [(f, f.count * self.itemsize) for f in self._companions().get(stage.id, ())]
            plan = self._plan_stage(sized, now, others, companions)
            self.window = plan.window_bytes
            for f in mine_out:
                view = self._send_view(f)
                ce = self._flow_chunk_elems(f)
                tag = wire.make_tag(wire.KIND_COLL, comm_id, self.wire_seq, f.id)
                outs.append(OutFlow(f, view, ce, plan.splits[f.id], tag, self._reach(f.dst)))
        ins = []
        for f in mine_in:
            view, acc = self._receive_target(f)
            ins.append(InFlow(f, view, self._flow_chunk_elems(f), wire.make_tag(wire.KIND_COLL, comm_id, self.wire_seq, f.id),
                              self.engine.planes_from(f.src), acc))
        self.active.append(StageRun(stage, outs, ins, plan, now))

    def _send_view(self, f: Flow) -> np.ndarray:
        """What a flow sends: its source range, or, while that still waits for
        its prologue copy, the copy's source (prologue.py)."""
        lo, hi = f.src_off, f.src_off + f.count
        deferred = self.deferred
        if deferred:
            source = deferred.source_of(f.src_buf, lo, hi)
            if source is not None:
                return source
            deferred.materialize(f.src_buf, lo, hi)
        return self.buffers[f.src_buf][lo:hi]

    def _receive_target(self, f: Flow) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """(destination range, operand to reduce from instead of it, or None)."""
        lo, hi = f.dst_off, f.dst_off + f.count
        view = self.buffers[f.dst_buf][lo:hi]
        deferred = self.deferred
        if not deferred or not deferred.overlaps(f.dst_buf, lo, hi):
            return view, None
        acc = deferred.source_of(f.dst_buf, lo, hi) if f.reduce else None
        if f.reduce and acc is None:
            deferred.materialize(f.dst_buf, lo, hi)
        else:
            deferred.discard(f.dst_buf, lo, hi)  # overwritten, or reduced from acc, whole
        return view, acc

    def _reach(self, peer: int) -> tuple[bool, bool]:
        up_ok, out_ok = self.splitter.reach(peer)
        if self.carries_failable is False and up_ok:
            return up_ok, False  # the declaration binds: whatever the plan says, nothing on 'out'
        return up_ok, out_ok

    def _companions(self) -> dict:
        """The out-only load the other channels put beside each stage (algorithms.overlap),
        worked out once per schedule; only 'adaptive' reads it (the coflow split)."""
        if self.splitter.name != "adaptive" or self.splitter.same_domain is None or self.schedule.channels <= 1:
            return {}
        by_topology = self.schedule.meta.setdefault("companions", {})  # schedules are cached across communicators
        same_domain = self.splitter.same_domain
        if same_domain not in by_topology:
            by_topology[same_domain] = companion_flows(self.schedule, same_domain)
        return by_topology[same_domain]

    def _plan_stage(self, sized, now, others=(), companions=()) -> StagePlan:
        """The split of this rank's flows in a stage; decided once per operation
        for each distinct demand (a ring's 2(p-1) stages send the same bytes to
        the same peer: one controller decision serves them all, and only the
        stage that made it reports back, so the controller judges it once)."""
        key = tuple((f.dst, n) for f, n in sized)
        memo = self._plan_memo.get(key)
        if memo is None:
            plan = self.splitter.plan(sized, now, self.plan_chunk_elems * self.itemsize, others, self.epoch,
                                      lambda f: self._flow_chunk_elems(f) * self.itemsize, companions)
            self._plan_memo[key] = (plan, [plan.splits[f.id] for f, _ in sized])
            return plan
        first, ordered = memo
        reason = {k: v for k, v in first.reason.items() if k != "decision"}
        return StagePlan({f.id: s for (f, _), s in zip(sized, ordered)}, first.window_bytes, reason, first.cache_key)

    def _stage_complete(self, sid: int) -> None:
        self.stages_done += 1
        for dep in self.dependents.get(sid, ()):
            self.remaining_deps[dep] -= 1
            if self.remaining_deps[dep] == 0:
                self.ready.append(dep)

    # -- progress -----------------------------------------------------------
    def _advance(self) -> bool:
        notices = self.engine.failover_notices
        if notices and self.phase != "quiesce" and self.wire_seq in notices:
            self._enter_quiesce(*notices[self.wire_seq])
        if self.phase == "quiesce":
            return self._advance_quiesce()
        try:
            return self._advance_finish() if self.phase == "finish" else self._advance_run()
        except PlaneFailure as exc:
            self._enter_quiesce(exc.plane, str(exc), self.rank)
            return True

    def _advance_run(self) -> bool:
        moved = self._check_fingerprints()
        if self.offers_two_step:
            if self._fp_recvs:
                return moved  # the executor is not agreed yet
            self._choose_executor()
            moved = True
        if self.two_step is not None:
            return self._advance_two_step() or moved
        moved |= self._start_ready_stages()
        moved |= self._post_receives()
        moved |= self._reap_receives()
        moved |= self._reap_sends()
        moved |= self._post_sends()
        moved |= self._retire_stages()
        if not moved:
            moved = self.deferred.copy_early(EARLY_COPY_BYTES)
        if self.stages_done == len(self.schedule.stages) and not self.ready and not self._fp_recvs:
            if self.protected and self.others:
                self._enter_finish()
            else:
                self._complete()
            return True
        return moved

    @property
    def stats_are_light(self) -> bool:
        """A two-step operation's record holds no split or event to count: the
        communicator builds it only if asked (Communicator._record)."""
        return self.two_step is not None and not self.events

    def _choose_executor(self) -> None:
        """Two-step when the peer offered it too (every peer: two_step.py is for 2 ranks)
        and no completion round is due; else the stages, as every rank decides alike."""
        self.offers_two_step = False
        if self._peers_two_step.issuperset(self.others) and not self.protected:
            self.two_step = TwoStepExecutor(self, MIN_SAMPLE_BYTES)  # it writes every output element itself
        else:
            self._begin_attempt()

    def _advance_two_step(self) -> bool:
        moved = self.two_step.advance()
        if self.two_step.done:
            if self.finalize is not None:
                self.finalize()
            self._finish()
        return moved

    # -- completion agreement and failover ----------------------------------
    def _enter_finish(self) -> None:
        self.phase = "finish"
        self._done_from: set = set()
        for peer in self.others:
            self.engine.send_ctrl(peer, self.wire_seq, wire.CTRL_DONE)

    def _advance_finish(self) -> bool:
        got = self.engine.take_ctrl(self.wire_seq, wire.CTRL_DONE)
        self._done_from.update(sender for sender, _ in got)
        if self._done_from.issuperset(self.others):
            self._complete()
            return True
        return bool(got)

    def plane_failed(self, plane: str, reason: str) -> None:
        """The engine's heartbeat found ``plane`` silent under this operation."""
        if self.phase != "quiesce":
            try:
                self._enter_quiesce(plane, reason, self.rank)
            except BaseException as exc:  # noqa: BLE001 - recorded, re-raised by wait()
                self._fail(exc)

    def _enter_quiesce(self, plane: str, reason: str, origin: int) -> None:
        stage = sorted(r.stage.id for r in self.active)
        if plane not in self.engine.planes:
            raise ProtocolError(f"rank {origin} announced a failure of unknown plane {plane[:40]!r}",
                                rank=self.rank, peer=origin, op=self.name, stage=stage)
        retry_blocker = ("its retry failed too" if self.attempt else
                         "no other plane reaches every rank" if not self.engine.can_take_over(plane, self.others) else
                         f"rank {self.rank} kept no copy of its in-place input" if self.input_unsaved else None)
        if retry_blocker:
            message = f"plane {plane!r} failed during {self.name} #{self.seq} ({reason}) and {retry_blocker}"
            self.engine.broadcast_abort(self.others, self.wire_seq, message)
            err = TransportError(message, rank=self.rank, plane=plane, op=self.name, stage=stage)
            err.peers_told = True
            raise err
        now = time.perf_counter()
        self.failover = {"plane": plane, "reason": reason, "detected_by": origin, "stage": stage,
                         "failed_seq": self.wire_seq, "t_wall": wall(now)}
        self._t_failover = now
        self.events.append({"kind": "plane_failure", "plane": plane, "op": self.name, "seq": self.seq,
                            "stage": stage, "reason": reason, "detected_by": origin})
        self.engine.fail_plane(plane, reason, self.wire_seq, self.others)
        self.offers_two_step = False  # the retry runs the stages (_retry)
        self.phase = "quiesce"
        self._quiesce_sent = False
        self._quiesced_from: set = set()
        self._peers_resuming: set = set()

    def _advance_quiesce(self) -> bool:
        """Stop posting; let every posted request finish (those on the failed
        plane were cancelled); discard what peers sent for this attempt; tell
        every rank; when every rank has said so, run the attempt again."""
        moved = self._reap_quiescing()
        moved |= self.engine.drain(self.wire_seq)
        if not self._quiesce_sent and not self.in_chunks and not self.out_chunks:
            # The payload says how this rank will retry (resume or restart):
            # every rank must do the same (_check_retry_modes).
            mode = RETRY_RESUME if self.resume_in_place else RETRY_RESTART
            for peer in self.others:
                self.engine.send_ctrl(peer, self.wire_seq, wire.CTRL_QUIESCED, mode)
            self._quiesce_sent = moved = True
        got = self.engine.take_ctrl(self.wire_seq, wire.CTRL_QUIESCED)
        self._quiesced_from.update(sender for sender, _ in got)
        self._peers_resuming.update(sender for sender, payload in got if payload[:1] == RETRY_RESUME)
        if self._quiesce_sent and self._quiesced_from.issuperset(self.others):
            # Control messages are ordered per endpoint: every FAILOVER and
            # chunk a peer sent for this attempt is queued before its QUIESCED.
            self.engine.poll_failovers()
            self.engine.drain(self.wire_seq)
            self.engine.failover_notices.pop(self.wire_seq, None)
            self._check_retry_modes()
            self._retry()
            return True
        return moved or bool(got)

    def _check_retry_modes(self) -> None:
        """A resuming rank sends what its buffers hold now, which only a resuming
        receiver reads right; a restarting one expects the schedule's values from
        the start. Every rank sees the same modes, so all go on or all fail."""
        resuming = self._peers_resuming | ({self.rank} if self.resume_in_place else set())
        if resuming and len(resuming) < len(self.others) + 1:
            restarting = sorted(set(self.others) - resuming) if self.resume_in_place else [self.rank]
            err = TransportError(
                f"plane {self.failover['plane']!r} failed during {self.name} #{self.seq} and it cannot be retried: "
                f"ranks {sorted(resuming)} called it in place and ranks {restarting} (at least) did not, "
                "so their retries would not fit (call all_reduce in place on every rank or on none)",
                rank=self.rank, plane=self.failover["plane"], op=self.name, stage=self.failover["stage"])
            err.peers_told = True  # every rank reaches this verdict from the same QUIESCED messages
            raise err

    def _reap_quiescing(self) -> bool:
        """Forget finished requests; park those on a downed plane (a dead link
        may never complete even a cancelled request, and its endpoints are
        closed, so nothing more lands in the buffers they name)."""
        before = len(self.in_chunks) + len(self.out_chunks)
        down = self.engine.health.down
        still_in = []
        for item in self.in_chunks:
            req, scratch, plane = item[0], item[3], item[5]
            if req.completed:
                if scratch is not None:
                    self.engine.release_scratch(scratch)
            elif plane.name in down:
                self.engine.park(req, scratch)  # the scratch chunk is never reused
            else:
                still_in.append(item)
        self.in_chunks = still_in
        still_out = []
        for item in self.out_chunks:
            req, plane = item[0], item[2]
            if req.completed:
                continue
            if plane.name in down:
                self.engine.park(req, item[1].view)
            else:
                still_out.append(item)
        self.out_chunks = still_out
        return len(self.in_chunks) + len(self.out_chunks) < before

    def _retry(self) -> None:
        self.attempt += 1
        self.wire_seq = wire.attempt_seq(self.seq, self.attempt)
        self.splitter = self.splitter.without(self.engine.health.down)
        if self.snapshot is not None:
            np.copyto(self.buffers["in"], self.snapshot)
        if self.resume_in_place:
            self.failover["resumed_elements"] = sum(hi - lo for ranges in self.reduced_ranges.values()
                                                    for lo, hi in ranges)
        self.failover.update(retry_seq=self.wire_seq, retry_planes=sorted(self.splitter.planes),
                             quiesce_s=round(time.perf_counter() - self._t_failover, 4))
        self.events.append({"kind": "retry", "op": self.name, "seq": self.seq, "planes": sorted(self.splitter.planes)})
        self._begin_attempt()
        self.phase = "run"

    def _post_receives(self) -> bool:
        moved = False
        # What the previous look found missing arrived since: the bound on how
        # late a peer evidently started (StageRun.delivery_samples).
        last_look, self.last_look = self.last_look, time.perf_counter()
        for run in self.active:
            for inflow in run.ins:
                if inflow.done or inflow.peer not in self.verified:
                    continue
                for plane in inflow.planes:
                    found = False
                    while True:
                        probe = plane.probe(inflow.tag_base, wire.MASK_STREAM)
                        if probe is None:
                            break
                        self._accept_chunk(run, inflow, plane, probe)
                        moved = found = True
                    if found:
                        run.note_first_chunk(plane.name, inflow.peer, last_look)
        return moved

    def _accept_chunk(self, run: StageRun, inflow: InFlow, plane, probe) -> None:
        try:
            index, offset, nelems = inflow.claim(probe, self.itemsize)
        except ValueError as exc:
            self.engine.discard(plane, probe)
            raise ProtocolError(
                f"{exc} (do all ranks call {self.name} with the same count and dtype?)",
                rank=self.rank, plane=plane.name, peer=inflow.peer, op=self.name, stage=run.stage.id,
            ) from None
        nbytes = nelems * self.itemsize
        if inflow.reduce:
            scratch = self.engine.scratch(nbytes)
            target = scratch[:nbytes]
        else:
            scratch = None
            target = inflow.view[offset : offset + nelems].view(np.uint8)
        req = plane.recv_probed(target, probe)
        self.in_chunks.append((req, inflow, index, scratch, run, plane, nbytes))

    def _reap_receives(self) -> bool:
        if not self.in_chunks:
            return False
        still, moved = [], False
        controller, now = self.engine.controller, None
        for item in self.in_chunks:
            req, inflow, index, scratch, run, plane, nbytes = item
            if not req.completed:
                still.append(item)
                continue
            moved = True
            self._check(req, plane, inflow.peer, run)
            if controller is not None and nbytes >= MIN_SAMPLE_BYTES:
                now = now or time.perf_counter()
                run.note_arrival(plane.name, inflow.peer, nbytes, now)
            if scratch is not None:
                offset, nelems = chunk_range(index, inflow.flow.count, inflow.chunk_elems)
                incoming = scratch[:nbytes].view(self.dtype)
                if self.resume_in_place:
                    self._reduce_once(inflow, offset, nelems, incoming)
                else:
                    self._reduce(inflow, offset, offset + nelems, incoming)
                self.engine.release_scratch(scratch)
            inflow.arrived += 1
        self.in_chunks = still
        return moved

    def _reduce(self, inflow: InFlow, lo: int, hi: int, incoming: np.ndarray) -> None:
        """Reduce ``incoming`` (elements lo..hi of the flow) into the destination."""
        if inflow.acc is not None:
            reduce_to(inflow.view[lo:hi], inflow.acc[lo:hi], incoming, self.op)
        else:
            reduce_into(inflow.view[lo:hi], incoming, self.op)

    def _reduce_once(self, inflow: InFlow, offset: int, nelems: int, incoming: np.ndarray) -> None:
        """Resume mode: reduce only what no attempt has reduced in yet (a retry's
        chunks may straddle ranges the failed attempt already reduced)."""
        done = self.reduced_ranges.setdefault(inflow.flow.id, [])
        hi = offset + nelems
        for lo_part, hi_part in (((offset, hi),) if self.attempt == 0 else missing_ranges(done, offset, hi)):
            self._reduce(inflow, lo_part, hi_part, incoming[lo_part - offset : hi_part - offset])
        done.append((offset, hi))

    def _reap_sends(self) -> bool:
        if not self.out_chunks:
            return False
        still, moved = [], False
        for item in self.out_chunks:
            req, outflow, plane, nbytes, t_post, run = item
            if not req.completed:
                still.append(item)
                continue
            moved = True
            self._check(req, plane, outflow.peer, run)
            outflow.pending -= 1
            self.inflight[plane.name] -= nbytes
        self.out_chunks = still
        return moved

    def _post_sends(self) -> bool:
        """Fill each plane's window, one chunk per plane in turn.

        Plane by plane, 'out' waited for 'up's whole window to be posted: a
        512 KiB eager tcp send copies for ~0.26 ms, so on the 2.4 / 1.2 Gbit/s
        testbed 'out' started 2 ms into an 18 ms stage, and in the VM's slow
        spells 8-15 ms. Its delivery samples then timed the wait as the link's
        (21-66 MB/s read on 150), the split gave it nothing, and no sample
        came to correct that for the rest of the run. Within a plane the
        flows fill in order, as before."""
        lanes = []  # [plane name, plane, window, position in flows]
        for name in (UP, OUT):
            limit = self.window.get(name, 0)
            if name in self.engine.planes and self.inflight[name] < limit:
                lanes.append([name, self.engine.planes[name], limit, 0])
        if not lanes:
            return False  # every window full: most rounds of a transfer
        flows = [(run, outflow) for run in self.active for outflow in run.outs]
        moved = False
        while lanes:
            for lane in list(lanes):
                if self._post_next(lane, flows):
                    moved = True
                else:
                    lanes.remove(lane)
        return moved

    def _post_next(self, lane: list, flows: list) -> bool:
        """Post the next chunk plane ``lane`` may send ([name, plane, window,
        position in ``flows``], the scan resuming where it stopped); whether one."""
        name, plane, limit, i = lane
        while i < len(flows) and self.inflight[name] < limit:
            run, outflow = flows[i]
            if outflow.cursor.wants(name):
                pacer = self.engine.pacer_for(name, self.splitter, outflow.peer)
                if pacer is None or pacer.ready(time.perf_counter()):
                    index = outflow.cursor.next_chunk(name)
                    nbytes = self._send_chunk(run, outflow, plane, index)
                    if pacer is not None:
                        pacer.take(nbytes, time.perf_counter())
                    lane[3] = i
                    return True
                # paced: 'up' may steal the chunk meanwhile; the next flow may go
            i += 1
        lane[3] = i
        return False

    def _send_chunk(self, run: StageRun, outflow: OutFlow, plane, index: int) -> int:
        offset, nelems = chunk_range(index, outflow.flow.count, outflow.chunk_elems)
        nbytes = nelems * self.itemsize
        view = outflow.view[offset : offset + nelems].view(np.uint8)
        try:
            req = plane.send(outflow.peer, view, outflow.tag_base | index)
        except TransportError as exc:  # the plane's endpoint is gone
            cls = PlaneFailure if self.protected and plane.failable else TransportError
            raise cls(exc.message, rank=self.rank, plane=plane.name, peer=outflow.peer, op=self.name,
                      stage=run.stage.id) from exc
        outflow.pending += 1
        self.inflight[plane.name] += nbytes
        self.bytes_per_plane[plane.name] += nbytes
        run.bytes_by_plane[plane.name] += nbytes
        self.out_chunks.append((req, outflow, plane, nbytes, time.perf_counter(), run))
        return nbytes

    def _retire_stages(self) -> bool:
        retired = []
        for run in list(self.active):
            if not run.done:
                continue
            run.t_end = time.perf_counter()
            self.active.remove(run)
            self._log_stage(run)
            if run.plan is not None and run.plan.cache_key is not None and self.splitter.cache is not None:
                self.splitter.cache.note_stage_time(run.plan.cache_key, run.t_end - run.t_start)
            self._stage_complete(run.stage.id)
            retired.append(run)
        if not retired:
            return False
        # The stages these made ready start, and post their first chunks, before
        # the controller hears of the retired ones: its feedback (~0.25 ms of
        # Python a stage on a slow host) sat between two stages on every rank,
        # so on the peer's critical path too. A later stage with another demand
        # is then planned without the retired stage's samples (one stage late).
        if self._start_ready_stages():
            self._post_sends()
        for run in retired:
            self._teach_controller(run)
            if self.plane_meter is not None:
                # Stage spans, not busy_intervals: a flow of one chunk (each step of a 16 MiB
                # hierarchical all_reduce on 8 channels, on one plane) has no spacing to time it by.
                for plane, sender, nbytes, t_first, t_last in run.delivery_samples():
                    self._meter_spans.setdefault(plane, []).append((t_first, t_last, nbytes, sender))
        if self.stages_done == len(self.schedule.stages):
            if self._port_intervals:
                self._teach_port_rates()
            if self._meter_spans:
                for plane, intervals in self._meter_spans.items():
                    total, busy, _ = _busy_time(intervals)
                    self.plane_meter.add(plane, total, busy)
                self._meter_spans = {}
        return True

    def _teach_controller(self, run: StageRun) -> None:
        """A retired stage's delivery samples and realised time, to the controller."""
        controller = self.engine.controller
        if controller is None:
            return
        if self.splitter.policy == "adaptive":
            # Only stages the controller planned teach it: samples from
            # fixed-policy operations (a benchmark interleaving 'out' or
            # 0.8 with 'adaptive') describe splits it did not choose and
            # upset its solo/joint bookkeeping.
            if self.schedule.channels > 1:
                for plane, sender, nbytes, t_first, t_last in run.busy_intervals():
                    self._port_intervals.setdefault(plane, []).append((t_first, t_last, nbytes, sender))
            else:
                probing = _probing(run.plan, self.rank)
                split = run.split_senders()
                for plane, sender, nbytes, t_first, t_last in run.delivery_samples():
                    controller.on_delivery(plane, sender, nbytes, t_first, t_last,
                                           size_evidence=not probing and sender in split)
        if run.plan is not None and "decision" in run.plan.reason:
            controller.on_stage(run.plan.reason["decision"], run.t_start, run.t_end,
                                dict(run.bytes_by_plane), received_by_plane=run.received_by_plane())

    def _teach_port_rates(self) -> None:
        """A pipelined operation's deliveries, filed per plane as the rate of the link into this rank.

        The channels' stages overlap, so one stage's flow gets a share of the link: filed alone,
        4 ranks as 2 domains at 1:1 (62.5 MB/s each) read 'up' at 31 MB/s and 'out' at 84 within
        one operation, and the split swung between 0 and 62% of a stage on 'out' (operations
        0.95-1.34 s against 1.08 on 'up' alone). All the bytes that reached this rank on a plane
        over the time any of them was arriving (the union of the stages' intervals) is the rate
        of the link they share; every sender's path is taught it."""
        controller = self.engine.controller
        for plane, intervals in self._port_intervals.items():
            total, busy, reach = _busy_time(intervals)
            if busy > 0:
                for sender in sorted({sender for _, _, _, sender in intervals}):
                    controller.on_delivery(plane, sender, total, reach - busy, reach, size_evidence=False,
                                           rate_only=True)
        self._port_intervals = {}

    def _log_stage(self, run: StageRun) -> None:
        reason = {} if run.plan is None else {k: v for k, v in run.plan.reason.items() if k != "decision"}
        self.stage_log.append({
            "stage": run.stage.id, "label": run.stage.label, "duration_s": run.t_end - run.t_start,
            "t_start_wall": wall(run.t_start),
            "bytes_per_plane": dict(run.bytes_by_plane), "arrivals": run.arrival_times(), "split": reason,
        })

    def _check(self, req, plane, peer, run) -> None:
        try:
            req.check_error()
        except Exception as exc:
            cls = PlaneFailure if self.protected and plane.failable else TransportError
            raise cls(
                f"{type(exc).__name__}: {exc}", rank=self.rank, plane=plane.name, peer=peer,
                op=self.name, stage=run.stage.id,
            ) from exc

    def _fail(self, exc: BaseException) -> None:
        if self.two_step is not None:
            for req, buf in self.two_step.pending():
                self.engine.park(req, buf)
        # The output holds what the prologue put there even when the operation
        # fails (a failed all_gather still has the rank's own block in place).
        deferred = getattr(self, "deferred", None)
        if deferred:
            deferred.flush()
        super()._fail(exc)

    def _complete(self) -> None:
        self.deferred.flush(scratch_reads=[(c.src_buf, c.src_off, c.src_off + c.count)
                                           for c in self.schedule.epilogue if c.rank == self.rank])
        self._run_copies(self.schedule.epilogue)
        if self.finalize is not None:
            self.finalize()
        self._finish()

    def _let_go_of_arrays(self) -> None:
        self.buffers, self.finalize, self.deferred = {}, None, None
        if self.two_step is not None:
            self.two_step.let_go_of_arrays()

    def describe_stall(self) -> dict:
        if self.two_step is not None:
            return self.two_step.describe_stall()
        if self.offers_two_step and self._fp_recvs:
            waiting = sorted(peer for _, peer, _ in self._fp_recvs)
            return {"stage": "start", "peer": waiting, "plane": "control",
                    "waiting_for": f"the fingerprint messages of ranks {waiting}"}
        waiting_in = [(i.peer, i.flow.id, f"{i.arrived}/{i.nchunks}") for r in self.active for i in r.ins if not i.done]
        waiting_out = [(o.peer, o.flow.id) for r in self.active for o in r.outs if not o.done]
        planes = sorted({p.name for _, _, _, _, _, p, _ in self.in_chunks} | {p.name for _, _, p, _, _, _ in self.out_chunks})
        if self.phase != "run":
            # finish: DONE still missing from these ranks; quiesce: QUIESCED missing
            heard = self._done_from if self.phase == "finish" else self._quiesced_from
            missing = sorted(set(self.others) - heard)
            return {"stage": "end", "phase": self.phase, "peer": missing, "plane": "control",
                    "waiting_for": f"{'DONE' if self.phase == 'finish' else 'QUIESCED'} from ranks {missing}"}
        return {
            "stage": [r.stage.id for r in self.active],
            "peer": sorted({p for p, _, _ in waiting_in} | {p for p, _ in waiting_out}),
            "plane": planes or "none posted",
            "waiting_for": waiting_in,
        }

    def _input_saved(self) -> Optional[str]:
        """How a retry would recover an in-place input: 'copy', 'resume', 'none'
        (aborts instead), or None (nothing to recover: out of place or unprotected)."""
        if self.snapshot is not None:
            return "copy"
        if self.resume_in_place:
            return "resume"
        return "none" if self.input_unsaved else None

    def stats(self) -> dict:
        out = super().stats()
        out.update(
            algorithm="two_step" if self.two_step is not None else self.schedule.algorithm,
            channels=self.schedule.channels,
            chunk_bytes=self.plan_chunk_elems * self.itemsize, whole_flows=self.flow_min_chunks == 1,
            policy=self.splitter.name, stages=self.stage_log,
            protected=self.protected, protection_waived=self.protection_waived,
            input_saved=self._input_saved(),
        )
        if self.attempt or self.events:
            out.update(attempts=self.attempt + 1, failover=self.failover, events=list(self.events))
        return out
