"""Pure chunking, split and tail-stealing logic of one flow (no I/O, no clock).

A flow of ``count`` elements is cut into chunks of ``chunk_elems`` elements
(the last one shorter). The scale-up plane takes chunks from the head, the
scale-out plane from the tail, so the two parts never interleave and the
boundary between them can float: a plane that runs ahead keeps taking chunks
past the planned boundary (tail stealing) while unstarted chunks remain,
within the scale-out cap. The engine and the simulator both drive this class.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

UP, OUT = "up", "out"


def chunk_count(count: int, chunk_elems: int) -> int:
    return -(-count // chunk_elems) if count > 0 else 0


def chunk_range(index: int, count: int, chunk_elems: int) -> tuple[int, int]:
    """(element offset within the flow, element length) of chunk ``index``."""
    start = index * chunk_elems
    return start, min(chunk_elems, count - start)


def missing_ranges(done, lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) that no (start, end) range in ``done`` covers, in order."""
    parts, at = [], lo
    for start, end in sorted(done):
        if end <= at or start >= hi:
            continue
        if start > at:
            parts.append((at, start))
        at = max(at, end)
        if at >= hi:
            break
    if at < hi:
        parts.append((at, hi))
    return parts


@dataclass
class FlowCursor:
    """Which chunks of one outgoing flow are assigned, started and left.

    ``boundary`` is the planned split: chunks [0, boundary) belong to 'up',
    [boundary, nchunks) to 'out'. ``steal`` lets a plane continue past it.
    ``out_cap_chunks`` bounds what 'out' may take, stealing included (QoS).
    """

    nchunks: int
    boundary: int
    steal: bool = False
    out_cap_chunks: Optional[int] = None
    head: int = 0  # next chunk 'up' would start
    tail: int = -1  # next chunk 'out' would start (descending); set in __post_init__
    out_taken: int = 0

    def __post_init__(self):
        if not 0 <= self.boundary <= self.nchunks:
            raise ValueError(f"boundary {self.boundary} outside [0, {self.nchunks}]")
        self.tail = self.nchunks - 1
        if self.out_cap_chunks is None:
            self.out_cap_chunks = self.nchunks

    def remaining(self) -> int:
        return max(0, self.tail - self.head + 1)

    def next_chunk(self, plane: str) -> Optional[int]:
        """The chunk this plane should start next, or None (nothing it may take)."""
        if self.head > self.tail:
            return None
        if plane == UP:
            if self.head >= self.boundary and not self.steal:
                return None
            index = self.head
            self.head += 1
            return index
        if self.tail < self.boundary and not self.steal:
            return None
        if self.out_taken >= self.out_cap_chunks:
            return None
        index = self.tail
        self.tail -= 1
        self.out_taken += 1
        return index

    def wants(self, plane: str) -> bool:
        """Would next_chunk(plane) return a chunk (without taking it)?"""
        if self.head > self.tail:
            return False
        if plane == UP:
            return self.steal or self.head < self.boundary
        if self.out_taken >= self.out_cap_chunks:
            return False
        return self.steal or self.tail >= self.boundary


def boundary_for(nbytes_up: int, nbytes_total: int, nchunks: int) -> int:
    """Chunks given to 'up' for a planned byte split (nearest whole chunk).

    All of the flow planned on one plane puts every chunk there, however
    small the flow; otherwise the split is rounded to the nearest chunk.
    """
    if nchunks == 0 or nbytes_up <= 0:
        return 0
    if nbytes_up >= nbytes_total:
        return nchunks
    return max(0, min(nchunks, int(round(nchunks * nbytes_up / nbytes_total))))


FLOW_MIN_CHUNKS = 4  # a flow that may be split is cut into at least this many chunks


def flow_min_chunks(whole_flows: bool) -> int:
    """Least chunks per flow: a sender on one plane only sends whole flows (in chunks
    of up to its plan's), one that may split keeps FLOW_MIN_CHUNKS for both planes."""
    return 1 if whole_flows else FLOW_MIN_CHUNKS


def flow_chunk_elems(count: int, plan_chunk_elems: int, min_chunk_elems: int,
                     min_chunks: int = FLOW_MIN_CHUNKS) -> int:
    """Chunk length (elements) for one flow; identical on sender and receiver.

    Flows shorter than ``min_chunks`` plan chunks are cut finer (down to
    ``min_chunk_elems``) so a split still has chunks to place on both planes.
    """
    target = -(-count // min_chunks) if count > 0 else 1
    return max(1, min(plan_chunk_elems, max(min_chunk_elems, target)))


class Pacer:
    """Token bucket for borrowed bytes on 'out' (the QoS rate cap, MPCCS_OUT_CAP_RATE).

    The controller's rate cap bounds how many bytes a stage puts there (rate x
    predicted stage time), but a plane that sends them as fast as its link allows
    still takes the whole link in bursts, and another tenant's flow on it loses
    its share for as long. The pacer spaces the chunks instead: a chunk may start
    when the bucket is not in debt, and its bytes are then owed at ``rate_Bps``,
    so over any interval the bytes started exceed ``rate x interval`` by at most
    one chunk plus ``burst_bytes``. Times are passed in (no clock here).
    """

    def __init__(self, rate_Bps: float, burst_bytes: float = 0.0, now: float = 0.0):
        if not rate_Bps > 0:
            raise ValueError(f"pacing rate must be > 0, got {rate_Bps}")
        self.rate_Bps = float(rate_Bps)
        self.burst_bytes = float(burst_bytes)
        self._tokens = float(burst_bytes)
        self._t = now

    def _refill(self, now: float) -> None:
        if now > self._t:
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._t) * self.rate_Bps)
            self._t = now

    def ready(self, now: float) -> bool:
        """May a chunk start now?"""
        self._refill(now)
        return self._tokens >= 0

    def take(self, nbytes: int, now: float) -> None:
        """A chunk of ``nbytes`` started at ``now``."""
        self._refill(now)
        self._tokens -= nbytes
