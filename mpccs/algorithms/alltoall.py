"""Pairwise-exchange all-to-all and all-to-allv.

At step k (1..p-1) rank r sends its block for (r+k) mod p and receives the
block of (r-k) mod p; the own block is a prologue copy. Each rank meets one
peer per direction per step, so no rank is flooded. The steps of a channel
are chained explicitly (there is no data dependency between them: every step
reads ``in`` and writes a different block of ``out``), which keeps the
exchange pairwise instead of letting all p-1 sends start at once.

Flow ids are a function of (channel, src, dst): ``(c * p + src) * p + dst``,
so two ranks that each build only their own view agree on them, which limits
``channels * p * p`` to 2**20.

all_to_allv is built per rank (``Schedule.local_rank``): the rank knows its
own send and receive counts, not its peers', so only flows touching it exist
and the far side's offset of each flow is :data:`REMOTE_OFFSET` (-1); the
peer's schedule carries it. Empty stages are kept so that stage ids,
``(k - 1) * channels + c``, are the same on every rank.
"""
from __future__ import annotations

from itertools import accumulate

from ._builder import MAX_FLOW_ID, REMOTE_OFFSET, Move, ScheduleBuilder, Spec, split
from .schedule import Schedule


def pairwise_flow_id(channel: int, src: int, dst: int, world: int) -> int:
    return (channel * world + src) * world + dst


def _check_id_space(spec: Spec) -> None:
    if spec.channels * spec.world * spec.world > MAX_FLOW_ID:
        raise ValueError(
            f"pairwise all-to-all with world={spec.world} and channels={spec.channels} needs "
            f"{spec.channels * spec.world ** 2} flow ids, more than {MAX_FLOW_ID}; use fewer channels"
        )


def all_to_all_pairwise(spec: Spec) -> Schedule:
    _check_id_space(spec)
    p, n = spec.world, spec.count
    b = ScheduleBuilder(spec)
    for r in range(p):
        b.prologue(r, "in", r * n, "out", r * n, n)
    parts = spec.channel_slices()
    previous: dict[int, tuple[int, ...]] = {}
    for k in range(1, p):
        for c, (off, size) in enumerate(parts):
            moves = []
            for src in range(p):
                dst = (src + k) % p
                fid = pairwise_flow_id(c, src, dst, p)
                moves.append(Move(src, dst, "in", dst * n + off, "out", src * n + off, size, False, fid))
            after = [previous[c]] if c in previous else []
            previous[c] = b.stage(moves, channel=c, label=f"step {k}" + (f" ch{c}" if len(parts) > 1 else ""), after=after)
    return b.build()


def all_to_allv_pairwise(spec: Spec) -> Schedule:
    _check_id_space(spec)
    p, me = spec.world, spec.rank
    sends, recvs = spec.send_counts, spec.recv_counts
    send_displ = [0, *accumulate(sends)][:-1]
    recv_displ = [0, *accumulate(recvs)][:-1]
    b = ScheduleBuilder(
        spec,
        keep_empty=True,  # stage ids must not depend on this rank's counts
        track=False,  # far-side offsets are unknown; steps are chained explicitly
        local_rank=me,
        meta={"send_counts": tuple(sends), "recv_counts": tuple(recvs), "in_count": sum(sends), "out_count": sum(recvs)},
    )
    b.prologue(me, "in", send_displ[me], "out", recv_displ[me], sends[me])
    previous: dict[int, tuple[int, ...]] = {}
    for k in range(1, p):
        to, frm = (me + k) % p, (me - k) % p
        for c in range(spec.channels):
            send_off, send_size = split(sends[to], spec.channels)[c]
            recv_off, recv_size = split(recvs[frm], spec.channels)[c]
            moves = [
                Move(me, to, "in", send_displ[to] + send_off, "out", REMOTE_OFFSET, send_size, False,
                     pairwise_flow_id(c, me, to, p)),
                Move(frm, me, "in", REMOTE_OFFSET, "out", recv_displ[frm] + recv_off, recv_size, False,
                     pairwise_flow_id(c, frm, me, p)),
            ]
            after = [previous[c]] if c in previous else []
            previous[c] = b.stage(moves, channel=c, label=f"step {k}" + (f" ch{c}" if spec.channels > 1 else ""), after=after)
    return b.build()
