"""PathController: per-stage split between the 'up' and 'out' planes.

Pure logic: no I/O and no clock. Every method takes the time it should
believe, so tests drive it with synthetic clocks and the simulator drives the
same object the engine does.

One decision per stage (a coflow): estimates -> coflow split -> fallbacks
and probes -> hysteresis and bounded steps -> QoS caps -> aligned byte
boundaries and per-plane windows. Realised stage times come back through
``on_stage``; they are the only evidence used to decide that a second plane
hurts (planes that share CPU, PCIe or memory), never a rule keyed on
transport or host names. See docs/controller.md for the equations.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import struct
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Mapping, NamedTuple, Optional, Sequence

from . import qos
from .bounded import remember
from .damping import BoundaryDamping
from .estimator import PLANES, Estimator, EstimateView, PathEstimate, window_bytes
from .split import FlowDemand, PathModel, SplitFlow, finish_times, solve_coflow

KiB = 1024


def _default_prior_rate() -> dict[str, float]:
    # Measured on the development machines (shared/reference/environment.md):
    # shm ~5 GB/s, tcp on loopback ~0.7 GB/s. Only the first decision uses them.
    return {"up": 5e9, "out": 0.7e9}


def _default_prior_delay() -> dict[str, float]:
    # Half round trips of an 8-byte message measured there: 14 us and 29 us.
    return {"up": 14e-6, "out": 29e-6}


@dataclass
class ControlConfig:
    """Controller constants. Every default is explained in docs/controller.md."""

    # Fallback: multipath=False is exactly a one-plane library (in-domain flows
    # on ``single_plane``, nothing borrowed, no stealing).
    multipath: bool = True
    single_plane: str = "up"
    # Stages below this go whole to the plane predicted fastest (NIMBLE turns
    # multipath off at <= 1 MB too). 256 KiB takes 25-50 us at 5-10 GB/s, about
    # one scale-out round trip; on the 2-core machines here setup and noise
    # swamped the gain up to ~1 MiB, and probes at that size misled the
    # controller into re-adding a plane that hurt (0.67x at 512 KiB).
    min_multipath_bytes: int = 1024 * KiB
    # Ranks off a stage's critical path aim this much below the stage time
    # (estimates run a few % optimistic: the max filter's noise bias).
    coflow_slack: float = 0.05
    # Whether another rank's dropped planes (from its piggybacked flags) bind
    # its flows in our coflow solve. Off: a rank that dropped 'out' would pin
    # the whole stage to its all-'up' time, every other rank would then see no
    # gain in probing 'out' either, and no rank could ever re-add it alone
    # (measured on the testbed: adaptive stuck on 'up'). Other ranks' flows
    # enter with the split their estimates make best.
    coflow_respects_remote_drops: bool = False
    # QoS on borrowed scale-out capacity (see qos.py).
    out_cap_share: float = 1.0
    out_cap_rate_Bps: Optional[float] = None
    # Stability: keep the previous share inside the band; move at most
    # max_step per decision outside it.
    hysteresis: float = 0.05
    max_step: float = 0.2
    # A split keeps its previous whole-chunk boundary while that is one of the
    # target's two neighbours and predicted within this of the other (see
    # _whole_chunks): one chunk of a stage's flow moves its time by ~8% on the
    # testbed, so 0.05 let estimate noise flip between the two.
    chunk_hysteresis: float = 0.10
    # Flap damping of that boundary (damping.py): two reversals within this many
    # decisions of the flow damp it, and a move to more bytes on 'out' then waits
    # until step_down_samples + 2 decisions in a row ask for it. 0: off.
    flap_half_life: float = 64.0
    # Negative-value detection and re-probing.
    probe_every: int = 16          # decisions between re-probes of a dropped plane (and between checks)
    # Start with 'out' dropped for in-domain flows and let a probe bring it in:
    # where the planes share a CPU or a link, the second plane never costs more
    # than its probes. The communicator sets it; the pure default stays off.
    start_on_one_plane: bool = False
    probe_backoff_max: int = 8     # failed probes double the interval up to probe_every * this ...
    # ... or, where stages are short, until probes are this far apart in time
    # (at most probe_every * SHORT_BACKOFF_MAX operations): a probe costs a few
    # operations, and at 2 MiB on the default planes one in 128 was most of what
    # a settled adaptive loop paid over 'up'. 0 turns it off.
    probe_spacing_s: float = 0.25
    probe_share: float = 0.34      # largest share a probe puts on the dropped plane (the model share, up to this)
    # Joint stages must beat one plane alone by this much, or the plane is
    # dropped: equal times mean fewer bytes belong on the shared network, and
    # 5% is above the run-to-run noise of a busy 2-core machine (at 1% the
    # shared-bottleneck testbed kept both planes about half the time).
    min_gain: float = 0.05
    harm_margin: float = 0.05      # a probe this much slower than solo backs the next probe off
    readd_margin: float = 0.08     # a probe this much faster than solo brings the plane back (> min_gain: a gap)
    solo_fresh_decisions: int = 4  # a solo record this recent may condemn a plane without a new check
    accuracy_band: float = 0.15    # judge a stage only if |realised/predicted - 1| <= this
    # Windows: g * B * R rounded up to chunks, at least 2 chunks.
    window_gain: float = 2.0
    chunk_bytes: int = 512 * KiB
    # Estimator filters (BBR: ~10 rounds; here chunk samples and seconds).
    filter_samples: int = 32       # chunk samples the max/min filters remember (8 rounds)
    filter_round_chunks: int = 4   # chunk samples averaged into one delivered-rate round
    filter_max_age_s: float = 2.0
    step_down_ratio: float = 0.75
    step_down_samples: int = 4
    prior_rate_Bps: dict = field(default_factory=_default_prior_rate)
    prior_delay_s: dict = field(default_factory=_default_prior_delay)
    # The planes' line rates where the user states them (MPCCS_PLANE_RATES): no
    # estimate reads above them. Delivery samples err fast when a peer's data
    # waited in the receive buffers; on the 2x2 testbed at 1:1 (62.5 MB/s links)
    # a 64 MiB hierarchical reduce_scatter read 'out' at up to 250 MB/s, and ranks
    # of one operation put 50% of their in-domain bytes there instead of 25%
    # (0.55-0.62 s against 0.43-0.45). None: no ceiling.
    rate_ceiling_Bps: Optional[dict] = None
    # Decide for this rank from the estimates it last exported (what every
    # other rank sees) rather than from fresher local ones.
    decide_from_exported_view: bool = True

    def __post_init__(self):
        if self.single_plane not in PLANES:
            raise ValueError(f"single_plane must be one of {PLANES}, got {self.single_plane!r}")
        if not 0.0 <= self.out_cap_share <= 1.0:
            raise ValueError(f"out_cap_share must lie in [0, 1], got {self.out_cap_share}")
        if self.out_cap_rate_Bps is not None and self.out_cap_rate_Bps < 0:
            raise ValueError("out_cap_rate_Bps must be >= 0")
        for name in ("hysteresis", "chunk_hysteresis", "max_step", "probe_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {value}")
        if self.max_step <= 0:
            raise ValueError("max_step must be > 0")
        for name in ("probe_every", "probe_backoff_max", "chunk_bytes", "filter_samples", "step_down_samples",
                     "filter_round_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.probe_backoff_max > 255:
            raise ValueError("probe_backoff_max must be <= 255 (it travels in one byte)")
        if self.probe_spacing_s < 0:
            raise ValueError("probe_spacing_s must be >= 0")
        if self.coflow_slack < 0:
            raise ValueError("coflow_slack must be >= 0")
        if self.window_gain <= 0:
            raise ValueError("window_gain must be > 0")
        if self.flap_half_life < 0:
            raise ValueError("flap_half_life must be >= 0 (0: no flap damping)")
        for plane in PLANES:
            if self.prior_rate_Bps.get(plane, 0) <= 0 or self.prior_delay_s.get(plane, -1) < 0:
                raise ValueError(f"prior_rate_Bps/prior_delay_s need a positive value for plane {plane!r}")


@dataclass
class StageDecision:
    up_bytes: dict[int, int]          # flow_id -> bytes carried by 'up' (a prefix of the flow)
    window_bytes: dict[str, int]      # plane -> max bytes in flight on that plane
    steal: bool                       # may a plane that runs ahead take the other's unstarted tail
    out_cap_bytes: dict[int, int]     # flow_id -> hard cap on 'out' bytes, stealing included
    reason: dict                      # JSON-able explanation
    window_by_rank: dict[int, dict[str, int]] = field(default_factory=dict)
    steal_by_rank: dict[int, bool] = field(default_factory=dict)

    def out_bytes(self, flow: FlowDemand) -> int:
        return flow.nbytes - self.up_bytes.get(flow.flow_id, 0)


@dataclass
class _Mode:
    """What a rank does in one decision."""

    kind: str                     # "multipath", "single", "check" (solo diagnostic), "probe"
    plane: Optional[str] = None   # plane run alone (check) or re-probed (probe)
    dropped: frozenset = frozenset()
    cause: str = ""               # why a check was asked for (the trace's why)


MISPREDICTIONS_BEFORE_JUDGING = 3
# A harm verdict is the median over the last JOINT_STAGES_KEPT judged joint
# stages and needs JOINT_STAGES_TO_DROP of them. With two (the first version)
# one slow stage of two dropped 'out' under a background flow where it paid
# 15-20% (testbed series: judged stages of 74 and 58 ms against a 60 ms solo).
JOINT_STAGES_KEPT = 5
JOINT_STAGES_TO_DROP = 3
SOLO_OVER_DELIVERY_MAX = 1.2  # a solo record's rate: at most this times the plane's delivery rate (_record_solo)
UNUSED_STAGES_BEFORE_DROP = 4  # see PathController._note_unused
SHORT_BACKOFF_MAX = 32  # probe_spacing_s backs probes off to at most probe_every * this operations (one byte)
# A probe slower than solo backs the next one off only when the solo time it
# was judged against rests on this many comparable records: one record after a
# regime change is no reference. Under CPU stalls the records of a 16 MiB
# testbed all_gather jumped 275 -> 171 -> 263 MB/s (each clearing the queue);
# a probe judged harmful against the last one doubled the interval to 32, the
# peer that had re-added followed the drop, and the whole 64 MiB sweep after
# the stall stayed on 'up' (0.99x up, 0.66x the sum).
SOLO_RECORDS_FOR_HARM = 2
# A re-add is checked against a fresh solo stage READD_CHECK_AFTER operations
# after the grid point of the probe that brought it (every rank that re-added
# from that probe checks in the same operation: a check stage is a solo record
# only when the peers send on one plane too). The probe was judged against the
# records of the operations before it, and on a link that was warming up those
# were slow: on the shared-bottleneck testbed under a CPU hog the first solo
# stages took 165-185 ms, the probe 139, and 'up' alone 135-140 ms later on; the
# joint stages after the re-add (129-146 ms) read 0.78x of the stale records, so
# the plane that did not pay stayed in use (5 of 12 runs).
READD_CHECK_AFTER = 4
# The check runs for this many operations in a row. A ring's stages share one
# decision per operation (CollectiveOp._plan_stage), so a 2-rank all_reduce
# has one judged stage per operation: with one check operation, a CPU stall
# in it on both ranks read as the split's gain, and both kept a split that
# did not pay (2 runs of 24 under a bursty CPU hog).
READD_CHECK_OPS = 2
FIRST_PROBE_AFTER = 4  # decisions (epochs) before the first probe of a plane that starts dropped: the median of 3 solo stages is the reference, not a cold first one


class _SoloRecord(NamedTuple):
    """One stage a rank ran on one plane alone."""

    k: int             # decision count
    rate_Bps: float    # bytes over the stage's time less latency_s
    nbytes: int
    latency_s: float   # the plane's latency estimate then: a solo time is rebuilt with it (_solo_time)


@dataclass
class _RankState:
    """Negative-value bookkeeping of one sending rank, from its realised stages."""

    dropped: set = field(default_factory=set)
    solo: dict = field(default_factory=lambda: {p: deque(maxlen=5) for p in PLANES})  # _SoloRecord
    pending_check: Optional[str] = None
    check_cause: str = ""  # what raised pending_check: the trace says why each check ran
    joint: deque = field(default_factory=lambda: deque(maxlen=JOINT_STAGES_KEPT))  # judged joint stages: (bytes, s)
    regime_at_joint: int = 0
    mispredicted: int = 0  # consecutive settled joint stages the estimates mispredicted
    last_check_k: float = -math.inf
    regime_at_check: int = 0
    probe_interval: int = 0
    next_probe_k: float = math.inf
    last_probe_epoch: Optional[int] = None
    confirm_epoch: Optional[int] = None  # an inconclusive probe is repeated once, in the next operation
    confirming: bool = False  # the probe in flight is that repeat
    readd_epoch: Optional[int] = None  # epoch of the probe that last brought a plane back
    harmless_probe_epoch: Optional[int] = None  # epoch of this rank's last probe that showed no harm
    probe_grid_epoch: Optional[int] = None  # the grid point of the last probe (its epoch, or the one before for a repeat)
    last_probe_stage: Optional[tuple] = None  # (bytes, s) of the last probe's stage (a re-add's check judges it)
    readd_check_epoch: Optional[int] = None  # a re-add is checked from this operation on (READD_CHECK_AFTER) ...
    readd_check_op: Optional[int] = None  # ... from the first one that has a judgeable stage: READD_CHECK_OPS run solo
    readd_checks: list = field(default_factory=list)  # (bytes, s) of the check operations' stages so far
    readd_keep: Optional[str] = None  # the plane kept while the re-added one was dropped: the check runs on it
    unused_stages: int = 0  # consecutive multipath stages that gave a usable plane nothing
    checks: int = 0
    drops: int = 0
    probes: int = 0
    readds: int = 0

    def to_json(self) -> dict:
        return {
            "dropped": sorted(self.dropped),
            "solo_ref_Bps": {p: (_median_rate(q) if q else None) for p, q in self.solo.items()},
            "pending_check": self.pending_check,
            "probe_interval": self.probe_interval,
            "next_probe": None if math.isinf(self.next_probe_k) else self.next_probe_k,
            "checks": self.checks, "drops": self.drops, "probes": self.probes, "readds": self.readds,
        }


# Blob: header (version, dropped-plane bits, probe grid, entry count), then per path the
# exporting rank measured one entry (plane index, peer, the path's regime
# count modulo 256, rate B/s, fixed delay s) = 14 bytes. The plane byte's top
# bit says the path runs from the peer to the exporter (measured at the
# receiver, what the engine reports); without it the path runs from the
# exporter to the peer (a sender's own completions). The probe grid byte is
# the exporter's probe grid / probe_every (at most probe_backoff_max), 0 when
# it drops nothing (no probe to announce); every rank runs the same probe_every.
_BLOB_VERSION = 3
_INCOMING = 0x80
_HDR = struct.Struct("<BBH")
_ENTRY = struct.Struct("<BIBff")


def _entry(reporter: int, path: tuple[int, str, int], rate: float, lat: float, regime: int) -> bytes:
    """One blob entry for ``path`` (src, plane, dst), as rank ``reporter`` exports it."""
    src, plane, dst = path
    if dst == reporter:
        return _ENTRY.pack(PLANES.index(plane) | _INCOMING, src, regime, rate, lat)
    return _ENTRY.pack(PLANES.index(plane), dst, regime, rate, lat)
# While 'out' may not carry bytes (controller.may_use), an export reuses the
# previous one's entries for this many calls unless a plane's rate stepped (the
# estimator's regime count moved) or the dropped flags changed: computing them
# is ~30 us of Python, 4% of a 2 MiB all_reduce on shared memory.
EXPORT_REUSE_CALLS = 4
# A settled operation (controller.settled) skips planning only if it takes less
# than this on 'up': ~50 us of Python is 7% of a 2 MiB all_reduce on shared
# memory, and nothing next to a 60 ms testbed operation.
SETTLED_MAX_S = 0.010


class PathController:
    def __init__(self, config: Optional[ControlConfig] = None, rank: Optional[int] = None):
        """``rank``: the rank this controller runs in. Left out, it is taken from
        the flows ``decide`` sees when they all leave from one rank (an engine
        deciding its own sends), else 0."""
        self.config = config if config is not None else ControlConfig()
        self._rank = rank
        self._inferred_rank: Optional[int] = None
        cfg = self.config
        self.estimator = Estimator(
            cfg.prior_rate_Bps, cfg.prior_delay_s,
            max_samples=cfg.filter_samples, max_age_s=cfg.filter_max_age_s,
            drop_ratio=cfg.step_down_ratio, drop_samples=cfg.step_down_samples,
            round_samples=cfg.filter_round_chunks, rate_ceiling_Bps=cfg.rate_ceiling_Bps,
        )
        self._k = 0                                   # decisions made
        self._epoch: Optional[int] = None             # the shared clock, when the engine gives one
        self._states: dict[int, _RankState] = {}      # ranks whose stages we observe
        self._remote_dropped: dict[int, set] = {}     # other ranks' dropped planes (from blobs)
        self._remote_grid: dict[int, int] = {}        # other ranks' probe grids (from blobs; see probe_grid)
        self._remote_grid_gcd = 0                     # their greatest common divisor (0: none heard)
        self._shares: dict[tuple, float] = {}         # (src, dst, size class) -> share on 'out'
        self._boundaries: dict[tuple, float] = {}     # (src, dst, size class) -> bytes on 'out' after _whole_chunks
        # A move to more bytes on 'out' is taken while damped once it outlasts a
        # spike of the estimate, which the filter keeps until step_down_samples
        # slower samples (next to a paced flow: 4 decisions at 48-55 MB/s
        # against 33-37, and moves that waited 4 came back 3-10 decisions later).
        self._flap_notes: dict[int, str] = {}
        self._flaps = (BoundaryDamping(cfg.flap_half_life, confirm=cfg.step_down_samples + 2)
                       if cfg.flap_half_life > 0 else None)
        self._events: deque = deque(maxlen=64)
        self._events_total = 0  # events ever appended (take_events hands out the ones since its last call)
        self._events_taken = 0
        self._last_reason: Optional[dict] = None
        # The flags this rank last exported and the epoch of the operation whose
        # export first carried them (the last epoch seen if that one had none).
        self._exported_flags: Optional[int] = None
        self._flags_since: Optional[int] = None
        self._export_epoch: Optional[int] = None
        self._export_cache: Optional[tuple] = None    # (calls, flags, regime changes, blob, samples seen, time, grid)
        self._exports = 0
        self._merged: dict[int, bytes] = {}           # the last blob merged from each rank
        self._exported_up_rate: Optional[float] = None  # best 'up' rate in this rank's last export
        self._pipelined_rates: Optional[dict[str, float]] = None  # see split_pipelined_at
        if self.config.start_on_one_plane and rank is not None:
            # 'out' has to earn its place: it starts dropped and is probed
            # after a couple of decisions; a probe that shows a gain re-adds it.
            st = self._states[rank] = _RankState()
            st.dropped = {"out"}
            st.probe_interval = self.config.probe_every
            st.next_probe_k = FIRST_PROBE_AFTER

    def split_pipelined_at(self, rates: Optional[Mapping[str, float]]) -> None:
        """Split a pipelined schedule's stages (those with companions) at these
        per-plane rates, every rank's ports alike, instead of at the estimates;
        None: at the estimates.

        The communicator passes the plan rates where they are measured and agreed
        by every rank, or stated. What a pipelined operation's estimates rest on
        is bytes over the time they were arriving (collective_op._teach_port_rates),
        and a plane its stages do not keep busy reads below its rate there: on
        2 domains of 2 at 1 / 1 Gbit/s the ranks' 'out' read 60-158 MB/s from
        one operation to the next (125 shaped), a rank that read low put fewer
        bytes there and read lower still (one stayed on no chunk of 'out' for 22
        of 32 64 MiB operations), and the ranks of a domain split differently,
        each stage waiting for the one that put more on 'up'. The agreed rates
        are medians over operations and ranks, the same on every rank, and
        follow the planes at each agreement (plan_rates.AgreementClock)."""
        self._pipelined_rates = None if rates is None else {p: float(rates[p]) for p in PLANES}

    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        return self._inferred_rank if self._inferred_rank is not None else 0

    # ------------------------------------------------------------------ decide
    def decide(self, flows: Sequence[FlowDemand], now: float, align: int = 4096,
               chunk_bytes: Optional[int] = None, epoch: Optional[int] = None) -> StageDecision:
        """Split every flow of one stage between the planes, together.

        ``epoch``: a clock every rank shares (the engine passes the count of
        multipath-eligible adaptive operations, identical on all ranks). With
        it, re-probes of a dropped plane happen at epochs on a global grid
        (multiples of the probe interval), so every rank probes in the same
        operation: a stage ends with its slowest rank, and a probe by one rank
        alone can never show the gain of both splitting. Without it (synthetic
        tests), probes are paced by this controller's own decision count.
        """
        cfg = self.config
        if align < 1:
            raise ValueError("align must be >= 1")
        chunk = int(chunk_bytes or cfg.chunk_bytes)
        flows = list(flows)
        _validate(flows)
        self._k += 1
        k = self._k
        by_src: dict[int, list[FlowDemand]] = {}
        for f in flows:
            by_src.setdefault(f.src, []).append(f)
        srcs = sorted(by_src)
        if len(srcs) == 1:
            self._inferred_rank = srcs[0]
        view = self.estimator.view(now, chunk)
        pipelined = any(f.companion for f in flows)  # other channels' stages overlap this one
        at_plan_rates = pipelined and self._pipelined_rates is not None
        if at_plan_rates:
            view = _AtRates(view, self._pipelined_rates)
        ports = {s: {p: view.plane(s, p) for p in PLANES} for s in srcs}
        models = _models(ports)
        caps = qos.share_caps(flows, cfg.out_cap_share, align)
        solo_planes = {s: self._solo_planes(by_src[s], caps) for s in srcs}
        if epoch is not None:
            self._epoch = epoch
        modes = {s: self._mode(s, k, by_src[s], solo_planes[s], epoch) for s in srcs}
        beside = {f.src for f in flows if f.companion}  # ranks whose 'out' other channels load (overlap)
        # what each rank sends in the stage: its flows; companions stand for other channels' load
        sent = {s: sum(f.nbytes for f in fl if not f.companion) for s, fl in by_src.items()}
        allowed = {f.flow_id: self._allowed_planes(f, modes[f.src], view, f.src in beside, sent[f.src])
                   for f in flows}
        split_in = self._split_inputs(flows, allowed, caps, view)
        # With companions (a pipelined schedule) every rank splits for its own balance: its
        # stages overlap the other channels', so bytes it moved to 'up' because another
        # rank's stage ends later stay on its 'up' port for the whole operation (and that
        # rank was often one this rank knew least: docs/controller.md, the coflow's fill).
        slack = math.inf if pipelined else cfg.coflow_slack
        split = solve_coflow(split_in, models, slack)
        rate_cap_time = None
        if cfg.out_cap_rate_Bps is not None:
            # The stage as it runs with 'out' paced to the cap: both planes
            # finish together at that time, and 'out' carries the cap's bytes
            # in it. Timed from the uncapped split instead, the budget followed
            # 'out''s estimate: a never-measured 'out' (its 700 MB/s prior)
            # made a 67 ms testbed stage look like 10 ms, its budget (315 KB)
            # rounded to no chunk at all, probes never measured 'out', and the
            # plane stayed dropped for good (testbed series, 250 Mbit/s cap).
            capped = solve_coflow(split_in, _models(ports, cfg.out_cap_rate_Bps), slack)
            rate_cap_time = capped.stage_time_s
            caps = qos.combine(caps, qos.rate_caps(flows, cfg.out_cap_rate_Bps, rate_cap_time, align))
            split_in = self._split_inputs(flows, allowed, caps, view)
            split = solve_coflow(split_in, models, slack)

        out_real, settled = {}, {s: True for s in srcs}
        self._flap_notes = {}  # flow id -> "damped" / "held" (a move refused), for the reason
        links_by_flow = {x.flow_id: x.links for x in split_in}
        loads_beside = _loads_beside(flows, split.out_bytes)
        timing = {f.flow_id: _FlowTiming(models[f.src], links_by_flow[f.flow_id], loads_beside[f.flow_id])
                  for f in flows}
        for f in flows:
            x, ok = self._stabilise(f, split.out_bytes.get(f.flow_id, 0.0), modes[f.src], allowed[f.flow_id],
                                    timing[f.flow_id])
            out_real[f.flow_id] = x
            settled[f.src] &= ok
        for f in flows:
            out_real[f.flow_id] = self._apply_probe(f, out_real[f.flow_id], modes[f.src], allowed[f.flow_id])
            out_real[f.flow_id] = self._whole_chunks(f, out_real[f.flow_id], modes[f.src], allowed[f.flow_id],
                                                     timing[f.flow_id])

        up_bytes, out_cap = {}, {}
        for f in flows:
            up_bytes[f.flow_id] = _aligned_up_bytes(f.nbytes, out_real[f.flow_id], caps[f.flow_id], align)
            out_cap[f.flow_id] = self._steal_cap(f, up_bytes[f.flow_id], caps[f.flow_id], modes[f.src])

        final_out = {f.flow_id: float(f.nbytes - up_bytes[f.flow_id]) for f in flows}
        finish = finish_times(split_in, models, final_out)
        window_by_rank = {s: {p: window_bytes(ports[s][p].rate_Bps, ports[s][p].base_delay_s, chunk,
                                              cfg.window_gain) for p in PLANES} for s in srcs}
        steal_by_rank = {s: self._steal_allowed(modes[s]) for s in srcs}
        reason = self._reason(k, now, chunk, align, by_src, split, finish, ports, modes, settled,
                              up_bytes, caps, split_in, solo_planes)
        reason["rate_cap_stage_time_s"] = rate_cap_time
        reason["split_rates_Bps"] = dict(self._pipelined_rates) if at_plan_rates else None  # None: the estimates
        decision = StageDecision(
            up_bytes=up_bytes,
            window_bytes=self._windows_for_me(window_by_rank, chunk),
            steal=all(steal_by_rank.values()) if steal_by_rank else cfg.multipath,
            out_cap_bytes=out_cap,
            reason=reason,
            window_by_rank=window_by_rank,
            steal_by_rank=steal_by_rank,
        )
        self._last_reason = reason
        return decision

    def _solo_planes(self, flows: Sequence[FlowDemand], caps: Mapping[int, int]) -> tuple[str, ...]:
        """Planes allowed to carry all of a rank's in-domain bytes alone (QoS may forbid 'out')."""
        capped = self.config.out_cap_rate_Bps is not None or any(
            qos.is_borrowable(f) and caps[f.flow_id] < f.nbytes for f in flows)
        return ("up",) if capped else PLANES

    def _mode(self, src: int, k: int, flows: Sequence[FlowDemand], solo_planes: tuple[str, ...],
              epoch: Optional[int] = None) -> _Mode:
        """Multipath, or one of the measurement stages (check, probe) for this rank."""
        cfg = self.config
        if not cfg.multipath:
            return _Mode("single")
        st = self._states.get(src)
        if st is None:
            remote = self._remote_dropped.get(src, ()) if cfg.coflow_respects_remote_drops else ()
            return _Mode("multipath", dropped=frozenset(remote))
        dropped = frozenset(st.dropped)
        if not _judgeable(flows, cfg.min_multipath_bytes):
            return _Mode("multipath", dropped=dropped)
        if self._readd_check_due(st, epoch):
            st.readd_check_epoch, st.readd_check_op, st.readd_checks = None, epoch, []
        if self._in_readd_check(st, epoch) and not st.dropped:
            st.pending_check = st.readd_keep or solo_planes[0]
            st.check_cause = "a re-added plane's check operations"
        if st.pending_check is not None:
            plane, st.pending_check = st.pending_check, None
            if plane not in solo_planes:
                plane = solo_planes[0]
            st.last_check_k = k
            st.checks += 1
            return _Mode("check", plane=plane, dropped=dropped, cause=st.check_cause)
        if st.dropped and self._probe_due(st, k, epoch):
            plane = sorted(st.dropped)[0]  # one plane at a time
            st.confirming = st.confirm_epoch is not None and epoch == st.confirm_epoch
            st.probe_grid_epoch = epoch - 1 if st.confirming and epoch is not None else epoch
            st.confirm_epoch = None
            st.next_probe_k = k + max(1, st.probe_interval)
            st.last_probe_epoch = epoch
            st.probes += 1
            return _Mode("probe", plane=plane, dropped=dropped)
        return _Mode("multipath", dropped=dropped)

    @staticmethod
    def _readd_check_due(st: "_RankState", epoch: Optional[int]) -> bool:
        """A re-add's check operations begin here (READD_CHECK_AFTER): the plane is still
        in use and this is the first operation with a judgeable stage from the check's
        epoch on; every judgeable stage of it and the next READD_CHECK_OPS - 1 then runs
        alone (_mode)."""
        return (st.readd_check_epoch is not None and epoch is not None and epoch >= st.readd_check_epoch
                and not st.dropped)

    @staticmethod
    def _in_readd_check(st: "_RankState", epoch: Optional[int]) -> bool:
        """Operation ``epoch`` is one of a re-add's READD_CHECK_OPS check operations."""
        return (st.readd_check_op is not None and epoch is not None
                and st.readd_check_op <= epoch < st.readd_check_op + READD_CHECK_OPS)

    def _probe_due(self, st: "_RankState", k: int, epoch: Optional[int]) -> bool:
        if epoch is None:
            return k >= st.next_probe_k
        if epoch == st.last_probe_epoch:
            return False  # one probe per operation: its first decision
        if epoch == st.confirm_epoch:
            return True
        if st.probes == 0 and epoch >= FIRST_PROBE_AFTER and st.readds == 0 and st.drops == 0:
            return epoch == FIRST_PROBE_AFTER or epoch % self.config.probe_every == 0
        return epoch % self._joint_probe_interval(st) == 0

    def _joint_probe_interval(self, st: "_RankState") -> int:
        """This rank's probe interval, or the coarser grid of a peer that has the
        same plane dropped: a probe by one rank alone cannot show the gain of
        both splitting (the stage ends with the peer's one-plane flows), so
        ranks probe at the multiples of the coarsest grid only. A rank whose
        drop followed a peer's (its interval reset to probe_every) probed alone
        at every odd multiple of it, ties that the testbed's 64 MiB operations
        paid for. Grids are probe_every times powers of two: a multiple of the
        coarsest is one of every rank's own, which is what each exports."""
        interval = max(1, st.probe_interval)
        plane = sorted(st.dropped)[0]
        for rank, dropped in self._remote_dropped.items():
            if rank != self.rank and plane in dropped:
                interval = max(interval, self._remote_grid.get(rank, interval))
        return interval

    def probe_due(self, epoch: Optional[int]) -> bool:
        """This rank's next decision at ``epoch`` would be a probe (a cached decision must not stand in)."""
        st = self._states.get(self.rank)
        return bool(st is not None and st.dropped and epoch is not None and self._probe_due(st, self._k + 1, epoch))

    def sends_on_one_plane(self, epoch: Optional[int]) -> bool:
        """This rank's own flows of operation ``epoch`` will go on one plane only:
        it has a plane dropped and no probe of it is due (a check stage runs one
        plane alone too). Peers may still split their flows to us. The engine
        then cuts whole flows, as in a settled operation: the planned ones
        around probe epochs took 1.9x a settled one at 2 MiB on the default
        planes, largely in per-chunk work."""
        if epoch is None:
            return False
        if not self.config.multipath:
            return True
        st = self._states.get(self.rank)
        return st is not None and bool(st.dropped) and not self.probe_due(epoch)

    def probe_grid(self) -> int:
        """This rank probes a dropped plane only at epochs that are multiples
        of this (_probe_due; its repeat follows one epoch later): probe_every
        until the first probe, then its backed-off interval. Exported with the
        estimates, so that operations between the probes of every rank can run
        settled (may_use): with one shared grid of probe_every, 4 operations in
        16 were planned (1.9x the time of a settled one at 2 MiB on the default
        planes) long after failed probes had backed off to every 128."""
        st = self._states.get(self.rank)
        return self.config.probe_every if st is None else _probe_grid(st, self.config.probe_every)

    def _allowed_planes(self, f: FlowDemand, mode: _Mode, view: EstimateView,
                        out_loaded_beside: bool, sender_bytes: int) -> tuple[str, ...]:
        """The planes flow ``f`` may use. ``out_loaded_beside``: the stage has
        companions at f's sender (other channels' load on its 'out').
        ``sender_bytes``: what f's sender sends in the stage (its flows, not
        companions), which min_multipath_bytes is held against: the flows
        share the sender's ports, so their sum is what a second plane would
        split. Held against each flow, the two 512 KiB flows
        each rank sends in an in-domain stage of a 16 MiB hierarchical
        reduce_scatter (2x2, 8 channels) stayed on 'up': 0.99x 'up', where a
        fixed 0.8 split reads 1.30x."""
        cfg = self.config
        planes = tuple(p for p in PLANES if p in f.planes)
        if len(planes) < 2:
            return planes  # a flow with one plane keeps it whatever else happens
        if mode.kind == "single":
            return (cfg.single_plane,)
        if mode.kind == "check":
            return (mode.plane,)
        usable = tuple(p for p in planes if p not in mode.dropped or (mode.kind == "probe" and p == mode.plane))
        if not usable:
            usable = planes
        if sender_bytes < cfg.min_multipath_bytes and len(usable) > 1:
            if out_loaded_beside:
                # Timed on its own, 'out' may look faster than it is: other channels'
                # cross-domain steps use it at the same time. On the 2x2 testbed at 1:1
                # a 16 MiB hierarchical reduce_scatter's 512 KiB in-domain flows all went
                # to 'out' and took 1.5x 'up' alone. The configured plane, as for a
                # small stage (flows.Splitter.plan).
                return (cfg.single_plane,) if cfg.single_plane in usable else usable[:1]
            # Small: the single plane that finishes it first on its own.
            times = {p: _path_model(view, f.src, p, f.dst).time(f.nbytes) for p in usable}
            return (min(usable, key=lambda p: (times[p], PLANES.index(p))),)
        return usable

    def _split_inputs(self, flows, allowed, caps, view: EstimateView) -> list[SplitFlow]:
        return [
            SplitFlow(f.flow_id, f.src, f.nbytes,
                      {p: _path_model(view, f.src, p, f.dst) for p in allowed[f.flow_id]},
                      float(caps[f.flow_id]))
            for f in flows
        ]

    def _stabilise(self, f: FlowDemand, target_out: float, mode: _Mode,
                   allowed: tuple[str, ...], timing: "_FlowTiming") -> tuple[float, bool]:
        """Hysteresis band and bounded step on the flow's share on 'out'.

        The previous share is kept while it is within ``hysteresis`` of the
        target both as a share and in predicted time (the flow's finish on its
        sender's ports, a + (beside + x) / B per plane; see _FlowTiming). The
        time test matters when the planes are far apart: with 'out' at a
        tenth of 'up', a share 3 points too high
        already makes the flow 30 % slower. Outside the band the share moves
        toward the target by at most ``max_step``.

        Only regular multipath decisions of large in-domain flows are smoothed;
        forced placements (single plane, dropped plane, small flow, check)
        jump, and a dropped plane leaves the remembered share at its forced
        value so that re-adding it ramps up from there.
        """
        cfg = self.config
        n = f.nbytes
        if n <= 0 or not qos.is_borrowable(f) or n < cfg.min_multipath_bytes:
            return target_out, True
        key = _size_class(f)
        if mode.kind in ("check", "probe", "single"):
            return target_out, True
        target = target_out / n
        if len(allowed) < 2:
            remember(self._shares, key, target)
            return target_out, True
        prev = self._shares.get(key)

        def flow_time(share: float) -> float:
            return timing.finish(n, n * share)

        def in_band(share: float) -> bool:
            return (abs(target - share) <= cfg.hysteresis
                    and flow_time(share) <= flow_time(target) * (1 + cfg.hysteresis))

        if prev is None:
            share = target
        elif in_band(prev):
            share = prev
        else:
            share = prev + max(-cfg.max_step, min(cfg.max_step, target - prev))
        remember(self._shares, key, share)
        return share * n, in_band(share)

    def _whole_chunks(self, f: FlowDemand, out: float, mode: _Mode, allowed: tuple[str, ...],
                      timing: "_FlowTiming") -> float:
        """The flow's bytes on 'out' moved to a neighbouring whole-chunk boundary:
        the one chosen last time while the model predicts it within
        ``chunk_hysteresis`` of the other, else the one it predicts finishes
        the flow sooner.

        The engine sends whole chunks ('up' takes a prefix of them), so a split
        lands on a multiple of the chunk; rounded to the nearest, a target
        between two multiples lands on whichever is closer in bytes, not in
        time. Next to a competing flow a 16 MiB all_reduce's split alternated
        between 1.5 and 2 MiB of 8 on 'out' (testbed series): 2 MiB overran the
        loaded link by 5-25%, 1.5 MiB left 'up' a few ms longer. Where the two
        are predicted within a few percent, the estimates' noise alone would
        flip between them: with 0.05 the loaded rank still moved to the other
        boundary and back 7-9 times in ~86 operations, with 0.10 1-3 times
        (testbed series, alternating runs). A boundary two chunks off the
        target is never kept, so the cost is bounded by one chunk and 10%.
        Only a regular multipath split moves; probes and checks keep their
        measured amounts. A boundary that flaps is damped (damping.py): its
        moves to more bytes on 'out' wait until they persist.

        A boundary is timed on the sender's ports, with the bytes its other
        flows put on each plane (``beside``). Timed on the flow's own links, the
        boundary that balanced the flow alone won: each 1 MiB in-domain flow of
        a 16 MiB hierarchical all_reduce (2 domains of 2, 1:1) beside a 512 KiB
        cross-domain flow on 'out' went 512 KiB on 'out' against a target of
        228 KiB (stages 1.3x their plan; operations as slow as 'up' alone).

        Where the model gives both planes bytes, each keeps at least one chunk:
        rounded to none, a plane's path to this peer gets no samples, and its
        estimate stays where it was when the split left it. On the 2x2 testbed
        (1 / 1 Gbit/s) a rank's 'out' estimate fell from 122 to 76 MB/s (125
        shaped) in one operation, its split went to no chunk on 'out', and it
        stayed there in 22 of the 32 64 MiB operations that followed, each at
        'up''s time. One chunk costs at most one chunk's time, and its samples
        can bring the estimate back.
        """
        q, n = f.quantum_bytes, f.nbytes
        if q <= 0 or n < 2 * q or mode.kind != "multipath" or len(allowed) < 2 or not 0 < out < n:
            return out
        up_chunks = (n - out) / q
        # At least one chunk on each plane (the docstring's last paragraph): 0 < out < n
        # and n >= 2q leave at least one of the two neighbours in 1..last.
        last = math.ceil(n / q) - 1
        candidates = sorted({float(n - k * q) for k in (math.floor(up_chunks), math.ceil(up_chunks)) if 1 <= k <= last})

        def flow_time(x: float) -> float:
            return timing.finish(n, x)

        key = _size_class(f)
        best = min(candidates, key=lambda x: (flow_time(x), abs(x - out)))
        prev = self._boundaries.get(key)
        if prev in candidates and flow_time(prev) <= flow_time(best) * (1 + self.config.chunk_hysteresis):
            best = prev
        if self._flaps is not None:
            picked, best = best, self._flaps.choose(key, prev, best)
            if self._flaps.damped(key):
                self._flap_notes[f.flow_id] = "held" if best != picked else "damped"
        remember(self._boundaries, key, best)
        return best

    def _apply_probe(self, f: FlowDemand, out: float, mode: _Mode, allowed: tuple[str, ...]) -> float:
        """A re-probe puts a small share on the dropped plane.

        The share is what the model would give the plane (so a probe of a
        recovered plane is faster than one plane alone, not slower because
        the probe overshot), clamped to [probe_share / 4, probe_share].
        """
        if mode.kind != "probe" or len(allowed) < 2 or not qos.is_borrowable(f):
            return out
        n = f.nbytes
        if n < self.config.min_multipath_bytes:
            return out
        model_share = (out if mode.plane == "out" else n - out) / n
        share = min(self.config.probe_share, max(self.config.probe_share / 4, model_share))
        return share * n if mode.plane == "out" else n - share * n

    def _steal_cap(self, f: FlowDemand, up: int, cap: int, mode: _Mode) -> int:
        """QoS cap, tightened to 0 where the controller decided 'out' must not carry the flow."""
        if not qos.is_borrowable(f):
            return cap if "out" in f.planes else 0
        if mode.kind == "single" or f.nbytes - up == 0:
            return 0
        return cap

    def _steal_allowed(self, mode: _Mode) -> bool:
        # 'up' has no cap in the contract, so stealing is off whenever 'up' must
        # stay idle: up dropped, or a solo measurement on 'out'.
        if mode.kind == "single":
            return False
        if "up" in mode.dropped:
            return False
        return not (mode.kind == "check" and mode.plane == "out")

    def _windows_for_me(self, window_by_rank: dict[int, dict[str, int]], chunk: int) -> dict[str, int]:
        if self.rank in window_by_rank:
            return dict(window_by_rank[self.rank])
        if not window_by_rank:
            return {p: 2 * chunk for p in PLANES}
        return {p: max(w[p] for w in window_by_rank.values()) for p in PLANES}

    def _reason(self, k, now, chunk, align, by_src, split, finish, ports, modes, settled,
                up_bytes, caps, split_in, solo_planes) -> dict:
        cfg = self.config
        ranks = {}
        in_by_src: dict[int, list[SplitFlow]] = {}
        for x in split_in:
            in_by_src.setdefault(x.src, []).append(x)
        flows = [f for fl in by_src.values() for f in fl]
        for s, mode in modes.items():
            own = by_src[s]
            own_in = in_by_src.get(s, [])
            single = self._single_plane_times(own, own_in, ports[s], s)
            bytes_by_plane = {"up": sum(up_bytes[f.flow_id] for f in own),
                              "out": sum(f.nbytes - up_bytes[f.flow_id] for f in own)}
            why = []
            if mode.dropped:
                why.append(f"dropped {sorted(mode.dropped)}: realised joint stages slower than one plane alone")
            if mode.kind == "check":
                why.append(f"check: one stage on {mode.plane} alone to measure its solo rate ({mode.cause})")
            if mode.kind == "probe":
                why.append(f"probe: {cfg.probe_share:.3f} of each flow on dropped plane {mode.plane}")
            if any(0 < f.nbytes < cfg.min_multipath_bytes and qos.is_borrowable(f) for f in own):
                why.append(f"flows under {cfg.min_multipath_bytes} B on one plane")
            if any(qos.is_borrowable(f) and caps[f.flow_id] < f.nbytes for f in own):
                why.append("QoS cap on borrowed 'out' bytes")
            ranks[str(s)] = {
                "mode": mode.kind,
                "plane": mode.plane,
                "dropped": sorted(mode.dropped),
                "judgeable": _judgeable(own, cfg.min_multipath_bytes),
                # Predictions from priors say nothing about the planes: never judged.
                "measured": all(ports[s][p].measured for p in PLANES if bytes_by_plane[p] > 0),
                "settled": settled[s],
                "pred_s": max(finish.get(s, {}).values(), default=0.0),
                "finish_s": finish.get(s, {}),
                "single_s": single,
                "best_single": min(single, key=single.get) if single else None,
                "solo_planes": list(solo_planes[s]),
                "est": {p: {"rate_Bps": e.rate_Bps, "latency_s": e.latency_s, "measured": e.measured}
                        for p, e in ports[s].items()},
                "bytes": bytes_by_plane,
                "why": why,
            }
        reason = {
            "decision": k,
            "now": now,
            "chunk_bytes": chunk,
            "align": align,
            "stage_time_s": max((r["pred_s"] for r in ranks.values()), default=0.0),
            "optimal_stage_time_s": split.stage_time_s,
            "critical_rank": split.critical_src,
            "bytes": sum(f.nbytes for f in flows),
            "out_bytes": sum(f.nbytes - up_bytes[f.flow_id] for f in flows),
            "ranks": ranks,
        }
        if len(flows) <= 64:
            reason["flows"] = {str(f.flow_id): {"target_out": round(split.out_bytes.get(f.flow_id, 0.0)),
                                                "out": f.nbytes - up_bytes[f.flow_id],
                                                "cap": caps[f.flow_id],
                                                **({"flap": self._flap_notes[f.flow_id]}
                                                   if f.flow_id in self._flap_notes else {})}
                                for f in flows}
        return reason

    def _single_plane_times(self, own, own_in, ports, src) -> dict[str, float]:
        """Predicted time of this rank's flows if one plane carried all of them."""
        if not own or not all(qos.is_borrowable(f) for f in own):
            return {}
        models = {src: _models({src: ports})[src]}
        out = {}
        for plane in PLANES:
            flows_on = [SplitFlow(x.flow_id, x.src, x.nbytes, {plane: PathModel(ports[plane].rate_Bps,
                                                                                 ports[plane].latency_s)})
                        for x in own_in]
            placed = {x.flow_id: (float(x.nbytes) if plane == "out" else 0.0) for x in own_in}
            out[plane] = max(finish_times(flows_on, models, placed)[src].values(), default=0.0)
        return out

    # ---------------------------------------------------------------- feedback
    def on_chunk(self, plane: str, peer: int, nbytes: int, t_post: float, t_done: float,
                 src: Optional[int] = None) -> None:
        """One chunk completion seen at a plane's window (``src`` defaults to this rank)."""
        self.estimator.observe(self.rank if src is None else src, plane, peer, nbytes, t_post, t_done)

    def on_delivery(self, plane: str, sender: int, nbytes: int, t_start: float, t_last: float,
                    size_evidence: bool = True, rate_only: bool = False) -> None:
        """Bytes from ``sender`` that arrived here over ``plane`` between
        ``t_start`` and ``t_last``: a sample of the path sender -> this rank.
        Filed under the sender's path and exported for it: a rank that filed
        what it received under its own path *to* the peer took links as
        symmetric, and under load in one direction the two ranks of a pair
        split on each other's numbers (one cut its unloaded link, the other
        kept 31% of its bytes on the loaded one). ``size_evidence``: whether
        the sample's size tells how the path's time grows as a split moves
        bytes onto it (PathEstimator._note_larger): not a probe's (a rate
        measured on a plane idle since its drop), nor a stage whose flow the
        sender sent whole on this one plane (a check, a dropped plane, the
        two-step executor): a split never moves its part there a chunk at a
        time. On the 2.4 / 1.2 Gbit/s testbed a 16 MiB all_reduce's check
        stages sent 8 MiB whole on 'up' at 300 MB/s beside split stages' 5.2
        MB at 340-380 (the tbf bucket's burst counts more in a smaller
        transfer); taken as latency growing faster than size, 'up' was
        planned at 0.8x its split stages' rate for the next 8 s, 215-265 MB/s,
        and the split put 0.62 of the bytes on 'up' instead of 0.69.
        ``rate_only``: see PathEstimator.add."""
        self.estimator.observe(sender, plane, self.rank, nbytes, t_start, t_last, port=self.rank,
                               size_evidence=size_evidence, rate_only=rate_only)

    def on_stage(self, decision: StageDecision, t_start: float, t_end: float,
                 bytes_by_plane: Mapping[str, int], rank: Optional[int] = None,
                 received_by_plane: Optional[Mapping[str, int]] = None) -> None:
        """Realised time of one stage on one rank: the evidence for dropping a plane.

        ``bytes_by_plane``: what the rank sent; ``received_by_plane`` (the
        engine's view, None in the simulator, whose stage times are the
        sender's own): what arrived."""
        cfg = self.config
        src = self.rank if rank is None else rank
        info = decision.reason.get("ranks", {}).get(str(src))
        duration = t_end - t_start
        if not cfg.multipath or info is None or duration <= 0 or not info["judgeable"]:
            return
        st = self._states.setdefault(src, _RankState())
        k = decision.reason["decision"]
        nbytes = sum(int(bytes_by_plane.get(p, 0)) for p in PLANES)
        used = [p for p in PLANES if bytes_by_plane.get(p, 0) > 0]
        if nbytes < cfg.min_multipath_bytes or not used:
            return
        if len(used) == 1:
            # Sent on one plane but received on both, the stage ended with the
            # peer's split (over tcp the own sends complete once the socket
            # buffers take them), not with this plane alone. Recorded as solo,
            # such stages (8 MiB in 45-48 ms on a 125 MB/s link) made joint
            # stages 25% under 'up' alone look no faster.
            alone = received_by_plane is None or not any(
                n > 0 for p, n in received_by_plane.items() if p != used[0])
            if alone:
                est = info["est"][used[0]]
                self._record_solo(st, src, used[0], nbytes, duration, est["latency_s"], k, est, t_end)
            if info["mode"] == "check" and alone:
                if self._in_readd_check(st, self._epoch):
                    self._check_readd(st, src, used[0], nbytes, duration, k)
                else:
                    self._resolve_check(st, src, used[0], k)
            elif info["mode"] == "multipath" and not st.dropped:
                self._note_unused(st, src, keep=used[0], k=k)
            return
        st.unused_stages = 0  # both planes carried bytes
        if info["mode"] == "multipath" and _arrived_on_one_plane(received_by_plane):
            # The peers sent on one plane (a check, or a drop this rank has not
            # followed yet): the stage ended with their one-plane data, so its
            # time says nothing of this rank's split. Judged, it read as fast as
            # solo and asked for a check of its own (testbed, 64 MiB: the two
            # ranks checked in turn, four check stages in 30 operations) or,
            # against a fresh solo record, dropped a plane that paid.
            return
        # Solo records come from solo stages only. Raised from joint stages
        # (the estimator's rate: early tcp completions, 211 MB/s on a 125 MB/s
        # link; or the stage's own 'up' rate, which judges the stage against
        # itself) they dropped planes that paid. A record left low by a plane
        # that got faster keeps a plane that may not pay, until a check.
        if info["mode"] == "probe":
            self._resolve_probe(st, src, info, nbytes, duration, k)
        elif info["mode"] == "multipath":
            self._judge_joint(st, src, info, nbytes, duration, k)

    def on_solo_stage(self, plane: str, nbytes: int, duration: float) -> None:
        """A stage's worth of this rank's bytes (``nbytes`` sent to each peer) that
        went on ``plane`` alone in ``duration``, outside any plan: the two-step
        executor, which runs the operations between probes once 'out' is dropped.
        A solo record like a planned solo stage's, and the freshest there is: left
        to the planned stages around probes alone, the record a 2 MiB probe was
        judged against was the communicator's first, DAG-run operations, and two
        probes in a row (1.9-2.9 ms operations against 0.4-0.6 ms two-step ones)
        passed for gains (default planes)."""
        st = self._states.get(self.rank)
        if not self.config.multipath or st is None or nbytes < self.config.min_multipath_bytes or duration <= 0:
            return
        latency = self.estimator.plane(self.rank, plane).latency_s
        self._record_solo(st, self.rank, plane, nbytes, duration, latency, self._k)

    def _record_solo(self, st: _RankState, src: int, plane: str, nbytes: int, duration: float,
                     latency: float, k: int, est: Optional[Mapping] = None, now: Optional[float] = None):
        net = duration - latency
        net = net if net > 0.5 * duration else duration  # latency estimate off: keep the raw rate
        rate = nbytes / net
        if est is not None and est["measured"]:
            # A rank's stage time is not its link's: over tcp its sends
            # complete once the socket buffers take them, so a solo stage
            # gated by a peer that split ends early. Such records (163-186
            # MB/s on a 125 MB/s link, testbed series) made joint stages that
            # beat 'up' alone by 25% look no faster, and 'out' was dropped.
            # The receivers' delivery rate of the plane bounds it: the higher
            # of the one the stage was planned with and the one after it. The
            # first alone was measured while the plane shared a link with the
            # other (pcie-p2p: both cross the GPU's x16; 'up' delivered 16.7
            # GB/s of the link's 28): a check stage's 26.9 GB/s was recorded
            # as 20, joint stages read 0.74x of solo, and 'out' stayed.
            rate = min(rate, SOLO_OVER_DELIVERY_MAX * max(est["rate_Bps"], self._delivery_rate(src, plane, now)))
        q = st.solo[plane]
        if q and not 0.8 <= rate / _median_rate(q) <= 1.25:
            q.clear()  # a different regime: older records describe a plane that is gone
        q.append(_SoloRecord(k, rate, nbytes, latency if net < duration else 0.0))

    def _delivery_rate(self, src: int, plane: str, now: Optional[float]) -> float:
        est = self.estimator.plane(src, plane, now)
        return est.rate_Bps if est.measured else 0.0

    def _solo_time(self, st: _RankState, plane: str, nbytes: int, best: bool = False) -> Optional[float]:
        """Time of ``nbytes`` on ``plane`` alone from its solo records of a
        comparable size (within 2x): the median, or with ``best`` the fastest
        (see _resolve_probe). A stage's rate depends on its size (fixed costs
        weigh more in small ones), and a communicator runs many sizes: a 2 MiB
        probe judged against records left by other sizes looked like a gain on
        the default planes and re-added 'out' for good. Each record's time is
        rebuilt with the latency it was recorded with: rebuilt with today's,
        a latency estimate that rose 3.4 -> 19 us (pcie-p2p) made a probe as
        fast as 'up' alone read 17% faster, and 'out' came back."""
        times = [r.latency_s + nbytes / r.rate_Bps for r in st.solo[plane] if _comparable(r.nbytes, nbytes)]
        if not times:
            return None
        return min(times) if best else statistics.median(times)

    @staticmethod
    def _solo_records(st: _RankState, plane: str, nbytes: int) -> int:
        """Solo records of a size comparable to ``nbytes`` (as _solo_time takes them) since the plane's
        last regime change (_record_solo clears the queue when a record departs from its median)."""
        return sum(1 for r in st.solo[plane] if _comparable(r.nbytes, nbytes))

    def _best_solo(self, st, nbytes, planes=PLANES) -> Optional[tuple[str, float]]:
        times = {p: self._solo_time(st, p, nbytes) for p in planes}
        times = {p: t for p, t in times.items() if t is not None}
        if not times:
            return None
        plane = min(times, key=times.get)
        return plane, times[plane]

    def _judge_joint(self, st, src, info, nbytes, duration, k) -> None:
        """A settled, well-predicted joint stage: does the second plane pay?

        The verdict is the median over the last few judged joint stages of
        realised time / solo time, so one noisy stage neither drops a plane
        nor hides real harm. A second plane that does not win at least
        ``min_gain`` is dropped: slower is negative value, and "as fast"
        borrows scale-out capacity for nothing. Dropping needs two stages and
        a fresh solo record; a stale record first buys one check stage.
        """
        cfg = self.config
        if not info["settled"] or not info["measured"] or info["pred_s"] <= 0:
            return
        regime = self.estimator.regime_changes(src)
        if regime != st.regime_at_joint:
            # A path into or out of this rank stepped and the estimates have
            # followed: older joint stages describe other planes, and stages
            # mispredicted before it were planned from stale numbers (under a
            # background flow starting, three of them dropped 'out' before
            # the step's report arrived).
            st.joint.clear()
            st.mispredicted = 0
            st.regime_at_joint = regime
        error = duration / info["pred_s"] - 1.0
        if abs(error) > cfg.accuracy_band:
            # Only stages persistently *slower* than predicted count toward judging anyway.
            st.mispredicted = st.mispredicted + 1 if error > 0 else 0
            if st.mispredicted < MISPREDICTIONS_BEFORE_JUDGING:
                return  # estimates were stale (a step change in progress): no verdict yet
            # Settled yet persistently mispredicted: the planes interfere in a way
            # per-plane estimates cannot see (each plane's max-filtered rate was
            # measured while the other paused). Judge by realised times instead.
        else:
            st.mispredicted = 0
        if st.joint and not _comparable(st.joint[-1][0], nbytes):
            # A verdict at one size says nothing of another (solo records count within 2x
            # alike, _solo_time). Kept across a testbed sweep's 16 -> 64 MiB step, two 16 MiB
            # joint stages judged against records 13 operations old joined two 64 MiB ones
            # (one a 153 ms jitter spike against a 111 ms norm) and dropped 'out' for the rest
            # of the 64 MiB point (1.0x up; target 1's all_reduce).
            st.joint.clear()
        st.joint.append((nbytes, duration))
        solo_planes = info["solo_planes"]
        best = self._best_solo(st, nbytes, solo_planes)
        if best is None:
            plane = info["best_single"] if info["best_single"] in solo_planes else solo_planes[0]
            self._request_check(st, src, plane, k, f"no solo record within 2x of {nbytes} B")
            return
        plane = best[0]
        ratio = self._joint_over_solo(st, plane)
        if ratio is None or ratio <= 1 - cfg.min_gain:
            return
        if len(st.joint) >= JOINT_STAGES_TO_DROP and self._solo_ref_fresh(st, src, plane, k):
            self._drop(st, src, keep=plane, k=k, evidence=self._joint_evidence(st, ratio))
        elif not self._solo_ref_fresh(st, src, plane, k):
            self._request_check(st, src, plane, k, f"joint stages took {ratio:.2f}x {plane} alone, "
                                                   f"by a solo record older than {cfg.solo_fresh_decisions} decisions")

    def _joint_over_solo(self, st, plane) -> Optional[float]:
        ratios = []
        for nbytes, duration in st.joint:
            t_solo = self._solo_time(st, plane, nbytes)
            if t_solo:
                ratios.append(duration / t_solo)
        return statistics.median(ratios) if ratios else None

    def _solo_ref_fresh(self, st, src, plane, k) -> bool:
        """Measured alone within the last few decisions.

        Only a solo stage right next to the joint ones tells interference
        (a plane slows down because the other is in use) from a plane that
        simply got slower: the estimator sees the same step down in both.
        """
        if not st.solo[plane]:
            return False
        return k - st.solo[plane][-1][0] <= self.config.solo_fresh_decisions

    def _request_check(self, st, src, plane, k, cause: str) -> None:
        # At most one diagnostic stage per probe_every decisions, unless a
        # plane's rate stepped since the last one (new information).
        regime = self.estimator.regime_changes(src)
        if k - st.last_check_k < self.config.probe_every and regime == st.regime_at_check:
            return
        if regime != st.regime_at_check and k - st.last_check_k < self.config.probe_every:
            cause += f"; a rate step since the last check ({k - st.last_check_k} decisions ago)"
        st.pending_check = plane
        st.check_cause = cause
        st.regime_at_check = regime

    def _resolve_check(self, st, src, plane, k) -> None:
        """The solo record is fresh now: judge the joint stages that raised the doubt."""
        ratio = self._joint_over_solo(st, plane)
        if ratio is not None and ratio > 1 - self.config.min_gain and len(st.joint) >= JOINT_STAGES_TO_DROP:
            self._drop(st, src, keep=plane, k=k, evidence=self._joint_evidence(st, ratio))

    def _check_readd(self, st, src, plane, nbytes, duration, k) -> None:
        """A re-add's check (READD_CHECK_AFTER), after each stage of the check
        operations (READD_CHECK_OPS): the re-adding probe's stage and the joint stages judged since,
        against the fastest check stage so far on ``plane`` alone, not against the
        records the probe was judged by. The split must still beat it by
        ``readd_margin``, what the re-add asked of the probe, or the plane is
        dropped again. Stage times, not records: every rank that re-added checks
        in these operations, so no peer's split ends a check stage early (what the
        record's cap is for), and capped, a 141 ms check read 151 ms. The fastest
        of the check stages: a CPU stall only slows a stage, and with one check
        stage each, both ranks of a shared-bottleneck testbed run read their
        stalled check as a gain and kept the split (2 runs of 24 under a CPU
        hog)."""
        st.readd_checks.append((nbytes, duration))
        # of this stage's size: the two check operations may run other sizes (a sweep's step),
        # and a larger stage's rate, its fixed costs spread thinner, would read any split as no gain
        best_rate = max(n / d for n, d in st.readd_checks if _comparable(nbytes, n))
        # the re-adding probe's stage: no probe runs while the plane is in use, so it is the last one
        stages = ([st.last_probe_stage] if st.last_probe_stage is not None else []) + list(st.joint)
        ratios = [d / (n / best_rate) for n, d in stages if _comparable(nbytes, n)]
        if ratios and statistics.median(ratios) > 1 - self.config.readd_margin:
            self._drop(st, src, keep=plane, k=k, evidence={
                "split_over_check": statistics.median(ratios), "check_s": [round(d, 6) for _, d in st.readd_checks],
                "joint_s": [round(d, 6) for _, d in stages]})

    @staticmethod
    def _joint_evidence(st, ratio) -> dict:
        """What a harm verdict rests on, for the trace: the median ratio and the judged stages."""
        return {"joint_over_solo": ratio, "joint_s": [round(d, 6) for _, d in st.joint],
                "regime": st.regime_at_joint}

    def _resolve_probe(self, st, src, info, nbytes, duration, k) -> None:
        cfg = self.config
        keep = next((p for p in PLANES if p not in st.dropped), None)
        t_solo = self._solo_time(st, keep, nbytes) if keep else None
        # A re-add must beat the plane's best solo record, not the median: the
        # records of a communicator's first, cold operations are slow, and
        # probes judged against them re-added 'out' on the default planes.
        t_best = self._solo_time(st, keep, nbytes, best=True) if keep else None
        # No solo record (cleared by a regime change) is no evidence: the
        # stages the dropped plane leaves solo refill it before the next probe.
        st.last_probe_stage = (nbytes, duration)
        if t_best is not None and duration < t_best * (1 - cfg.readd_margin):
            self._readd(st, st.last_probe_epoch, {"decision": k, "rank": src, "event": "readd", "plane": info["plane"],
                                                  "probe_s": duration, "solo_s": t_solo, "best_solo_s": t_best})
            return
        # A first probe planned from the prior measured the plane: not judged (below).
        judged = info["measured"] or st.confirming
        harmful = t_solo is not None and duration > t_solo * (1 + cfg.harm_margin)
        harm = judged and harmful and self._solo_records(st, keep, nbytes) >= SOLO_RECORDS_FOR_HARM
        # no harm here: a peer's re-add from the same probe may bring the plane back (_follow_peer_readd)
        st.harmless_probe_epoch = None if harm else st.last_probe_epoch
        if not info["measured"] and not st.confirming:
            # Planned from a prior, the probe measured the plane rather than
            # tested a split at its rate: the repeat, planned from what it
            # measured, does that. Judged as harm, a first probe that put 34%
            # on a loaded link taking ~19% (700 MB/s prior against 32 MB/s)
            # backed both ranks off, and the matrix's background cells stayed
            # on 'up' while a fixed 0.8 ran 1.2-1.3x faster.
            self._repeat_probe(st, k)
            return
        if harm:
            # Still harmful: probe less often.
            st.probe_interval = min(st.probe_interval * 2, self._backoff_cap(t_solo))
        elif not st.confirming:
            # Neither a gain nor harm: repeat it once, in the next operation.
            # One stage decides a probe, and one in ten came out ~15 ms slow
            # on one rank of the testbed (solo 65 ms, probes 48); that rank
            # kept the plane dropped, the peer re-added it, and the peer's
            # joint stages, waiting on the first rank's single-plane data,
            # showed no gain and dropped it too, for 16+ operations. The
            # repeat also runs on chunks that refreshed the estimate.
            self._repeat_probe(st, k)
            return
        st.next_probe_k = k + st.probe_interval

    def _readd(self, st: _RankState, epoch: Optional[int], event: dict) -> None:
        """Bring the dropped plane back (a probe's gain here, or a peer's: _follow_peer_readd),
        and check it READD_CHECK_AFTER operations after this rank's probe's grid point."""
        st.readd_keep = next((p for p in PLANES if p not in st.dropped), None)
        st.readd_check_epoch = None if st.probe_grid_epoch is None else st.probe_grid_epoch + READD_CHECK_AFTER
        st.readd_check_op = None
        st.dropped.clear()
        st.joint.clear()
        st.probe_interval = 0
        st.next_probe_k = math.inf
        st.readds += 1
        st.readd_epoch = epoch
        self._note_event(event)

    @staticmethod
    def _repeat_probe(st: _RankState, k: int) -> None:
        """Probe again in the next operation (its epoch on every rank that repeats too)."""
        st.confirm_epoch = None if st.last_probe_epoch is None else st.last_probe_epoch + 1
        st.next_probe_k = k + 1

    def _backoff_cap(self, stage_s: float) -> int:
        """The longest probe interval: probe_every * probe_backoff_max, or where the
        probed stage is short, the interval at which its probes are probe_spacing_s
        apart (stages of stage_s each), up to probe_every * SHORT_BACKOFF_MAX. Kept a
        power-of-two multiple of probe_every, as every grid is (may_use's gcd)."""
        cfg = self.config
        cap = cfg.probe_every * cfg.probe_backoff_max
        if cfg.probe_spacing_s > 0 and stage_s > 0:
            spaced = min(cfg.probe_spacing_s / stage_s, cfg.probe_every * SHORT_BACKOFF_MAX)
            while cap * 2 <= spaced:
                cap *= 2
        return cap

    def _note_event(self, event: dict) -> None:
        if self._epoch is not None:
            event["epoch"] = self._epoch
        self._events.append(event)
        self._events_total += 1

    def has_events(self) -> bool:
        """Drop or re-add events not yet taken (take_events)."""
        return self._events_total > self._events_taken

    def take_events(self) -> list[dict]:
        """Drop and re-add events since the last call (for the operation's telemetry record)."""
        fresh = min(self._events_total - self._events_taken, len(self._events))
        self._events_taken = self._events_total
        return list(self._events)[len(self._events) - fresh:] if fresh else []

    def _note_unused(self, st, src, keep, k) -> None:
        """A plane the split may use but gives nothing, stage after stage, is
        dropped: the state then says what happens (one plane), operations can
        run settled, and probes on the shared grid test the plane again. A
        re-add judged against an old solo record (the first, cold operations)
        otherwise left 'out' "in use" with a zero share for good, every later
        operation planned (~50 us each at 2 MiB) and never settled."""
        st.unused_stages += 1
        if st.unused_stages >= UNUSED_STAGES_BEFORE_DROP:
            self._drop(st, src, keep=keep, k=k, evidence={"unused_stages": st.unused_stages})

    def _drop(self, st, src, keep, k, evidence) -> None:
        cfg = self.config
        st.dropped = {p for p in PLANES if p != keep}
        st.drops += 1
        st.unused_stages = 0
        st.pending_check = None
        st.readd_check_epoch = st.readd_check_op = None
        st.joint.clear()
        st.probe_interval = cfg.probe_every
        st.next_probe_k = k + cfg.probe_every
        forced = 0.0 if keep == "up" else 1.0
        for key in list(self._shares):
            if key[0] == src:
                self._shares[key] = forced
        self._note_event({"decision": k, "rank": src, "event": "drop", "planes": sorted(st.dropped),
                             "keep": keep, **evidence})

    def may_use(self, plane: str, epoch: Optional[int]) -> bool:
        """Whether operation ``epoch`` might put bytes on ``plane`` on any rank
        (the failover snapshot's test). False only when this rank has the plane
        dropped with no check pending (and its drop already exported), every
        rank we heard from has it dropped too, and ``epoch`` is neither on the
        probe grid (any rank's probe epochs are multiples of the probe grid
        it exports, or the first probe) nor one of the two after it (a probe's repeat, and the
        operation in which a peer that re-added at the repeat says so)."""
        st = self._states.get(self.rank)
        if epoch is None or st is None or plane not in st.dropped or st.pending_check is not None:
            return True
        if self._flags_since is None or epoch <= self._flags_since:
            # The peers have not seen this rank's drop yet (it happened after
            # the last export, mid-operation): they still declare they may
            # carry, and an operation settled here alone kept its DONE round
            # (the settled-adaptive collectives test, once in a fresh-clone CI).
            return True
        # A probe at epoch g on the grid (or FIRST_PROBE_AFTER) may re-add the
        # plane at g, or at g + 1 when its inconclusive result is repeated
        # (confirm_epoch); a re-add reaches the peers with the next operation's
        # blob, so they cannot know of it before g + 2 (a peer that re-added at
        # its confirm epoch 33 sent on 'out' while this rank ran 34 settled).
        # Every rank probes only on multiples of its own grid (probe_grid),
        # which it exports; a multiple of any grid is one of their greatest
        # common divisor (the finest grid: they are probe_every times powers
        # of two). A grid that doubled reaches the peers an operation later;
        # until then they test the finer one, which only plans one operation
        # more. Asked up to four times per operation: plain loops.
        grid = self._finest_probe_grid(st)
        for e in (epoch, epoch - 1, epoch - 2):
            if _may_probe_at(e, grid):
                return True
        if not self._remote_dropped:
            return True
        for dropped in self._remote_dropped.values():
            if plane not in dropped:
                return True
        return False

    def _finest_probe_grid(self, st: "_RankState") -> int:
        """The greatest common divisor of every rank's probe grid (see may_use)."""
        return math.gcd(_probe_grid(st, self.config.probe_every), self._remote_grid_gcd)

    def settled(self, epoch: Optional[int], nbytes: Optional[int] = None,
                out_usable: Optional[bool] = None) -> bool:
        """Nothing to decide at operation ``epoch``: 'out' may not be used in it
        (may_use) nor in the next one, so this is no probe, no check and not the
        operation before a probe (whose planned stages refresh the solo record
        the probe is judged against), and the operation is short on 'up'
        (``nbytes`` at its estimated rate under SETTLED_MAX_S). The engine then
        runs it on 'up' without asking the controller. Long operations keep
        their planning: it costs nothing next to them, and their feedback keeps
        the solo record a probe is judged against fresh (without it the testbed
        all_to_all judged its probes against stale records and never took
        'out' back). ``out_usable``: may_use("out", epoch), where the caller asked already."""
        if epoch is None:
            return False
        if out_usable is None:
            out_usable = self.may_use("out", epoch)
        if out_usable:
            return False
        # may_use("out", epoch + 1), given it is False at epoch: only a probe at epoch + 1
        # can change the answer (the epochs before it and every other test are the same).
        if _may_probe_at(epoch + 1, self._finest_probe_grid(self._states[self.rank])):
            return False
        if nbytes is None:
            return True
        rate = self._exported_up_rate or self.estimator.plane(self.rank, "up").rate_Bps
        return rate > 0 and nbytes / rate < SETTLED_MAX_S

    # ------------------------------------------------------------ estimates I/O
    def export_estimates(self, now: Optional[float] = None, epoch: Optional[int] = None,
                         out_usable: Optional[bool] = None) -> bytes:
        """This rank's measured estimates, to piggyback on its chunks (14 B per path).

        The entries of the previous export are reused (EXPORT_REUSE_CALLS)
        only for an operation ``epoch`` in which 'out' may not carry bytes
        (may_use): there every stage goes on 'up' whatever the numbers say,
        while a rank that splits decides from what it exports and needs them
        fresh. ``out_usable``: may_use("out", epoch), where the caller asked already."""
        st = self._states.get(self.rank)
        flags = 0
        for i, plane in enumerate(PLANES):
            if st is not None and plane in st.dropped:
                flags |= 1 << i
        self._exports += 1
        if epoch is not None:
            self._export_epoch = epoch
        if flags != self._exported_flags:
            self._exported_flags = flags
            self._flags_since = -1 if self._export_epoch is None else self._export_epoch
        grid_byte = _probe_grid(st, self.config.probe_every) // self.config.probe_every if flags else 0
        cached = self._export_cache
        # Regime counts move only with samples: unchanged since the cached
        # export, so is the count (summing it is ~3 us of Python).
        samples = self.estimator.samples_seen
        regime = (cached[2] if cached is not None and cached[4] == samples
                  else self.estimator.local_regime_changes(self.rank))
        if (cached is not None and cached[1:3] == (flags, regime) and cached[6] == grid_byte
                and epoch is not None and not (self.may_use("out", epoch) if out_usable is None else out_usable)
                and (self._exports - cached[0] < EXPORT_REUSE_CALLS
                     or self._unchanged_since(cached, now))):
            return cached[3]
        entries = self.estimator.reported(self.rank, now)
        body = b"".join(_entry(self.rank, path, *value) for path, value in sorted(entries.items()))
        blob = bytes([_BLOB_VERSION]) + _HDR.pack(flags, grid_byte, len(entries)) + body
        if self.config.decide_from_exported_view:
            self.merge_estimates(self.rank, blob)
        self._export_cache = ((self._exports, flags, regime, blob, self.estimator.samples_seen, now, grid_byte)
                              if entries else None)
        # What settled() sizes operations with (estimator.plane() builds a view: 5 us a call).
        self._exported_up_rate = max((v[0] for (_, p, _), v in entries.items() if p == "up"), default=None)
        return blob

    def note_settled_operation(self) -> None:
        """A settled operation (settled()) sends no estimates: between probes nothing
        decides from them, and the operations around a probe are never settled, so
        they export afresh. Counted as an export all the same, so that the first
        export after settled operations does not reuse entries older than
        EXPORT_REUSE_CALLS operations. Exporting and merging cost ~15 us of a
        2 MiB two-step operation (settled adaptive / up 1.07 -> 1.04)."""
        self._exports += 1

    def _unchanged_since(self, cached: tuple, now: Optional[float]) -> bool:
        """No sample arrived since that export and its samples have not aged
        past the estimator's window since: the same blob again. Settled
        operations give no feedback, so this holds between probes, where
        rebuilding the blob every EXPORT_REUSE_CALLS cost ~30 us per operation
        on average (2 MiB all_reduce on shared memory: ~4% of it)."""
        return (cached[4] == self.estimator.samples_seen and now is not None and cached[5] is not None
                and now - cached[5] < self.config.filter_max_age_s)

    @staticmethod
    def blob_capacity(npeers: int) -> int:
        """The most bytes export_estimates() writes for a rank with ``npeers`` peers."""
        return 1 + _HDR.size + _ENTRY.size * 2 * len(PLANES) * max(1, npeers)  # both directions

    @staticmethod
    def blob_length(buf) -> int:
        """Length of the blob at the start of ``buf`` (bytes, or a uint8 array; 0 when there is none)."""
        if len(buf) < 1 + _HDR.size or buf[0] != _BLOB_VERSION:
            return 0
        _, _, count = _HDR.unpack_from(buf, 1)
        return 1 + _HDR.size + count * _ENTRY.size

    def merge_estimates(self, rank: int, blob: bytes) -> None:
        """Another rank's exported estimates; they replace what we had for it."""
        if rank != self.rank and self._merged.get(rank) == blob:
            # The same export again (exports are reused for a few calls): only
            # the peer-drop rule has to run, on what we already hold.
            self._follow_peer_drop(rank, self._remote_dropped.get(rank, set()))
            return
        if not blob or blob[0] != _BLOB_VERSION:
            raise ValueError(f"estimate blob from rank {rank}: unknown version")
        try:
            flags, grid_byte, count = _HDR.unpack_from(blob, 1)
            off = 1 + _HDR.size
            if len(blob) != off + count * _ENTRY.size:
                raise ValueError("length does not match entry count")
            entries = {}
            for i in range(count):
                plane_byte, peer, regime, rate, lat = _ENTRY.unpack_from(blob, off + i * _ENTRY.size)
                plane_idx = plane_byte & ~_INCOMING
                if plane_idx >= len(PLANES) or peer == rank or not rate > 0 or not lat >= 0:
                    raise ValueError(f"bad entry {i}")
                src, dst = (peer, rank) if plane_byte & _INCOMING else (rank, peer)
                entries[(src, PLANES[plane_idx], dst)] = (float(rate), float(lat), regime)
        except struct.error as exc:
            raise ValueError(f"estimate blob from rank {rank}: {exc}") from None
        self.estimator.set_remote(rank, entries)
        dropped = {p for i, p in enumerate(PLANES) if flags & (1 << i)}
        before = self._remote_dropped.get(rank)
        self._remote_dropped[rank] = dropped
        grid = self.config.probe_every * max(1, grid_byte)
        if self._remote_grid.get(rank) != grid:
            self._remote_grid[rank] = grid
            self._remote_grid_gcd = math.gcd(*self._remote_grid.values())
        self._merged[rank] = bytes(blob)
        if before is not None:
            self._follow_peer_readd(rank, before - dropped)
        self._follow_peer_drop(rank, dropped)

    def _follow_peer_readd(self, rank: int, readded: set) -> None:
        """A plane a peer's probe just brought back comes back here too, when this
        rank's own probe of it at the same grid point (or its repeat) showed no harm.

        Ranks probe together and each judges its own stage, one stage each: on
        the testbed's 16 MiB all_reduce (1 Gbit/s / 500 Mbit/s) stages of one
        split ran 44-97 ms, and a rank saw the gain in one probe of two. With
        "any rank's drop is everyone's", a plane came back only when both
        ranks saw it in the same probe: one re-added, its peer (neutral)
        stayed dropped, the re-add was undone two operations later, and
        'out' stayed off for 16-32 operations at a time (matrix failure
        series: 37 operations before both split). A gain on one rank and no
        harm on the other now bring it back on both; the joint stages that
        follow are judged as any others (_judge_joint), so a plane that does
        not pay is dropped again on their evidence. Harm on any rank still wins."""
        st = self._states.get(self.rank)
        if st is None or rank == self.rank or not self.config.multipath or not (readded & st.dropped):
            return
        if st.harmless_probe_epoch is None or self._epoch is None or self._epoch > st.harmless_probe_epoch + 2:
            return  # this rank's own last probe is older than the peer's (or showed harm)
        self._readd(st, self._epoch, {"decision": self._k, "rank": self.rank, "event": "readd",
                                      "plane": sorted(readded & st.dropped)[0], "peer_readd": rank})

    def _follow_peer_drop(self, rank: int, dropped: set) -> None:
        """A plane another rank dropped is dropped here too.

        Splitting only pays when every rank of a stage splits (the stage ends
        with its slowest rank), so ranks must agree; judgments are local and
        can differ. The rule that converges: any rank's drop is everyone's
        drop, and a plane comes back only when a probe (on the shared epoch
        grid, so all ranks probe together) convinces every rank.
        """
        st = self._states.get(self.rank)
        if st is None or rank == self.rank or not self.config.multipath:
            return
        if st.readd_epoch is not None and self._epoch is not None and self._epoch <= st.readd_epoch + 1:
            # This rank re-added the plane at probe epoch e; a peer whose probe
            # there was inconclusive repeats it at e + 1, and its flags say
            # "dropped" until its blob after that (blobs also arrive with
            # chunks, mid-operation). Following them undid the re-add before
            # the repeat could confirm it, and the repeat's re-add was undone
            # in turn by this rank's drop: both on one plane for 16+ operations.
            return
        for plane in sorted(dropped - st.dropped):
            keep = next((p for p in PLANES if p != plane), None)
            if keep is not None and not st.dropped:
                self._drop(st, self.rank, keep=keep, k=self._k, evidence={"peer_dropped": rank})

    # --------------------------------------------------------------- telemetry
    def plane_costs(self, now: Optional[float] = None, src: Optional[int] = None) -> dict[str, PathModel]:
        """Latency and rate per plane of one rank, for the tuner's cost model."""
        s = self.rank if src is None else src
        view = self.estimator.view(now)
        return {p: PathModel(view.plane(s, p).rate_Bps, view.plane(s, p).latency_s) for p in PLANES}

    def snapshot(self) -> dict:
        return {
            "rank": self.rank,
            "decisions": self._k,
            "config": asdict(self.config),
            "estimates": self.estimator.snapshot(),
            "ranks": {str(s): st.to_json() for s, st in sorted(self._states.items())},
            "remote_dropped": {str(s): sorted(d) for s, d in sorted(self._remote_dropped.items())},
            "probe_grid": self.probe_grid(),
            "remote_probe_grid": {str(s): g for s, g in sorted(self._remote_grid.items())},
            "shares": {f"{s}->{d}@2^{c}": v for (s, d, c), v in self._shares.items()},
            "events": list(self._events),
            "last_decision": self._last_reason,
        }


# ---------------------------------------------------------------------- helpers
def _may_probe_at(epoch: int, grid: int) -> bool:
    """Some rank may probe at ``epoch``: a multiple of the finest probe grid, or the first probe."""
    return epoch % grid == 0 or epoch == FIRST_PROBE_AFTER


def _probe_grid(st: _RankState, probe_every: int) -> int:
    """See PathController.probe_grid."""
    return st.probe_interval if st.probes and st.probe_interval else probe_every


def _comparable(recorded: int, nbytes: int) -> bool:
    """A stage of ``recorded`` bytes speaks for one of ``nbytes``: within 2x (see _solo_time)."""
    return recorded / 2 <= nbytes <= 2 * recorded


def _arrived_on_one_plane(received_by_plane: Optional[Mapping[str, int]]) -> bool:
    """The peers' bytes of a stage came on one plane only (None: not known, the simulator)."""
    if not received_by_plane:
        return False
    return sum(1 for p in PLANES if received_by_plane.get(p, 0) > 0) == 1


def _median_rate(q) -> float:
    return statistics.median(entry[1] for entry in q)


def _validate(flows: Sequence[FlowDemand]) -> None:
    seen = set()
    for f in flows:
        if f.flow_id in seen:
            raise ValueError(f"flow id {f.flow_id} appears twice in one stage")
        seen.add(f.flow_id)
        if f.nbytes < 0:
            raise ValueError(f"flow {f.flow_id}: negative size")
        if not f.planes or any(p not in PLANES for p in f.planes):
            raise ValueError(f"flow {f.flow_id}: planes must be a non-empty subset of {PLANES}, got {f.planes}")


def _judgeable(flows: Sequence[FlowDemand], min_bytes: int) -> bool:
    """A rank's stage says something about a second plane only if one plane could carry it all,
    and only if the stage has its links to itself: a stage with companions (other channels'
    stages of a pipelined schedule, on the same links at once) takes mostly its wait behind
    them, so a joint stage read slower than an all-'up' check stage (0.197 s against 0.138,
    4 ranks as 2 domains at 1:1) while the operations it ran in were 1.1-1.2x faster."""
    if any(f.companion for f in flows):
        return False
    return bool(flows) and all(qos.is_borrowable(f) for f in flows) and sum(f.nbytes for f in flows) >= min_bytes


def _path_model(view: EstimateView, src: int, plane: str, peer: int) -> PathModel:
    est = view.path(src, plane, peer)
    return PathModel(est.rate_Bps, est.latency_s)


def _models(ports: Mapping[int, Mapping[str, PathEstimate]],
            out_rate_max: Optional[float] = None) -> dict[int, dict[str, PathModel]]:
    """Per rank and plane, the (rate, delay) a split is planned with; ``out_rate_max``:
    'out' no faster than that (the QoS rate cap, which the engine's pacer enforces)."""
    def rate(p, e):
        return min(e.rate_Bps, out_rate_max) if p == "out" and out_rate_max is not None else e.rate_Bps
    return {s: {p: PathModel(rate(p, e), e.latency_s) for p, e in pe.items()} for s, pe in ports.items()}


def _loads_beside(flows: Sequence[FlowDemand], out_bytes: Mapping[int, float]) -> dict[int, dict[str, float]]:
    """Per flow: the bytes its sender's other flows of the stage put on each plane
    (their targets; a companion's count too), by flow id."""
    totals: dict[int, dict[str, float]] = {}
    for f in flows:
        out = out_bytes.get(f.flow_id, 0.0)
        port = totals.setdefault(f.src, {"up": 0.0, "out": 0.0})
        port["up"] += f.nbytes - out
        port["out"] += out
    beside = {}
    for f in flows:
        out, port = out_bytes.get(f.flow_id, 0.0), totals[f.src]
        beside[f.flow_id] = {"up": max(0.0, port["up"] - (f.nbytes - out)), "out": max(0.0, port["out"] - out)}
    return beside


class _AtRates:
    """An estimate view with every rank's planes at given rates (delays as
    estimated): what a pipelined stage is split by (split_pipelined_at)."""

    def __init__(self, view: EstimateView, rates: Mapping[str, float]):
        self._view = view
        self._rates = rates

    def plane(self, src: int, plane: str) -> PathEstimate:
        return self._at_rate(plane, self._view.plane(src, plane))

    def path(self, src: int, plane: str, peer: int) -> PathEstimate:
        return self._at_rate(plane, self._view.path(src, plane, peer))

    def _at_rate(self, plane: str, est: PathEstimate) -> PathEstimate:
        return dataclasses.replace(est, rate_Bps=self._rates[plane])


@dataclass(frozen=True)
class _FlowTiming:
    """What times one flow's split: its sender's ports (``ports``, every flow of
    the rank shares them), behind ``beside`` bytes of its other flows on each
    plane, and the flow's own paths (``links``), which carry its bytes alone.

    The ports time the load beside, not the flow's path: a path reads below
    its port where its receiver's link is shared with another sender, and the
    bytes beside go to other receivers. Timed at the path's rate, the other
    channels' cross-domain load made each chunk on 'out' look dearer than it is.
    """

    ports: Mapping[str, PathModel]
    links: Mapping[str, PathModel]
    beside: Mapping[str, float]

    def finish(self, nbytes: float, out: float) -> float:
        """When the flow is done with ``out`` of its ``nbytes`` on 'out'."""
        on = {"up": nbytes - out, "out": out}
        return max(max(self.ports[p].time(self.beside[p] + on[p]), self.links[p].time(on[p])) for p in PLANES)


def _size_class(f: FlowDemand) -> tuple[int, int, int]:
    """(src, dst, size class 2^k): what a flow's remembered share and chunk boundary are kept under."""
    return f.src, f.dst, int(math.log2(f.nbytes))


def _aligned_up_bytes(nbytes: int, out: float, cap: int, align: int) -> int:
    """Boundary between the 'up' prefix and the 'out' suffix, on an ``align`` multiple.

    Rounded to the nearest multiple, then pushed up far enough that 'out'
    never exceeds its cap; the flow's end is the only unaligned boundary.
    """
    if nbytes <= 0:
        return 0
    up = nbytes - max(0.0, min(float(nbytes), out))
    up_aligned = int(round(up / align)) * align
    min_up = nbytes - cap
    if up_aligned < min_up:
        up_aligned = -(-min_up // align) * align
    return max(0, min(nbytes, up_aligned))
