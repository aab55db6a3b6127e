"""The scale-out load that a pipelined schedule's other channels put beside each stage.

With one channel a stage has the planes to itself (its peers' flows aside,
which the coflow split sees). With c > 1 channels the stages of different
channels overlap: in a hierarchical all_reduce one channel's intra-domain
stage runs while another's inter-domain stage sends bytes that only 'out'
can carry. Split as if 'out' were free, an intra-domain stage at 1:1 rates
put half of its bytes on 'out', on top of the inter-domain phases: the out
link carried 1.0x the buffer against 0.5x on 'up' and the operation took as
long as on 'up' alone (simulated), 0.81-0.90x of it on the 2x2 testbed.

Balanced over the operation, a rank sending S bytes that either plane can
carry and P bytes that only 'out' reaches, at rates u and o, finishes
soonest with a share x of S on 'out' where (1 - x) S / u = (x S + P) / o,
clamped to [0, 1]. The coflow split reaches that x by itself when each of
the rank's splittable flows (n bytes) comes with a companion demand of
n P / S bytes that only 'out' reaches: :func:`companion_flows` builds them.
"""
from __future__ import annotations

from typing import Callable

from .schedule import Flow, Schedule

# Companion flows take ids from this one down; schedule flows have ids >= 0.
COMPANION_ID_BASE = -1


def companion_flows(schedule: Schedule, same_domain: Callable[[int, int], bool]) -> dict[int, tuple[Flow, ...]]:
    """Per stage id, one out-only companion flow per sending rank (see module docstring).

    Empty for a schedule on one channel, or where no rank sends both kinds of
    flow (a flat ring: every peer in one domain, or one rank per domain)."""
    if schedule.channels <= 1:
        return {}
    splittable: dict[int, int] = {}
    pinned: dict[int, int] = {}
    pinned_peer: dict[int, int] = {}
    for f in schedule.flows():
        if same_domain(f.src, f.dst):
            splittable[f.src] = splittable.get(f.src, 0) + f.count
        else:
            pinned[f.src] = pinned.get(f.src, 0) + f.count
            pinned_peer.setdefault(f.src, f.dst)
    companions: dict[int, tuple[Flow, ...]] = {}
    next_id = COMPANION_ID_BASE
    for stage in schedule.stages:
        per_src: dict[int, int] = {}
        for f in stage.flows:
            if same_domain(f.src, f.dst) and pinned.get(f.src):
                per_src[f.src] = per_src.get(f.src, 0) + f.count
        extra = []
        for src, count in sorted(per_src.items()):
            load = round(count * pinned[src] / splittable[src])
            if load > 0:
                extra.append(Flow(next_id, src, pinned_peer[src], "", 0, "", 0, load))
                next_id -= 1
        if extra:
            companions[stage.id] = tuple(extra)
    return companions
