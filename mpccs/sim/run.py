"""Execute a coflow DAG on a simulated cluster, split by a path policy.

This is the simulator's counterpart of the real engine: the same
:class:`~mpccs.algorithms.schedule.Schedule`, the same per-rank stage
dependencies, the same controller API (``decide`` at each stage start,
``on_chunk`` for every completed chunk, ``on_stage`` at each stage end).

Execution of one flow
  * the flow becomes ready when both its sender and its receiver have
    entered its stage (receives are posted at stage entry, as with tag
    matching);
  * the sender's policy has split it into an up part and an out part;
  * each part is one fluid transfer through its plane's route, capped by
    the sender's per-plane window (at most ``window`` bytes in flight over a
    post-to-completion latency ``L``: rate <= window / L);
  * a part's last chunk completes ``L`` after its last byte left;
  * with ``steal``, a plane that finishes sending first takes the other
    plane's unposted tail (all but one window), sized so that both finish
    together at current rates, in whole chunks;
  * the flow lands when its last part completes (plus a reduction cost).

Aggregation (``aggregate=True``): when every scale-up domain is the same and
the schedule treats every domain alike, only the ranks of domain 0 are
simulated. A flow from domain 0 to rank ``(d, i)`` uses the receive ports of
``(0, i)``, which carry, by symmetry, the image of that traffic; a receive
of domain 0 from outside is taken to land when its mirror (the flow domain 0
sends with the same stage, local endpoints and size) lands. tests/test_sim.py
checks aggregated against full simulation at 64 ranks.
"""
from __future__ import annotations

import inspect
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from mpccs.algorithms.overlap import companion_flows
from mpccs.algorithms.schedule import Flow, Schedule

from .engine import Simulator
from .fabric import PLANES, Cluster, Transfer

from mpccs.control.split import FlowDemand, PathModel, equal_finish


@dataclass
class StageDecision:
    """A fixed policy's answer for one stage: the fields of
    ``mpccs.control.controller.StageDecision`` the engine reads."""

    up_bytes: dict
    window_bytes: object = None   # int, or {plane: bytes}; None: the run's default
    steal: bool = False
    out_cap_bytes: object = None  # int, {flow_id: bytes}, or None
    reason: str = ""


MiB = 1 << 20


# --- fixed policies ----------------------------------------------------------
def _round_down(nbytes: float, align: int) -> int:
    return int(nbytes // align) * align


class FixedShare:
    """Send a fixed fraction of every two-plane flow on the out plane.

    ``FixedShare(0)`` is the single-plane baseline: intra-domain flows on the
    scale-up plane, inter-domain flows on the scale-out plane, as NCCL does.
    """

    wants_feedback = False  # static: chunk completions would be thrown away

    def __init__(self, out_share: float, window_bytes: Optional[int] = None, steal: bool = False):
        if not 0.0 <= out_share <= 1.0:
            raise ValueError("out_share must lie in [0, 1]")
        self.out_share = out_share
        self.window_bytes = window_bytes
        self.steal = steal

    def decide(self, flows, now, align):
        up = {}
        for f in flows:
            if "up" not in f.planes:
                up[f.flow_id] = 0
            elif "out" not in f.planes:
                up[f.flow_id] = f.nbytes
            else:
                up[f.flow_id] = f.nbytes - _round_down(f.nbytes * self.out_share, align)
        return StageDecision(up_bytes=up, window_bytes=self.window_bytes, steal=self.steal,
                             out_cap_bytes=None, reason=f"fixed out share {self.out_share:g}")

    def on_chunk(self, plane, peer, nbytes, t_post, t_done):
        pass

    def on_stage(self, decision, t_start, t_end, bytes_by_plane):
        pass


class NominalSplit(FixedShare):
    """Equal-finish split from the link specifications alone, no feedback.

    Each flow's planes are taken as independent paths at the rate of their
    narrowest link and the plane latency (anchors.md two-path formula). It
    is what summing datasheet rates gives, and is wrong exactly where the
    planes share a resource or a NIC serves several GPUs.
    """

    def __init__(self, cluster: Cluster, window_bytes: Optional[int] = None, steal: bool = False):
        super().__init__(0.0, window_bytes, steal)
        self.cluster = cluster

    def decide(self, flows, now, align):
        up = {}
        for f in flows:
            if "up" not in f.planes or "out" not in f.planes:
                up[f.flow_id] = f.nbytes if "up" in f.planes else 0
                continue
            paths = [PathModel(self.cluster.nominal_rate(f.src, f.dst, p), self.cluster.latency(p)) for p in PLANES]
            _, (_, x_out) = equal_finish(f.nbytes, paths)
            up[f.flow_id] = f.nbytes - _round_down(x_out, align)
        return StageDecision(up_bytes=up, window_bytes=self.window_bytes, steal=self.steal,
                             out_cap_bytes=None, reason="equal finish from link specs")


def controller_factory(**config):
    """``policy_factory(cluster, rank)`` building one mpccs.control PathController per rank.

    Its priors are the cluster's link specifications (what a deployment
    would configure), its chunk size the run's; ``config`` overrides any
    other ControlConfig field."""
    from mpccs.control.controller import ControlConfig, PathController

    def make(cluster: Cluster, rank: int) -> PathController:
        values = dict(
            prior_rate_Bps={p: cluster.lone_rate(rank, p) for p in PLANES},
            prior_delay_s={p: cluster.latency(p) for p in PLANES},
        )
        values.update(config)
        return PathController(ControlConfig(**values), rank=rank)

    return make


# --- timed events ------------------------------------------------------------
@dataclass(frozen=True)
class Background:
    """Competing traffic on one plane's ports of every simulated rank.

    Inelastic (default): the traffic takes ``fraction`` of each port, like
    another job's reserved or higher-priority share. Elastic: one flow that
    wants ``fraction`` of the port but shares max-min fairly with the
    collective's flows (so it gets less when they are many).
    """

    plane: str
    fraction: float
    start_s: float = 0.0
    end_s: float = math.inf
    elastic: bool = False


@dataclass(frozen=True)
class PlaneDown:
    """A plane fails at ``at_s``; it is noticed ``detect_s`` later.

    Bytes not yet sent on the dead plane are resent on the other plane from
    the last chunk boundary that left; a flow with no other plane fails the
    operation (fail-and-retry from a known boundary, not transparent)."""

    plane: str
    at_s: float
    detect_s: float = 1e-3


# --- results -----------------------------------------------------------------
@dataclass
class StageRecord:
    rank: int
    stage: int
    label: str
    t_start: float
    t_end: float
    bytes_by_plane: dict
    reason: str = ""


@dataclass
class SimResult:
    time_s: float
    ok: bool
    error: Optional[str]
    bytes_by_plane: dict            # over every rank (aggregated runs scaled up)
    movable_bytes_by_plane: dict    # only flows that could use both planes
    ranks_simulated: int
    world: int
    aggregated: bool
    stages: list = field(default_factory=list)
    events: list = field(default_factory=list)
    reallocations: int = 0

    @property
    def out_share(self) -> float:
        """Share of the two-plane (intra-domain) bytes carried by the out plane."""
        total = sum(self.movable_bytes_by_plane.values())
        return self.movable_bytes_by_plane.get("out", 0) / total if total else 0.0


# --- the run -----------------------------------------------------------------
class _FlowRun:
    """One simulated flow: readiness, its parts, its completion."""

    __slots__ = ("flow", "stage", "dst_image", "nbytes", "waiting", "parts", "open_parts",
                 "decision", "up_bytes", "carried", "mirrors", "windows")

    def __init__(self, flow: Flow, stage: int, dst_image: int, nbytes: int):
        self.flow = flow
        self.stage = stage
        self.dst_image = dst_image
        self.nbytes = nbytes
        self.waiting = 2          # sender entered the stage, receiver entered it
        self.parts: dict = {}     # plane -> Transfer
        self.open_parts = 0
        self.decision = None
        self.up_bytes = 0         # the policy's split: a prefix on up, the rest on out
        self.carried = dict.fromkeys(PLANES, 0)
        self.mirrors: list[Flow] = []  # receives into domain 0 that land with it (same stage)
        self.windows: dict = {}


class ScheduleRun:
    """State of one schedule executing on one cluster."""

    def __init__(self, schedule: Schedule, cluster: Cluster, policy_for: Callable[[int], object], *,
                 itemsize: int = 4, chunk_bytes: int = MiB, window_bytes: Optional[int] = 16 * MiB,
                 aggregate=False, events: Sequence = (), feedback: bool = True,
                 align: Optional[int] = None, start_s: float = 0.0, epoch: Optional[int] = None):
        if schedule.world != cluster.world:
            raise ValueError(f"schedule has {schedule.world} ranks, cluster {cluster.world}")
        self.schedule = schedule
        self.cluster = cluster
        self.itemsize = itemsize
        self.align = align or itemsize  # split boundaries fall on elements
        self.chunk = chunk_bytes
        self.default_window = window_bytes
        self.events = list(events)
        self.feedback = feedback
        self.sim = Simulator(cluster.net)
        self.sim.now = self.start_s = start_s  # back-to-back operations share one clock
        self.reps = _representatives(schedule, cluster, aggregate)
        self.aggregated = len(self.reps) < cluster.world
        self.policies = {r: policy_for(r) for r in self.reps}
        # mpccs.control's controller takes the engine's chunk size and the
        # operations' shared clock (its probes fall on a grid of it); fixed policies do not.
        self._decide_kw = {r: _accepted(p.decide, chunk_bytes=chunk_bytes, epoch=epoch)
                           for r, p in self.policies.items()}
        self._takes_received = {r: bool(_accepted(p.on_stage, received_by_plane=True))
                                for r, p in self.policies.items()}
        self.error: Optional[str] = None
        self._feedback: dict = {}  # rank -> chunk completions not yet delivered
        self.log: list = []
        self.stage_records: list[StageRecord] = []
        self._plan()

    # -- preprocessing
    def _image(self, rank: int) -> int:
        return self.cluster.local(rank) if self.aggregated else rank

    def _plan(self) -> None:
        reps = set(self.reps)
        stages = {s.id: s for s in self.schedule.stages}
        self.stage_by_id = stages
        # What the engine's splitter adds to a pipelined stage's coflow (the
        # other channels' out-only load): mpccs.algorithms.overlap.
        self.companions = companion_flows(self.schedule, self.cluster.topology.same_domain)
        self.sends = defaultdict(list)     # (rank, stage) -> [_FlowRun]
        self.rendezvous = defaultdict(list)  # (rank, stage) -> [_FlowRun] it receives (image)
        self.expect = Counter()            # (rank, stage) -> completions to wait for
        self.runs: list[_FlowRun] = []
        outward = {}                       # mirror key -> _FlowRun leaving domain 0
        inward = []                        # receives into domain 0 from outside
        involved = defaultdict(set)
        for stage in self.schedule.stages:
            for f in stage.flows:
                if f.src in reps:
                    run = _FlowRun(f, stage.id, self._image(f.dst), f.count * self.itemsize)
                    self.runs.append(run)
                    self.sends[f.src, stage.id].append(run)
                    self.rendezvous[run.dst_image, stage.id].append(run)
                    self.expect[f.src, stage.id] += 1
                    involved[f.src].add(stage.id)
                    involved[run.dst_image].add(stage.id)
                    if f.dst not in reps:
                        outward.setdefault(self._mirror_key(stage.id, f), run)
                if f.dst in reps:
                    self.expect[f.dst, stage.id] += 1
                    involved[f.dst].add(stage.id)
                    if f.src not in reps:
                        inward.append((stage.id, f))
        for stage_id, f in inward:
            run = outward.get(self._mirror_key(stage_id, f))
            if run is None:
                raise ValueError(f"aggregation: no mirror for flow {f.id} in stage {stage_id}; "
                                 "the schedule is not domain-symmetric, run with aggregate=False")
            run.mirrors.append(f)
        self._plan_dependencies(involved)

    def _mirror_key(self, stage_id: int, f: Flow) -> tuple:
        c = self.cluster
        return (stage_id, c.local(f.src), c.local(f.dst), f.count, f.reduce)

    def _plan_dependencies(self, involved: dict) -> None:
        """Per rank: the stages it takes part in and what each waits for.

        A stage a rank has no flow in finishes on that rank as soon as its
        own dependencies do, so dependencies are resolved through it."""
        order = _topological_order(self.schedule)
        self.waits = {}                    # (rank, stage) -> unfinished deps
        self.dependents = defaultdict(list)
        self.roots = defaultdict(list)
        for rank in self.reps:
            mine = involved.get(rank, set())
            reach: dict[int, frozenset] = {}
            for sid in order:
                deps = frozenset().union(*(reach[d] for d in self.stage_by_id[sid].deps)) \
                    if self.stage_by_id[sid].deps else frozenset()
                if sid in mine:
                    self.waits[rank, sid] = len(deps)
                    for d in deps:
                        self.dependents[rank, d].append(sid)
                    if not deps:
                        self.roots[rank].append(sid)
                    reach[sid] = frozenset((sid,))
                else:
                    reach[sid] = deps
        self.unfinished = Counter(rank for rank, _ in self.waits)
        self.stage_start = {}
        self.stage_decision = {}
        self.rank_done_at = {}

    # -- run
    def run(self) -> SimResult:
        self._schedule_events()
        for rank in self.reps:
            t0 = self.start_s + self._local_copy_time(rank, self.schedule.prologue) \
                + self.cluster.preset.op_overhead_us * 1e-6
            for sid in self.roots[rank]:
                self.sim.at(t0, self._enter_stage, rank, sid)
            if not self.roots[rank]:
                self.rank_done_at[rank] = t0
        self.sim.run()
        return self._result()

    def _local_copy_time(self, rank: int, copies) -> float:
        nbytes = sum(c.count for c in copies if c.rank == rank) * self.itemsize
        rate = self.cluster.preset.copy_GBps * 1e9
        return nbytes / rate if nbytes and math.isfinite(rate) else 0.0

    def _enter_stage(self, rank: int, sid: int) -> None:
        now = self.sim.now
        self.stage_start[rank, sid] = now
        sends = self.sends.get((rank, sid), [])
        if sends:
            self._decide(rank, sid, sends)
        for run in sends:
            self._rendezvous(run)
        for run in self.rendezvous.get((rank, sid), []):
            self._rendezvous(run)
        if self.expect[rank, sid] == 0:
            self._finish_stage(rank, sid)

    def _decide(self, rank: int, sid: int, sends: list) -> None:
        self._flush_feedback(rank)
        demands = [FlowDemand(r.flow.id, r.flow.src, r.flow.dst, r.nbytes,
                              self.cluster.planes_between(r.flow.src, r.flow.dst)) for r in sends]
        companions = [FlowDemand(f.id, f.src, f.dst, f.count * self.itemsize, ("out",), companion=True)
                      for f in self.companions.get(sid, ()) if f.src == rank]
        decision = self._call_decide(rank, demands + companions)
        self.stage_decision[rank, sid] = decision
        for run, demand in zip(sends, demands):
            up = int(decision.up_bytes.get(run.flow.id, 0 if "up" not in demand.planes else run.nbytes))
            if not 0 <= up <= run.nbytes:
                raise ValueError(f"policy put {up} of {run.nbytes} bytes of flow {run.flow.id} on up")
            if up and "up" not in demand.planes:
                raise ValueError(f"policy put bytes of flow {run.flow.id} on a plane it cannot use")
            run.decision = decision
            run.up_bytes = up
            run.windows = {p: self._window(decision, p) for p in PLANES}

    def _call_decide(self, rank: int, demands):
        return self.policies[rank].decide(demands, self.sim.now, self.align, **self._decide_kw[rank])

    def _window(self, decision, plane: str) -> Optional[int]:
        w = getattr(decision, "window_bytes", None)
        if isinstance(w, dict):
            w = w.get(plane)
        if w is None:
            w = self.default_window
        return None if w is None else max(int(w), self.chunk)

    def _rendezvous(self, run: _FlowRun) -> None:
        run.waiting -= 1
        if run.waiting == 0:
            self._start_flow(run)

    def _start_flow(self, run: _FlowRun) -> None:
        if run.nbytes == 0:
            self._flow_landed(run)
            return
        alive = self.cluster.planes_between(run.flow.src, run.flow.dst)
        if not alive:
            self._fail(f"flow {run.flow.id} ({run.flow.src}->{run.flow.dst}): no live plane")
            return
        if len(alive) == 1:  # a plane died after the decision: all on the other
            split = {alive[0]: run.nbytes}
        else:
            split = {"up": run.up_bytes, "out": run.nbytes - run.up_bytes}
        for plane, nbytes in split.items():
            if nbytes > 0:
                self._start_part(run, plane, nbytes)

    def _start_part(self, run: _FlowRun, plane: str, nbytes: float) -> None:
        f = run.flow
        route = self.cluster.route(f.src, run.dst_image, plane)
        latency = self.cluster.latency(plane) + self.cluster.chunk_overhead(plane)
        window = run.windows.get(plane)
        cap = window / latency if window and latency > 0 else math.inf
        tr = Transfer(route, float(nbytes), cap=cap, on_sent=self._part_sent, tag=(run, plane),
                      t_start=self.sim.now, history=[] if self._wants_feedback(f.src) else None,
                      priority=self.stage_by_id[run.stage].channel)
        run.parts[plane] = tr
        run.open_parts += 1
        self.sim.start(tr)

    def _wants_feedback(self, rank: int) -> bool:
        return self.feedback and getattr(self.policies[rank], "wants_feedback", True)

    def _part_sent(self, tr: Transfer, now: float) -> None:
        run, plane = tr.tag
        if tr.dead:
            return
        if self._steal(run, plane, tr):
            return
        self.sim.after(self.cluster.latency(plane) + self.cluster.chunk_overhead(plane),
                       self._part_done, run, plane, tr)

    def _steal(self, run: _FlowRun, plane: str, tr: Transfer) -> bool:
        """Take whole chunks off the other plane's unposted tail."""
        if not getattr(run.decision, "steal", False):
            return False
        other = "out" if plane == "up" else "up"
        peer = run.parts.get(other)
        if peer is None or peer.remaining <= 0 or peer.rate <= 0 or tr.rate <= 0 \
                or peer.dead or not self.cluster.plane_alive[plane]:
            return False
        kept = min(peer.remaining, run.windows.get(other) or 0)
        stealable = peer.remaining - kept
        # Equal finish at current rates: (rem - x)/r_o + L_o = x/r_p + L_p.
        l_p, l_o = self.cluster.latency(plane), self.cluster.latency(other)
        x = (peer.remaining / peer.rate + l_o - l_p) / (1 / tr.rate + 1 / peer.rate)
        x = min(x, stealable)
        cap = getattr(run.decision, "out_cap_bytes", None)
        if isinstance(cap, dict):
            cap = cap.get(run.flow.id)
        if plane == "out" and cap is not None:
            x = min(x, cap - run.carried["out"] - tr.sent)
        x = _round_down(max(x, 0.0), self.chunk)
        if x <= 0:
            return False
        peer.remaining -= x
        tr.remaining = float(x)
        self.sim.start(tr)
        return True

    def _part_done(self, run: _FlowRun, plane: str, tr: Transfer) -> None:
        if tr.dead:
            return
        run.carried[plane] += tr.sent
        if tr.history is not None:
            self._record_chunks(run, plane, tr)
        run.open_parts -= 1
        if run.open_parts == 0:
            self._flow_landed(run)

    def _flow_landed(self, run: _FlowRun) -> None:
        now = self.sim.now
        f = run.flow
        self._count_completion(f.src, run.stage)
        for g in ([f] if f.dst in self.policies else []) + run.mirrors:
            self.sim.at(now + self._reduce_time(g), self._count_completion, g.dst, run.stage)

    def _received(self, rank: int, sid: int) -> dict:
        """Bytes that reached ``rank`` in stage ``sid`` per plane, as the engine's
        receivers count them: the controller's judge takes a stage sent on one
        plane but received on both for no solo record (PathController.on_stage),
        and without them every such stage was one in the simulator."""
        got = dict.fromkeys(PLANES, 0)
        for run in self.rendezvous.get((rank, sid), []):
            for p in PLANES:
                got[p] += run.carried[p]
        return got

    def _reduce_time(self, f: Flow) -> float:
        rate = self.cluster.preset.reduce_GBps * 1e9
        return f.count * self.itemsize / rate if f.reduce and math.isfinite(rate) else 0.0

    def _count_completion(self, rank: int, sid: int) -> None:
        self.expect[rank, sid] -= 1
        if self.expect[rank, sid] == 0:
            self._finish_stage(rank, sid)

    def _finish_stage(self, rank: int, sid: int) -> None:
        now = self.sim.now
        carried = dict.fromkeys(PLANES, 0)
        for run in self.sends.get((rank, sid), []):
            for p in PLANES:
                carried[p] += run.carried[p]
        decision = self.stage_decision.get((rank, sid))
        stage = self.stage_by_id[sid]
        self.stage_records.append(StageRecord(rank, sid, stage.label, self.stage_start[rank, sid], now,
                                              carried, _short_reason(decision, rank)))
        if decision is not None:
            self._flush_feedback(rank)
            policy = self.policies[rank]
            kw = {"received_by_plane": self._received(rank, sid)} if self._takes_received[rank] else {}
            policy.on_stage(decision, self.stage_start[rank, sid], now, carried, **kw)
        self.unfinished[rank] -= 1
        if self.unfinished[rank] == 0:
            self.rank_done_at[rank] = now + self._local_copy_time(rank, self.schedule.epilogue)
            if len(self.rank_done_at) == len(self.reps):
                self.sim.stop()  # background load and later events outlive the operation
        for nxt in self.dependents.get((rank, sid), []):
            self.waits[rank, nxt] -= 1
            if self.waits[rank, nxt] == 0:
                self._enter_stage(rank, nxt)

    # -- controller feedback
    def _record_chunks(self, run: _FlowRun, plane: str, tr: Transfer) -> None:
        """Chunk completions of one part, read off its rate history."""
        latency = self.cluster.latency(plane) + self.cluster.chunk_overhead(plane)
        window = run.windows.get(plane) or self.chunk
        in_window = max(1, window // self.chunk)
        done: list[float] = []
        pending = self._feedback.setdefault(run.flow.src, [])
        offset = 0.0
        while offset < tr.sent - 1e-6:
            nbytes = min(self.chunk, tr.sent - offset)
            offset += nbytes
            t_done = tr.time_of(offset) + latency
            t_post = tr.t_start if len(done) < in_window else done[-in_window]
            done.append(t_done)
            pending.append((t_done, plane, run.flow.dst, int(nbytes), t_post))

    def _flush_feedback(self, rank: int) -> None:
        pending = self._feedback.get(rank)
        if not pending:
            return
        now = self.sim.now
        pending.sort()
        policy = self.policies[rank]
        keep = []
        for t_done, plane, peer, nbytes, t_post in pending:
            if t_done <= now + 1e-12:
                policy.on_chunk(plane, peer, nbytes, t_post, t_done)
            else:
                keep.append((t_done, plane, peer, nbytes, t_post))
        self._feedback[rank] = keep

    # -- timed events
    def _schedule_events(self) -> None:
        for ev in self.events:
            if isinstance(ev, Background):
                if ev.end_s > self.start_s:  # over before this operation: nothing to do
                    self.sim.at(ev.start_s, self._background_on, ev)
            elif isinstance(ev, PlaneDown):
                self.sim.at(ev.at_s, self._plane_down, ev)
            else:
                raise TypeError(f"unknown event {ev!r}")

    def _background_on(self, ev: Background) -> None:
        net = self.cluster.net
        resources = sorted({r for rank in self.reps for r in self.cluster.plane_resources(ev.plane, rank)})
        undo = []
        for r in resources:
            cap = net.capacity(r)
            if ev.elastic:
                load = self.sim.start(Transfer(((r, 1.0),), math.inf, cap=ev.fraction * cap, tag="background"))
                undo.append(lambda load=load: net.remove(load))
            else:
                net.set_capacity(r, cap * (1.0 - ev.fraction))
                undo.append(lambda r=r, cap=cap: net.set_capacity(r, cap))
        kind = "elastic" if ev.elastic else "inelastic"
        self.log.append((self.sim.now, f"background {ev.fraction:.0%} ({kind}) on {ev.plane}"))
        if math.isfinite(ev.end_s):
            self.sim.at(ev.end_s, self._background_off, ev, undo)

    def _background_off(self, ev: Background, undo: list) -> None:
        for action in undo:
            action()
        self.log.append((self.sim.now, f"background off on {ev.plane}"))

    def _plane_down(self, ev: PlaneDown) -> None:
        self.cluster.plane_alive[ev.plane] = False
        self.log.append((self.sim.now, f"plane {ev.plane} down"))
        for run in self.runs:
            tr = run.parts.get(ev.plane)
            if tr is None or tr.remaining <= 0 or tr not in self.cluster.net.transfers:
                continue
            self.cluster.net.remove(tr)
            tr.dead = True
            run.carried[ev.plane] += tr.sent
            self.sim.after(ev.detect_s, self._resend, run, ev.plane, tr.remaining)

    def _resend(self, run: _FlowRun, dead_plane: str, nbytes: float) -> None:
        """Resend what the dead plane did not deliver on a plane still alive."""
        run.open_parts -= 1
        alive = self.cluster.planes_between(run.flow.src, run.flow.dst)
        if not alive:
            self._fail(f"flow {run.flow.id} ({run.flow.src}->{run.flow.dst}) lost its only plane "
                       f"{dead_plane}; the operation fails and must be retried")
            return
        self.log.append((self.sim.now, f"flow {run.flow.id}: {int(nbytes)} B resent on {alive[0]}"))
        run.parts.pop(alive[0], None)
        self._start_part(run, alive[0], nbytes)

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
            self.log.append((self.sim.now, message))
        self.sim.stop()

    # -- result
    def _result(self) -> SimResult:
        ok = self.error is None and len(self.rank_done_at) == len(self.reps)
        error = self.error or (None if ok else "deadlock: some stages never started")
        scale = self.cluster.world / len(self.reps)
        total = dict.fromkeys(PLANES, 0.0)
        movable = dict.fromkeys(PLANES, 0.0)
        for run in self.runs:
            two_planes = self.cluster.domain(run.flow.src) == self.cluster.domain(run.flow.dst)
            for p in PLANES:
                total[p] += run.carried[p] * scale
                if two_planes:
                    movable[p] += run.carried[p] * scale
        time_s = max(self.rank_done_at.values()) - self.start_s if ok and self.rank_done_at else math.inf
        return SimResult(time_s=time_s, ok=ok, error=error, bytes_by_plane=total,
                         movable_bytes_by_plane=movable, ranks_simulated=len(self.reps),
                         world=self.cluster.world, aggregated=self.aggregated,
                         stages=self.stage_records, events=self.log,
                         reallocations=self.sim.reallocations)


def _short_reason(decision, rank: int) -> str:
    """One line per stage record: the controller's reason is a large dict."""
    reason = getattr(decision, "reason", "")
    if isinstance(reason, dict):
        mine = reason.get("ranks", {}).get(str(rank), {})
        return "; ".join([mine.get("mode", "")] + list(mine.get("why", [])))
    return str(reason)


def _topological_order(schedule: Schedule) -> list[int]:
    ids = [s.id for s in schedule.stages]
    known = set(ids)
    indegree = {s.id: 0 for s in schedule.stages}
    children = defaultdict(list)
    for s in schedule.stages:
        for d in s.deps:
            if d not in known:
                raise ValueError(f"stage {s.id} depends on unknown stage {d}")
            indegree[s.id] += 1
            children[d].append(s.id)
    ready = [i for i in ids if indegree[i] == 0]
    order = []
    while ready:
        sid = ready.pop()
        order.append(sid)
        for c in children[sid]:
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
    if len(order) != len(ids):
        raise ValueError("stage dependencies have a cycle")
    return order


def domain_symmetric(schedule: Schedule, cluster: Cluster) -> bool:
    """Does every domain send and receive the same flows, stage by stage?

    Necessary for aggregation: it makes the load a domain-0 port carries in
    the reduced run equal to the load of any port in the full run."""
    sig = defaultdict(Counter)
    for stage in schedule.stages:
        for f in stage.flows:
            key = (cluster.local(f.src), cluster.local(f.dst),
                   cluster.domain(f.src) == cluster.domain(f.dst), f.count, f.reduce)
            sig[stage.id, cluster.domain(f.src), "send"][key] += 1
            sig[stage.id, cluster.domain(f.dst), "recv"][key] += 1
    for stage in schedule.stages:
        for side in ("send", "recv"):
            first = sig.get((stage.id, 0, side), Counter())
            if any(sig.get((stage.id, d, side), Counter()) != first for d in range(1, cluster.domains)):
                return False
    return True


def _representatives(schedule: Schedule, cluster: Cluster, aggregate) -> list[int]:
    everyone = list(range(cluster.world))
    if not aggregate or cluster.domains == 1:
        return everyone
    if not domain_symmetric(schedule, cluster):
        if aggregate == "auto":
            return everyone
        raise ValueError("schedule is not domain-symmetric; aggregation would be wrong")
    return list(range(cluster.preset.gpus_per_domain))


def _accepted(method, **offered) -> dict:
    """The keywords of ``offered`` that ``method`` takes (and that are set): policies differ in what they take."""
    params = inspect.signature(method).parameters
    return {k: v for k, v in offered.items() if k in params and v is not None}


def simulate(schedule: Schedule, cluster: Cluster, policy=None, *, policy_factory=None,
             itemsize: int = 4, chunk_bytes: int = MiB, window_bytes: Optional[int] = 16 * MiB,
             aggregate="auto", events: Sequence = (), feedback: bool = True,
             start_s: float = 0.0, epoch: Optional[int] = None) -> SimResult:
    """Run ``schedule`` on ``cluster``.

    ``policy``: one stateless policy object for every rank (None: single
    plane); or ``policy_factory(rank)``: one controller per rank, as in real
    runs. A policy has ``decide``, ``on_chunk`` and ``on_stage``.
    ``start_s``: the clock at the operation's start (timed events use the
    same clock), so controllers can live across back-to-back operations;
    ``epoch``: the operation's index among them, the clock the engine's ranks
    share (PathController.decide: re-probes fall on a grid of it).
    Returns the operation's duration in ``time_s``.
    """
    if policy is not None and policy_factory is not None:
        raise ValueError("give policy or policy_factory, not both")
    if policy_factory is None:
        shared = policy if policy is not None else FixedShare(0.0)
        policy_for = lambda rank: shared  # noqa: E731
    else:
        policy_for = policy_factory
    run = ScheduleRun(schedule, cluster, policy_for, itemsize=itemsize, chunk_bytes=chunk_bytes,
                      window_bytes=window_bytes, aggregate=aggregate, events=events, feedback=feedback,
                      start_s=start_s, epoch=epoch)
    return run.run()
