"""Discrete-event core: timed callbacks interleaved with fluid transfers.

Time only jumps to the next instant where something changes: a scheduled
callback, or the first transfer sending its last byte at current rates.
Everything due at one instant runs before rates are recomputed once, so a
thousand symmetric ranks finishing together cost one reallocation.
"""
from __future__ import annotations

import heapq
import itertools
import math
from typing import Callable

from .fabric import TIME_EPS, FluidNetwork, Transfer


class Simulator:
    def __init__(self, network: FluidNetwork):
        self.net = network
        self.now = 0.0
        self._queue: list = []
        self._order = itertools.count()
        self.stopped = False
        self.reallocations = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` at absolute time ``t`` (never in the past)."""
        heapq.heappush(self._queue, (max(t, self.now), next(self._order), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def start(self, transfer: Transfer) -> Transfer:
        return self.net.add(transfer, self.now)

    def stop(self) -> None:
        """End the run after the current instant (a failed operation)."""
        self.stopped = True

    def run(self, until: float = math.inf) -> float:
        while not self.stopped:
            if self.net.dirty:
                self.net.reallocate(self.now)
                self.reallocations += 1
            t_event = self._queue[0][0] if self._queue else math.inf
            t_flow = self.now + self.net.next_completion()
            t_next = min(t_event, t_flow, until)
            if math.isinf(t_next):
                break
            self.net.advance(t_next - self.now)
            self.now = t_next
            if self.now >= until:
                break
            self._run_instant()
        return self.now

    def _run_instant(self) -> None:
        """Everything due now: finished transfers first, then callbacks."""
        for tr in self.net.pop_finished():
            if tr.on_sent is not None:
                tr.on_sent(tr, self.now)
        horizon = self.now + TIME_EPS
        while self._queue and self._queue[0][0] <= horizon and not self.stopped:
            _, _, fn, args = heapq.heappop(self._queue)
            fn(*args)
