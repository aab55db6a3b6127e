"""Bandwidth lower bounds on an all_reduce over two planes: the most any schedule or split can reach.

Used to read a measured gain against what the links allow (bench/testbed_2x2.py).
Model: p ranks in scale-up domains; every rank has its own link on each plane
it reaches, capped at ``up_Bps`` / ``out_Bps`` in each direction (the testbed
shapes each rank's veths at both ends); ``up`` joins only the ranks of one
domain, ``out`` joins all. Latency and the CPU are left out: these are floors.

Two limits hold for every algorithm and every split of its bytes:

* per rank: in a bandwidth-optimal all_reduce each rank sends and receives at
  least ``2 (p-1)/p * N`` bytes (Patarasuk and Yuan, 2009), over both of its
  links at once: ``2 (p-1)/p * N / (up + out)``;
* across domains: ``up`` does not leave a domain, so the domains all_reduce
  among themselves over ``out`` alone: the same bound with each of the ``D``
  domains as one node of ``l * out`` bytes per second (``l`` ranks per
  domain), ``2 (D-1)/D * N / (l * out)``.

The single-plane policy (``up`` inside domains, ``out`` between them) run as a
hierarchical schedule whose phases overlap (the tuner's channels) is limited
by its busier plane: a rank moves ``2 (l-1)/l * N`` bytes on ``up`` (the
intra-domain reduce-scatter and all-gather over ``l`` local ranks) and
``2 (D-1)/D * N / l`` on ``out`` (the inter-domain all_reduce of its shard
across ``D`` domains). Its ``out`` term is the cross-domain limit itself, so
once ``up / out >= (l-1) D / (D-1)`` (2 on two domains of two, the testbed's
2:1; 7.5 for 16 domains of 8, which NVLink against one NIC per GPU exceeds)
splitting bytes across the planes can add nothing that overlapping the phases
does not already give.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class AllReduceBounds:
    """Lower bounds on one all_reduce's time, in seconds."""

    per_rank_s: float      # both links of a rank busy the whole time
    cross_domain_s: float  # the domains' all_reduce among themselves on 'out' (0 with one domain)
    single_plane_s: float  # the single-plane policy's busier plane, phases overlapped

    @property
    def multipath_s(self) -> float:
        """No schedule over both planes can finish sooner."""
        return max(self.per_rank_s, self.cross_domain_s)

    @property
    def ceiling(self) -> float:
        """The largest possible speed-up of a multipath policy over the single-plane one, if both reached their bounds."""
        return self.single_plane_s / self.multipath_s


def all_reduce_bounds(nbytes: float, domain_of: Sequence[int], up_Bps: float, out_Bps: float) -> AllReduceBounds:
    """Bounds for ``nbytes`` all_reduced by ranks ``0..p-1`` whose scale-up domain is ``domain_of[rank]``.

    Every domain must hold the same number of ranks (the hierarchical schedule's
    own condition); one rank per domain means no ``up`` at all."""
    p = len(domain_of)
    if p < 2:
        raise ValueError("an all_reduce bound needs at least 2 ranks")
    if up_Bps <= 0 or out_Bps <= 0:
        raise ValueError(f"link rates must be positive, got up {up_Bps} and out {out_Bps} B/s")
    sizes = Counter(domain_of)
    if len(set(sizes.values())) != 1:
        raise ValueError(f"domains of unequal size {sorted(sizes.values())}: no hierarchical schedule to bound")
    local, domains = next(iter(sizes.values())), len(sizes)
    up = up_Bps if local > 1 else 0.0
    per_rank = 2 * (p - 1) / p * nbytes / (up + out_Bps)
    cross = 2 * (domains - 1) / domains * nbytes / (local * out_Bps)
    up_bytes = 2 * (local - 1) / local * nbytes
    out_bytes = 2 * (domains - 1) / domains * nbytes / local
    single = max(up_bytes / up if up else 0.0, out_bytes / out_Bps)
    return AllReduceBounds(per_rank, cross, single)
