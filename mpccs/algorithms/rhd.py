"""Recursive halving-doubling (Rabenseifner) and recursive-doubling all-gather.

Among p2 = 2**L ranks (L = lg p2), the data is cut into p2 *groups*:

* recursive halving (reduce-scatter), L steps: at step k the distance is
  p2 / 2**(k+1); each rank keeps the half of its current group range on its
  side of that bit and sends the other half to its partner, which reduces
  it in. Rank r ends holding group r, reduced over all p2 ranks.
* recursive doubling (all-gather), L steps: distance 1, 2, 4, ...; each rank
  sends the aligned group range it holds to its partner, doubling it.

Non-powers of two (p = p2 + rem): each extra rank p2+i first folds its data
into partner i, the p2 survivors run the algorithm, and partner i hands the
result back at the end (Thakur, Rabenseifner and Gropp 2005). For
reduce-scatter and all-gather the extra rank's block travels inside its
partner's group (group g = block g plus block p2+g when g < rem), so groups
of partners carry twice the data of the others.
"""
from __future__ import annotations

from typing import Sequence

from ._builder import Extent, Move, ScheduleBuilder, Spec, Step, coalesce, moves_over, pow2_floor, split
from .ring import Block, strip_blocks
from .schedule import Schedule


def group_range(groups: Sequence[Block], lo: int, hi: int) -> tuple[Extent, ...]:
    """Element extents of groups lo..hi-1, merged where they touch."""
    return coalesce(e for g in groups[lo:hi] for e in g)


def halving_steps(groups: Sequence[Block], buf: str) -> list[Step]:
    """Recursive halving over ranks 0..p2-1 (p2 = len(groups), a power of two)."""
    p2 = len(groups)
    held = {r: (0, p2) for r in range(p2)}
    steps = []
    dist = p2 // 2
    while dist >= 1:
        moves: list[Move] = []
        for r in range(p2):
            lo, hi = held[r]
            mid = (lo + hi) // 2
            keep, send = ((mid, hi), (lo, mid)) if r & dist else ((lo, mid), (mid, hi))
            moves += moves_over(r, r ^ dist, buf, group_range(groups, *send), reduce=True)
            held[r] = keep
        steps.append((f"halving d={dist}", moves))
        dist //= 2
    return steps


def doubling_steps(groups: Sequence[Block], buf: str) -> list[Step]:
    """Recursive doubling over ranks 0..p2-1; rank r starts holding group r."""
    p2 = len(groups)
    steps = []
    dist = 1
    while dist < p2:
        moves: list[Move] = []
        for r in range(p2):
            lo = r & ~(dist - 1)  # aligned range of `dist` groups held by r
            moves += moves_over(r, r ^ dist, buf, group_range(groups, lo, lo + dist))
        steps.append((f"doubling d={dist}", moves))
        dist *= 2
    return steps


def fold_groups(blocks: Sequence[Block], p2: int) -> list[Block]:
    """Group g = block g, plus the block of extra rank p2+g if it exists."""
    rem = len(blocks) - p2
    return [tuple(blocks[g]) + (tuple(blocks[p2 + g]) if g < rem else ()) for g in range(p2)]


def all_reduce_rhd(spec: Spec) -> Schedule:
    p, n = spec.world, spec.count
    p2 = pow2_floor(p)
    extras = range(p2, p)
    b = ScheduleBuilder(spec, meta={"pow2": p2})
    for r in range(p):
        b.prologue(r, "in", 0, "out", 0, n)
    per_channel = []
    for off, size in spec.channel_slices():
        whole = ((off, size),)
        groups = [((off + o, s),) for o, s in split(size, p2)]
        fold = [m for e in extras for m in moves_over(e, e - p2, "out", whole, reduce=True)]
        unfold = [m for e in extras for m in moves_over(e - p2, e, "out", whole)]
        per_channel.append([("fold", fold)] + halving_steps(groups, "out") + doubling_steps(groups, "out") + [("unfold", unfold)])
    b.interleave(per_channel)
    return b.build()


def reduce_scatter_rhd(spec: Spec) -> Schedule:
    p, n = spec.world, spec.count
    p2 = pow2_floor(p)
    extras = range(p2, p)
    b = ScheduleBuilder(spec, work_count=p * n, meta={"pow2": p2})
    for r in range(p):
        b.prologue(r, "in", 0, "work", 0, p * n)
    per_channel = []
    for part in spec.channel_slices():
        blocks = strip_blocks(p, n, part)
        everything = [e for blk in blocks for e in blk]
        fold = [m for e in extras for m in moves_over(e, e - p2, "work", everything, reduce=True)]
        unfold = [m for e in extras for m in moves_over(e - p2, e, "work", blocks[e])]
        per_channel.append([("fold", fold)] + halving_steps(fold_groups(blocks, p2), "work") + [("unfold", unfold)])
    b.interleave(per_channel)
    for r in range(p):
        b.epilogue(r, "work", r * n, "out", 0, n)
    return b.build()


def all_gather_rd(spec: Spec) -> Schedule:
    p, n = spec.world, spec.count
    p2 = pow2_floor(p)
    extras = range(p2, p)
    b = ScheduleBuilder(spec, meta={"pow2": p2})
    for r in range(p):
        b.prologue(r, "in", 0, "out", r * n, n)
    per_channel = []
    for part in spec.channel_slices():
        blocks = strip_blocks(p, n, part)
        fold = [m for e in extras for m in moves_over(e, e - p2, "out", blocks[e])]
        unfold = [
            m for e in extras
            for m in moves_over(e - p2, e, "out", [x for j, blk in enumerate(blocks) if j != e for x in blk])
        ]
        per_channel.append([("fold", fold)] + doubling_steps(fold_groups(blocks, p2), "out") + [("unfold", unfold)])
    b.interleave(per_channel)
    return b.build()
