"""Hierarchical (two-level) algorithms for d >= 2 scale-up domains of m ranks.

Flows between domains can only use the scale-out plane, so these algorithms
keep cross-domain traffic to its minimum and do the rest inside domains.
D_k[j] is the j-th rank (by rank order) of domain k; "peers" are the ranks
with the same j in every domain.

* all_reduce: intra-domain ring reduce-scatter of m blocks (D_k[j] gets block
  j reduced within its domain); ring all-reduce of block j among the peers
  (reduce-scatter + all-gather over d sub-blocks); intra-domain ring
  all-gather. (m-1) + 2(d-1) + (m-1) stages.
* reduce_scatter: group G_j = the blocks of all peers j. Intra-domain ring
  reduce-scatter of the groups, then a ring reduce-scatter of G_j among the
  peers, each keeping its own block. (m-1) + (d-1) stages.
* all_gather: the reverse: ring all-gather among the peers (each gets G_j),
  then intra-domain ring all-gather of the groups.

Unequal domains, or a single domain, fall back to ring; the schedule says so
in ``meta["fallback"]``.

With c channels (the buffer in c slices, each its own chain of phases) the
channels take turns: step t of channel k waits for step t of channel k - 1
(ScheduleBuilder.interleave(in_order=True)), so channel 0 leaves its
in-domain phase first and its cross-domain phase runs while channel 1 is in
the domain, as a pipeline. Without the turns every channel's first step
started at once and shared the links: on the 2x2 testbed at 1:1 each rank's
in-domain 'out' parts of all channels sat queued on the 'out' link ahead of
the first cross-domain step, and a 64 MiB all_reduce splitting 25% of its
in-domain bytes onto 'out' took 1.10-1.24 s against 1.09 on 'up' alone; with
the turns it took 0.85-0.94 s (16 channels).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ._builder import ScheduleBuilder, Spec, split
from .ring import (
    all_gather_ring,
    all_reduce_ring,
    reduce_scatter_ring,
    ring_all_gather_steps,
    ring_reduce_scatter_steps,
    strip_blocks,
    zip_steps,
)
from .schedule import Schedule, Topology


def equal_domains(topology: Topology) -> Optional[list[list[int]]]:
    """The domains if there are at least two and all have the same size."""
    domains = topology.domains()
    if len(domains) >= 2 and len({len(d) for d in domains}) == 1:
        return domains
    return None


def _fallback(spec: Spec, ring_builder) -> Schedule:
    sizes = [len(d) for d in spec.topology.domains()]
    schedule = ring_builder(replace(spec, algorithm="ring"))
    schedule.meta["fallback"] = f"hierarchical needs >= 2 domains of equal size, got sizes {sizes}; using ring"
    schedule.meta["requested"] = "hierarchical"
    return schedule


def all_reduce_hierarchical(spec: Spec) -> Schedule:
    domains = equal_domains(spec.topology)
    if domains is None:
        return _fallback(spec, all_reduce_ring)
    p, n, m = spec.world, spec.count, len(domains[0])
    b = ScheduleBuilder(spec, meta={"domains": len(domains), "domain_size": m})
    for r in range(p):
        b.prologue(r, "in", 0, "out", 0, n)
    per_channel = []
    for off, size in spec.channel_slices():
        blocks = [((off + o, s),) for o, s in split(size, m)]
        intra_rs = zip_steps([ring_reduce_scatter_steps(d, blocks, "out") for d in domains], "intra rs")
        inter_rs, inter_ag = [], []
        for j, ((boff, bsize),) in enumerate(blocks):
            peers = [d[j] for d in domains]
            sub = [((boff + o, s),) for o, s in split(bsize, len(domains))]
            inter_rs.append(ring_reduce_scatter_steps(peers, sub, "out"))
            inter_ag.append(ring_all_gather_steps(peers, sub, "out"))
        intra_ag = zip_steps([ring_all_gather_steps(d, blocks, "out") for d in domains], "intra ag")
        per_channel.append(intra_rs + zip_steps(inter_rs, "inter rs") + zip_steps(inter_ag, "inter ag") + intra_ag)
    b.interleave(per_channel, in_order=True)
    return b.build()


def _peer_groups(domains: list[list[int]], blocks: list) -> list:
    """G_j: the blocks of the j-th rank of every domain."""
    return [tuple(e for d in domains for e in blocks[d[j]]) for j in range(len(domains[0]))]


def reduce_scatter_hierarchical(spec: Spec) -> Schedule:
    domains = equal_domains(spec.topology)
    if domains is None:
        return _fallback(spec, reduce_scatter_ring)
    p, n = spec.world, spec.count
    b = ScheduleBuilder(spec, work_count=p * n, meta={"domains": len(domains), "domain_size": len(domains[0])})
    for r in range(p):
        b.prologue(r, "in", 0, "work", 0, p * n)
    per_channel = []
    for part in spec.channel_slices():
        blocks = strip_blocks(p, n, part)
        groups = _peer_groups(domains, blocks)
        intra = zip_steps([ring_reduce_scatter_steps(d, groups, "work") for d in domains], "intra rs")
        inter = zip_steps([
            ring_reduce_scatter_steps([d[j] for d in domains], [blocks[d[j]] for d in domains], "work")
            for j in range(len(domains[0]))
        ], "inter rs")
        per_channel.append(intra + inter)
    b.interleave(per_channel, in_order=True)
    for r in range(p):
        b.epilogue(r, "work", r * n, "out", 0, n)
    return b.build()


def all_gather_hierarchical(spec: Spec) -> Schedule:
    domains = equal_domains(spec.topology)
    if domains is None:
        return _fallback(spec, all_gather_ring)
    p, n = spec.world, spec.count
    b = ScheduleBuilder(spec, meta={"domains": len(domains), "domain_size": len(domains[0])})
    for r in range(p):
        b.prologue(r, "in", 0, "out", r * n, n)
    per_channel = []
    for part in spec.channel_slices():
        blocks = strip_blocks(p, n, part)
        groups = _peer_groups(domains, blocks)
        inter = zip_steps([
            ring_all_gather_steps([d[j] for d in domains], [blocks[d[j]] for d in domains], "out")
            for j in range(len(domains[0]))
        ], "inter ag")
        intra = zip_steps([ring_all_gather_steps(d, groups, "out") for d in domains], "intra ag")
        per_channel.append(inter + intra)
    b.interleave(per_channel, in_order=True)
    return b.build()
