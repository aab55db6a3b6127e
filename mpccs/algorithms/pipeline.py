"""Pipelined chain broadcast and reduce.

The ranks form a chain starting at the root: root, root+1, ..., root-1.
Each channel's slice is cut into segments; stage (s, k) moves segment s over
link k of the chain (one flow). Its data dependency is segment s crossing
the neighbouring link first; an explicit dependency on (s-1, k) keeps each
link sending its segments in order, so the first segment reaches the far end
early instead of every segment sharing the link at once. Nothing orders
(s, k) against (s+1, k-1) (broadcast) or (s+1, k+1) (reduce): that overlap
is the pipeline. Time ~ (segments + p - 2) x (alpha + segment bytes x beta).

Broadcast copies ``out`` from the root outward. Reduce runs the chain the
other way: the far end sends first, each rank reduces the segment into its
``work`` and forwards it toward the root, whose epilogue copies ``work`` to
``out``.
"""
from __future__ import annotations

from ._builder import Extent, Move, ScheduleBuilder, Spec, split
from .schedule import Schedule

# Segments per channel when the caller does not say; capped by the slice
# length. A tuner that knows bytes, alpha and beta should pick about
# sqrt((p - 2) * n * beta / alpha) instead.
DEFAULT_SEGMENTS = 8


def channel_segments(spec: Spec) -> list[list[Extent]]:
    """Per channel, the non-empty segments of its slice."""
    wanted = spec.segments or DEFAULT_SEGMENTS
    return [
        [(off + o, s) for o, s in split(size, max(1, min(wanted, size))) if s > 0]
        for off, size in spec.channel_slices()
    ]


def _chain_stages(b: ScheduleBuilder, spec: Spec, buf: str, toward_root: bool) -> None:
    chain = [(spec.root + i) % spec.world for i in range(spec.world)]
    # Link k joins chain[k] and chain[k+1]; toward the root the far end sends first.
    links = list(range(spec.world - 1))[::-1 if toward_root else 1]
    per_channel = channel_segments(spec)
    last_on_link: dict[tuple[int, int], tuple[int, ...]] = {}  # (channel, link) -> stage handle
    for s in range(max((len(x) for x in per_channel), default=0)):
        for c, segments in enumerate(per_channel):
            if s >= len(segments):
                continue
            off, size = segments[s]
            for k in links:
                src, dst = (chain[k + 1], chain[k]) if toward_root else (chain[k], chain[k + 1])
                move = Move(src, dst, buf, off, buf, off, size, reduce=toward_root)
                after = [last_on_link[(c, k)]] if (c, k) in last_on_link else []
                last_on_link[(c, k)] = b.stage([move], channel=c, label=f"seg {s} link {k}", after=after)
    b.meta["segments"] = max((len(x) for x in per_channel), default=0)


def broadcast_pipeline(spec: Spec) -> Schedule:
    b = ScheduleBuilder(spec)
    _chain_stages(b, spec, "out", toward_root=False)
    return b.build()


def reduce_pipeline(spec: Spec) -> Schedule:
    n = spec.count
    b = ScheduleBuilder(spec, work_count=n)
    for r in range(spec.world):
        b.prologue(r, "in", 0, "work", 0, n)
    _chain_stages(b, spec, "work", toward_root=True)
    b.epilogue(spec.root, "work", 0, "out", 0, n)
    return b.build()
