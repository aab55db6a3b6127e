"""Ring algorithms: reduce-scatter, all-gather, and all-reduce as both.

Ring primitives work on any list of ranks and any list of blocks (each block
a tuple of element extents, so a "block" may be scattered, as the
hierarchical algorithms need). With n ranks on the ring:

* reduce-scatter, n-1 steps: at step t position i sends block (i-t-1) mod n
  to position i+1, which reduces it in. Block j starts at position j+1 and
  ends, fully reduced, at position j. Each block is reduced along one path
  and then only copied, so every rank ends with bit-identical results.
* all-gather, n-1 steps: position i starts with block i; at step t it sends
  block (i-t) mod n to position i+1.

Channels cut the data into disjoint slices, each running its own ring.
"""
from __future__ import annotations

from typing import Sequence

from ._builder import Extent, Move, ScheduleBuilder, Spec, Step, moves_over, split
from .schedule import Schedule

Block = tuple[Extent, ...]


def ring_reduce_scatter_steps(ranks: Sequence[int], blocks: Sequence[Block], buf: str, label: str = "rs") -> list[Step]:
    """Steps after which ``ranks[j]`` holds block j reduced over the ring."""
    n = len(ranks)
    assert len(blocks) == n, "one block per ring position"
    steps = []
    for t in range(n - 1):
        moves: list[Move] = []
        for i in range(n):
            block = blocks[(i - t - 1) % n]
            moves += moves_over(ranks[i], ranks[(i + 1) % n], buf, block, reduce=True)
        steps.append((f"{label} {t}", moves))
    return steps


def ring_all_gather_steps(ranks: Sequence[int], blocks: Sequence[Block], buf: str, label: str = "ag") -> list[Step]:
    """Steps after which every rank holds every block (ranks[j] starts with block j)."""
    n = len(ranks)
    assert len(blocks) == n, "one block per ring position"
    steps = []
    for t in range(n - 1):
        moves: list[Move] = []
        for i in range(n):
            moves += moves_over(ranks[i], ranks[(i + 1) % n], buf, blocks[(i - t) % n])
        steps.append((f"{label} {t}", moves))
    return steps


def zip_steps(groups: Sequence[Sequence[Step]], label: str) -> list[Step]:
    """Merge step t of several independent rings into one stage."""
    longest = max((len(g) for g in groups), default=0)
    merged = []
    for t in range(longest):
        moves = [m for g in groups if t < len(g) for m in g[t][1]]
        merged.append((f"{label} {t}", moves))
    return merged


def strip_blocks(world: int, count: int, part: Extent) -> list[Block]:
    """Block j = channel ``part`` of rank j's ``count``-element slot."""
    off, size = part
    return [((j * count + off, size),) for j in range(world)]


def all_reduce_ring(spec: Spec) -> Schedule:
    p, n = spec.world, spec.count
    b = ScheduleBuilder(spec)
    for r in range(p):
        b.prologue(r, "in", 0, "out", 0, n)
    ranks = list(range(p))
    per_channel = []
    for off, size in spec.channel_slices():
        blocks = [((off + o, s),) for o, s in split(size, p)]
        per_channel.append(ring_reduce_scatter_steps(ranks, blocks, "out") + ring_all_gather_steps(ranks, blocks, "out"))
    b.interleave(per_channel)
    return b.build()


def reduce_scatter_ring(spec: Spec) -> Schedule:
    """Partial sums in ``work``; a rank's own block goes straight to ``out``.

    The own block is written once, by the ring's last step (block j ends at
    position j), so that step reduces the rank's input block and the arriving
    partial sums into ``out`` (the engine's deferred prologue copy makes it one
    pass, operands in the same order). Through ``work`` it took an epilogue
    copy after the last step: 5-6 ms of a 2-rank 64 MiB call's ~88 on the
    testbed, with nothing left to overlap it."""
    p, n = spec.world, spec.count
    b = ScheduleBuilder(spec, work_count=p * n)
    for r in range(p):
        b.prologue(r, "in", r * n, "out", 0, n)
        b.prologue(r, "in", 0, "work", 0, r * n)
        b.prologue(r, "in", (r + 1) * n, "work", (r + 1) * n, (p - r - 1) * n)
    ranks = list(range(p))
    b.interleave([_own_block_into_out(ring_reduce_scatter_steps(ranks, strip_blocks(p, n, part), "work"), n)
                  for part in spec.channel_slices()])
    return b.build()


def _own_block_into_out(steps: list[Step], n: int) -> list[Step]:
    """The last step's moves into the receiver's own block of ``work`` (rank r's: [r n, (r + 1) n)) land in ``out``."""
    if not steps:
        return steps
    label, moves = steps[-1]
    last = [m._replace(dst_buf="out", dst_off=m.dst_off - m.dst * n)
            if m.dst_buf == "work" and m.dst * n <= m.dst_off < (m.dst + 1) * n else m for m in moves]
    return steps[:-1] + [(label, last)]


def all_gather_ring(spec: Spec) -> Schedule:
    p, n = spec.world, spec.count
    b = ScheduleBuilder(spec)
    for r in range(p):
        b.prologue(r, "in", 0, "out", r * n, n)
    ranks = list(range(p))
    b.interleave([ring_all_gather_steps(ranks, strip_blocks(p, n, part), "out") for part in spec.channel_slices()])
    return b.build()
