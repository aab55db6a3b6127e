"""Split decisions and per-flow state: what a stage sends on which plane.

A Splitter turns the path policy (and, under 'adaptive', the controller) into
each flow's split and the planes' windows; OutFlow / InFlow carry a flow's
chunks and their accounting (every chunk index claimed once, with its exact
length); StageRun times a stage and files the delivery samples the controller
learns from. Used by collective operations and point-to-point alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from . import wire
from .algorithms.schedule import Flow, Stage
from .windows import OUT, UP, FlowCursor, boundary_for, chunk_count, chunk_range

MIN_CHUNK_BYTES = 64 << 10
MIN_SAMPLE_BYTES = 64 << 10  # smaller chunks measure latency and skew, not a link's rate
SHORT_STAGE_S = 0.005  # stages shorter than this reuse a controller decision ...
REUSE_MAX = 7  # ... up to this many times before deciding afresh
# While every rank has 'out' dropped and no probe is due there is nothing to
# decide (everything goes on 'up'): a short stage's decision is reused for longer.
REUSE_MAX_SETTLED = 15
MAX_WINDOW_BYTES = 8 << 20  # more in flight only pushes chunks out of cache before they are reduced


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
                 cache: Optional[DecisionCache] = None, name: Optional[str] = None,
                 same_domain: Optional[Callable[[int, int], bool]] = None):
        self.policy = policy
        # What the caller asked for: 'adaptive' also when a settled controller
        # had nothing to decide and the operation runs as 'up' (comm._run).
        self.name = name or _policy_name(policy)
        self.planes = planes
        self.window_bytes = window_bytes
        self.controller = controller
        self.cache = cache
        # Whether two ranks share a scale-up domain (the communicator's
        # topology): where 'up' runs between two other ranks.
        self.same_domain = same_domain

    def without(self, down) -> "Splitter":
        """The same policy on the planes that are not down."""
        live = {n: p for n, p in self.planes.items() if n not in down}
        return Splitter(self.policy, live, self.window_bytes, self.controller, self.cache, self.name,
                        self.same_domain)

    def reach(self, peer: int) -> tuple[bool, bool]:
        up = self.planes.get(UP)
        out = self.planes.get(OUT)
        return (up is not None and up.reaches(peer), out is not None and out.reaches(peer))

    @property
    def can_steal(self) -> bool:
        """Stealing is paced by send completions; only sound where they mean delivery."""
        return all(p.completion_means_delivery for p in self.planes.values())

    def plan(self, flows: list[tuple[Flow, int]], now: float, chunk_bytes: Optional[int] = None,
             others: tuple = (), epoch: Optional[int] = None,
             quantum_of: Optional[Callable[[Flow], int]] = None, companions: tuple = ()) -> StagePlan:
        """flows: (flow, nbytes) this rank sends in the stage; others: the
        stage's flows from other ranks, which the controller splits together
        with ours (the coflow) from their piggybacked estimates; quantum_of:
        a flow's chunk length in bytes, the step its split moves in;
        companions: (flow, nbytes) that stand for other channels' load beside
        the stage (algorithms.overlap): they take capacity, move nothing."""
        if self.policy == "adaptive" and self.controller is not None:
            if sum(n for _, n in flows) >= self.controller.config.min_multipath_bytes:
                return self._adaptive(flows, now, chunk_bytes, others, epoch, quantum_of, companions)
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

    def _adaptive(self, flows, now, chunk_bytes, others=(), epoch=None, quantum_of=None, companions=()) -> StagePlan:
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
        plan = self._decide(flows, now, chunk_bytes, others, epoch, quantum_of, companions)
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

    def _links(self, plane: str, src: int, dst: int, mine: int) -> bool:
        """Whether another rank's flow can use ``plane``, as far as this rank can
        tell: a plane that reaches both ends from here reaches between them, and
        'up' runs inside every scale-up domain (the topology), not only this
        rank's. Taken from reach alone, the flows inside the other domains of a
        hierarchical all_reduce went on 'out' only in the coflow: their domain
        looked critical (150 ms against 64 on 'up'), this rank's own flows had
        slack and stayed on 'up', and its probes put one chunk in sixteen on
        'out' (the 2x2 testbed, 1.00x)."""
        if plane == UP and self.same_domain is not None and self.same_domain(src, dst):
            # Ends in this rank's domain must still be reachable (not severed).
            return all(r == mine or not self.same_domain(r, mine) or self.planes[UP].reaches(r) for r in (src, dst))
        return all(r == mine or self.planes[plane].reaches(r) for r in (src, dst))

    def _decide(self, flows, now, chunk_bytes, others=(), epoch=None, quantum_of=None, companions=()) -> StagePlan:
        from .control import FlowDemand

        demands = []
        for f, nbytes in flows:
            up_ok, out_ok = self.reach(f.dst)
            planes = tuple(p for p, ok in ((UP, up_ok), (OUT, out_ok)) if ok)
            demands.append(FlowDemand(flow_id=f.id, src=f.src, dst=f.dst, nbytes=nbytes, planes=planes,
                                      quantum_bytes=quantum_of(f) if quantum_of else 0))
        mine = flows[0][0].src if flows else None
        for (f, nbytes), companion in [(o, False) for o in others] + [(c, True) for c in companions]:
            planes = tuple(p for p in (UP, OUT) if p in self.planes and self._links(p, f.src, f.dst, mine))
            if planes and nbytes:
                # A peer's flow lands on its own whole chunks too (quantum_of knows the
                # peer's chunking): without them its predicted finish, and with it the
                # stage time telemetry reports, was the unaligned optimum's.
                quantum = quantum_of(f) if quantum_of and not companion else 0
                demands.append(FlowDemand(flow_id=f.id, src=f.src, dst=f.dst, nbytes=nbytes, planes=planes,
                                          quantum_bytes=quantum, companion=companion))
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
    # (plane, peer) -> the last time this rank looked for the peer's chunks
    # there and found none (set when its first chunk is found)
    silent_until: dict = field(default_factory=dict)

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

    def note_first_chunk(self, plane: str, peer: int, last_empty_look: float) -> None:
        """The peer's first chunk on ``plane`` was found; ``last_empty_look``:
        when this rank had last looked (or this stage's start, if later)."""
        self.silent_until.setdefault((plane, peer), max(self.t_start, last_empty_look))

    def received_by_plane(self) -> dict:
        """Bytes that arrived in this stage per plane (chunks of at least MIN_SAMPLE_BYTES)."""
        got = {UP: 0, OUT: 0}
        for (plane, _), (_, _, nbytes, _) in self.arrivals.items():
            got[plane] += nbytes
        return got

    def split_senders(self) -> set:
        """The peers whose chunks reached this rank on both planes in this stage:
        those that split their flow here (the others sent it whole on one plane)."""
        planes_of: dict = {}
        for plane, peer in self.arrivals:
            planes_of.setdefault(peer, set()).add(plane)
        return {peer for peer, planes in planes_of.items() if len(planes) > 1}

    def arrival_times(self) -> dict:
        """Per plane, when this stage's chunks arrived here, from its start (seconds):
        the first and the last, and their bytes. The trace's realised side of a
        split's predicted ``finish_s``: which plane the stage waited for."""
        seen: dict = {}
        for (plane, _), (first, last, nbytes, _) in self.arrivals.items():
            entry = seen.setdefault(plane, [first, last, 0])
            entry[0], entry[1], entry[2] = min(entry[0], first), max(entry[1], last), entry[2] + nbytes
        return {plane: {"first_s": round(first - self.t_start, 6), "last_s": round(last - self.t_start, 6),
                        "bytes": nbytes} for plane, (first, last, nbytes) in seen.items()}

    def busy_intervals(self):
        """Per (plane, peer): (plane, peer, bytes, start, end), the span this stage's chunks were
        arriving here, from one chunk's spacing before the first to the last (flows of one chunk
        give no spacing and are left out). In a pipelined schedule the link is shared with the
        other channels' stages, so these spans, not the stage's, tell when the link was busy
        (CollectiveOp._teach_port_rates)."""
        for (plane, peer), (first, last, nbytes, chunks) in self.arrivals.items():
            if chunks > 1 and last > first:
                yield plane, peer, nbytes, _one_spacing_before(first, last, chunks), last

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
        rank put everything on 'up' (testbed, 1.2x slower operations).

        A late first chunk is evidence of a late peer only if this rank was
        looking for it: the interval starts no later than this rank's last
        look that found nothing (``silent_until``). A rank that spends the
        stage's first milliseconds posting its own window (a 2.4 / 1.2 Gbit/s
        tcp testbed, 16 MiB all_gather: 3-8 ms without a look) finds chunks
        that waited in its socket buffers in a bunch; timed from the first of
        them less their spacing, 'up' read 400-870 MB/s on a 300 MB/s link
        and 'out' 160-520 on 150, the split swung between the planes and
        stages took up to 1.3x their plan. From the last empty look they read
        315-385 and 110-170 (the tbf bucket refills between operations).

        The estimator sees one chunk posted to an idle plane and fits rate and
        delay from such samples (its idle-only model).
        """
        for (plane, peer), (first, last, nbytes, chunks) in self.arrivals.items():
            start = self.t_start
            if chunks > 1:
                late = _one_spacing_before(first, last, chunks)
                start = max(start, min(late, self.silent_until.get((plane, peer), start)))
            if nbytes and last > start:
                yield plane, peer, nbytes, start, last


def _one_spacing_before(first: float, last: float, chunks: int) -> float:
    """When a flow's first chunk started arriving: one mean gap between its arrivals before it."""
    return first - (last - first) / (chunks - 1)
