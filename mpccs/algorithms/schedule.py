"""Coflow DAG types shared by every algorithm, the engine and the simulator.

A collective is a :class:`Schedule`: a prologue of local copies, then stages.
Each stage is a coflow: a set of :class:`Flow` transfers that must all finish
(on a given rank) before the stages that depend on it start (on that rank).
Dependencies are evaluated per rank: stage ``s`` may start on rank ``r`` once
every stage in ``s.deps`` has finished *on rank r* (its sends completed and
its receives landed and were reduced). That is the usual local projection of
a global schedule; algorithms must order data dependencies accordingly.

All offsets and counts are in *elements*, never bytes: the engine multiplies
by the item size, so one schedule serves every dtype and chunks are always cut
on element boundaries.

Buffers are named, per rank:
  ``in``   the user's input (read-only; may alias ``out`` for in-place calls),
  ``out``  the user's output,
  ``work`` a scratch buffer of ``Schedule.work_count`` elements the engine
           allocates when an algorithm needs one (reduce_scatter, reduce).

A flow reads ``count`` elements from ``src_buf[src_off:]`` on rank ``src`` and
writes them into ``dst_buf[dst_off:]`` on rank ``dst``; with ``reduce=True``
the destination becomes ``op(destination, incoming)`` instead. The order of
the operands never depends on which plane carried the bytes, so results are
bit-identical under every path policy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

BUFFERS = ("in", "out", "work")
COLLECTIVES = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "all_to_allv",
    "broadcast",
    "reduce",
)


@dataclass(frozen=True)
class Flow:
    """One transfer of a contiguous element range between two ranks."""

    id: int  # unique within the schedule; travels in the wire tag
    src: int
    dst: int
    src_buf: str
    src_off: int
    dst_buf: str
    dst_off: int
    count: int
    reduce: bool = False


@dataclass(frozen=True)
class LocalCopy:
    """A copy inside one rank (no network), e.g. ``out[:] = in`` before a ring."""

    rank: int
    src_buf: str
    src_off: int
    dst_buf: str
    dst_off: int
    count: int


@dataclass(frozen=True)
class Stage:
    """A coflow: flows that complete together before dependent stages start."""

    id: int
    flows: tuple[Flow, ...]
    deps: tuple[int, ...] = ()
    channel: int = 0
    label: str = ""


@dataclass(frozen=True)
class Topology:
    """Which scale-up domain each rank belongs to (domain_of[rank])."""

    domain_of: tuple[int, ...]

    @classmethod
    def flat(cls, world: int) -> "Topology":
        """One scale-up domain holding every rank (a single server)."""
        return cls(tuple(0 for _ in range(world)))

    @classmethod
    def blocks(cls, world: int, per_domain: int) -> "Topology":
        """Consecutive ranks grouped into domains of ``per_domain``."""
        return cls(tuple(r // per_domain for r in range(world)))

    @property
    def world(self) -> int:
        return len(self.domain_of)

    def same_domain(self, a: int, b: int) -> bool:
        return self.domain_of[a] == self.domain_of[b]

    def domains(self) -> list[list[int]]:
        """Ranks of each domain, domains ordered by their lowest rank."""
        groups: dict[int, list[int]] = {}
        for rank, dom in enumerate(self.domain_of):
            groups.setdefault(dom, []).append(rank)
        return sorted(groups.values(), key=lambda g: g[0])


@dataclass(frozen=True)
class Schedule:
    collective: str
    algorithm: str
    world: int
    count: int  # elements per rank as the API defines it (see each builder)
    stages: tuple[Stage, ...]
    prologue: tuple[LocalCopy, ...] = ()
    epilogue: tuple[LocalCopy, ...] = ()
    work_count: int = 0
    channels: int = 1
    root: Optional[int] = None
    # For all_to_allv the schedule is built from one rank's counts only; the
    # flows touching other pairs are absent. None for global schedules.
    local_rank: Optional[int] = None
    meta: dict = field(default_factory=dict, compare=False)

    def flows(self):
        for stage in self.stages:
            yield from stage.flows

    def stages_of(self, rank: int) -> list[Stage]:
        """Stages in which ``rank`` sends or receives (or all, for deps)."""
        return [s for s in self.stages if any(f.src == rank or f.dst == rank for f in s.flows)]

    def max_stage_send(self) -> int:
        """Most elements one rank sends in one stage: below min_multipath_bytes
        the engine never splits any stage of this schedule (Splitter.plan).
        Cached in meta: the direct-path rule asks on every medium all_reduce."""
        known = self.meta.get("max_stage_send")
        if known is None:
            sums: dict = {}
            for stage in self.stages:
                for f in stage.flows:
                    sums[stage.id, f.src] = sums.get((stage.id, f.src), 0) + f.count
            known = self.meta["max_stage_send"] = max(sums.values(), default=0)
        return known
