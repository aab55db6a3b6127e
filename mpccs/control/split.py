"""Coflow split: how many bytes of each flow of a stage go to each plane.

The objective is the completion time of the stage (max over its flows and
planes of the finish time), not the sum of per-flow throughputs. Plane
``p`` at sending rank ``s`` is a port of rate ``C_sp`` and fixed delay
``a_sp`` that all of ``s``'s flows on ``p`` share; a flow to peer ``d`` is
also bounded by its own path (``r_spd``, ``a_spd``). Carrying ``X`` bytes
finishes at ``a + X / C``.

For a target time ``T`` every limit is a byte budget: the port carries at
most ``C (T - a)+``, a flow's path at most ``r (T - a)+``, and the QoS cap
bounds each flow's 'out' part. With two planes the bytes rank ``s`` can put
on 'up' form an interval (a sum of per-flow intervals), so feasibility of
``T`` is a one-line test and the smallest feasible ``T`` is found by
bisection per rank. The stage time is the max over ranks; every rank is then
filled at that common ``T`` with as many bytes on 'up' as fit, so flows off
the critical path stay on 'up' (fewer borrowed scale-out bytes for the same
stage time).

``equal_finish`` is the closed form for one flow over paths that do not
share anything (anchors.md): ``T = (n + sum a_i B_i) / sum B_i``,
``x_i = B_i (T - a_i)``, dropping any path with ``a_i >= T``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from .estimator import PLANES


@dataclass(frozen=True)
class FlowDemand:
    """One flow of a stage, as the controller sees it."""

    flow_id: int
    src: int
    dst: int
    nbytes: int
    planes: tuple[str, ...]  # ("up", "out") inside a domain, ("out",) across domains
    # The flow's chunk length: a split lands on whole chunks (windows.boundary_for),
    # so the controller picks the faster neighbouring multiple. 0: not known.
    quantum_bytes: int = 0
    # Stands for load beside the stage (a pipelined schedule's other channels,
    # algorithms.overlap): it takes its planes' capacity in the split, moves no
    # bytes of the stage, and is not one of the rank's judged flows.
    companion: bool = False


@dataclass(frozen=True)
class PathModel:
    """Latency + bytes / bandwidth for one path or one port."""

    rate_Bps: float
    latency_s: float

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.rate_Bps if nbytes > 0 else 0.0

    def capacity(self, t: float) -> float:
        return self.rate_Bps * max(0.0, t - self.latency_s)


def equal_finish(nbytes: float, paths: Sequence[PathModel]) -> tuple[float, list[float]]:
    """Split ``nbytes`` over independent paths so that all used ones finish together.

    Returns (T, bytes per path). A path whose latency is at least T would only
    delay the finish; it is dropped and T recomputed over the rest.
    """
    if nbytes <= 0 or not paths:
        return 0.0, [0.0] * len(paths)
    active = [i for i, p in enumerate(paths) if p.rate_Bps > 0]
    while True:
        rate_sum = sum(paths[i].rate_Bps for i in active)
        t = (nbytes + sum(paths[i].latency_s * paths[i].rate_Bps for i in active)) / rate_sum
        slow = [i for i in active if paths[i].latency_s >= t]
        if not slow:
            break
        # Drop one path at a time: removing a path that carries nothing
        # lowers T, so a second slow path is re-tested against the new T.
        active.remove(max(slow, key=lambda i: paths[i].latency_s))
    x = [0.0] * len(paths)
    for i in active:
        x[i] = paths[i].rate_Bps * (t - paths[i].latency_s)
    return t, x


@dataclass(frozen=True)
class SplitFlow:
    """A flow as the solver sees it: its allowed planes' path models and 'out' cap."""

    flow_id: int
    src: int
    nbytes: int
    links: Mapping[str, PathModel]  # allowed planes only
    out_cap: float = float("inf")   # bytes 'out' may carry (QoS)


@dataclass
class CoflowSplit:
    stage_time_s: float                  # predicted completion of the stage
    time_by_src: dict[int, float]        # each rank's own best time
    out_bytes: dict[int, float]          # flow_id -> bytes on 'out' (real-valued, before alignment)
    critical_src: Optional[int] = None
    finish: dict[int, dict[str, float]] = field(default_factory=dict)  # src -> plane -> time


def _flow_bounds(f: SplitFlow, t: float) -> tuple[float, float, float]:
    """(min on up, max on up, max on out) for flow ``f`` to finish by ``t``."""
    n = float(f.nbytes)
    up = f.links.get("up")
    out = f.links.get("out")
    e_up = min(n, up.capacity(t)) if up is not None else 0.0
    e_out = min(n, f.out_cap, out.capacity(t)) if out is not None else 0.0
    return max(0.0, n - e_out), e_up, e_out


def _port_caps(ports: Mapping[str, PathModel], used: set[str], t: float) -> dict[str, float]:
    return {p: (ports[p].capacity(t) if p in used else 0.0) for p in PLANES}


def _used_planes(flows: Sequence[SplitFlow]) -> set[str]:
    return {p for f in flows for p in f.links}


def up_interval(flows: Sequence[SplitFlow], ports: Mapping[str, PathModel], t: float):
    """Range of total 'up' bytes that lets every flow of one rank finish by ``t``.

    Returns (lo, hi) or None when ``t`` is infeasible.
    """
    used = _used_planes(flows)
    caps = _port_caps(ports, used, t)
    total = lo = hi = 0.0
    for f in flows:
        f_lo, f_hi, e_out = _flow_bounds(f, t)
        if f_hi + e_out < f.nbytes * (1 - 1e-12):
            return None
        total += f.nbytes
        lo += f_lo
        hi += f_hi
    lo = max(lo, total - caps["out"])
    hi = min(hi, caps["up"])
    if lo > hi + 1e-9 * max(1.0, total):
        return None
    return lo, max(lo, hi)


def _single_flow_time(flows: Sequence[SplitFlow], ports: Mapping[str, PathModel]) -> Optional[float]:
    """Closed form for the common case: one flow whose own paths bind tighter than the ports."""
    if len(flows) != 1:
        return None
    f = flows[0]
    planes = [p for p in PLANES if p in f.links]
    for p in planes:
        link, port = f.links[p], ports[p]
        if link.rate_Bps > port.rate_Bps or link.latency_s < port.latency_s:
            return None
    t, x = equal_finish(f.nbytes, [f.links[p] for p in planes])
    if "out" in planes and x[planes.index("out")] > f.out_cap:
        return None  # the QoS cap binds: bisection handles it
    return t


def _min_time(flows: Sequence[SplitFlow], ports: Mapping[str, PathModel], rel_tol: float = 1e-7) -> float:
    """Smallest ``T`` at which one rank's flows all fit (bisection)."""
    if not flows or all(f.nbytes <= 0 for f in flows):
        return 0.0
    closed = _single_flow_time(flows, ports)
    if closed is not None:
        return closed
    lo = 0.0
    hi = max(m.time(sum(f.nbytes for f in flows)) for f in flows for m in f.links.values())
    hi = max(hi, 1e-9)
    while up_interval(flows, ports, hi) is None:
        lo, hi = hi, hi * 2
        if hi > 1e9:
            raise ValueError("coflow split: no plane can carry the flows (rates of zero?)")
    for _ in range(200):
        if hi - lo <= rel_tol * hi:
            break
        mid = 0.5 * (lo + hi)
        if up_interval(flows, ports, mid) is None:
            lo = mid
        else:
            hi = mid
    return hi


def _fill(flows: Sequence[SplitFlow], ports: Mapping[str, PathModel], t: float) -> dict[int, float]:
    """At time ``t``, as many bytes on 'up' as fit; returns flow -> bytes on 'out'.

    Extra 'up' bytes beyond each flow's minimum are shared in proportion to
    each flow's room, which keeps shares smooth between decisions.
    """
    interval = up_interval(flows, ports, t)
    if interval is None:  # numerical edge at the bisection boundary
        interval = up_interval(flows, ports, t * (1 + 1e-6))
    _, x_up = interval
    bounds = [_flow_bounds(f, t) for f in flows]
    base = sum(b[0] for b in bounds)
    room = sum(max(0.0, b[1] - b[0]) for b in bounds)
    extra = max(0.0, x_up - base)
    frac = min(1.0, extra / room) if room > 0 else 0.0
    out = {}
    for f, (f_lo, f_hi, _) in zip(flows, bounds):
        up_bytes = min(float(f.nbytes), f_lo + frac * max(0.0, f_hi - f_lo))
        out[f.flow_id] = max(0.0, f.nbytes - up_bytes)
    return out


def finish_times(flows: Sequence[SplitFlow], ports: Mapping[int, Mapping[str, PathModel]],
                 out_bytes: Mapping[int, float]) -> dict[int, dict[str, float]]:
    """Predicted finish per rank and plane of a given split (0 for an unused plane)."""
    by_src = group_by_src(flows)
    result = {}
    for src, fl in by_src.items():
        per_plane = {}
        for plane in PLANES:
            parts = []
            for f in fl:
                x = out_bytes.get(f.flow_id, 0.0) if plane == "out" else f.nbytes - out_bytes.get(f.flow_id, 0.0)
                if x > 0 and plane in f.links:
                    parts.append((f, x))
            if not parts:
                per_plane[plane] = 0.0
                continue
            port_t = ports[src][plane].time(sum(x for _, x in parts))
            path_t = max(f.links[plane].time(x) for f, x in parts)
            per_plane[plane] = max(port_t, path_t)
        result[src] = per_plane
    return result


def group_by_src(flows: Sequence[SplitFlow]) -> dict[int, list[SplitFlow]]:
    out: dict[int, list[SplitFlow]] = {}
    for f in flows:
        out.setdefault(f.src, []).append(f)
    return out


def solve_coflow(flows: Sequence[SplitFlow], ports: Mapping[int, Mapping[str, PathModel]],
                 slack: float = 0.0) -> CoflowSplit:
    """Minimise the stage's completion time; among equally fast splits, least on 'out'.

    ``slack`` > 0 makes ranks off the critical path aim at
    ``stage_time / (1 + slack)`` instead of the stage time itself (never
    below their own best), so an estimate that is a little optimistic does
    not turn them into the critical path. 0 is the exact optimum.
    """
    by_src = group_by_src([f for f in flows if f.nbytes > 0])
    time_by_src = {src: _min_time(fl, ports[src]) for src, fl in by_src.items()}
    stage_t = max(time_by_src.values(), default=0.0)
    critical = max(time_by_src, key=time_by_src.get) if time_by_src else None
    out_bytes = {f.flow_id: 0.0 for f in flows}
    for src, fl in by_src.items():
        target = max(time_by_src[src], stage_t / (1.0 + slack))
        out_bytes.update(_fill(fl, ports[src], target))
    split = CoflowSplit(stage_t, time_by_src, out_bytes, critical)
    split.finish = finish_times(flows, ports, out_bytes)
    return split


def greedy_per_flow(flows: Sequence[SplitFlow]) -> dict[int, float]:
    """Baseline: each flow split alone by ``equal_finish`` over its own paths.

    Ignores that flows of a rank share its ports and that only the slowest
    rank sets the stage time. Kept for comparison (tests, telemetry).
    """
    out = {}
    for f in flows:
        planes = [p for p in PLANES if p in f.links]
        _, x = equal_finish(f.nbytes, [f.links[p] for p in planes])
        x_out = x[planes.index("out")] if "out" in planes else 0.0
        if "up" in planes:
            x_out = min(x_out, f.out_cap)
        out[f.flow_id] = x_out
    return out
