"""Links, shared resources and max-min fair sharing of fluid transfers.

A *resource* is anything with a byte rate that transfers share: one
direction of a port, a NIC, a PCIe link, a domain's host memory. A transfer
uses a set of resources, each with a weight (bytes of that resource spent per
byte delivered: a host-staged copy writes and reads host memory, weight 2).
At any instant the rates are the weighted max-min fair allocation (found by
progressive filling), also bounded by each transfer's own rate cap (window
over latency). Transfers of a lower ``priority`` number are served first:
a later class shares only the capacity the earlier ones leave (see
Transfer.priority). Rates only change when a transfer starts or ends, or a
capacity changes, so between those instants every transfer is a straight
line: this is a flow-level (fluid) model, not a packet model.

:class:`Cluster` maps a preset onto resources and answers ``route(src, dst,
plane)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from mpccs.algorithms.schedule import Topology

from .presets import Preset

PLANES = ("up", "out")
GB = 1e9
US = 1e-6

# Two completions closer than this (seconds) are treated as simultaneous;
# symmetric ranks then finish in one batch instead of many.
TIME_EPS = 1e-12
# Longest route (resources per transfer); rows are padded to it with weight 0
# so the fair-share arrays can be built in one numpy call.
ROUTE_WIDTH = 12


def max_min_rates(res_idx: np.ndarray, weights: np.ndarray, caps: np.ndarray,
                  capacity: np.ndarray) -> np.ndarray:
    """Weighted max-min fair rates by progressive filling.

    res_idx[f, k]: the k-th resource of transfer f (pad with any index and
    weight 0). All unfrozen transfers grow at one common level; a transfer
    freezes when one of its resources saturates or it reaches its cap.
    """
    n_flows = res_idx.shape[0]
    rate = np.zeros(n_flows)
    if n_flows == 0:
        return rate
    n_res = capacity.shape[0]
    headroom = capacity.astype(float).copy()
    active = np.ones(n_flows, dtype=bool)
    level = 0.0
    while active.any():
        load = np.bincount(res_idx[active].ravel(), weights=weights[active].ravel(), minlength=n_res)
        used = load > 0
        step_res = np.min(headroom[used] / load[used]) if used.any() else math.inf
        step_cap = np.min(caps[active]) - level
        step = max(0.0, min(step_res, step_cap))
        if math.isinf(step):
            raise ValueError("a transfer has neither a finite cap nor a finite resource")
        level += step
        headroom -= load * step
        rate[active] = level
        saturated = used & (headroom <= 1e-9 * np.maximum(capacity, 1.0))
        touches_saturated = (saturated[res_idx] & (weights > 0)).any(axis=1)
        frozen = touches_saturated | (caps <= level * (1 + 1e-12))
        active &= ~frozen
    return rate


def _rates_by_priority(res_idx: np.ndarray, weights: np.ndarray, caps: np.ndarray, capacity: np.ndarray,
                       priority: np.ndarray) -> np.ndarray:
    """Max-min fair rates within each priority class, the classes served in order."""
    classes = np.unique(priority)
    if len(classes) == 1:
        return max_min_rates(res_idx, weights, caps, capacity)
    rate = np.zeros(len(caps))
    headroom = capacity.astype(float).copy()
    for cls in classes:
        sel = priority == cls
        rate[sel] = max_min_rates(res_idx[sel], weights[sel], caps[sel], headroom)
        used = np.bincount(res_idx[sel].ravel(), weights=(weights[sel] * rate[sel, None]).ravel(),
                           minlength=len(headroom))
        headroom = np.maximum(headroom - used, 0.0)
    return rate


@dataclass(eq=False)
class Transfer:
    """Bytes moving through a set of resources; ``on_sent`` fires at the end."""

    resources: tuple[tuple[int, float], ...]
    remaining: float
    cap: float = math.inf
    on_sent: Optional[Callable[["Transfer", float], None]] = None
    tag: object = None
    t_start: float = 0.0
    rate: float = 0.0
    sent: float = 0.0
    # Served before every transfer of a higher number on a shared resource.
    # The simulator gives a schedule's channel c priority c: a pipeline's
    # channels then run staggered, one channel's inter-domain phase beside
    # another's intra-domain phase, as the engine's do (the testbed's 2x2
    # all_reduce ran 1.55-1.67x faster on 4 channels than on one). Shared
    # fairly, channels of equal demand moved in lockstep and the model gave
    # channels no gain at all.
    priority: int = 0
    dead: bool = False  # its plane failed: ignore its completion
    # (time, bytes sent so far) at every rate change: chunk completion times
    # are read off this piecewise-linear curve, without one event per chunk.
    history: Optional[list] = None

    def __post_init__(self):
        if len(self.resources) > ROUTE_WIDTH:
            raise ValueError(f"route longer than {ROUTE_WIDTH} resources")
        pad = ROUTE_WIDTH - len(self.resources)
        self.res_row = tuple(r for r, _ in self.resources) + (0,) * pad
        self.weight_row = tuple(float(w) for _, w in self.resources) + (0.0,) * pad

    def time_of(self, nbytes: float) -> float:
        """When the ``nbytes``-th byte left, read off the rate history."""
        hist = self.history
        for (t0, s0, r0), nxt in zip(hist, hist[1:] + [None]):
            if nxt is None or nbytes <= nxt[1]:
                return t0 + (nbytes - s0) / r0 if r0 > 0 else t0
        return hist[-1][0]


class FluidNetwork:
    """Resources and the transfers currently sharing them."""

    def __init__(self):
        self.names: list = []
        self.index: dict = {}
        self.capacity_list: list[float] = []
        self._capacity_array: Optional[np.ndarray] = None
        self.transfers: list[Transfer] = []
        self.dirty = True

    # -- resources
    def resource(self, name, capacity: float) -> int:
        """Index of resource ``name``, created with ``capacity`` on first use."""
        idx = self.index.get(name)
        if idx is None:
            idx = len(self.names)
            self.index[name] = idx
            self.names.append(name)
            self.capacity_list.append(float(capacity))
            self._capacity_array = None
            self.dirty = True
        return idx

    def set_capacity(self, idx: int, capacity: float) -> None:
        self.capacity_list[idx] = float(capacity)
        self._capacity_array = None
        self.dirty = True

    def capacity(self, idx: int) -> float:
        return self.capacity_list[idx]

    # -- transfers
    def add(self, transfer: Transfer, now: float) -> Transfer:
        if transfer.history is not None:  # (re)started: rate unknown until reallocation
            transfer.history.append((now, transfer.sent, 0.0))
        self.transfers.append(transfer)
        self.dirty = True
        return transfer

    def remove(self, transfer: Transfer) -> None:
        self.transfers.remove(transfer)
        self.dirty = True

    def reallocate(self, now: float) -> None:
        """Recompute fair rates after a start, an end or a capacity change."""
        self.dirty = False
        if not self.transfers:
            return
        transfers = self.transfers
        res_idx = np.array([t.res_row for t in transfers], dtype=np.int64)
        weights = np.array([t.weight_row for t in transfers])
        caps = np.fromiter((t.cap for t in transfers), float, len(transfers))
        if self._capacity_array is None:
            self._capacity_array = np.asarray(self.capacity_list, dtype=float)
        priority = np.fromiter((t.priority for t in transfers), np.int64, len(transfers))
        rates = _rates_by_priority(res_idx, weights, caps, self._capacity_array, priority)
        for tr, rate in zip(self.transfers, rates.tolist()):
            if tr.history is not None and rate != tr.rate:
                tr.history.append((now, tr.sent, rate))
            tr.rate = rate

    def next_completion(self) -> float:
        """Seconds until the first transfer sends its last byte."""
        best = math.inf
        for tr in self.transfers:
            if tr.rate > 0:
                best = min(best, tr.remaining / tr.rate)
        return best

    def advance(self, dt: float) -> None:
        if dt <= 0:
            return
        for tr in self.transfers:
            moved = min(tr.remaining, tr.rate * dt)
            tr.remaining -= moved
            tr.sent += moved

    def pop_finished(self) -> list[Transfer]:
        done = [t for t in self.transfers
                if t.remaining <= max(1e-6, t.rate * TIME_EPS)]
        if done:
            for t in done:
                t.sent += t.remaining
                t.remaining = 0.0
            done_ids = {id(t) for t in done}
            self.transfers = [t for t in self.transfers if id(t) not in done_ids]
            self.dirty = True
        return done


class Cluster:
    """A preset laid over ``domains`` scale-up domains: resources and routes.

    Resources are created on first use, so a run that simulates only some
    ranks (aggregation) only builds their ports.
    """

    def __init__(self, preset: Preset, domains: int = 1, network: Optional[FluidNetwork] = None):
        if domains < 1:
            raise ValueError("domains must be >= 1")
        self.preset = preset
        self.domains = domains
        self.world = preset.gpus_per_domain * domains
        self.topology = Topology.blocks(self.world, preset.gpus_per_domain)
        self.net = network or FluidNetwork()
        self.plane_alive = {p: True for p in PLANES}
        self._routes: dict = {}

    # -- geometry
    def domain(self, rank: int) -> int:
        return rank // self.preset.gpus_per_domain

    def local(self, rank: int) -> int:
        return rank % self.preset.gpus_per_domain

    def nic(self, rank: int) -> int:
        return rank // self.preset.gpus_per_nic

    def latency(self, plane: str) -> float:
        p = self.preset
        return (p.up_latency_us if plane == "up" else p.out_latency_us) * US

    def chunk_overhead(self, plane: str) -> float:
        return self.preset.chunk_overhead_us.get(plane, 0.0) * US

    def planes_between(self, src: int, dst: int) -> tuple[str, ...]:
        """Planes that can carry src->dst now (up only inside a domain)."""
        candidates = PLANES if self.domain(src) == self.domain(dst) else ("out",)
        return tuple(p for p in candidates if self.plane_alive[p])

    # -- resources
    def _res(self, kind: str, owner, link_GBps: float) -> int:
        return self.net.resource((kind, owner), link_GBps * GB)

    def _gpu_pcie(self, direction: str, rank: int) -> int:
        return self._res(f"gpu_pcie_{direction}", rank, self.preset.gpu_pcie.usable_GBps)

    def up_route(self, src: int, dst: int) -> list[tuple[int, float]]:
        p = self.preset
        if p.up_kind == "switch":
            return [(self._res("up_tx", src, p.up_port.usable_GBps), 1.0),
                    (self._res("up_rx", dst, p.up_port.usable_GBps), 1.0)]
        if p.up_kind == "mesh":
            return [(self._res("up_tx", src, p.mesh_aggregate.usable_GBps), 1.0),
                    (self._res("up_rx", dst, p.mesh_aggregate.usable_GBps), 1.0),
                    (self._res("mesh_link", (src, dst), p.up_port.usable_GBps), 1.0)]
        route = [(self._gpu_pcie("tx", src), 1.0), (self._gpu_pcie("rx", dst), 1.0)]
        if p.up_kind == "host-staged":
            # The sender writes the staging buffer, the receiver reads it.
            route.append((self._res("host_memory", self.domain(src), p.host_memory.usable_GBps), 2.0))
        return route

    def out_route(self, src: int, dst: int) -> list[tuple[int, float]]:
        p = self.preset
        nic_rate = p.nic.usable_GBps
        route = [(self._gpu_pcie("tx", src), 1.0),
                 (self._res("nic_tx", self.nic(src), nic_rate), 1.0),
                 (self._res("nic_rx", self.nic(dst), nic_rate), 1.0),
                 (self._gpu_pcie("rx", dst), 1.0)]
        if p.nic_pcie is not None:
            route += [(self._res("nic_pcie_tx", self.nic(src), p.nic_pcie.usable_GBps), 1.0),
                      (self._res("nic_pcie_rx", self.nic(dst), p.nic_pcie.usable_GBps), 1.0)]
        if p.out_oversubscription > 1.0:
            # The scale-out core carries 1/oversubscription of the domain's
            # NIC bandwidth; every out-plane byte of the domain crosses it.
            core = p.gpus_per_domain / p.gpus_per_nic * nic_rate / p.out_oversubscription
            route += [(self._res("core_tx", self.domain(src), core), 1.0),
                      (self._res("core_rx", self.domain(dst), core), 1.0)]
        return route

    def route(self, src: int, dst: int, plane: str) -> tuple[tuple[int, float], ...]:
        """Resources (index, weight) a src->dst transfer on ``plane`` uses."""
        key = (src, dst, plane)
        found = self._routes.get(key)
        if found is None:
            found = self._routes[key] = tuple(self._build_route(src, dst, plane))
        return found

    def _build_route(self, src: int, dst: int, plane: str) -> list[tuple[int, float]]:
        if plane == "up":
            if self.domain(src) != self.domain(dst):
                raise ValueError(f"ranks {src} and {dst} share no scale-up domain")
            route = self.up_route(src, dst)
        elif plane == "out":
            route = self.out_route(src, dst)
        else:
            raise ValueError(f"unknown plane {plane!r}")
        shared = self.preset.both_planes
        if shared is not None:
            route += [(self._res("both_tx", src, shared.usable_GBps), 1.0),
                      (self._res("both_rx", dst, shared.usable_GBps), 1.0)]
        return route

    def plane_resources(self, plane: str, rank: int) -> list[int]:
        """Resources that belong to one plane only at ``rank`` (load, failure)."""
        if plane == "out":
            return [self._res("nic_tx", self.nic(rank), self.preset.nic.usable_GBps),
                    self._res("nic_rx", self.nic(rank), self.preset.nic.usable_GBps)]
        if self.preset.up_kind in ("switch", "mesh"):
            port = (self.preset.up_port if self.preset.up_kind == "switch"
                    else self.preset.mesh_aggregate).usable_GBps
            return [self._res("up_tx", rank, port), self._res("up_rx", rank, port)]
        return [self._gpu_pcie("tx", rank), self._gpu_pcie("rx", rank)]

    def lone_rate(self, rank: int, plane: str) -> float:
        """Nominal rate of ``rank``'s plane toward a typical peer (priors, specs)."""
        if plane == "up":
            peer = rank ^ 1 if self.preset.gpus_per_domain > 1 else rank
            if self.domain(peer) != self.domain(rank):
                peer = rank - 1
        else:
            peer = (rank + self.preset.gpus_per_domain) % self.world
            if peer == rank:
                peer = rank ^ 1 if self.world > 1 else rank
        return self.nominal_rate(rank, peer, plane)

    def nominal_rate(self, src: int, dst: int, plane: str) -> float:
        """Bytes/s of one lone transfer: the narrowest resource on its route."""
        return min(self.net.capacity(r) / w for r, w in self.route(src, dst, plane))
