"""The Communicator: validates arguments, picks a plan, runs it, returns Work."""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
import os
import time
from collections import OrderedDict
from typing import Optional

import numpy as np

from . import arrays, direct_ops, staging
from . import algorithms, fingerprint, pipe_steps, shm_steps
from .algorithms import Topology, resumable_in_place
from .bootstrap import Bootstrap, hostname, rendezvous, usable_cores
from .config import (DEFAULT_UP_TLS_CPU, GPU_DIRECT_OUT_TLS, GPU_DIRECT_UP_TLS, Options, load_options, parse_policy,
                     with_device_tls)
from .collective_op import CollectiveOp
from .direct_ops import (DIRECT_BLOCKS_MIN_BYTES, DIRECT_CMA_BLOCK_BYTES, DIRECT_CMA_MAX_BYTES, DIRECT_MAX_BYTES,
                         DIRECT_OUTBOX_MAX_BYTES,
                         DIRECT_MEDIUM_BUDGET, DIRECT_SHM_MIN_BYTES, DirectAllGatherOp, DirectAllReduceOp,
                         DirectAllToAllOp, DirectBlocksAllReduceOp, DirectBroadcastOp, DirectReduceOp,
                         DirectPipeBlocksOp, DirectReduceScatterOp, DirectShmAllReduceOp, DirectShmBlocksOp, LightRecord,
                         StartedSteps, run_steps_alone)
from .engine import Engine
from .flows import Splitter
from .group_lane_ops import GroupLane, GroupLaneOp, GroupReadsOp, takes_group_lane, takes_group_reads
from .lane_ops import DONE as LANE_DONE, POSTED as LANE_POSTED, Lane, LaneOp, fingerprint_words, takes_lane
from .operation import Operation
from .p2p_ops import RecvOp, SendOp
from .errors import CommunicatorAborted, ConfigError, MismatchError, MpccsError, TransportError
from .reduce import finish_avg
from .telemetry import Telemetry
from .transports import cacheflush, shm, shm_group
from .transports.shm_group import GROUP_MAX_RANKS
from .transports.plane import Plane
from .two_step import MAX_HALF_BYTES as TWO_STEP_MAX_HALF_BYTES
from .control.landing import LandingChoices
from .control.split import PathModel
from .windows import OUT, UP, Pacer

DEFAULT_WINDOW_BYTES = {UP: 4 << 20, OUT: 4 << 20}
DEFAULT_CHUNK_BYTES = 1 << 20
SINGLE_PLANE_CHUNK_BYTES = 1 << 20  # a sender on one plane only: comm._chunking_for
# _direct_by_cma's, besides all_reduce (broadcast and reduce: the whole buffer is the block)
CMA_BLOCK_COLLECTIVES = ("reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")
DIRECT_MAX_RANKS = 8  # the direct path sends up to p - 1 messages per rank
MAX_POLICIES_REMEMBERED = 16  # path policies whose call answers are kept (Communicator.set_path_policy)
DIRECT_OPS = {"all_gather": DirectAllGatherOp, "reduce_scatter": DirectReduceScatterOp, "all_to_all": DirectAllToAllOp,
              "broadcast": DirectBroadcastOp, "reduce": DirectReduceOp}
# What the tuner assumes a reduction costs (bytes of output per second). A
# prior, identical on every rank: plans must not depend on local measurements.
REDUCE_BPS_PRIOR = 5e9
# 'auto': reduce_scatter and reduce of device arrays reduced on the device from
# here (an H200 host: 1.2-1.5x at 16 MiB, 0.6-0.8x at 1 MiB; config.DEVICE_REDUCE_MODES)
DEVICE_REDUCE_AUTO_MIN_BYTES = 16 << 20
# GPU-direct planes carry a call's device arrays from here (the larger buffer's
# bytes); smaller calls take the pinned mirrors. On an H200 (2 ranks, one GPU) a
# device message on the up plane cost ~175 us one way at 64 KiB (host: ~20), so
# a GPU-direct all_reduce (two collectives) took ~1.8-2.2 ms from 64 KiB to 1 MiB
# against 0.23-0.45 on the mirrors (bench/results/gpu_direct_h200, gpu_mirrors_h200).
# all_to_allv, whose buffers differ per rank, is GPU-direct at any size: both
# ways run the same schedule, so ranks may differ.
GPU_DIRECT_MIN_BYTES = 2 << 20
# all_reduce and reduce_scatter on a 2-rank pair that reads across processes
# (the mirrors take the direct path's reads: cma_steps.py) take the mirrors to
# here: on the H200 host, the mirrors against GPU-direct in alternating runs,
# all_reduce 2.6x at 2 MiB, 1.3-1.5x at 4, 0.8-0.9x at 8; reduce_scatter 1.9x,
# 1.3x, 0.8x; all_gather 1.35x at 2 MiB but 0.9x at 4, so it keeps the bound
# above (bench/results/gpu_mirrors_h200).
GPU_DIRECT_READS_MIN_BYTES = 8 << 20


@dataclass(frozen=True)
class CallPlan:
    schedule: "algorithms.Schedule"
    chunk_bytes: int
    single_plane: bool  # the tuner found a second plane does not pay at this size


def _parse_tune(text):
    from .control.tuner import parse_tune

    try:
        return parse_tune(text)
    except ValueError as exc:
        raise ConfigError(f"MPCCS_TUNE: {exc}") from None


class Work:
    """Handle of an operation in flight (``async_op=True``)."""

    def __init__(self, comm: "Communicator", op: Operation, result=None):
        self._comm = comm
        self._op = op
        self._result = result

    def wait(self, timeout: Optional[float] = None):
        """Block until done; ``timeout`` is the no-progress limit in seconds."""
        self._comm._wait(self._op, timeout)
        return self._result

    def is_completed(self) -> bool:
        if not self._op.finished:
            self._comm._engine.progress()
        return self._op.finished

    def stats(self) -> dict:
        return self._op.stats()

    def exception(self) -> Optional[BaseException]:
        return self._op.error


class Communicator:
    def __init__(self, boot: Bootstrap, options: Options, comm_id: int = 0):
        self.rank = boot.rank
        self.size = boot.size
        self.options = options
        self._boot = boot
        self._closed = False
        self._aborted: Optional[str] = None
        self._seq = 0
        self._epoch = 0  # multipath-eligible adaptive calls so far (see _run)
        self._send_seq: dict[int, int] = {}
        self._recv_seq: dict[int, int] = {}
        self._last_stats = None  # a dict, or a light Operation whose dict is built when asked
        self._plans: OrderedDict = OrderedDict()  # _schedule's answers by its arguments
        # _direct's and _protected's answers (configuration, path policy and call only), kept per policy:
        # a loop that changes the policy between calls (mpccs-perf interleaving policies, a training
        # loop with one policy per tensor) found them cleared at every change and decided every call
        # afresh: 4-6 us of a 8-32 KiB all_reduce's 18-24 (bench/results/adaptive_vs_up_s41/answers_ab/).
        self._answers_by_policy: dict = {}
        self._direct_answers: dict = {}
        self._protected_answers: dict = {}
        self.gpu_direct = staging.offers_gpu_direct(options.gpu_direct)  # this rank's offer; agreed below
        self.hosts, self.domains = self._exchange_identity(boot, options)
        self.domain = self.domains[self.rank]
        self._one_domain = len(set(self.domains)) == 1
        self.local_rank = boot.local_rank if boot.local_rank is not None else self._derive_local_rank()
        self.topology = Topology(tuple(_domain_ids(self.domains)))
        self._tune = _parse_tune(options.tune)
        if self._tune.multipath is False:
            self.options = options = dataclasses.replace(options, multipath=False, path_policy="up")
        if options.landing_flush == "always" and not (cacheflush.available() and cacheflush.prepare()):
            raise ConfigError("landing_flush='always' (MPCCS_LANDING_FLUSH) needs an x86-64 CPU with CLFLUSHOPT "
                              f"and a working numba ({cacheflush.failure or 'no CLFLUSHOPT or no numba here'}); "
                              "use 'auto' or 'never'")
        self._planes = self._open_planes(options)
        pacer = None if options.out_cap_rate_Bps is None else Pacer(options.out_cap_rate_Bps, now=time.perf_counter())
        self._engine = Engine(self.rank, comm_id, self._planes, controller=self._make_controller(),
                              plane_timeout_s=options.plane_timeout_s, reprobe_s=options.reprobe_s,
                              out_pacer=pacer)
        self._engine.liveness = self._lost_local_peers
        self._make_plan_rate_measurement()
        self._engine.share_cores(self.local_size > usable_cores())
        if self.size == 2 and boot.store is not None:
            self._engine.shm = shm.open_pair(boot.store, self.rank, options.rendezvous_timeout_s,
                                             willing=self._shm_willing(options), cma_willing=options.cma)
        if self._engine.shm is not None:
            can_flush = cacheflush.available()
            self._engine.outbox_landing = LandingChoices(options.landing_flush, can_flush=can_flush)
            if self._engine.shm.cma:
                self._engine.landing = LandingChoices(options.landing_flush, can_flush=can_flush)
        self._lane = Lane(self._engine.shm, self.rank) if self._engine.shm is not None else None
        self._group = None  # the group lane's segments (3 to 8 ranks on one host: transports/shm_group.py)
        if 2 < self.size <= GROUP_MAX_RANKS and boot.store is not None:
            self._group = shm_group.open_group(boot.store, self.rank, self.size, options.rendezvous_timeout_s,
                                               willing=self._group_willing(options),
                                               yields=self._engine.oversubscribed, cma_willing=options.cma)
        self._group_lane = GroupLane(self._group, self.rank) if self._group is not None else None
        self._telemetry = Telemetry(options.trace, self.rank)
        self._policy = None
        self.set_path_policy(options.path_policy)

    # -- set-up -------------------------------------------------------------
    def _exchange_identity(self, boot: Bootstrap, opts: Options):
        host = hostname()
        domain = opts.domain or host
        if boot.store is None:
            return [host], [domain]
        boot.store.set(f"info/{boot.rank}", json.dumps({"host": host, "domain": domain, "pid": os.getpid(),
                                                        "gpu_direct": self.gpu_direct,
                                                        "plane_rates": opts.plane_rates,
                                                        "measure_plan_rates": opts.measure_plan_rates}).encode())
        infos = [json.loads(v) for v in boot.store.gather("info", boot.size, opts.rendezvous_timeout_s)]
        _check_same_plane_rates(infos, boot.rank)
        self._pids = [i["pid"] for i in infos]
        # Every rank moves device arrays the same way (a device reduction's steps
        # differ between the two ways): GPU-direct only where every rank offers it.
        self.gpu_direct = all(i.get("gpu_direct", False) for i in infos)
        return [i["host"] for i in infos], [i["domain"] for i in infos]

    def _shm_willing(self, opts: Options) -> bool:
        """Whether this rank offers the shared-memory segments (transports/shm.py):
        asked for, one host, and 'up' the shared-memory plane that reaches the peer
        (on a testbed whose 'up' is shaped tcp, the segments would bypass it)."""
        up = self._planes.get(UP)
        return (opts.shm and shm.supported() and self.hosts[0] == self.hosts[1] and up is not None
                and not up.failable and up.reaches(1 - self.rank))

    def _group_willing(self, opts: Options) -> bool:
        """The group lane's condition, as _shm_willing's for a pair: every rank on
        this host and 'up' the shared-memory plane that reaches every peer."""
        up = self._planes.get(UP)
        return (opts.shm and shm.supported() and len(set(self.hosts)) == 1 and up is not None
                and not up.failable and all(up.reaches(r) for r in range(self.size) if r != self.rank))

    def _lost_local_peers(self) -> list[int]:
        """Ranks on this host whose process no longer exists.

        Liveness independent of the operation timeout: shared memory has no
        peer-failure handler at all, so a stalled operation asks the kernel
        whether each same-host peer's process is still there (remote peers
        are covered by the scale-out plane's endpoint errors). Ranks in other
        PID namespaces on a host of the same name are not supported.
        """
        pids = getattr(self, "_pids", None)
        if not pids:
            return []
        lost = []
        for rank, pid in enumerate(pids):
            if rank == self.rank or self.hosts[rank] != self.hosts[self.rank]:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                lost.append(rank)
            except PermissionError:
                pass  # exists, owned by someone else
        return lost

    @property
    def local_size(self) -> int:
        """How many ranks run on this rank's host."""
        return sum(1 for host in self.hosts if host == self.hosts[self.rank])

    def _derive_local_rank(self) -> int:
        return sum(1 for r in range(self.rank) if self.hosts[r] == self.hosts[self.rank])

    def _open_planes(self, opts: Options) -> dict:
        settings = plane_settings(opts, self.gpu_direct, one_host=len(set(self.hosts)) == 1)
        planes = {name: Plane(name, tls, dev, self.rank) for name, (tls, dev) in settings.items()}
        if self.gpu_direct:
            check_device_transports(planes)
        if self.size == 1:
            return planes
        store = self._boot.store
        for name, plane in planes.items():
            store.set(f"addr/{name}/{self.rank}", plane.address)
        for name, plane in planes.items():
            addresses = store.gather(f"addr/{name}", self.size, opts.rendezvous_timeout_s)
            for peer, address in enumerate(addresses):
                if peer == self.rank:
                    continue
                if name == UP and self.domains[peer] != self.domain:
                    continue  # the scale-up fabric stops at the domain's edge
                plane.connect(peer, address)
        _wire_up(planes, self.rank, opts.rendezvous_timeout_s)
        return planes

    def _make_controller(self):
        from .control import ControlConfig, PathController

        # Rates the user states (MPCCS_PLANE_RATES) replace the priors the tuner plans by and the
        # controller starts from; the priors were measured on the development machines (shm against
        # tcp on loopback, 7:1) and choose single-plane plans where the planes are closer than that.
        # Stated rates are also the planes' line rates: no estimate reads above them.
        stated = dict(self.options.plane_rates or ())
        priors = {**ControlConfig().prior_rate_Bps, **stated}
        config = ControlConfig(out_cap_share=self.options.out_cap_share, out_cap_rate_Bps=self.options.out_cap_rate_Bps,
                               start_on_one_plane=not stated, prior_rate_Bps=priors,
                               rate_ceiling_Bps=stated or None)
        self._prior_costs = {p: PathModel(config.prior_rate_Bps[p], config.prior_delay_s[p]) for p in ("up", "out")}
        controller = PathController(config, rank=self.rank)
        if {"up", "out"} <= set(stated):
            controller.split_pipelined_at(stated)
        return controller

    def _make_plan_rate_measurement(self) -> None:
        """Without stated rates, ranks in several domains measure their planes and agree on the
        rates the tuner plans by (control/plan_rates.py; docs/controller.md, Plan rates).

        Several domains only: there 'out' carries the cross-domain steps, so the tuner weighs
        the in-domain steps' split against them by the rates, and a single-plane plan keeps the
        in-domain steps off 'out' whatever the controller measures. In one domain the
        controller splits every stage by its own estimates, and the DAG's rates are no
        measure of 'up' where most calls take the shared-memory paths: 2 ranks on the
        default planes read 'up' at 850 MB/s through the DAG against its 5 GB/s prior."""
        from .control.plan_rates import AgreementClock, PlaneRateMeter

        self._plan_rates_source = "stated" if self.options.plane_rates else "priors"
        self._plan_events: list[dict] = []
        self._plane_meter = self._agreement_clock = None
        if (self.options.measure_plan_rates and not self.options.plane_rates and not self._one_domain
                and self.options.multipath and {UP, OUT} <= set(self._planes)):
            self._plane_meter, self._agreement_clock = PlaneRateMeter(), AgreementClock()

    @property
    def plan_rate_calls(self) -> int:
        """Calls measured so far for the ranks' agreements on the plan rates (the same count
        on every rank); 0 where the ranks do not measure them (rates stated, one domain)."""
        return self._agreement_clock.calls if self._agreement_clock is not None else 0

    @property
    def plan_rates(self) -> dict:
        """The rates (bytes/s) the tuner plans by, and where they came from: 'stated'
        (MPCCS_PLANE_RATES), 'priors', or 'measured' (agreed by every rank)."""
        return {"source": self._plan_rates_source,
                **{plane: model.rate_Bps for plane, model in self._prior_costs.items()}}

    @property
    def landing(self) -> Optional[dict]:
        """This rank's choices of where a 2-rank all_reduce flushes the lines it is about to
        write (control/landing.py): the mode; the size classes (each a power of two of
        bytes: half the call) whose in-place landings of the second read flush now
        ('flushing', where the pair reads across processes) and whose outboxes flush
        around their copy in ('outbox_flushing'); how often the choices changed. None
        where the pair has no shared-memory segments."""
        outbox, reads = self._engine.outbox_landing, self._engine.landing
        if outbox is None:
            return None
        return {"mode": outbox.mode, "flushing": reads.flushing_classes if reads is not None else [],
                "outbox_flushing": outbox.flushing_classes,
                "switches": outbox.switches + (reads.switches if reads is not None else 0)}

    def _agree_plan_rates(self) -> None:
        """Every rank at the same call: every rank's measured rates, the agreed ones made of them
        (control.plan_rates.agree: the lower median per plane, 0 where some rank has none), and
        the plan rebuilt from them where they differ enough from its rates; the highest, the
        line rates the controller's estimates are capped at."""
        from .control.plan_rates import agree, measured_everywhere, replan_rates

        measured = self._plane_meter.rates()
        # an all_gather as a sum all_reduce: each rank fills its own row of zeros (exact: x + 0 == x)
        rows = np.zeros((self.size, 2), dtype=np.float64)
        rows[self.rank] = (measured[UP], measured[OUT])
        self._run_control_op("plan_rates", rows.reshape(-1), "sum")
        readings = [{UP: float(up), OUT: float(out)} for up, out in rows]
        agreed, highest = agree(readings)
        self._agreement_clock.agreed(agreed)
        planned = {p: model.rate_Bps for p, model in self._prior_costs.items()}
        rates = replan_rates(agreed, planned)
        complete = measured_everywhere(agreed)
        self._plan_events.append({
            "kind": "plan_rates", "measured_Bps": measured,
            "by_rank_Bps": {p: [r[p] for r in readings] for p in (UP, OUT)},
            "agreed_Bps": agreed, "highest_Bps": highest, "planned_Bps": planned, "replanned": rates is not None,
            "pipelined_split_Bps": dict(agreed) if complete else None})
        if rates is not None:
            self._replan(rates, highest)
        if complete:
            self._engine.controller.split_pipelined_at(agreed)

    def _replan(self, rates: dict, highest: dict) -> None:
        """Plan by the agreed ``rates`` from now on, and restart the controller from them."""
        from .control import PathController

        self._prior_costs = {p: PathModel(rates[p], model.latency_s) for p, model in self._prior_costs.items()}
        self._plan_rates_source = "measured"
        self._forget_plans()
        # The controller starts again as under stated rates: from the agreed rates, with 'out' in
        # use, its estimates capped at the highest rates any rank measured (the line rates, as
        # far as the ranks can tell). Left as it was, it held 'out' dropped (start_on_one_plane)
        # until a probe showed a gain, and probes judge whole stages, which overlap in a
        # pipelined schedule. Capped at 1.1x the lowest instead, 'up' read 66 MB/s on a 62.5 MB/s
        # link beside 'out' at 45, and ranks put none of a 64 MiB all_reduce's in-domain bytes on
        # 'out' (1.01x 'up' against 1.25 with the stated rates as ceilings; testbed_2x2_s44). At
        # 1.1x the agreed (lower-median) rates all_reduce held, but a reduce_scatter's agreement
        # read 'out' at 92 MB/s, re-planned from it, and its 64 MiB points fell to 1.00x (s45).
        old = self._engine.controller.config
        config = dataclasses.replace(old, start_on_one_plane=False, prior_rate_Bps={**old.prior_rate_Bps, **rates},
                                     rate_ceiling_Bps=highest)
        self._engine.controller = PathController(config, rank=self.rank)

    def _forget_plans(self) -> None:
        """Drop every answer made from the plan rates: the plans and what depends on them."""
        self._plans.clear()
        Communicator._choose.cache_clear()
        for direct, protected in self._answers_by_policy.values():
            direct.clear()
            protected.clear()
        self._direct_answers.clear()
        self._protected_answers.clear()

    # -- public attributes -------------------------------------------------
    @property
    def planes(self) -> dict[str, list[int]]:
        """Which peers each plane reaches."""
        return {name: plane.peers for name, plane in self._planes.items()}

    @property
    def path_policy(self):
        return self._policy

    @property
    def adaptive_epoch(self) -> int:
        """Operations run under 'adaptive' at a size the controller may split, so
        far: the controller's shared clock (the same count on every rank), which
        places its probes (docs/controller.md)."""
        return self._epoch

    def set_path_policy(self, policy) -> None:
        """'up', 'out', 'adaptive', or a fixed fraction of bytes on 'up'."""
        policy = parse_policy(policy)
        if not self.options.multipath and policy != "up":
            raise ConfigError("multipath is disabled (MPCCS_MULTIPATH=0): only the 'up' policy is allowed")
        forced = UP if policy == "up" else OUT if policy == "out" else None
        if forced is not None and forced not in self._planes:
            raise ConfigError(
                f"path policy {policy!r} forces plane {forced!r}, which is disabled "
                f"(MPCCS_PLANES={','.join(self.options.planes)})"
            )
        if forced == UP and self.size > 1 and not self._planes[UP].peers and OUT not in self._planes:
            raise ConfigError("path policy 'up' but the scale-up plane reaches no peer and 'out' is disabled")
        if OUT not in self._planes and not self._one_domain:
            raise ConfigError("plane 'out' is disabled but ranks span several domains: nothing would reach them")
        self._policy = policy
        if policy not in self._answers_by_policy and len(self._answers_by_policy) >= MAX_POLICIES_REMEMBERED:
            self._answers_by_policy.clear()  # bounded: a sweep over many fixed fractions
        self._direct_answers, self._protected_answers = self._answers_by_policy.setdefault(policy, ({}, {}))

    def last_stats(self) -> Optional[dict]:
        """Record of the operation completed last (see Work.stats)."""
        if isinstance(self._last_stats, (Operation, LightRecord)):
            self._last_stats = self._last_stats.stats()
        return self._last_stats

    def metrics(self) -> dict:
        """Counters since init: bytes per plane, operations, fallbacks, caps, failures, errors."""
        return self._telemetry.counters.as_dict()

    def prometheus(self) -> str:
        """The counters in Prometheus' text exposition format."""
        from .telemetry import prometheus_text

        return prometheus_text(self.metrics(), self.rank)

    # -- lifecycle -------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise MpccsError("communicator is closed")
        if self._aborted:
            raise CommunicatorAborted(f"communicator was aborted: {self._aborted}")

    def close(self) -> None:
        if self._closed:
            return
        if self.size > 1 and not self._aborted:
            try:
                self.barrier()
            except MpccsError:
                pass
        self._closed = True
        self._lane = self._group_lane = None  # (their slot views of the segments go first)
        if self._engine.shm is not None:
            self._engine.shm.close()
            self._engine.shm = None
        if self._group is not None:
            self._group.close()
            self._group = None
        for plane in self._planes.values():
            plane.close()
        self._telemetry.close()
        self._boot.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- running operations -------------------------------------------------
    def _splitter(self, single_plane: bool = False, settled: bool = False) -> Splitter:
        policy = self._policy
        if single_plane and policy == "adaptive":
            policy = "up"  # the tuner found a second plane does not pay at this size
        name = None
        if settled and policy == "adaptive":
            # Nothing to decide (controller.settled): run as 'up', without the
            # ~50 us of planning and feedback; still 'adaptive' to the peers
            # (estimates piggybacked) and in the statistics.
            policy, name = "up", "adaptive"
        return Splitter(policy, self._engine.health.live(), DEFAULT_WINDOW_BYTES, self._engine.controller,
                        self._engine.decisions, name, same_domain=self.topology.same_domain)

    def _submit(self, op: Operation, result, async_op: bool):
        op.on_finish.append(self._record)
        self._engine.submit(op)
        if async_op:
            return Work(self, op, result)
        self._wait_usable(op, None)  # nothing since the caller's check can have closed or aborted it
        return result

    def _records_light(self) -> bool:
        """Whether a successful operation now needs no record but its counts:
        no trace to write, no plane or controller events to attach to it."""
        controller = self._engine.controller
        return (not self._engine.health.events and not self._telemetry.tracing and not self._plan_events
                and (controller is None or not controller.has_events()))

    def _record(self, op: Operation) -> None:
        health, controller = self._engine.health, self._engine.controller
        if op.error is None and op.stats_are_light and self._records_light():
            # A direct or two-step operation: count it now, build its record
            # only if asked (last_stats) - ~2 us of an ~25 us call, ~10 us of a
            # two-step one.
            self._telemetry.counters.count_light(op.name, op.bytes_per_plane)
            self._last_stats = op
            return
        stats = op.stats()
        events = health.take_events()  # plane rejoins
        if controller is not None:
            # Why the split changed: drops and re-adds with their evidence.
            events += [{"kind": "controller", **e} for e in controller.take_events()]
        events += self._plan_events  # the plan rates' agreements (_agree_plan_rates)
        self._plan_events = []
        if events:
            stats["events"] = stats.get("events", []) + events
        if op.error is None:
            self._last_stats = stats
        else:
            stats["error"] = str(op.error)
        self._telemetry.record(stats)

    def _wait(self, op: Operation, timeout: Optional[float]) -> None:
        self._check_usable()
        self._wait_usable(op, timeout)

    def _wait_usable(self, op: Operation, timeout: Optional[float]) -> None:
        try:
            self._engine.wait(op, self.options.timeout_s if timeout is None else timeout)
        except TransportError as exc:
            self._abort(op, exc, str(exc))
            raise
        except MismatchError as exc:
            # A point-to-point size mismatch is caught before any byte moves and
            # leaves both ends consistent; a collective one leaves chunks of a
            # half-run schedule behind, so the communicator cannot be trusted.
            if not isinstance(op, (SendOp, RecvOp)):
                self._abort(op, exc, str(exc))
            raise
        except Exception as exc:
            # Anything else escaping an operation (a UCX error type mpccs does not
            # wrap yet) leaves it half-run: never let the next call reuse the state.
            self._abort(op, exc, f"{type(exc).__name__}: {exc}")
            raise

    def _abort(self, op: Operation, exc: BaseException, reason: str) -> None:
        """Mark the communicator aborted and tell the other ranks why, over the
        planes left, unless they know already: a peer blocked in an operation
        with this rank (a point-to-point receive whose sender's plane failed)
        then fails within milliseconds instead of at its own no-progress timeout."""
        self._aborted = reason
        if getattr(exc, "peers_told", False):
            return
        lost = set(getattr(exc, "lost_ranks", ()))
        peers = [r for r in range(self.size) if r != self.rank and r not in lost]
        self._engine.broadcast_abort(peers, getattr(op, "wire_seq", op.seq),
                                     f"{op.name} #{op.seq} failed on rank {self.rank}: {reason}")

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # -- point-to-point -----------------------------------------------------
    def _check_peer(self, peer, name: str) -> int:
        if not isinstance(peer, (int, np.integer)) or not 0 <= int(peer) < self.size:
            raise ValueError(f"{name}={peer!r} is not a rank of this communicator (size {self.size})")
        if int(peer) == self.rank:
            raise ValueError(f"{name}={peer} is this rank; use a local copy")
        return int(peer)

    def isend(self, buf, dst: int) -> Work:
        self._check_usable()
        dst = self._check_peer(dst, "dst")
        if staging.is_device_array(buf):
            return self._via_host({"buf": buf}, ["buf"], [], None, lambda h: self.isend(h["buf"], dst), True,
                                  any_dtype=True)
        view = arrays.check_bytes(buf, "buf")
        seq = self._send_seq.get(dst, 0) + 1
        self._send_seq[dst] = seq
        chunk = self.options.chunk_bytes or DEFAULT_CHUNK_BYTES
        return self._submit(SendOp(self._engine, seq, view, dst, self._splitter(), chunk), None, True)

    def irecv(self, buf, src: int) -> Work:
        self._check_usable()
        src = self._check_peer(src, "src")
        if staging.is_device_array(buf):
            return self._via_host({"buf": buf}, [], ["buf"], "buf", lambda h: self.irecv(h["buf"], src), True,
                                  any_dtype=True)
        view = arrays.check_bytes(buf, "buf", writable=True)
        seq = self._recv_seq.get(src, 0) + 1
        self._recv_seq[src] = seq
        return self._submit(RecvOp(self._engine, seq, view, src, self.options.chunk_bytes or DEFAULT_CHUNK_BYTES), buf, True)

    def send(self, buf, dst: int) -> None:
        self.isend(buf, dst).wait()

    def recv(self, buf, src: int):
        return self.irecv(buf, src).wait()

    # -- device arrays ---------------------------------------------------------
    def _via_host(self, device_arrays: dict, loads, outputs, result, call, async_op, *, any_dtype=False):
        """The same call on pinned host mirrors of device arrays (mpccs.staging):
        ``call`` gets the mirrors by name and returns the host Work; outputs are
        copied back when it completes. ``result`` names the array returned."""
        staged = staging.StagedCall(device_arrays, loads=loads, outputs=outputs, any_dtype=any_dtype)
        work = staging.DeviceWork(self, call(staged.host), staged, device_arrays.get(result) if result else None)
        return work if async_op else work.wait()

    def _device_reduces(self, kind: str, send) -> bool:
        """Reduce device arrays on the device (config.DEVICE_REDUCE_MODES)? The same answer
        on every rank: it depends on the configuration (GPU-direct is agreed at init) and
        the call only. 'auto' does wherever the call goes GPU-direct: no byte crosses PCIe."""
        mode = self.options.device_reduce
        if mode != "auto":
            return mode == "always"
        return self._gpu_direct_for(send.nbytes, kind) or (kind != "all_reduce"
                                                            and send.nbytes >= DEVICE_REDUCE_AUTO_MIN_BYTES)

    def _gpu_direct_for(self, call_bytes: Optional[int], kind: Optional[str] = None) -> bool:
        """GPU-direct for a call of this size (None: any size)? The same answer on
        every rank for the same call: GPU-direct is agreed at init, and whether the
        pair reads across processes at set-up (_pair_reads)."""
        if not self.gpu_direct or call_bytes is None:
            return self.gpu_direct
        reads = kind in ("all_reduce", "reduce_scatter") and self._pair_reads()
        return call_bytes >= (GPU_DIRECT_READS_MIN_BYTES if reads else GPU_DIRECT_MIN_BYTES)

    def _pair_reads(self) -> bool:
        """A 2-rank pair whose host calls under 'up' or 'adaptive' may read across
        processes: both ranks agreed at set-up (transports/shm.py), so every rank
        answers alike."""
        pair = self._engine.shm
        return pair is not None and pair.cma and self._policy in (UP, "adaptive")

    def _group_reads(self) -> bool:
        """3 to 8 ranks whose group reads across processes (transports/shm_group.py),
        under policy 'up' or 'adaptive' (why 'adaptive' too: _direct_by_cma)."""
        group = self._group
        return group is not None and group.cma and self._policy in (UP, "adaptive")

    def _moves_on_device(self, device_arrays: dict, any_size: bool = False) -> bool:
        """Whether a data-movement call's device arrays go to the planes as they are
        (GPU-direct, validated here) rather than through host mirrors: from
        GPU_DIRECT_MIN_BYTES of its larger buffer (``any_size``: at every size). A
        call whose arrays are all empty takes the mirrors: it moves nothing either way."""
        present = [a for a in device_arrays.values() if a is not None]
        if not self._gpu_direct_for(None if any_size else max(a.nbytes for a in present)):
            return False
        staging.check_device_arrays(device_arrays)
        return any(a.size for a in present)

    def _run_on_device(self, name, plan: "CallPlan", buffers: dict, result, async_op: bool):
        """A data-movement collective on device views through the DAG engine (the
        direct and two-step paths read host memory); UCX moves the chunks."""
        staging.sync_current_stream()
        staged = staging.DirectCall(staging.CupyBackend(int(buffers["in"].device.id)))  # validated by the caller
        host_work = self._run(name, plan, buffers, buffers["in"].dtype, "sum", result, True)
        work = staging.DeviceWork(self, host_work, staged, result)
        return work if async_op else work.wait()

    def _reduce_on_device(self, kind, send, out, op, root, async_op, result, backend=None, direct=None):
        """A reduction of device arrays with the arithmetic on the device
        (mpccs.staging.DeviceReduction); arguments already validated. ``direct``
        (default: GPU-direct planes) runs both steps on the arrays themselves.
        ``backend`` and ``direct`` are for the CPU tests, which run the same steps on numpy."""
        backend = backend or staging.backend_for({"send": send, "recv": out})
        direct = self._gpu_direct_for(send.nbytes) and backend.name == "cupy" if direct is None else direct
        red = staging.DeviceReduction(backend, kind, send.reshape(-1), None if out is None else out.reshape(-1),
                                      op, self.rank, self.size, root,
                                      lambda name, *args: getattr(self, name)(*args, async_op=True), direct=direct)
        work = staging.DeviceWork(self, red.start(), red, result)
        return work if async_op else work.wait()

    def _annotate_last_stats(self, work: Work, **extra) -> None:
        """Add ``extra`` to last_stats when it is still ``work``'s record."""
        op, last = work._op, self._last_stats
        if last is op or (isinstance(last, dict) and last.get("seq") == op.seq and last.get("op") == op.name):
            self.last_stats().update(extra)

    # -- collectives ---------------------------------------------------------
    def _schedule(self, collective: str, count: int, nbytes: int, root=None, algorithm=None, **extra) -> "CallPlan":
        """The schedule and plan of one call: MPCCS_TUNE, else the tuner (deterministic: the same on every rank).
        Kept by the call's arguments (256 kept): a repeated call finds its plan in one
        dict lookup (the tuner's choice and the key's assembly cost ~7 us a call cold)."""
        key = (collective, count, nbytes, root, algorithm, tuple(sorted((k, _hashable(v)) for k, v in extra.items()))
               if extra else ())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(collective, count, nbytes, root, algorithm, extra)
            if len(self._plans) > 256:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def _make_plan(self, collective: str, count: int, nbytes: int, root, algorithm, extra: dict) -> "CallPlan":
        choice = self._choose(collective, nbytes)
        algorithm = algorithm or choice.algorithm
        if algorithm not in algorithms.ALGORITHMS[collective]:
            raise ValueError(f"unknown algorithm {algorithm!r} for {collective}; "
                             f"valid: {', '.join(algorithms.ALGORITHMS[collective])}")
        channels = choice.channels if algorithm == choice.algorithm else 1
        schedule = algorithms.build_schedule(collective, self.size, count, algorithm=algorithm,
                                             topology=self.topology, channels=channels, root=root or 0, **extra)
        return CallPlan(schedule, self.options.chunk_bytes or choice.chunk_bytes, choice.split_policy == "single")

    @functools.lru_cache(maxsize=1024)
    def _choose(self, collective: str, nbytes: int):
        """Tuner choice from the configured priors only, so every rank picks the same plan."""
        from .control.tuner import choose

        return choose(collective, self.size, nbytes, self.topology, self._prior_costs, override=self._tune,
                      reduce_Bps=REDUCE_BPS_PRIOR)

    def _run(self, name, plan: "CallPlan", buffers, dtype, op, result, async_op, finalize=None,
             two_step: bool = False):
        """``two_step``: the call may run on the two-step executor (_two_step_call)."""
        self._check_usable()
        schedule = plan.schedule
        health = self._engine.health
        if health.down:
            health.try_rejoin(time.perf_counter())
        nbytes = schedule.count * np.dtype(dtype).itemsize
        meter = self._measure_plan_rates(name, nbytes)
        protected = self._protected(nbytes, plan.single_plane)
        epoch = None
        if self._policy == "adaptive" and self._multipath_eligible(nbytes, plan.single_plane):
            self._epoch += 1  # the same count on every rank: the controller's shared clock
            epoch = self._epoch
        controller = self._engine.controller
        # Whether 'out' may carry bytes of this operation anywhere: asked once (it feeds
        # settled, the failable-plane promise and the estimates export; ~3 us a question).
        out_usable = epoch is None or controller.may_use(OUT, epoch)
        settled = not out_usable and controller.settled(epoch, nbytes, out_usable=False)
        splitter = self._splitter(single_plane=plan.single_plane, settled=settled)
        carries = self._may_carry_failable(out_usable) if protected and self._policy == "adaptive" else None
        one_plane = settled or carries is False or (epoch is not None and controller.sends_on_one_plane(epoch))
        chunk_bytes, whole_flows = self._chunking_for(plan, one_plane)
        fp = None
        if self.options.fingerprint:
            count = None if name == "all_to_allv" else schedule.count
            fp = fingerprint.make(name, op, dtype, schedule.algorithm, schedule.root, chunk_bytes, count, protected,
                                  whole_flows)
        snapshot, unsaved, resume = None, False, False
        reduces_into_input = name in ("all_reduce", "reduce", "reduce_scatter")
        if protected and reduces_into_input and np.shares_memory(buffers["in"], buffers["out"]):
            # A retry cannot restart from an input the first attempt reduced
            # over (in place, a ring reduce_scatter's last step reduces into the
            # rank's own input block). Where the schedule allows, it resumes over the buffers as
            # left instead (algorithms/resume.py); otherwise it restarts from a
            # copy. Under 'adaptive', when every rank has 'out' dropped with no
            # probe due (the piggybacked flags say so), skip the copy: a failure
            # then aborts cleanly instead of retrying (docs/reliability.md).
            if resumable_in_place(schedule):
                resume = True
            elif carries is False:
                unsaved = True
            else:
                snapshot = buffers["in"].copy()
        two_step = two_step and fp is not None and self._sends_on_up_only(protected, epoch, carries)
        cop = CollectiveOp(self._engine, self._next_seq(), schedule, buffers, dtype, op, splitter,
                           chunk_bytes, name, finalize, fp, protected=protected, snapshot=snapshot,
                           input_unsaved=unsaved, epoch=epoch, carries_failable=carries, whole_flows=whole_flows,
                           resume_in_place=resume, two_step=two_step, settled=settled, plane_meter=meter)
        return self._submit(cop, result, async_op)

    def _measure_plan_rates(self, name: str, nbytes: int):
        """The plane meter where this call is measured, else None; first, where the clock
        says so, the ranks agree on the plan rates (every rank at the same call: the
        calls run here are the same on every rank, and so are their sizes).

        Every measured call counts for the clock, but only calls under 'adaptive'
        feed the meter: the agreed rates split its stages, and a plane is read true
        only where its load is the one those splits give it. Under another policy a
        plane may carry a small part (under 'up', 'out' takes only the cross-domain
        steps), its messages land in the socket buffers before this rank looks for
        them or after it waited for a late peer, and its rate reads anywhere from
        0.5x to 2.5x the link's: on 2 domains of 2 at 1 / 1 Gbit/s, 40 operations
        under 'up' (mpccs-perf --settle's baseline) left 'out' agreed at 77 MB/s on
        one run and 198 on another (125 shaped), and 'adaptive' then put 1/8 or 3/8
        of its in-domain bytes on 'out' instead of 1/4, 12-15% slower, until the
        next agreement (bench/results/testbed_2x2_s48/)."""
        clock = self._agreement_clock
        if clock is None or not clock.measured(name, nbytes):
            return None
        if clock.tick():
            self._agree_plan_rates()
        return self._plane_meter if self._policy == "adaptive" else None

    def _chunking_for(self, plan: "CallPlan", sends_on_one_plane: bool) -> tuple[int, bool]:
        """How this rank cuts its flows: (chunk bytes, whole flows). The tuner's chunk,
        and at least 4 chunks a flow, let a split land near its share; a rank that
        sends on one plane only in this operation (a single-plane policy or plan, or
        'adaptive' settled on 'up') needs no such granularity and sends each flow in
        chunks of up to 1 MiB, no finer: per-chunk work was what it paid for (all_reduce
        on 'up', interleaved A/B, two runs each: 1 MiB chunks over the tuner's
        1.29-1.34x at 1 MiB, 1.21-1.23x at 2 MiB, 1.08-1.10x at 8 MiB; then whole flows
        over 4 chunks a flow 1.16x at 256 KiB, 1.39-1.40x at 512 KiB, 1.32-1.36x at
        1 MiB, 1.24x at 2 MiB, 1.02-1.06x at 4 MiB). Receivers learn a sender's
        chunking from its fingerprint, so ranks need not agree; without fingerprints,
        or with MPCCS_CHUNK set, every rank keeps the planned chunking. The pipelined
        chain keeps the tuner's: there the chunk sets the overlap."""
        if (self.options.chunk_bytes is not None or not self.options.fingerprint
                or plan.schedule.algorithm == "pipeline"):
            return plan.chunk_bytes, False
        policy = self._policy
        # (the tuner's single-plane hint binds 'adaptive' only: a fixed fraction splits whatever it says)
        one_plane = (policy in (UP, OUT) or len(self._planes) < 2
                     or (policy == "adaptive" and (plan.single_plane or sends_on_one_plane)))
        if not one_plane:
            return plan.chunk_bytes, False
        return max(plan.chunk_bytes, SINGLE_PLANE_CHUNK_BYTES), True

    def _two_step_call(self, collective: str, algorithm, block_bytes: int, call_bytes: int) -> bool:
        """An all_reduce, reduce_scatter or all_gather the two-step executor may run
        (collective_op.CollectiveOp offers it to the peer, which must offer it too): 2 ranks in
        one domain, no algorithm asked for (by argument or MPCCS_TUNE), fingerprints on
        (the offer rides on them), and blocks (an all_reduce's halves) within the buffer
        the engine keeps for them (two_step.MAX_HALF_BYTES)."""
        return (self.size == 2 and self.options.two_step and self.options.fingerprint and algorithm is None
                and self._one_domain and block_bytes <= TWO_STEP_MAX_HALF_BYTES
                and self._tune.match(collective, call_bytes) is None)

    def _sends_on_up_only(self, protected: bool, epoch: Optional[int], carries: Optional[bool]) -> bool:
        """Every byte this rank sends in the call goes on 'up', which reaches the peer
        and cannot fail: policy 'up', or 'adaptive' below the multipath size, or with
        'out' dropped (the promise CollectiveOp declares). Then the two-step executor,
        which sends on the control plane, changes no plane a byte takes."""
        if UP in self._engine.health.down:
            return False
        if carries is False:  # a promise made only where 'up' reaches every rank and cannot fail
            return True
        if not self._up_reaches_all_unfailing():
            return False
        if self._policy == UP:
            return not protected
        return self._policy == "adaptive" and epoch is None and not protected

    def _multipath_eligible(self, nbytes: int, single_plane: bool) -> bool:
        """An adaptive call the controller may split (deterministic: the same on every rank)."""
        return not single_plane and nbytes >= self._engine.controller.config.min_multipath_bytes

    def _may_carry_failable(self, out_usable: bool) -> bool:
        """Whether this rank may put bytes of an adaptive operation on a failable
        plane: False only when 'out' is dropped here and at every rank we heard
        from with no probe due (``out_usable``: controller.may_use), 'up' reaches
        every rank and cannot fail itself. False is a promise the operation keeps (it
        sends on 'up' only) and declares to its peers (engine._resolve_protection)."""
        return out_usable or not self._up_reaches_all_unfailing()

    def _up_reaches_all_unfailing(self) -> bool:
        """'up' exists, reaches every other rank and cannot fail itself (shared memory):
        what a rank must know before it promises to send on 'up' alone."""
        up = self._planes.get(UP)
        return up is not None and not up.failable and all(up.reaches(r) for r in range(self.size) if r != self.rank)

    def _protected(self, nbytes: int, single_plane: bool) -> bool:
        """Whether a call runs under the failover protocol (the same answer on every rank:
        it depends on the configuration and the call only, never on local plane state).

        Protection pays for a completion round, and for in-place reductions a
        copy of the input, so it applies only where a network plane (one that
        can fail while the processes live) may carry bytes and another plane
        reaches every rank to take over.
        """
        key = (nbytes, single_plane)
        answer = self._protected_answers.get(key)
        if answer is None:
            if len(self._protected_answers) > 1024:
                self._protected_answers.clear()
            answer = self._protected_answers[key] = self._decide_protected(nbytes, single_plane)
        return answer

    def _decide_protected(self, nbytes: int, single_plane: bool) -> bool:
        if not self.options.failover or self.size == 1 or len(self._planes) < 2 or not self._one_domain:
            return False
        policy = self._policy
        if policy == "adaptive":
            carriers = {UP, OUT} if self._multipath_eligible(nbytes, single_plane) else {UP}
        elif policy in (UP, OUT):
            carriers = {policy}
        else:
            carriers = {p for p, share in ((UP, policy), (OUT, 1.0 - policy)) if share > 0}
        return any(self._planes[p].failable for p in carriers)

    def _direct(self, collective: str, count: int, itemsize: int, algorithm, call_bytes: int, root=None) -> bool:
        """Whether a call takes one message per peer (direct_ops.DirectAllReduceOp and
        DIRECT_OPS) instead of the DAG engine: small calls of every collective
        but all_to_allv always, unless an algorithm is asked for (by argument or
        MPCCS_TUNE); medium ones where the DAG would run them on the control
        plane alone. count x itemsize: the bytes a rank sends each peer;
        call_bytes: what the tuner sizes the call by. The answer depends on the
        configuration, the path policy and the call only: kept per call until the
        policy changes (the medium test plans the call: ~15 us cold at 2 MiB)."""
        if count * itemsize <= DIRECT_MAX_BYTES:
            return self._decide_direct(collective, count, itemsize, algorithm, call_bytes, root)  # no planning
        key = (collective, count, itemsize, algorithm, call_bytes, root)
        answer = self._direct_answers.get(key)
        if answer is None:
            if len(self._direct_answers) > 1024:
                self._direct_answers.clear()
            answer = self._direct_answers[key] = self._decide_direct(collective, count, itemsize, algorithm,
                                                                     call_bytes, root)
        return answer

    def _decide_direct(self, collective: str, count: int, itemsize: int, algorithm, call_bytes: int, root) -> bool:
        if algorithm is not None or not 1 < self.size <= DIRECT_MAX_RANKS \
                or self._tune.match(collective, call_bytes) is not None:
            return False
        return (count * itemsize <= DIRECT_MAX_BYTES or self._in_group_lane(collective, count * itemsize, call_bytes)
                or self._direct_by_pipe(collective, count * itemsize)
                or self._direct_by_cma(collective, count * itemsize, call_bytes)
                or self._direct_by_outboxes(collective, call_bytes)
                or self._direct_medium(collective, count, itemsize, call_bytes, root))

    def _in_group_lane(self, collective: str, block_bytes: int, call_bytes: int) -> bool:
        """A call the group lane carries (group_lane_ops.takes_group_lane) under policy
        'up' or 'adaptive', as _direct_medium's: one whose rank's block is above the
        direct path's small bound would otherwise go by that path's own rules, which
        sent a 4-rank all_gather of 640 KiB to the DAG (its last stage sends 1.25 MiB):
        3.2-4.0 ms against 0.4-0.6 for MPICH."""
        return self._policy in (UP, "adaptive") and takes_group_lane(
            self._group, collective, _input_bytes(collective, block_bytes, call_bytes))

    def _direct_medium(self, collective: str, count: int, itemsize: int, call_bytes: int, root=None) -> bool:
        """Where the DAG would send every byte on the control plane, unprotected:
        policy 'up', or 'adaptive' where no rank sends min_multipath_bytes in any
        stage of the schedule the tuner picks (the engine splits no smaller
        stage), in one domain, with p - 1 messages of count x itemsize per rank
        within DIRECT_MEDIUM_BUDGET. The same answer on every rank that set the
        same path policy (configuration and call only). 'up' follows the same
        bound as 'adaptive' so that the two run the same way at every size."""
        if (count * itemsize * (self.size - 1) > DIRECT_MEDIUM_BUDGET or not self._one_domain
                or self._policy not in (UP, "adaptive") or self._protected(call_bytes, single_plane=True)):
            return False
        plan = self._schedule(collective, count, call_bytes, root=root)
        return (plan.single_plane
                or plan.schedule.max_stage_send() * itemsize < self._engine.controller.config.min_multipath_bytes)

    def _direct_by_pipe(self, collective: str, block_bytes: int) -> bool:
        """A 2-rank call whose part pipe_steps.takes (a broadcast or reduce above the
        lane's bound up to the outbox's 2 MiB; on a pair that does not read across
        processes, an all_gather's block up to 768 KiB too, and larger broadcasts and
        reduces round the outbox: PIPE_MAX_BYTES_WITHOUT_READS), on a pair with the
        segments open, under policy 'up' or 'adaptive' (why 'adaptive' too:
        _direct_by_cma), goes through the outboxes in chunks
        (direct_ops.DirectPipeBlocksOp). The same answer on every rank."""
        pair = self._engine.shm
        return (pair is not None and self._policy in (UP, "adaptive")
                and pipe_steps.takes(collective, block_bytes, pair.cma))

    def _direct_by_cma(self, collective: str, block_bytes: int, call_bytes: int) -> bool:
        """On a pair that reads across processes (transports/shm.py: both ranks agreed
        at set-up), under policy 'up' or 'adaptive': a 2-rank all_reduce from
        DIRECT_SHM_MIN_BYTES to DIRECT_CMA_MAX_BYTES, or reduce_scatter /
        all_gather / all_to_all with blocks in DIRECT_CMA_BLOCK_BYTES (broadcast,
        reduce: a buffer in it), takes the direct path on 'up' alone, reading from
        the peer (cma_steps.py).

        Under 'adaptive' this takes the call from the controller: both ranks are on
        one host and 'up' is shared memory the ranks copy themselves, so the copy is
        bound by the ranks' own cores and memory, which a second plane on the same
        host (tcp through the same kernel and cores) shares rather than adds to; on
        these machines the controller, measuring, dropped 'out' at every such size,
        and its planning and probes cost 4-6% of the call (bench/adaptive_cost.py).
        A testbed whose 'up' is a network has no segments, so its calls stay the
        controller's. The same answer on every rank (configuration and call only)."""
        if self._group_reads():
            return takes_group_reads(self._group, collective, _input_bytes(collective, block_bytes, call_bytes))
        if not self._pair_reads():
            return False
        if collective == "all_reduce":
            return DIRECT_SHM_MIN_BYTES <= call_bytes <= DIRECT_CMA_MAX_BYTES
        low, high = DIRECT_CMA_BLOCK_BYTES
        return collective in CMA_BLOCK_COLLECTIVES and low <= block_bytes <= high

    def _direct_by_outboxes(self, collective: str, call_bytes: int) -> bool:
        """On a pair with the segments open that does not read across processes,
        under policy 'up' or 'adaptive' (why 'adaptive' too: _direct_by_cma): a
        2-rank all_reduce from DIRECT_SHM_MIN_BYTES to DIRECT_OUTBOX_MAX_BYTES
        takes the direct path through the outboxes, in rounds where its halves are
        larger (shm_steps.py). The same answer on every rank."""
        pair = self._engine.shm
        return (collective == "all_reduce" and pair is not None and not pair.cma
                and self._policy in (UP, "adaptive") and DIRECT_SHM_MIN_BYTES <= call_bytes <= DIRECT_OUTBOX_MAX_BYTES)

    def _run_direct(self, name, send, out, op, result, async_op, finalize=None, root=None):
        if takes_lane(self._engine.shm, name, send):
            return self._run_lane(self._lane, LaneOp, name, send, out, op, result, async_op, finalize, root)
        if takes_group_lane(self._group, name, send.nbytes):
            return self._run_lane(self._group_lane, GroupLaneOp, name, send, out, op, result, async_op, finalize,
                                  root)
        # Always the control plane (scale-up where it reaches): both ends must
        # agree on the plane without a round trip, and plane state (a plane
        # down, rejoining) may differ between ranks for a moment.
        kind = DIRECT_OPS.get(name, DirectAllReduceOp)  # all_reduce and barrier: DirectAllReduceOp
        engine = self._engine
        segments, extra = engine.shm, {} if root is None else {"root": root}
        if self._group_reads() and takes_group_reads(self._group, name, send.nbytes):
            kind, segments, extra = GroupReadsOp, self._group, {"group": self._group}
        elif name == "all_reduce" and self._through_segments(send):
            kind = DirectShmAllReduceOp
        elif name in CMA_BLOCK_COLLECTIVES:
            block = _block_bytes(name, send, out, self.size)
            if self._direct_by_pipe(name, block):
                kind = DirectPipeBlocksOp
            elif self._direct_by_cma(name, block, 0):
                kind = DirectShmBlocksOp
        elif name == "all_reduce" and send.nbytes >= DIRECT_BLOCKS_MIN_BYTES:
            kind = DirectBlocksAllReduceOp
        fp = self._direct_fingerprint(name, op, send, kind.algorithm, root)  # (every caller checked usability)
        if issubclass(kind, DirectShmAllReduceOp) and not async_op and not engine.active \
                and engine.shm_holder is None and self._records_light():
            return self._run_steps_alone(kind, segments, name, send, out, op, fp, result, finalize, extra, root)
        dop = kind(engine, self._next_seq(), send, out, op, self.size, fp, finalize, name, **extra)
        return self._submit(dop, result, async_op)

    def _run_steps_alone(self, kind, segments, name, send, out, op, fp, result, finalize, extra, root):
        """A blocking call through the segments (``segments``: the pair's, or the
        group's for GroupReadsOp) with nothing else in flight: its steps run here
        without an operation (direct_ops.run_steps_alone, as the lane's exchange);
        what they do not finish, an operation takes over where they stopped (its
        meeting, sleep, stall watch), and a failed step fails that operation (its
        abandon, the abort)."""
        engine, seq, t_start = self._engine, self._next_seq(), time.perf_counter()
        root = 0 if root is None else root
        steps = kind.publish(segments, engine, seq, name, send, out, op, fp, root)
        failure = None
        try:
            done, met = run_steps_alone(segments, seq, steps, fp, None if segments is engine.shm else segments.peers,
                                        yields=engine.oversubscribed)
        except BaseException as exc:  # noqa: BLE001 - failed as the operation's own advance would (Operation.advance)
            failure, done, met = exc, False, True
        if done:
            self._finished_alone(name, seq, kind.peer_bytes(name, send, self.rank, root, self.size), t_start,
                                 kind.algorithm, finalize, getattr(steps, "marks", None))
            return result
        dop = kind(engine, seq, send, out, op, self.size, fp, finalize, name, **extra,
                   started=StartedSteps(steps, met, t_start))
        dop.on_finish.append(self._record)
        if failure is None:
            engine.submit(dop)
        else:
            dop._fail(failure)
        self._wait_usable(dop, None)
        return result

    def _finished_alone(self, name: str, seq: int, nbytes: int, t_start: float, algorithm: str, finalize,
                        marks: Optional[list] = None) -> None:
        """A call that ran without an operation (the lane's exchange, steps run alone)
        is done: its finalize, its counts, and a record built only if asked (with the
        steps' timeline where they keep one: ``marks``)."""
        if finalize is not None:
            finalize()
        self._telemetry.counters.count_light(name, {UP: nbytes, OUT: 0})
        self._last_stats = LightRecord(name, seq, nbytes, t_start, time.perf_counter(), algorithm, marks)

    def _direct_fingerprint(self, name, op, send, algorithm: str, root):
        """A direct or lane call's fingerprint (None: fingerprints off)."""
        if not self.options.fingerprint:
            return None
        return fingerprint.make(name, op, send.dtype, algorithm, root, 0, send.size)

    def _run_lane(self, lane, kind, name, send, out, op, result, async_op, finalize, root):
        """A call through a lane (``lane``: the 2-rank Lane or the GroupLane; ``kind``:
        its operation, LaneOp or GroupLaneOp): a call with nothing else in flight
        exchanges by itself (no Operation, its record built only if asked; an async
        one whose peers are there at once gets a Work that is already done, 38 -> 24
        us for 8 bytes and its wait on 2 ranks); whatever that does not finish, an
        operation takes over, posted or not, run alone first where it can be."""
        fp = self._direct_fingerprint(name, op, send, kind.algorithm, root)
        seq, engine, posted = self._next_seq(), self._engine, False
        parts = lane.parts(name, send, root)
        if not engine.active and self._records_light():
            # An async call looks for its peers a moment, not PEER_SPIN_S: it must not block.
            t_start = time.perf_counter()
            outcome = lane.exchange(seq, name, send, out, op, root, parts, fingerprint_words(fp),
                                    spin_s=0.0 if async_op else direct_ops.PEER_SPIN_S)
            if outcome == LANE_DONE:
                self._finished_alone(name, seq, parts[0].nbytes, t_start, kind.algorithm, finalize)
                return Work(self, self._last_stats, result) if async_op else result
            posted = outcome == LANE_POSTED
        lane_op = kind(engine, seq, send, out, op, fp, finalize, name, lane=lane, parts=parts, root=root,
                       posted=posted)
        lane_op.on_finish.append(self._record)
        if async_op or engine.active:
            lane_op.advance()  # one look: a peer already there finishes it now
        elif lane_op.run_alone():
            self._wait_usable(lane_op, None)  # (raises its error, aborting where due)
            return result
        if not lane_op.finished:
            engine.submit(lane_op)
        if async_op:
            return Work(self, lane_op, result)
        self._wait_usable(lane_op, None)
        return result

    def _through_segments(self, send: np.ndarray) -> bool:
        """A direct all_reduce the shared-memory segments carry (DirectShmAllReduceOp):
        2 ranks with the segments open, from DIRECT_SHM_MIN_BYTES, halves within the
        outbox, or up to DIRECT_CMA_MAX_BYTES where the pair reads across processes,
        DIRECT_OUTBOX_MAX_BYTES where it does not (the outboxes in rounds)."""
        pair = self._engine.shm
        if send.nbytes < DIRECT_SHM_MIN_BYTES or pair is None:
            return False
        bound = DIRECT_CMA_MAX_BYTES if pair.cma else DIRECT_OUTBOX_MAX_BYTES
        return shm_steps.fits(send.nbytes - send.nbytes // 2) or send.nbytes <= bound

    def _avg(self, op, buf):
        return (lambda: finish_avg(buf, self.size)) if op == "avg" else None

    def all_reduce(self, send, recv=None, op: str = "sum", *, async_op: bool = False, algorithm=None):
        """Reduce ``send`` over all ranks into ``recv`` (in place when recv is None)."""
        self._check_usable()
        # numpy arrays pass with two type checks: the 8-byte all_reduce is the latency figure
        if (type(send) is not np.ndarray or (recv is not None and type(recv) is not np.ndarray)) \
                and staging.any_on_device(send, recv):
            staging.check_device_arrays({"send": send, "recv": recv})
            if self._device_reduces("all_reduce", send):
                out = send if recv is None else recv
                arrays.same_dtype(send, out)
                arrays.check_size(out.size, send.size, "recv")
                arrays.check_op(op, send.dtype)
                return self._reduce_on_device("all_reduce", send, out, op, None, async_op, out)
            out = "send" if recv is None else "recv"
            return self._via_host({"send": send, "recv": recv}, ["send"], [out], out, lambda h: self.all_reduce(
                h["send"], h["recv"], op, async_op=True, algorithm=algorithm), async_op)
        s = arrays.check_array(send, "send", writable=recv is None)
        r = s if recv is None else arrays.check_array(recv, "recv", writable=True)
        arrays.same_dtype(s, r)
        arrays.check_size(r.size, s.size, "recv")
        arrays.check_op(op, s.dtype)
        if recv is not None and arrays.check_separate(s, r):
            r = s  # the same elements passed twice: in place
        if self._direct("all_reduce", s.size, s.itemsize, algorithm, s.nbytes):
            return self._run_direct("all_reduce", s, r, op, send if recv is None else recv, async_op, self._avg(op, r))
        sched = self._schedule("all_reduce", s.size, s.nbytes, algorithm=algorithm)
        return self._run("all_reduce", sched, {"in": s, "out": r}, s.dtype, op,
                         send if recv is None else recv, async_op, self._avg(op, r),
                         two_step=self._two_step_call("all_reduce", algorithm, s.nbytes // 2, s.nbytes))

    def reduce_scatter(self, send, recv, op: str = "sum", *, async_op: bool = False, algorithm=None):
        """Rank i receives the reduction of block i (send.size == size * recv.size)."""
        self._check_usable()
        if staging.any_on_device(send, recv):
            staging.check_device_arrays({"send": send, "recv": recv})
            if self._device_reduces("reduce_scatter", send):
                arrays.same_dtype(send, recv)
                arrays.check_size(send.size, self.size * recv.size, "send (size x recv)")
                arrays.check_op(op, send.dtype)
                return self._reduce_on_device("reduce_scatter", send, recv, op, None, async_op, recv)
            return self._via_host({"send": send, "recv": recv}, ["send"], ["recv"], "recv", lambda h: self.reduce_scatter(
                h["send"], h["recv"], op, async_op=True, algorithm=algorithm), async_op)
        s = arrays.check_array(send, "send")
        r = arrays.check_array(recv, "recv", writable=True)
        arrays.same_dtype(s, r)
        arrays.check_size(s.size, self.size * r.size, "send (size x recv)")
        arrays.check_op(op, s.dtype)
        arrays.check_separate(s, r, block_at=self.rank * r.size)
        if self._direct("reduce_scatter", r.size, r.itemsize, algorithm, s.nbytes):
            return self._run_direct("reduce_scatter", s, r, op, recv, async_op, self._avg(op, r))
        sched = self._schedule("reduce_scatter", r.size, s.nbytes, algorithm=algorithm)
        return self._run("reduce_scatter", sched, {"in": s, "out": r}, s.dtype, op, recv,
                         async_op, self._avg(op, r),
                         two_step=self._two_step_call("reduce_scatter", algorithm, r.nbytes, s.nbytes))

    def all_gather(self, send, recv, *, async_op: bool = False, algorithm=None):
        """Block i of ``recv`` is rank i's ``send`` (recv.size == size * send.size)."""
        self._check_usable()
        device = staging.any_on_device(send, recv)
        if device and not self._moves_on_device({"send": send, "recv": recv}):
            return self._via_host({"send": send, "recv": recv}, ["send"], ["recv"], "recv", lambda h: self.all_gather(
                h["send"], h["recv"], async_op=True, algorithm=algorithm), async_op)
        s = send.reshape(-1) if device else arrays.check_array(send, "send")
        r = recv.reshape(-1) if device else arrays.check_array(recv, "recv", writable=True)
        arrays.same_dtype(s, r)
        arrays.check_size(r.size, self.size * s.size, "recv (size x send)")
        arrays.check_separate(s, r, block_at=self.rank * s.size)
        if device:
            sched = self._schedule("all_gather", s.size, r.nbytes, algorithm=algorithm)
            return self._run_on_device("all_gather", sched, {"in": s, "out": r}, recv, async_op)
        if self._direct("all_gather", s.size, s.itemsize, algorithm, r.nbytes):
            return self._run_direct("all_gather", s, r, "sum", recv, async_op)
        sched = self._schedule("all_gather", s.size, r.nbytes, algorithm=algorithm)
        return self._run("all_gather", sched, {"in": s, "out": r}, s.dtype, "sum", recv, async_op,
                         two_step=self._two_step_call("all_gather", algorithm, s.nbytes, r.nbytes))

    def all_to_all(self, send, recv, *, async_op: bool = False, algorithm=None):
        """Block j of ``send`` goes to rank j; block i of ``recv`` came from rank i."""
        self._check_usable()
        device = staging.any_on_device(send, recv)
        if device and not self._moves_on_device({"send": send, "recv": recv}):
            return self._via_host({"send": send, "recv": recv}, ["send"], ["recv"], "recv", lambda h: self.all_to_all(
                h["send"], h["recv"], async_op=True, algorithm=algorithm), async_op)
        s = send.reshape(-1) if device else arrays.check_array(send, "send")
        r = recv.reshape(-1) if device else arrays.check_array(recv, "recv", writable=True)
        arrays.same_dtype(s, r)
        arrays.check_size(r.size, s.size, "recv")
        if arrays.check_separate(s, r):
            raise ValueError("all_to_all cannot run in place: pass separate send and recv arrays")
        if s.size % self.size:
            raise ValueError(f"send has {s.size} elements, not a multiple of the communicator size {self.size}")
        if device:
            sched = self._schedule("all_to_all", s.size // self.size, s.nbytes, algorithm=algorithm)
            return self._run_on_device("all_to_all", sched, {"in": s, "out": r}, recv, async_op)
        if self._direct("all_to_all", s.size // self.size, s.itemsize, algorithm, s.nbytes):
            return self._run_direct("all_to_all", s, r, "sum", recv, async_op)
        sched = self._schedule("all_to_all", s.size // self.size, s.nbytes, algorithm=algorithm)
        return self._run("all_to_all", sched, {"in": s, "out": r}, s.dtype, "sum", recv, async_op)

    def all_to_allv(self, send, send_counts, recv, recv_counts, *, async_op: bool = False):
        """Uneven all-to-all: send_counts[j] elements to rank j, recv_counts[i] from rank i."""
        self._check_usable()
        device = staging.any_on_device(send, recv)
        if device and not self._moves_on_device({"send": send, "recv": recv}, any_size=True):
            return self._via_host({"send": send, "recv": recv}, ["send"], ["recv"], "recv", lambda h: self.all_to_allv(
                h["send"], send_counts, h["recv"], recv_counts, async_op=True), async_op)
        s = send.reshape(-1) if device else arrays.check_array(send, "send")
        r = recv.reshape(-1) if device else arrays.check_array(recv, "recv", writable=True)
        arrays.same_dtype(s, r)
        sc = _counts(send_counts, self.size, "send_counts")
        rc = _counts(recv_counts, self.size, "recv_counts")
        arrays.check_size(s.size, sum(sc), "send (sum of send_counts)")
        arrays.check_size(r.size, sum(rc), "recv (sum of recv_counts)")
        if arrays.check_separate(s, r):
            raise ValueError("all_to_allv cannot run in place: pass separate send and recv arrays")
        sched = CallPlan(algorithms.build_schedule("all_to_allv", self.size, 0, algorithm="pairwise",
                                                   topology=self.topology, send_counts=sc, recv_counts=rc, rank=self.rank),
                         self.options.chunk_bytes or DEFAULT_CHUNK_BYTES, sum(sc) * s.itemsize < (256 << 10))
        if device:
            return self._run_on_device("all_to_allv", sched, {"in": s, "out": r}, recv, async_op)
        return self._run("all_to_allv", sched, {"in": s, "out": r}, s.dtype, "sum", recv, async_op)

    def broadcast(self, buf, root: int = 0, *, async_op: bool = False, algorithm=None):
        self._check_usable()
        root = self._check_root(root)
        if staging.is_device_array(buf):
            if self._moves_on_device({"buf": buf}):
                b = buf.reshape(-1)
                sched = self._schedule("broadcast", b.size, b.nbytes, root=root, algorithm=algorithm)
                return self._run_on_device("broadcast", sched, {"in": b, "out": b}, buf, async_op)
            return self._via_host({"buf": buf}, ["buf"] if self.rank == root else [], ["buf"], "buf",
                                  lambda h: self.broadcast(h["buf"], root, async_op=True, algorithm=algorithm), async_op)
        b = arrays.check_array(buf, "buf", writable=True)
        if self._direct("broadcast", b.size, b.itemsize, algorithm, b.nbytes, root=root):
            return self._run_direct("broadcast", b, b, "sum", buf, async_op, root=root)
        sched = self._schedule("broadcast", b.size, b.nbytes, root=root, algorithm=algorithm)
        return self._run("broadcast", sched, {"in": b, "out": b}, b.dtype, "sum", buf, async_op)

    def reduce(self, send, recv=None, op: str = "sum", root: int = 0, *, async_op: bool = False, algorithm=None):
        """Reduction over ranks into ``recv`` on ``root`` (in place on root when recv is None)."""
        self._check_usable()
        root = self._check_root(root)
        if staging.any_on_device(send, recv if self.rank == root else None):
            staging.check_device_arrays({"send": send, "recv": recv if self.rank == root else None})
            if self._device_reduces("reduce", send):
                dev_out = None if self.rank != root else (send if recv is None else recv)
                if dev_out is not None:
                    arrays.same_dtype(send, dev_out)
                    arrays.check_size(dev_out.size, send.size, "recv")
                arrays.check_op(op, send.dtype)
                return self._reduce_on_device("reduce", send, dev_out, op, root, async_op, dev_out)
            out = None if self.rank != root else ("send" if recv is None else "recv")
            mine = {"send": send, "recv": recv if self.rank == root else None}
            return self._via_host(mine, ["send"], [out] if out else [], out, lambda h: self.reduce(
                h["send"], h["recv"], op, root, async_op=True, algorithm=algorithm), async_op)
        s = arrays.check_array(send, "send", writable=recv is None and self.rank == root)
        r = None
        if self.rank == root:
            r = s if recv is None else arrays.check_array(recv, "recv", writable=True)
            arrays.same_dtype(s, r)
            arrays.check_size(r.size, s.size, "recv")
            if recv is not None and arrays.check_separate(s, r):
                r = s  # the same elements passed twice: in place
        arrays.check_op(op, s.dtype)
        out = r if r is not None else np.empty(0, dtype=s.dtype)
        result = (send if recv is None else recv) if self.rank == root else None
        finalize = self._avg(op, r) if r is not None else None
        if self._direct("reduce", s.size, s.itemsize, algorithm, s.nbytes, root=root):
            return self._run_direct("reduce", s, out, op, result, async_op, finalize, root=root)
        sched = self._schedule("reduce", s.size, s.nbytes, root=root, algorithm=algorithm)
        return self._run("reduce", sched, {"in": s, "out": out}, s.dtype, op, result, async_op, finalize)

    def barrier(self) -> None:
        self._check_usable()
        if self.size == 1:
            return
        token = np.zeros(1, dtype=np.uint8)
        if self._direct("all_reduce", 1, 1, None, 1):
            self._run_direct("barrier", token, token, "max", None, False)
            return
        self._run_control_op("barrier", token, "max")

    def _run_control_op(self, name: str, buf: np.ndarray, op: str) -> None:
        """A small all_reduce in place for the library's own use (barrier, plan rates)."""
        sched = self._schedule("all_reduce", buf.size, buf.nbytes, algorithm="rd")
        policy = self._policy
        self._policy = "up" if UP in self._planes else "out"  # control traffic: lowest latency, no split
        try:
            self._run(name, sched, {"in": buf, "out": buf}, buf.dtype, op, None, False)
        finally:
            self._policy = policy

    def _check_root(self, root) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < self.size:
            raise ValueError(f"root={root!r} is out of range for communicator size {self.size}")
        return int(root)


def plane_settings(opts: Options, gpu_direct: bool, one_host: bool) -> dict:
    """plane name -> (UCX transports, devices). Without GPU-direct the planes read
    host memory only and device arrays reach them as pinned host mirrors
    (mpccs.staging): cuda transports would only add a memory-type lookup to every
    send. With it, 'up' adds cuda_ipc / cuda_copy (device to device within the
    domain: NVLink where there is one) and 'out' cuda_copy (UCX stages device
    chunks through host fragments for a network that cannot read GPU memory, and
    that cost is in the rate the controller measures for 'out')."""
    settings = {}
    if UP in opts.planes:
        tls = opts.up_tls or DEFAULT_UP_TLS_CPU
        settings[UP] = (with_device_tls(tls, GPU_DIRECT_UP_TLS) if gpu_direct else tls, opts.up_devices)
    if OUT in opts.planes:
        devices = opts.out_devices
        if devices is None and one_host:
            devices = "lo"  # a one-host job: keep scale-out traffic on loopback
        tls = opts.out_tls
        settings[OUT] = (with_device_tls(tls, GPU_DIRECT_OUT_TLS) if gpu_direct else tls, devices)
    return settings


def check_device_transports(planes: dict) -> None:
    """GPU-direct hands device pointers to every plane: each must have opened
    UCX's cuda_copy (a UCX built without CUDA ignores the name, and its host
    transports would read a device pointer as host memory)."""
    for name, plane in planes.items():
        if not any(r.startswith("cuda_copy/") for r in plane.resources()):
            raise ConfigError(f"GPU-direct: plane {name!r} opened no cuda_copy transport with UCX_TLS={plane.tls} "
                              f"(resources: {', '.join(plane.resources()) or 'none'}): this UCX has no CUDA support; "
                              "use the UCX of the ucxx-cu12 wheels, or MPCCS_GPU_DIRECT=0")


def _wire_up(planes: dict, rank: int, timeout_s: float) -> None:
    """One byte each way on every plane to every peer it reaches, at init.

    UCX opens a tcp connection on an endpoint's first send; without this the
    first operation that uses a plane pays the connection set-up, and the
    controller's first probe of 'out' measured set-up, not the link.
    """
    from . import wire

    token = np.ones(1, dtype=np.uint8)
    pending = []
    for plane in planes.values():
        for peer in plane.peers:
            pending.append(plane.send(peer, token, wire.make_tag(wire.KIND_CTRL, 0xFF, 0, rank, wire.CTRL_WIREUP)))
            buf = np.zeros(1, dtype=np.uint8)
            pending.append(plane.recv(buf, wire.make_tag(wire.KIND_CTRL, 0xFF, 0, peer, wire.CTRL_WIREUP)))
            pending.append(buf)
    requests = [r for r in pending if not isinstance(r, np.ndarray)]
    deadline = time.monotonic() + timeout_s
    while not all(r.completed for r in requests):
        for plane in planes.values():
            plane.progress()
        if time.monotonic() > deadline:
            raise TransportError(f"planes did not connect within {timeout_s:g} s (wire-up)", rank=rank)
    for r in requests:
        r.check_error()


def _block_bytes(collective: str, send: np.ndarray, out: np.ndarray, world: int) -> int:
    """One rank's block of a reduce_scatter (its output), all_gather (its input), all_to_all, or
    the whole buffer of a broadcast or reduce."""
    if collective == "reduce_scatter":
        return out.nbytes
    return send.nbytes // world if collective == "all_to_all" else send.nbytes


def _input_bytes(collective: str, block_bytes: int, call_bytes: int) -> int:
    """A rank's input from _direct's sizes: an all_gather's is its block, every other's the call's size."""
    return block_bytes if collective == "all_gather" else call_bytes


def _hashable(value):
    return tuple(value) if isinstance(value, (list, tuple, np.ndarray)) else value


def _counts(counts, size: int, name: str) -> list[int]:
    values = [int(c) for c in counts]
    if len(values) != size:
        raise ValueError(f"{name} has {len(values)} entries, expected one per rank ({size})")
    if any(c < 0 for c in values):
        raise ValueError(f"{name} has a negative entry")
    return values


def _check_same_plane_rates(infos: list, rank: int) -> None:
    """Every rank plans by the same rates (the tuner's plan must be the same
    everywhere): refuse to start where MPCCS_PLANE_RATES or
    MPCCS_MEASURE_PLAN_RATES differs (the ranks agree on measured rates at the same calls)."""
    for key, var in (("plane_rates", "MPCCS_PLANE_RATES"), ("measure_plan_rates", "MPCCS_MEASURE_PLAN_RATES")):
        stated = [json.dumps(i.get(key)) for i in infos]
        if len(set(stated)) > 1:
            odd = [r for r, v in enumerate(stated) if v != stated[rank]]
            raise ConfigError(f"rank {rank}: {var} {stated[rank]} differs on rank(s) {odd} "
                              f"({stated[odd[0]]}); set it the same on every rank")


def _domain_ids(domains: list[str]) -> list[int]:
    ids: dict[str, int] = {}
    return [ids.setdefault(d, len(ids)) for d in domains]


def init(**options) -> Communicator:
    """Find the other ranks, open both planes, return the world communicator.

    Keyword options override MPCCS_* variables (see docs/configuration.md).
    """
    opts = load_options(**options)
    boot = rendezvous(timeout_s=opts.rendezvous_timeout_s)
    try:
        return Communicator(boot, opts)
    except BaseException:
        boot.close()
        raise
