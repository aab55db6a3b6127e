"""Flap damping of a flow's whole-chunk boundary (pure logic, no clock).

A split lands on a whole-chunk boundary near the model's target
(controller._whole_chunks). Next to a paced competing flow the loaded rank of
a 16 MiB all_reduce moved 1.5 -> 2 (or 2.5) -> 1.5 MiB of 8 on 'out' and back
12-15 times in ~160 operations on an AMD 2-vCPU host
(bench/results/series_s51_damping/). The 'out' estimate swings: with 1.5 MiB
parts the competing flow's queue drains and the parts read 45-65 MB/s for a
few operations, the split moves up, the larger parts wait behind that queue and
read 33-37, and it moves back. What the estimates miss is how the link's rate
depends on what is sent into it; a swing lasts as long as the estimator's
filter keeps a fast sample.

The rule is route-flap damping (RFC 2439) on the boundary: every reversal (a
move against the direction of the flow's last move) adds one to a penalty that
halves every ``half_life`` decisions of the flow; two reversals within a
half-life (``suppress`` = 1.5) damp it, until the penalty decays below
``reuse``. Moves that keep one direction (a ramp toward a new target) and a
single reversal (a load that came and went) never damp. Damped, the flow holds
the last boundary it stayed on for ``confirm`` decisions (longer than a swing
lasts), or the lower one of the flap where none did. A move to fewer bytes on
'out' is taken at once (a load that came: target 5 wants it followed within 5
operations), and so is a move back up to the held boundary (the end of a dip);
a move above it is taken only once the model has asked for it ``confirm``
decisions in a row (a load that went persists; a swing of the estimate does
not), and then as far as the least of those picks. Each refused swing counts
as a flap, so swings that keep coming keep the flow damped.

Only moves to more bytes on 'out' wait: those bytes are borrowed (they cost
other tenants), and the delay the model misses in a flap grows with the bytes
sent into a shared queue. The cost: a load that went is followed ``confirm``
decisions later while the flow is damped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .bounded import remember


@dataclass
class _Flaps:
    penalty: float = 0.0
    damped: bool = False
    last_move: int = 0           # +1: the last move put more bytes on 'out', -1: fewer, 0: none yet
    stayed: int = 0              # decisions in a row on the current boundary
    settled: Optional[float] = None  # the last boundary that stayed ``confirm`` decisions or more
    hold: float = 0.0            # damped: moves up to this many bytes on 'out' are free, above it they wait
    refused: list = field(default_factory=list)  # the picks above ``hold`` refused in a row


class BoundaryDamping:
    def __init__(self, half_life: float = 64.0, suppress: float = 1.5, reuse: float = 0.5, confirm: int = 6):
        if half_life <= 0:
            raise ValueError("half_life must be > 0")
        if not 0 <= reuse < suppress:
            raise ValueError("need 0 <= reuse < suppress")
        if confirm < 1:
            raise ValueError("confirm must be >= 1")
        self.half_life = float(half_life)
        self.suppress = float(suppress)
        self.reuse = float(reuse)
        self.confirm = int(confirm)
        self._flows: dict[tuple, _Flaps] = {}

    def choose(self, key: tuple, prev: Optional[float], best: float) -> float:
        """The bytes on 'out' to use, given the previous boundary (what this returned
        last time for the flow; None: its first decision) and the one the model and
        the hysteresis picked."""
        st = self._flows.get(key) or _Flaps()
        remember(self._flows, key, st)
        st.penalty *= 0.5 ** (1.0 / self.half_life)
        if st.damped and st.penalty < self.reuse:
            st.damped = False
        chosen = self._choose(st, prev, best)
        st.stayed = st.stayed + 1 if chosen == prev else 1
        if st.stayed >= self.confirm:  # longer than a swing of the estimate lasts
            st.settled = chosen
            if st.damped:
                st.hold = chosen  # the level to hold
        return chosen

    def _choose(self, st: _Flaps, prev: Optional[float], best: float) -> float:
        if prev is None or best == prev:
            st.refused.clear()
            return best
        move = 1 if best > prev else -1
        if st.damped and best > max(prev, st.hold):
            if not st.refused:
                st.penalty += 1.0  # each refused swing counts as a flap: swings that keep coming keep it damped
            st.refused.append(best)
            if len(st.refused) < self.confirm:
                return prev
            best = min(st.refused)  # it persisted (a load that went): as far as every pick of it asked
        st.refused.clear()
        if move == -st.last_move:
            st.penalty += 1.0  # a reversal
        st.last_move = move
        if not st.damped and st.penalty >= self.suppress:
            st.damped = True
            st.hold = st.settled if st.settled is not None else min(prev, best)
        return best

    def damped(self, key: tuple) -> bool:
        st = self._flows.get(key)
        return bool(st and st.damped)

    def __len__(self) -> int:
        return len(self._flows)
