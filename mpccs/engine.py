"""Runs coflow DAGs and point-to-point messages on the planes.

One rank's engine is single-threaded: whoever waits on a ``Work`` drives
``Engine.progress()``, which advances every operation in flight (so several
operations may be outstanding and complete in any order). No progress thread:
on small machines a busy-polling thread starves the ranks themselves.

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

import os
import select
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from . import wire
from .algorithms.schedule import Flow, Schedule, Stage
from .arrays import copy_into, empty_like_memory, same_start
from .fingerprint import Fingerprint
from .errors import MismatchError, MpccsError, OperationTimeout, PlaneFailure, ProtocolError, TransportError
from .health import PlaneHealth
from .prologue import DeferredCopies
from .reduce import reduce_into, reduce_to
from .telemetry import wall
from .shm_steps import ShmSteps
from .two_step import TwoStepExecutor
from .windows import (OUT, UP, FlowCursor, Pacer, boundary_for, chunk_count, chunk_range, flow_chunk_elems,
                      flow_min_chunks, missing_ranges)

MIN_CHUNK_BYTES = 64 << 10
# QUIESCED payloads: how the sender retries (CollectiveOp._check_retry_modes)
RETRY_RESTART = b"\0"  # from intact (or restored) inputs
RETRY_RESUME = b"\1"  # over its buffers as left, each range reduced once
FP_BYTES = 16  # a fingerprint's two uint64 words
# A byte after the fingerprint carries the sender's declarations (0: none).
# Under 'adaptive': whether it may put bytes of this operation on a failable
# plane (no declaration, e.g. a peer on a fixed policy, reads as "may").
# DECLARES_TWO_STEP: it would run the operation on the two-step executor
# (two_step.py), which both ranks then do only if both declare it.
DECLARES_SAFE, DECLARES_CARRY, DECLARES_TWO_STEP = 1, 2, 4
ABORT_REASON_MAX = 1024
IDLE_SPINS_BEFORE_YIELD = 16
MIN_SAMPLE_BYTES = 64 << 10  # smaller chunks measure latency and skew, not a link's rate
SHORT_STAGE_S = 0.005  # stages shorter than this reuse a controller decision ...
REUSE_MAX = 7  # ... up to this many times before deciding afresh
# While every rank has 'out' dropped and no probe is due there is nothing to
# decide (everything goes on 'up'): a short stage's decision is reused for longer.
REUSE_MAX_SETTLED = 15
SCRATCH_POOL_BYTES = 8 << 20  # reduction chunks kept for reuse: the default windows' worth (up + out)
MAX_WINDOW_BYTES = 8 << 20  # more in flight only pushes chunks out of cache before they are reduced
IDLE_SPINS_BEFORE_SLEEP = 256  # then block on the planes' event fds ...
IDLE_SLEEP_S = 0.001  # ... for at most this long (bounds the cost of a missed wake-up)
ABORT_POLL_AFTER_S = 0.005  # look for peers' aborts only once an operation stalls this long
ABORT_FLUSH_S = 0.5  # how long a rank that aborts keeps progressing to get its abort messages out
ALONE_SPINS = 4  # progress rounds Engine._spin_alone gives a direct operation before the general loop
DIRECT_LAYOUTS_KEPT = 1024  # direct operations' layouts kept per engine (DirectAllReduceOp._layout)
CONTROL_POLL_S = 0.002  # progress() looks for failover notices and pings this often
LIVENESS_AFTER_S = 0.5  # and for peers whose process is gone once it stalls this long


# ---------------------------------------------------------------------------
# split decisions
# ---------------------------------------------------------------------------
@dataclass
class FlowSplit:
    boundary_bytes: int  # bytes planned on 'up' (a prefix of the flow)
    steal: bool
    out_cap_bytes: Optional[int] = None


@dataclass
class StagePlan:
    splits: dict[int, FlowSplit]  # flow id -> split
    window_bytes: dict[str, int]
    reason: dict = field(default_factory=dict)
    cache_key: Optional[tuple] = None  # set when the split came from (or went into) the DecisionCache


@dataclass
class _CachedDecision:
    splits: list  # FlowSplit per flow, in the demand's order
    window_bytes: dict
    reason: dict
    uses: int = 0
    stage_s: float = float("inf")  # realised time of the last stage that used it
    up_only: bool = False  # every flow wholly on 'up' (the only decision a settled controller makes)


class DecisionCache:
    """Reuses a controller decision across operations when stages are short.

    A decision costs ~0.15 ms of Python; on a stage of a few milliseconds that
    is several percent. For a demand (the same bytes to the same peers) whose
    last stage took under SHORT_STAGE_S, the previous decision is reused up to
    REUSE_MAX times before the controller decides (and probes, and judges)
    again. Long stages always get a fresh decision, so convergence after a
    change is as fast as the controller makes it where the bytes are.
    """

    def __init__(self):
        self._entries: dict = {}

    def get(self, key, settled: bool = False) -> Optional[_CachedDecision]:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.stage_s >= SHORT_STAGE_S:
            # Long stages always decide: the decision costs nothing next to them
            # and its feedback keeps the solo record a probe is judged against
            # fresh (reused while 'out' was dropped, the testbed's probes were
            # judged against stale records and 'out' never came back).
            return None
        if entry.uses >= (REUSE_MAX_SETTLED if settled and entry.up_only else REUSE_MAX):
            return None
        entry.uses += 1
        return entry

    def put(self, key, entry: _CachedDecision) -> None:
        if len(self._entries) > 256:
            self._entries.clear()
        self._entries[key] = entry

    def note_stage_time(self, key, seconds: float) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.stage_s = seconds


class Splitter:
    """Turns the communicator's path policy into per-stage splits.

    Fixed policies ('up', 'out', a fraction) are decided here; 'adaptive'
    asks the controller (mpccs.control) when one is attached.
    """

    def __init__(self, policy, planes: dict, window_bytes: dict[str, int], controller=None,
                 cache: Optional[DecisionCache] = None, name: Optional[str] = None):
        self.policy = policy
        # What the caller asked for: 'adaptive' also when a settled controller
        # had nothing to decide and the operation runs as 'up' (comm._run).
        self.name = name or _policy_name(policy)
        self.planes = planes
        self.window_bytes = window_bytes
        self.controller = controller
        self.cache = cache

    def without(self, down) -> "Splitter":
        """The same policy on the planes that are not down."""
        live = {n: p for n, p in self.planes.items() if n not in down}
        return Splitter(self.policy, live, self.window_bytes, self.controller, self.cache, self.name)

    def reach(self, peer: int) -> tuple[bool, bool]:
        up = self.planes.get(UP)
        out = self.planes.get(OUT)
        return (up is not None and up.reaches(peer), out is not None and out.reaches(peer))

    @property
    def can_steal(self) -> bool:
        """Stealing is paced by send completions; only sound where they mean delivery."""
        return all(p.completion_means_delivery for p in self.planes.values())

    def plan(self, flows: list[tuple[Flow, int]], now: float, chunk_bytes: Optional[int] = None,
             others: tuple = (), epoch: Optional[int] = None) -> StagePlan:
        """flows: (flow, nbytes) this rank sends in the stage; others: the
        stage's flows from other ranks, which the controller splits together
        with ours (the coflow) from their piggybacked estimates."""
        if self.policy == "adaptive" and self.controller is not None:
            if sum(n for _, n in flows) >= self.controller.config.min_multipath_bytes:
                return self._adaptive(flows, now, chunk_bytes, others, epoch)
            # Too small for a second plane to pay (the controller would say the
            # same, at the cost of a decision): the configured single plane.
            splits = {f.id: FlowSplit(nbytes, False) for f, nbytes in flows}
            return StagePlan(splits, dict(self.window_bytes), {"policy": "adaptive", "fallback": "small"})
        splits = {f.id: self._fixed(f, nbytes) for f, nbytes in flows}
        return StagePlan(splits, dict(self.window_bytes), {"policy": _policy_name(self.policy)})

    def _fixed(self, flow: Flow, nbytes: int) -> FlowSplit:
        up_ok, out_ok = self.reach(flow.dst)
        policy = self.policy
        if not (up_ok and out_ok):
            return FlowSplit(nbytes if up_ok else 0, False)
        if policy == "out":
            return FlowSplit(0, False)
        if isinstance(policy, float):
            return FlowSplit(int(round(policy * nbytes)), False)
        # 'up', and 'adaptive' without a controller: the single-plane default.
        return FlowSplit(nbytes, False)

    def _adaptive(self, flows, now, chunk_bytes, others=(), epoch=None) -> StagePlan:
        key = (tuple((f.dst, n) for f, n in flows), chunk_bytes)
        cached = None
        if self.cache is not None:
            cached = self.cache.get(key, settled=not self.controller.may_use(OUT, epoch))
        if cached is not None and (self.controller.probe_due(epoch)
                                   or (epoch is not None and self.controller.probe_due(epoch + 1))):
            # Every rank probes in this operation: a reused decision must not
            # skip it. Nor the operation before: its solo stages are the record
            # the probe is judged against (reused, the record was the first
            # operation's cold stage, 1.8 ms where warm ones take 0.9, and every
            # probe looked like a gain).
            cached = None
        if cached is not None:
            splits = {f.id: s for (f, _), s in zip(flows, cached.splits)}
            return StagePlan(splits, cached.window_bytes, {**cached.reason, "reused": cached.uses}, key)
        plan = self._decide(flows, now, chunk_bytes, others, epoch)
        mine = str(flows[0][0].src) if flows else None
        mode = plan.reason.get("ranks", {}).get(mine, {}).get("mode")
        if self.cache is not None and mode not in ("probe", "check"):
            # A probe or check is one measured stage; reused, it became eight
            # in a row (the default planes lost 26-38% at 2 MiB to probing 'out').
            reason = {k: v for k, v in plan.reason.items() if k != "decision"}
            splits = [plan.splits[f.id] for f, _ in flows]
            up_only = all(sp.boundary_bytes >= n and not sp.steal for sp, (_, n) in zip(splits, flows))
            self.cache.put(key, _CachedDecision(splits, plan.window_bytes, reason, up_only=up_only))
            plan.cache_key = key
        return plan

    def _decide(self, flows, now, chunk_bytes, others=(), epoch=None) -> StagePlan:
        from .control import FlowDemand

        demands = []
        for f, nbytes in flows:
            up_ok, out_ok = self.reach(f.dst)
            planes = tuple(p for p, ok in ((UP, up_ok), (OUT, out_ok)) if ok)
            demands.append(FlowDemand(flow_id=f.id, src=f.src, dst=f.dst, nbytes=nbytes, planes=planes))
        mine = flows[0][0].src if flows else None
        for f, nbytes in others:
            # Another rank's flow: the planes it can use, as far as this rank can
            # tell (a plane that reaches both ends from here reaches between them).
            planes = tuple(p for p in (UP, OUT) if p in self.planes
                           and all(r == mine or self.planes[p].reaches(r) for r in (f.src, f.dst)))
            if planes and nbytes:
                demands.append(FlowDemand(flow_id=f.id, src=f.src, dst=f.dst, nbytes=nbytes, planes=planes))
        decision = self.controller.decide(demands, now, chunk_bytes=chunk_bytes, epoch=epoch)
        steal = decision.steal and self.can_steal
        splits = {
            f.id: FlowSplit(decision.up_bytes.get(f.id, 0), steal, decision.out_cap_bytes.get(f.id))
            for f, _ in flows
        }
        windows = {p: min(max(decision.window_bytes.get(p, 0), self.window_bytes[p]), MAX_WINDOW_BYTES) for p in self.window_bytes}
        return StagePlan(splits, windows, {"policy": "adaptive", **decision.reason, "decision": decision})


def _policy_name(policy) -> str:
    return f"{policy:g}" if isinstance(policy, float) else str(policy)


# ---------------------------------------------------------------------------
# per-flow state
# ---------------------------------------------------------------------------
def cursor_for(split: FlowSplit, nchunks: int, nbytes: int, chunk_bytes: int, reach: tuple[bool, bool]) -> FlowCursor:
    """Clamp a planned split to what the planes can do, so no chunk is ever stranded.

    A plane that does not reach the peer gets nothing (whatever a policy or
    controller said); the QoS cap binds 'out' only where 'up' can take the
    rest, and the chunks it keeps from 'out' move to 'up'.
    """
    up_ok, out_ok = reach
    if not up_ok:
        return FlowCursor(nchunks, 0, False, None)
    if not out_ok:
        return FlowCursor(nchunks, nchunks, False, 0)
    boundary = boundary_for(split.boundary_bytes, nbytes, nchunks)
    cap = None if split.out_cap_bytes is None else min(nchunks, split.out_cap_bytes // chunk_bytes)
    if cap is not None:
        boundary = max(boundary, nchunks - cap)
    return FlowCursor(nchunks, boundary, split.steal, cap)


class OutFlow:
    __slots__ = ("flow", "view", "chunk_elems", "itemsize", "cursor", "tag_base", "peer", "pending")

    def __init__(self, flow: Flow, view: np.ndarray, chunk_elems: int, split: FlowSplit, tag_base: int,
                 reach: tuple[bool, bool] = (True, True)):
        self.flow = flow
        self.view = view  # typed 1-D source range
        self.chunk_elems = chunk_elems
        self.itemsize = view.dtype.itemsize
        nchunks = chunk_count(flow.count, chunk_elems)
        self.cursor = cursor_for(split, nchunks, flow.count * self.itemsize, chunk_elems * self.itemsize, reach)
        self.tag_base = tag_base
        self.peer = flow.dst
        self.pending = 0  # chunks posted, not completed

    @property
    def done(self) -> bool:
        return self.cursor.remaining() == 0 and self.pending == 0


class InFlow:
    __slots__ = ("flow", "view", "acc", "chunk_elems", "nchunks", "seen", "arrived", "tag_base", "reduce", "peer",
                 "planes")

    def __init__(self, flow: Flow, view: np.ndarray, chunk_elems: int, tag_base: int, planes: list,
                 acc: Optional[np.ndarray] = None):
        self.flow = flow
        self.view = view  # typed 1-D destination range
        # A reducing flow whose destination still waits for its prologue copy
        # reduces op(acc, incoming) into view: the copy and the reduction in one pass.
        self.acc = acc
        self.chunk_elems = chunk_elems
        self.nchunks = chunk_count(flow.count, chunk_elems)
        self.seen = bytearray(self.nchunks)
        self.arrived = 0  # chunks whose data has landed (and been reduced)
        self.tag_base = tag_base
        self.reduce = flow.reduce
        self.peer = flow.src
        self.planes = planes

    @property
    def done(self) -> bool:
        return self.arrived == self.nchunks

    def recut(self, chunk_elems: int) -> None:
        """The sender's chunk length, learnt before any of its chunks was accepted."""
        if any(self.seen):
            raise AssertionError("a flow is recut after chunks were accepted")
        self.chunk_elems = chunk_elems
        self.nchunks = chunk_count(self.flow.count, chunk_elems)
        self.seen = bytearray(self.nchunks)

    def claim(self, probe, itemsize: int) -> tuple[int, int, int]:
        """Validate a probed chunk and mark it seen: (index, element offset, element count).

        Raises ValueError with the reason when the chunk does not fit this flow
        (index out of range, a duplicate, or a length other than expected).
        """
        index = wire.chunk_index(probe.sender_tag.value)
        if index >= self.nchunks or self.seen[index]:
            raise ValueError(f"chunk {index} of flow {self.flow.id} is "
                             f"{'a duplicate' if index < self.nchunks else 'out of range'}")
        offset, nelems = chunk_range(index, self.flow.count, self.chunk_elems)
        if probe.length != nelems * itemsize:
            raise ValueError(f"chunk {index} of flow {self.flow.id} has {probe.length} bytes, "
                             f"expected {nelems * itemsize}")
        self.seen[index] = 1
        return index, offset, nelems


@dataclass
class StageRun:
    stage: Stage
    outs: list
    ins: list
    plan: Optional[StagePlan]
    t_start: float
    t_end: Optional[float] = None
    bytes_by_plane: dict = field(default_factory=lambda: {UP: 0, OUT: 0})
    # (plane, peer) -> [first arrival, last arrival, bytes arrived, chunks arrived]
    arrivals: dict = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(o.done for o in self.outs) and all(i.done for i in self.ins)

    def note_arrival(self, plane: str, peer: int, nbytes: int, now: float) -> None:
        record = self.arrivals.get((plane, peer))
        if record is None:
            self.arrivals[(plane, peer)] = [now, now, nbytes, 1]
        else:
            record[1] = now
            record[2] += nbytes
            record[3] += 1

    def received_by_plane(self) -> dict:
        """Bytes that arrived in this stage per plane (chunks of at least MIN_SAMPLE_BYTES)."""
        got = {UP: 0, OUT: 0}
        for (plane, _), (_, _, nbytes, _) in self.arrivals.items():
            got[plane] += nbytes
        return got

    def delivery_samples(self):
        """One delivery sample per (plane, peer) over the whole stage.

        The estimator learns a link from what arrives over it: a receiver sees
        delivered bytes whatever the protocol, while a sender's completion
        under an eager protocol only means the socket took them. The sample
        belongs to the peer's path to this rank (controller.on_delivery), and
        the peer learns it from this rank's exported estimates. The interval
        ends at the last arrival and starts at this rank's stage start, or
        later when the peer evidently started later: its first chunk came
        more than one chunk's spacing (the mean gap between its arrivals)
        after the stage start. Arrival times alone mislead when a flow fits in
        the socket buffers (the first chunk already waited for most of the
        transfer: then the chunks land in a burst at the stage start, and the
        spacing moves nothing). A late peer, counted from this rank's start,
        read slow: under a load on one direction of a 2-rank ring the other
        rank starts each all-gather late, its paths looked 30% slower than
        they were, it became the critical rank of the plan, and the loaded
        rank put everything on 'up' (testbed, 1.2x slower operations). The
        estimator sees one chunk posted to an idle plane and fits rate and
        delay from such samples (its idle-only model).
        """
        for (plane, peer), (first, last, nbytes, chunks) in self.arrivals.items():
            start = self.t_start
            if chunks > 1:
                start = max(start, first - (last - first) / (chunks - 1))
            if nbytes and last > start:
                yield plane, peer, nbytes, start, last


# ---------------------------------------------------------------------------
# operations
# ---------------------------------------------------------------------------
class Operation:
    """Base of everything the engine drives. Subclasses implement _advance()."""

    name = "op"
    stats_are_light = False  # True: its record holds nothing to count but the operation and its bytes; built later
    posts_when_built = False  # True: its constructor posted everything; nothing can have completed by submit()
    spin_planes: tuple = ()  # the planes its messages use, where it knows (Engine._spin_alone); () = all
    # True while it waits on a flag in shared memory (shm_steps.py): no plane event
    # announces the peer's step, so the engine polls instead of sleeping on them
    # while any such operation is active.
    polls_memory = False

    def __init__(self, engine: "Engine", seq: int):
        self.engine = engine
        self.seq = seq
        self.finished = False
        self.error: Optional[BaseException] = None
        self.t_start = time.perf_counter()
        self.t_end: Optional[float] = None
        self.last_progress = self.t_start
        self.bytes_per_plane = {UP: 0, OUT: 0}
        self.result = None
        self.on_finish: list[Callable] = []

    def advance(self) -> bool:
        if self.finished:
            return False
        try:
            moved = self._advance()
        except BaseException as exc:  # noqa: BLE001 - recorded and re-raised by wait()
            self._fail(exc)
            return True
        if moved:
            self.last_progress = time.perf_counter()
        return moved

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self._finish()

    def _finish(self) -> None:
        self.finished = True
        self.t_end = time.perf_counter()
        for callback in self.on_finish:
            callback(self)

    def stalled_for(self, now: float) -> float:
        return now - self.last_progress

    def describe_stall(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {
            "op": self.name,
            "seq": self.seq,
            "duration_s": (self.t_end or time.perf_counter()) - self.t_start,
            "t_start_wall": wall(self.t_start),
            "bytes_per_plane": dict(self.bytes_per_plane),
        }


def check_fingerprint(op: "Operation", message: np.ndarray, peer: int, abort_peers, abort_seq: int):
    """Compare the fingerprint at the start of a peer's message with ``op.fingerprint``;
    on a difference tell ``abort_peers`` and raise MismatchError saying what differs.
    Returns the peer's fingerprint where its words differ from ours (None: the same)."""
    mine = op.fingerprint
    if message[:FP_BYTES].tobytes() == mine.raw:
        return None  # the same words: nothing can differ (the common case, ~3 us of decoding saved)
    theirs = Fingerprint.decode(message[:FP_BYTES].view(np.uint64))
    diffs = mine.differences(theirs)
    if diffs:
        text = (f"rank {op.engine.rank} called {mine.describe()} as operation #{op.seq} but rank "
                f"{peer} called {theirs.describe()} ({'; '.join(diffs)})")
        op.engine.broadcast_abort(abort_peers, abort_seq, text)
        err = MismatchError(text)
        err.peers_told = True
        raise err
    return theirs


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
        )
        schedule.meta[key] = plan
    return plan


class CollectiveOp(Operation):
    def __init__(self, engine, seq, schedule: Schedule, buffers: dict, dtype, op: str,
                 splitter: Splitter, chunk_bytes: int, name: str, finalize: Optional[Callable] = None,
                 fingerprint=None, protected: bool = False, snapshot: Optional[np.ndarray] = None,
                 input_unsaved: bool = False, epoch: Optional[int] = None,
                 carries_failable: Optional[bool] = None, whole_flows: bool = False,
                 resume_in_place: bool = False, two_step: bool = False, settled: bool = False):
        super().__init__(engine, seq)
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
        self.inflight = {UP: 0, OUT: 0}
        self.window = dict(self.splitter.window_bytes)
        self.stages_done = 0
        self._plan_memo: dict = {}
        self.remaining_deps = dict(local.dep_counts)
        self.dependents = local.dependents
        self.stage_by_id = local.stage_by_id
        self.deferred = DeferredCopies(self.schedule.prologue, self.rank, self.buffers)
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
            plan = self._plan_stage(sized, now, others)
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

    def _plan_stage(self, sized, now, others=()) -> StagePlan:
        """The split of this rank's flows in a stage; decided once per operation
        for each distinct demand (a ring's 2(p-1) stages send the same bytes to
        the same peer: one controller decision serves them all, and only the
        stage that made it reports back, so the controller judges it once)."""
        key = tuple((f.dst, n) for f, n in sized)
        memo = self._plan_memo.get(key)
        if memo is None:
            plan = self.splitter.plan(sized, now, self.plan_chunk_elems * self.itemsize, others, self.epoch)
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
        for run in self.active:
            for inflow in run.ins:
                if inflow.done or inflow.peer not in self.verified:
                    continue
                for plane in inflow.planes:
                    while True:
                        probe = plane.probe(inflow.tag_base, wire.MASK_STREAM)
                        if probe is None:
                            break
                        self._accept_chunk(run, inflow, plane, probe)
                        moved = True
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
        moved = False
        for plane_name in (UP, OUT):
            plane = self.engine.planes.get(plane_name)
            if plane is None:
                continue
            limit = self.window.get(plane_name, 0)
            for run in self.active:
                for outflow in run.outs:
                    pacer = self.engine.pacer_for(plane_name, self.splitter, outflow.peer)
                    while self.inflight[plane_name] < limit and outflow.cursor.wants(plane_name):
                        if pacer is not None and not pacer.ready(time.perf_counter()):
                            break  # 'up' may steal the chunk meanwhile
                        index = outflow.cursor.next_chunk(plane_name)
                        nbytes = self._send_chunk(run, outflow, plane, index)
                        if pacer is not None:
                            pacer.take(nbytes, time.perf_counter())
                        moved = True
        return moved

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
        moved = False
        for run in list(self.active):
            if not run.done:
                continue
            run.t_end = time.perf_counter()
            self.active.remove(run)
            self._log_stage(run)
            if run.plan is not None and run.plan.cache_key is not None and self.splitter.cache is not None:
                self.splitter.cache.note_stage_time(run.plan.cache_key, run.t_end - run.t_start)
            if self.engine.controller is not None and self.splitter.policy == "adaptive":
                # Only stages the controller planned teach it: samples from
                # fixed-policy operations (a benchmark interleaving 'out' or
                # 0.8 with 'adaptive') describe splits it did not choose and
                # upset its solo/joint bookkeeping.
                for sample in run.delivery_samples():
                    self.engine.controller.on_delivery(*sample)
            if self.engine.controller is not None and run.plan is not None and "decision" in run.plan.reason:
                self.engine.controller.on_stage(run.plan.reason["decision"], run.t_start, run.t_end,
                                                dict(run.bytes_by_plane), received_by_plane=run.received_by_plane())
            self._stage_complete(run.stage.id)
            moved = True
        return moved

    def _log_stage(self, run: StageRun) -> None:
        reason = {} if run.plan is None else {k: v for k, v in run.plan.reason.items() if k != "decision"}
        self.stage_log.append({
            "stage": run.stage.id, "label": run.stage.label, "duration_s": run.t_end - run.t_start,
            "t_start_wall": wall(run.t_start),
            "bytes_per_plane": dict(run.bytes_by_plane), "split": reason,
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
        self.deferred.flush()
        self._run_copies(self.schedule.epilogue)
        if self.finalize is not None:
            self.finalize()
        self._finish()

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


# ---------------------------------------------------------------------------
# the direct path: small and medium collectives as one message per peer
# ---------------------------------------------------------------------------
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
# over four runs.
DIRECT_SHM_MIN_BYTES = 384 << 10
DIRECT_POOL_PER_SIZE = 4  # reusable DirectBuffers kept per size (operations in flight at once)
DIRECT_POOL_SIZES = 32  # sizes kept
DIRECT_POOL_BYTES = 32 << 20  # and at most this much memory in them (medium buffers are up to ~2 MiB)


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


class DirectShmAllReduceOp(DirectAllReduceOp):
    """A 2-rank all_reduce of halves through the shared-memory segments
    (shm_steps.py), behind the direct path's fingerprint messages: the direct
    blocks' reduce-scatter and all-gather with a copy and a flag in place of
    each message. Chosen like the rest of the direct path, from the
    configuration and the call alone (comm._run_direct): every rank opened the
    segments or none did (transports/shm.open_pair). A rank completes only
    once its peer's fingerprint matched: a peer that called something else
    gets its MismatchError as on the rest of the direct path (the output may
    then hold anything, as after any error).

    One outbox per rank: operations in flight together (async_op) take the
    segments in turn, in the order they were submitted (the same on both
    ranks): an operation starts its steps once the one before it finished
    here, which was once the peer had taken everything from this outbox."""

    algorithm = "direct_shm"

    def __init__(self, engine, seq, send: np.ndarray, out: np.ndarray, op: str, world: int,
                 fingerprint: Optional[Fingerprint], finalize: Optional[Callable] = None,
                 name: str = "all_reduce"):
        super().__init__(engine, seq, send, out, op, world, fingerprint, finalize, name)
        self._pair = engine.shm  # the segments this call was chosen for (the engine's may change later)
        self._steps: Optional[ShmSteps] = None
        self._start_steps()
        self.bytes_per_plane[UP] += send.nbytes  # its part of the peer's half, then the peer's copy of its own

    def _start_steps(self) -> bool:
        """Take the segments if no earlier operation holds them (Engine.shm_holder)."""
        if self.engine.shm_holder is not None:
            return False
        self.engine.shm_holder = self
        self._steps = ShmSteps(self._pair, self.seq, self.engine.rank, self.mine, self.out, self.op)
        return True

    def _own_input(self, send: np.ndarray, out: np.ndarray, me: int, world: int) -> np.ndarray:
        return send  # the steps read each half before anything writes over it

    def _sends_to(self, peer: int) -> bool:
        return False  # the fingerprint alone: the halves go through the segments

    def _receives_from(self, peer: int) -> bool:
        return False

    def _received_bytes(self) -> int:
        return 0

    def _advance(self) -> bool:
        moved = self._take_arrivals()
        if self._steps is None and not self._start_steps():
            return moved
        moved |= self._steps.advance()
        if self._recvs or not self._steps.done or not all(r.completed for r in self._sends):
            return moved
        for req in self._sends:
            req.check_error()
        self._release()
        self._complete()
        return True

    @property
    def polls_memory(self) -> bool:
        """Only once the peer's fingerprint is here: it sends that first, so until
        then a plane event wakes this rank, and a peer that comes late (uneven
        work between collectives) costs no spinning."""
        return not self._recvs

    def _release(self) -> None:
        if self.engine.shm_holder is self:
            self.engine.shm_holder = None

    def _fail(self, exc: BaseException) -> None:
        self._release()
        super()._fail(exc)

    def describe_stall(self) -> dict:
        if self._recvs:
            return super().describe_stall()
        waiting = "an earlier operation to let go of the segments" if self._steps is None else self._steps.waiting_for
        return {"stage": "direct shm", "peer": list(self.others), "plane": UP, "waiting_for": waiting}


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


# ---------------------------------------------------------------------------
# point-to-point
# ---------------------------------------------------------------------------
# Point-to-point messages up to this size ride inside their header message on
# the control plane (P2P_INLINE in the header's size word) under the policies
# that would send them there ('up', and 'adaptive', which keeps small flows on
# one plane): the payload then travels with the request instead of after the
# receiver's accept, one message and one reply instead of three messages.
# Every receive posts room for it (a pooled inbox, Engine.p2p_inbox), so a
# sender's choice needs no agreement.
P2P_INLINE_MAX_BYTES = 64 << 10
P2P_INBOX_BYTES = 8 + P2P_INLINE_MAX_BYTES  # what every receive has room for (fixed: senders may inline less)
P2P_INLINE = 1 << 63
P2P_INBOXES_KEPT = 16  # pooled receive buffers (receives in flight at once reuse them)


class SendOp(Operation):
    """Header -> wait for the receiver's accept -> chunks on both planes; or
    (small, P2P_INLINE_MAX_BYTES) the header with the payload inside -> the accept."""

    name = "send"

    def __init__(self, engine, seq, buf: np.ndarray, dst: int, splitter: Splitter, chunk_bytes: int):
        super().__init__(engine, seq)
        self.buf = buf
        self.dst = dst
        self.splitter = splitter
        self.chunk_bytes = chunk_bytes
        self.ctrl = engine.control_plane(dst)
        self.inline = buf.nbytes <= P2P_INLINE_MAX_BYTES and splitter.name in (UP, "adaptive")
        if self.inline:
            header = np.empty(8 + buf.nbytes, dtype=np.uint8)
            header[:8].view(np.uint64)[0] = buf.nbytes | P2P_INLINE
            header[8:] = buf
            self.bytes_per_plane[self.ctrl.name] += buf.nbytes
        else:
            header = np.array([buf.nbytes], dtype=np.uint64).view(np.uint8)
        self._header = header
        me = engine.rank
        self._header_req = self.ctrl.send(dst, header, wire.make_tag(wire.KIND_CTRL, engine.comm_id, seq, me, wire.CTRL_P2P_HEADER))
        self._reply = np.zeros(2, dtype=np.uint64)
        self._reply_req = self.ctrl.recv(
            self._reply.view(np.uint8), wire.make_tag(wire.KIND_CTRL, engine.comm_id, seq, dst, wire.CTRL_P2P_REPLY)
        )
        self.outflow: Optional[OutFlow] = None
        self.pending: list = []
        self.inflight = {UP: 0, OUT: 0}
        self.window = dict(splitter.window_bytes)

    def _advance(self) -> bool:
        if self.outflow is None:
            if not (self._reply_req.completed and self._header_req.completed):
                return False
            self._check_ctrl(self._header_req)
            self._check_ctrl(self._reply_req)
            if int(self._reply[0]) != 1:
                raise MismatchError(
                    f"rank {self.engine.rank}: send of {self.buf.nbytes} bytes to rank {self.dst} refused: "
                    f"the receiver posted {int(self._reply[1])} bytes"
                )
            if self.inline:  # the payload went with the header
                self._finish()
                return True
            flow = Flow(id=0, src=self.engine.rank, dst=self.dst, src_buf="in", src_off=0, dst_buf="out", dst_off=0, count=self.buf.nbytes)
            plan = self.splitter.plan([(flow, self.buf.nbytes)], time.perf_counter())
            self.window = plan.window_bytes
            ce = flow_chunk_elems(self.buf.nbytes, self.chunk_bytes, MIN_CHUNK_BYTES)
            tag = wire.make_tag(wire.KIND_P2P, self.engine.comm_id, self.seq, self.engine.rank)
            self.outflow = OutFlow(flow, self.buf, ce, plan.splits[0], tag, self.splitter.reach(self.dst))
            return True
        moved = self._reap()
        moved |= self._post()
        if self.outflow.done:
            self._finish()
            return True
        return moved

    def _post(self) -> bool:
        moved = False
        of = self.outflow
        for name, plane in self.engine.planes.items():
            if not plane.reaches(self.dst):
                continue
            pacer = self.engine.pacer_for(name, self.splitter, self.dst)
            while self.inflight[name] < self.window.get(name, 0) and of.cursor.wants(name):
                if pacer is not None and not pacer.ready(time.perf_counter()):
                    break  # borrowed bytes wait for the QoS pacer, as in collectives
                index = of.cursor.next_chunk(name)
                offset, n = chunk_range(index, of.flow.count, of.chunk_elems)
                if pacer is not None:
                    pacer.take(n, time.perf_counter())
                req = plane.send(self.dst, self.buf[offset : offset + n], of.tag_base | index)
                of.pending += 1
                self.inflight[name] += n
                self.bytes_per_plane[name] += n
                self.pending.append((req, plane, n))
                moved = True
        return moved

    def _reap(self) -> bool:
        still, moved = [], False
        for req, plane, n in self.pending:
            if not req.completed:
                still.append((req, plane, n))
                continue
            try:
                req.check_error()
            except Exception as exc:
                raise TransportError(str(exc), rank=self.engine.rank, plane=plane.name, peer=self.dst, op="send") from exc
            self.outflow.pending -= 1
            self.inflight[plane.name] -= n
            moved = True
        self.pending = still
        return moved

    def _check_ctrl(self, req) -> None:
        try:
            req.check_error()
        except Exception as exc:
            raise TransportError(str(exc), rank=self.engine.rank, plane=self.ctrl.name, peer=self.dst, op="send") from exc

    def describe_stall(self) -> dict:
        state = "waiting for the receiver to post" if self.outflow is None else "sending"
        return {"peer": self.dst, "plane": self.ctrl.name, "state": state}


class RecvOp(Operation):
    name = "recv"

    def __init__(self, engine, seq, buf: np.ndarray, src: int, chunk_bytes: int):
        super().__init__(engine, seq)
        self.buf = buf
        self.src = src
        self.chunk_bytes = chunk_bytes
        self.ctrl = engine.control_plane(src)
        self._inbox = engine.p2p_inbox()  # room for a header with its payload inside (SendOp.inline)
        cid, me = engine.comm_id, engine.rank
        self._header_req = self.ctrl.recv(self._inbox, wire.make_tag(wire.KIND_CTRL, cid, seq, src, wire.CTRL_P2P_HEADER))
        self._inline_done = False
        self._reply = np.zeros(2, dtype=np.uint64)
        self._reply_req = None
        self._reply_tag = wire.make_tag(wire.KIND_CTRL, cid, seq, me, wire.CTRL_P2P_REPLY)
        self.inflow: Optional[InFlow] = None
        self.pending: list = []

    def _advance(self) -> bool:
        if self.inflow is None:
            if not self._header_req.completed:
                return False
            try:
                self._header_req.check_error()
            except Exception as exc:  # a header longer than 8 bytes arrives truncated
                raise ProtocolError(f"malformed point-to-point header: {type(exc).__name__}: {exc}",
                                    rank=self.engine.rank, peer=self.src, op="recv") from None
            word = int(self._inbox[:8].view(np.uint64)[0])
            sent, inline = word & ~P2P_INLINE, bool(word & P2P_INLINE)
            ok = sent == self.buf.nbytes
            self._reply[:] = (1 if ok else 0, self.buf.nbytes)
            self._reply_req = self.ctrl.send(self.src, self._reply.view(np.uint8), self._reply_tag)
            if not ok:
                self._drain_reply()
                raise MismatchError(
                    f"rank {self.engine.rank}: receive of {self.buf.nbytes} bytes from rank {self.src} "
                    f"does not match the {sent} bytes sent; nothing was written"
                )
            if inline:
                self.buf[...] = self._inbox[8:8 + sent]
                self.bytes_per_plane[self.ctrl.name] += sent
                self._inline_done = True
                self._finish_inline()
                return True
            flow = Flow(id=0, src=self.src, dst=self.engine.rank, src_buf="in", src_off=0, dst_buf="out", dst_off=0, count=sent)
            ce = flow_chunk_elems(sent, self.chunk_bytes, MIN_CHUNK_BYTES)
            tag = wire.make_tag(wire.KIND_P2P, self.engine.comm_id, self.seq, self.src)
            self.inflow = InFlow(flow, self.buf, ce, tag, self.engine.planes_from(self.src))
            return True
        if self._inline_done:
            return self._finish_inline()
        moved = False
        for plane in self.inflow.planes:
            while True:
                probe = plane.probe(self.inflow.tag_base, wire.MASK_STREAM)
                if probe is None:
                    break
                try:
                    _, offset, n = self.inflow.claim(probe, 1)
                except ValueError as exc:
                    self.engine.discard(plane, probe)
                    raise ProtocolError(str(exc), rank=self.engine.rank, plane=plane.name, peer=self.src,
                                        op="recv") from None
                self.pending.append((plane.recv_probed(self.buf[offset : offset + n], probe), plane, n))
                moved = True
        still = []
        for req, plane, n in self.pending:
            if not req.completed:
                still.append((req, plane, n))
                continue
            try:
                req.check_error()
            except Exception as exc:
                raise TransportError(str(exc), rank=self.engine.rank, plane=plane.name, peer=self.src, op="recv") from exc
            self.inflow.arrived += 1
            self.bytes_per_plane[plane.name] += n
            moved = True
        self.pending = still
        if self.inflow.done and (self._reply_req is None or self._reply_req.completed):
            self._finish()
            return True
        return moved

    def _finish_inline(self) -> bool:
        """An inline message is placed: done once the accept has gone (its buffer is this op's)."""
        if not self._reply_req.completed:
            return False
        self.engine.give_p2p_inbox(self._inbox)
        self._finish()
        return True

    def _drain_reply(self) -> None:
        deadline = time.perf_counter() + 5
        while not self._reply_req.completed and time.perf_counter() < deadline:
            self.engine.progress_planes()

    def describe_stall(self) -> dict:
        state = "waiting for the sender's header" if self.inflow is None else f"{self.inflow.arrived}/{self.inflow.nchunks} chunks"
        return {"peer": self.src, "plane": [p.name for p in self.engine.planes_to(self.src)], "state": state}


# ---------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------
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
        self.decisions = DecisionCache()
        self.liveness: Optional[Callable[[], list]] = None  # returns ranks known to be gone
        self.health = PlaneHealth(rank, comm_id, planes, plane_timeout_s, reprobe_s)
        self.failover_notices: dict[int, tuple] = {}  # attempt seq -> (plane, reason, sender)
        self._failovers_sent: set[int] = set()  # attempts this rank already announced
        self._ctrl_sends: list = []
        self._parked: list = []
        self._next_control_poll = 0.0
        self._direct_pool: dict[tuple, list] = {}  # DirectBuffers by DirectBuffers.key
        self._two_step_scratch: Optional[np.ndarray] = None  # see two_step_scratch()
        self.shm = None  # transports.shm.ShmPair of a 2-rank job on one host (the communicator opens it)
        self._p2p_inboxes: list[np.ndarray] = []  # see p2p_inbox()
        self.shm_holder: Optional[Operation] = None  # the operation whose steps use the segments now
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

    def two_step_scratch(self, nbytes: int) -> np.ndarray:
        """The two-step executor's receive buffer (one: collectives run one at a
        time), kept at the largest size asked (at most two_step.MAX_HALF_BYTES).
        Pooled chunks of that size were often gone to the DAG's chunks in between,
        and a fresh buffer per call faulted its pages in under the receive (a
        4 MiB half took 2.5x as long as into a warm buffer)."""
        buf = self._two_step_scratch
        if buf is None or buf.nbytes < nbytes:
            buf = self._two_step_scratch = np.empty(max(1, nbytes), dtype=np.uint8)
        return buf[:nbytes]

    def forget_two_step_scratch(self) -> None:
        """A failed call parked it: UCX may still write there, so the next call gets its own."""
        self._two_step_scratch = None

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
                elif idle > IDLE_SPINS_BEFORE_YIELD:
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
