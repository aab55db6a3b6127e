"""Binomial trees (reduce, broadcast, all-reduce) and recursive-doubling all-reduce.

Binomial trees work for any world size. With v = (rank - root) mod p:

* reduce, ceil(lg p) steps: at step k (mask = 2**k) every v with lowest set
  bit == mask sends its partial to v - mask, which reduces it in;
* broadcast: the same tree backwards, masks from the largest down: every v
  that is a multiple of 2*mask and has v + mask < p sends to v + mask.

Recursive doubling all-reduce (small messages, lg p latency): at step k each
rank exchanges its whole partial with rank ^ 2**k and both reduce. A flow
reduces into its destination as the data lands, so the receiving buffer
must already hold the receiver's partial while another buffer is being sent
from; and a stage may not read and write the same range. Each step therefore
consumes one copy of the partial: copies C_0..C_{L-1} live in ``work``
(work_count = L * count) and C_L is ``out``; step k sends C_k and reduces
into C_{k+1}..C_L. That is L stages (lg p latency) moving L(L+1)/2 times the
message, a good trade for the small messages rd is meant for. Non-powers of
two fold the extra ranks into partners first (into every copy) and send the
result back at the end. Both ranks of a pair compute op(a, b) and op(b, a),
identical for the commutative IEEE operations sum, prod, min and max.
"""
from __future__ import annotations

from ._builder import Extent, Move, ScheduleBuilder, Spec, Step, moves_over, pow2_floor
from .schedule import Schedule


def binomial_reduce_steps(p: int, root: int, extents: tuple[Extent, ...], buf: str) -> list[Step]:
    """Steps that reduce ``buf[extents]`` of every rank into the root's."""
    steps = []
    mask = 1
    while mask < p:
        moves: list[Move] = []
        for v in range(mask, p, 2 * mask):
            moves += moves_over((v + root) % p, (v - mask + root) % p, buf, extents, reduce=True)
        steps.append((f"reduce m={mask}", moves))
        mask *= 2
    return steps


def binomial_bcast_steps(p: int, root: int, extents: tuple[Extent, ...], buf: str) -> list[Step]:
    """Steps that copy the root's ``buf[extents]`` to every rank."""
    steps = []
    mask = pow2_floor(p - 1) if p > 1 else 0
    while mask >= 1:
        moves: list[Move] = []
        for v in range(0, p - mask, 2 * mask):
            moves += moves_over((v + root) % p, (v + mask + root) % p, buf, extents)
        steps.append((f"bcast m={mask}", moves))
        mask //= 2
    return steps


def all_reduce_tree(spec: Spec) -> Schedule:
    """Binomial reduce to rank 0, then binomial broadcast from rank 0."""
    p, n = spec.world, spec.count
    b = ScheduleBuilder(spec)
    for r in range(p):
        b.prologue(r, "in", 0, "out", 0, n)
    b.interleave([
        binomial_reduce_steps(p, 0, (part,), "out") + binomial_bcast_steps(p, 0, (part,), "out")
        for part in spec.channel_slices()
    ])
    return b.build()


def reduce_tree(spec: Spec) -> Schedule:
    p, n = spec.world, spec.count
    b = ScheduleBuilder(spec, work_count=n)
    for r in range(p):
        b.prologue(r, "in", 0, "work", 0, n)
    b.interleave([binomial_reduce_steps(p, spec.root, (part,), "work") for part in spec.channel_slices()])
    b.epilogue(spec.root, "work", 0, "out", 0, n)
    return b.build()


def broadcast_tree(spec: Spec) -> Schedule:
    b = ScheduleBuilder(spec)
    b.interleave([binomial_bcast_steps(spec.world, spec.root, (part,), "out") for part in spec.channel_slices()])
    return b.build()


def all_reduce_rd(spec: Spec) -> Schedule:
    p, n = spec.world, spec.count
    p2 = pow2_floor(p)
    levels = p2.bit_length() - 1
    b = ScheduleBuilder(spec, work_count=levels * n, meta={"pow2": p2})
    for r in range(p):
        b.prologue(r, "in", 0, "out", 0, n)
        if r < p2:  # extra ranks only send, they need no copies
            for j in range(levels):
                b.prologue(r, "in", 0, "work", j * n, n)

    def copy_at(j: int, off: int) -> tuple[str, int]:
        return ("work", j * n + off) if j < levels else ("out", off)

    per_channel = []
    for off, size in spec.channel_slices():
        fold = [
            Move(e, e - p2, "out", off, *copy_at(j, off), size, True)
            for e in range(p2, p) for j in range(levels + 1)
        ]
        steps: list[Step] = [("fold", fold)]
        for k in range(levels):
            src_buf, src_off = copy_at(k, off)
            moves = [
                Move(r, r ^ (1 << k), src_buf, src_off, *copy_at(j, off), size, True)
                for r in range(p2) for j in range(k + 1, levels + 1)
            ]
            steps.append((f"rd d={1 << k}", moves))
        steps.append(("unfold", [m for e in range(p2, p) for m in moves_over(e - p2, e, "out", ((off, size),))]))
        per_channel.append(steps)
    b.interleave(per_channel)
    return b.build()
