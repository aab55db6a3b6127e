"""Synthetic planes: turn a StageDecision into chunk completions and stage times.

A deliberately small model, shared by the controller tests and usable by the
simulator as a quick stand-in:

* each sending rank has one port per plane (rate, fixed delay); a path to a
  given peer may be slower (``links``). A port sends one chunk at a time,
  round robin over its flows, at the path's rate times a per-chunk noise
  factor drawn uniformly from [1 - noise, 1 + noise]; a chunk completes one
  fixed delay after its last byte left.
* the engine's window: a plane posts a chunk only while the bytes posted and
  not yet completed fit in ``decision.window_bytes`` (one chunk always may).
* stealing: a plane with nothing of its own left takes the last unstarted
  chunk of the other plane's part, when it would land that chunk before the
  other plane lands its remaining part (the model knows the true rates; an
  engine uses its estimates); 'out' never exceeds ``out_cap_bytes``.
* shared resources: ``interference[plane]`` multiplies a plane's rate at a
  rank during any stage in which that rank uses both planes (CPU cores,
  PCIe or memory shared by the two transports).

Randomness is seeded per (stage, rank, plane), so the same split replays the
same noise whatever else changed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from .estimator import PLANES
from .split import FlowDemand


@dataclass
class SyntheticLink:
    rate_Bps: float
    latency_s: float


@dataclass(frozen=True)
class ChunkEvent:
    src: int
    dst: int
    flow_id: int
    plane: str
    offset: int
    nbytes: int
    t_post: float
    t_done: float
    stolen: bool = False


@dataclass
class StageResult:
    t_start: float
    t_end_by_src: dict[int, float]
    bytes_by_src: dict[int, dict[str, int]]
    out_bytes_by_flow: dict[int, int]
    chunks: list[ChunkEvent]

    @property
    def t_end(self) -> float:
        return max(self.t_end_by_src.values(), default=self.t_start)

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start


@dataclass
class _FlowParts:
    flow: FlowDemand
    up_next: int
    up_end: int
    out_next: int
    out_end: int
    out_cap: int
    out_carried: int = 0


class SyntheticPlanes:
    def __init__(self, ports: Mapping[tuple[int, str], SyntheticLink], *,
                 links: Optional[Mapping[tuple[int, str, int], SyntheticLink]] = None,
                 noise: float = 0.1, seed: int = 0,
                 interference: Optional[Mapping[str, float]] = None):
        self.ports = dict(ports)
        self.links = dict(links or {})
        self.noise = noise
        self.seed = seed
        self.interference = dict(interference or {})
        self.stages_run = 0

    @classmethod
    def uniform(cls, ranks: Sequence[int], up: SyntheticLink, out: SyntheticLink, **kw) -> "SyntheticPlanes":
        ports = {}
        for r in ranks:
            ports[(r, "up")] = SyntheticLink(up.rate_Bps, up.latency_s)
            ports[(r, "out")] = SyntheticLink(out.rate_Bps, out.latency_s)
        return cls(ports, **kw)

    def set_rate(self, plane: str, rate_Bps: float, ranks: Optional[Sequence[int]] = None) -> None:
        for (r, p), link in self.ports.items():
            if p == plane and (ranks is None or r in ranks):
                link.rate_Bps = rate_Bps

    def _path(self, src: int, plane: str, dst: int) -> tuple[float, float]:
        port = self.ports[(src, plane)]
        link = self.links.get((src, plane, dst))
        if link is None:
            return port.rate_Bps, port.latency_s
        return min(port.rate_Bps, link.rate_Bps), max(port.latency_s, link.latency_s)

    def run_stage(self, decision, flows: Sequence[FlowDemand], t_start: float,
                  chunk_bytes: int, stage_index: Optional[int] = None) -> StageResult:
        idx = self.stages_run if stage_index is None else stage_index
        self.stages_run += 1
        result = StageResult(t_start, {}, {}, {}, [])
        for src in sorted({f.src for f in flows}):
            own = [f for f in flows if f.src == src and f.nbytes > 0]
            if not own:
                continue
            planned_both = any(0 < decision.up_bytes.get(f.flow_id, 0) < f.nbytes for f in own) or (
                any(decision.up_bytes.get(f.flow_id, 0) > 0 for f in own)
                and any(decision.up_bytes.get(f.flow_id, 0) < f.nbytes for f in own))
            events, parts = self._run_src(decision, own, src, t_start, chunk_bytes, idx, planned_both)
            used = {e.plane for e in events}
            if (len(used) == 2) != planned_both:  # stealing changed which planes ran: replay
                events, parts = self._run_src(decision, own, src, t_start, chunk_bytes, idx, len(used) == 2)
            result.chunks.extend(events)
            result.t_end_by_src[src] = max((e.t_done for e in events), default=t_start)
            result.bytes_by_src[src] = {p: sum(e.nbytes for e in events if e.plane == p) for p in PLANES}
            for fp in parts:
                result.out_bytes_by_flow[fp.flow.flow_id] = fp.out_carried
        result.chunks.sort(key=lambda e: e.t_done)
        return result

    def _run_src(self, decision, own, src, t_start, chunk, idx, both_used):
        parts = []
        for f in own:
            up = decision.up_bytes.get(f.flow_id, 0)
            parts.append(_FlowParts(f, 0, up, up, f.nbytes, decision.out_cap_bytes.get(f.flow_id, f.nbytes)))
        steal = decision.steal_by_rank.get(src, decision.steal)
        windows = decision.window_by_rank.get(src, decision.window_bytes)
        rngs = {p: random.Random(self.seed * 1_000_003 + idx * 7919 + src * 31 + PLANES.index(p))
                for p in PLANES}
        factor = {p: (self.interference.get(p, 1.0) if both_used else 1.0) for p in PLANES}
        free_at = {p: t_start for p in PLANES}
        inflight: dict[str, list[tuple[float, int]]] = {p: [] for p in PLANES}
        next_post: dict[str, Optional[float]] = {p: t_start for p in PLANES}
        rr = {p: 0 for p in PLANES}
        events = []
        while True:
            ready = [p for p in PLANES if next_post[p] is not None]
            if not ready:
                break
            plane = min(ready, key=lambda p: (next_post[p], PLANES.index(p)))
            t = next_post[plane]
            taken = self._take_own(parts, plane, chunk, rr)
            if not taken and steal and self._steal_pays(parts, src, plane, t, free_at, chunk):
                taken = self._take_stolen(parts, plane, chunk, rr)
            if not taken:
                next_post[plane] = None
                continue
            fp, offset, size, stolen = taken
            rate, lat = self._path(src, plane, fp.flow.dst)
            noisy = rate * factor[plane] * rngs[plane].uniform(1 - self.noise, 1 + self.noise)
            tx_start = max(t, free_at[plane])
            tx_end = tx_start + size / noisy
            t_done = tx_end + lat
            free_at[plane] = tx_end
            inflight[plane].append((t_done, size))
            if plane == "out":
                fp.out_carried += size
            events.append(ChunkEvent(src, fp.flow.dst, fp.flow.flow_id, plane, offset, size, t, t_done, stolen))
            next_post[plane] = _next_post_time(inflight[plane], t, windows[plane], chunk)
        return events, parts

    def _steal_pays(self, parts, src, plane, t, free_at, chunk) -> bool:
        """Steal only a chunk this plane lands before the owner would land its own tail."""
        other = "out" if plane == "up" else "up"
        left = sum((fp.out_end - fp.out_next) if other == "out" else (fp.up_end - fp.up_next) for fp in parts)
        if left <= 0:
            return False
        dst = parts[0].flow.dst
        rate, lat = self._path(src, plane, dst)
        o_rate, o_lat = self._path(src, other, dst)
        mine = max(t, free_at[plane]) + min(chunk, left) / rate + lat
        theirs = max(t, free_at[other]) + left / o_rate + o_lat
        return mine < theirs

    @staticmethod
    def _take_own(parts, plane, chunk, rr):
        n = len(parts)
        for i in range(n):
            fp = parts[(rr[plane] + i) % n]
            if plane == "up" and fp.up_next < fp.up_end:
                size = min(chunk, fp.up_end - fp.up_next)
                off, fp.up_next = fp.up_next, fp.up_next + size
            elif plane == "out" and fp.out_next < fp.out_end:
                size = min(chunk, fp.out_end - fp.out_next, fp.out_cap - fp.out_carried)
                if size <= 0:
                    continue
                off, fp.out_next = fp.out_next, fp.out_next + size
            else:
                continue
            rr[plane] = (rr[plane] + i + 1) % n
            return fp, off, size, False
        return None

    @staticmethod
    def _take_stolen(parts, plane, chunk, rr):
        for fp in parts:
            if plane == "up" and fp.out_next < fp.out_end:
                size = min(chunk, fp.out_end - fp.out_next)
                fp.out_end -= size
                return fp, fp.out_end, size, True
            if plane == "out" and fp.up_next < fp.up_end:
                size = min(chunk, fp.up_end - fp.up_next, fp.out_cap - fp.out_carried)
                if size <= 0:
                    continue
                fp.up_end -= size
                return fp, fp.up_end, size, True
        return None


def _next_post_time(inflight: list[tuple[float, int]], t: float, window: int, chunk: int) -> float:
    """Earliest time a further chunk fits in the window."""
    inflight[:] = [x for x in inflight if x[0] > t]
    pending = sorted(inflight)
    in_flight = sum(n for _, n in pending)
    if in_flight + chunk <= window or not pending:
        return t
    for t_done, n in pending:
        in_flight -= n
        if in_flight + chunk <= window or in_flight == 0:
            return t_done
    return pending[-1][0]


@dataclass
class Driver:
    """Runs stages through a controller and synthetic planes, feeding back completions.

    Every sending rank's completions and realised stage time go to the one
    controller (``src=`` / ``rank=``), the single-controller view the
    simulator uses.
    """

    controller: object
    planes: SyntheticPlanes
    chunk_bytes: int = 512 * 1024
    align: int = 4096
    gap_s: float = 1e-4
    now: float = 0.0
    history: list = field(default_factory=list)

    def step(self, flows: Sequence[FlowDemand]):
        decision = self.controller.decide(flows, self.now, align=self.align, chunk_bytes=self.chunk_bytes)
        result = self.planes.run_stage(decision, flows, self.now, self.chunk_bytes)
        for ev in result.chunks:
            self.controller.on_chunk(ev.plane, ev.dst, ev.nbytes, ev.t_post, ev.t_done, src=ev.src)
        for src, t_end in result.t_end_by_src.items():
            self.controller.on_stage(decision, self.now, t_end, result.bytes_by_src[src], rank=src)
        self.history.append((decision, result))
        self.now = result.t_end + self.gap_s
        return decision, result
