"""The base of everything the engine drives, and the fingerprint check every
operation makes on its peers' first message."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from .errors import MismatchError
from .fingerprint import Fingerprint
from .telemetry import wall
from .windows import OUT, UP

if TYPE_CHECKING:
    from .engine import Engine

FP_BYTES = 16  # a fingerprint's two uint64 words


class Operation:
    """Base of everything the engine drives. Subclasses implement _advance()."""

    name = "op"
    stats_are_light = False  # True: its record holds nothing to count but the operation and its bytes; built later
    posts_when_built = False  # True: its constructor posted everything; nothing can have completed by submit()
    spin_planes: tuple = ()  # the planes its messages use, where it knows (Engine._spin_alone); () = all
    # True while it waits on a flag in shared memory (shm_steps.py): no plane event
    # announces the peer's step, so the engine polls instead of sleeping on them
    # while any such operation is active.
    polls_memory = False

    def __init__(self, engine: "Engine", seq: int):
        self.engine = engine
        self.seq = seq
        self.finished = False
        self.error: Optional[BaseException] = None
        self.t_start = time.perf_counter()
        self.t_end: Optional[float] = None
        self.last_progress = self.t_start
        self.bytes_per_plane = {UP: 0, OUT: 0}
        self.result = None
        self.on_finish: list[Callable] = []

    def advance(self) -> bool:
        if self.finished:
            return False
        try:
            moved = self._advance()
        except BaseException as exc:  # noqa: BLE001 - recorded and re-raised by wait()
            self._fail(exc)
            return True
        if moved:
            self.last_progress = time.perf_counter()
        return moved

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self._finish()

    def _finish(self) -> None:
        self.finished = True
        self.t_end = time.perf_counter()
        if self.error is None:
            self._let_go_of_arrays()
        for callback in self.on_finish:
            callback(self)

    def _let_go_of_arrays(self) -> None:
        """Drop the references to the caller's arrays once the operation has
        succeeded: the communicator keeps its last operation for last_stats(), and
        it must not keep a call's arrays alive (a device call's pinned host mirrors
        go back to cupy's pool only then; one held a call longer made the next call
        allocate anew, ~20 ms for 64 MiB). A Work the caller keeps still holds the
        result it returns. Never after a failure, where UCX may still hold them
        (Engine.park)."""

    def run_alone(self) -> bool:
        """Drive it without the planes for a moment, where that can finish it (an
        operation that waits on memory only: lane_ops.LaneOp); True once
        finished. Engine.wait calls it for an operation alone in the engine."""
        return False

    def stalled_for(self, now: float) -> float:
        return now - self.last_progress

    def describe_stall(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {
            "op": self.name,
            "seq": self.seq,
            "duration_s": (self.t_end or time.perf_counter()) - self.t_start,
            "t_start_wall": wall(self.t_start),
            "bytes_per_plane": dict(self.bytes_per_plane),
        }


def check_fingerprint(op: "Operation", message: np.ndarray, peer: int, abort_peers, abort_seq: int):
    """Compare the fingerprint at the start of a peer's message with ``op.fingerprint``;
    on a difference tell ``abort_peers`` and raise MismatchError saying what differs.
    Returns the peer's fingerprint where its words differ from ours (None: the same)."""
    mine = op.fingerprint
    if message[:FP_BYTES].tobytes() == mine.raw:
        return None  # the same words: nothing can differ (the common case, ~3 us of decoding saved)
    theirs = Fingerprint.decode(message[:FP_BYTES].view(np.uint64))
    diffs = mine.differences(theirs)
    if diffs:
        text = (f"rank {op.engine.rank} called {mine.describe()} as operation #{op.seq} but rank "
                f"{peer} called {theirs.describe()} ({'; '.join(diffs)})")
        op.engine.broadcast_abort(abort_peers, abort_seq, text)
        err = MismatchError(text)
        err.peers_told = True
        raise err
    return theirs
