"""Whether a cross-process read flushes the lines it lands in first (transports/cacheflush.py).

A 2-rank in-place all_reduce on the direct path (cma_steps.py) lands the
peer's half of the result in lines the peer read a moment before. Where the
two cores do not share a last-level cache, each store of that landing waits
for the line to come back from the peer: in slow launches of this VM the
2 MiB landing of a 4 MiB call took 670-900 us against 100-185 in the others,
and flushing the lines first took the call to 0.57-0.78x its time (9 slow
launches of 30). Where the caches are shared, the flush only adds its own
time: 1.26-1.63x (21 launches; bench/results/landing_s49/phases.md and
phases_run1.md, both ways alternating within each launch). The same host
shows both from one launch to the next, so a rank decides from its own
landings' times:

- Landing plain, it compares each landing's time per byte with the time per
  byte of the same call's first reads, which land in a buffer the peer never
  reads (the reference: the read itself, without the lines' return). When
  ``slow_after`` landings in a row took over ``slow_ratio`` times the
  reference, it tries ``slow_after`` flushed landings (flush included in
  their time) and flushes from then on if their median beat the plain ones'.
- Flushing, every ``recheck_every``-th landing goes plain again; if it beats
  the flushed median, the rank lands plain again.
- A trial that lost waits ``recheck_every`` slow landings before the next.

Each size class of landing (a power of two of its bytes) has its own choice
(``LandingChoices``): the lines' return costs most where a landing fits the
caches (slow launches against fast: a 4 MiB call 3.4x, 16 MiB 1.25x), while a
flush costs its bytes' write-back at any size. With one choice for every size,
the flushing that 4 MiB calls chose carried over to 16 MiB calls, which then
ran 0.97x the time of never flushing (bench/results/landing_s49_one_choice/).

Each rank decides alone: the flush touches only its own memory, and the
peer's steps are the same either way. Pure logic: the caller times the
landings and the flushes.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable

FLUSH_MODES = ("auto", "never", "always")


@dataclass(frozen=True)
class LandingConfig:
    # Fast launches measured 0.4-1.35x the reference, slow ones 1.8-5.5x (bench/results/landing_s49/phases*.md);
    # a trial in a fast launch costs 3 flushed landings, a slow launch missed costs every call.
    slow_ratio: float = 1.6
    slow_after: int = 3       # landings in a row over slow_ratio before a trial; also the trial's length
    recheck_every: int = 32   # while flushing, one landing in this many goes plain


class LandingChoice:
    """One rank's choice for one kind of landing; ``flush_next()`` before each
    landing, ``record()`` after it."""

    def __init__(self, mode: str = "auto", can_flush: bool = True, config: LandingConfig = LandingConfig()):
        if mode not in FLUSH_MODES:
            raise ValueError(f"unknown landing flush mode {mode!r}; use one of {', '.join(FLUSH_MODES)}")
        self.mode, self.config = mode, config
        self.can_flush = can_flush and mode != "never"
        self.flushing = mode == "always"
        self._plain: deque[float] = deque(maxlen=config.slow_after)   # seconds per byte
        self._flushed: deque[float] = deque(maxlen=config.slow_after)
        self._slow_run = 0        # plain landings in a row over slow_ratio x the reference
        self._trial_left = 0      # flushed landings left in a trial
        self._since_plain = 0     # flushed landings since the last plain one
        self._slow_needed = config.slow_after
        self.switches = 0         # times the choice changed (telemetry, tests)

    def flush_next(self, ready: Callable[[], bool] = lambda: True) -> bool:
        """Whether the next landing flushes its lines first. ``ready()`` is asked where
        it would (the caller's flush kernel, built then: transports/cacheflush.prepare);
        False from it turns the flush off for good, and the landing goes plain."""
        if not self.can_flush or not self._would_flush():
            return False
        if not ready():
            self.can_flush = False
            return False
        return True

    def _would_flush(self) -> bool:
        if self.mode != "auto":
            return self.flushing
        if self._trial_left:
            return True
        return self.flushing and self._since_plain < self.config.recheck_every

    def record(self, flushed: bool, landing_s_per_byte: float, reference_s_per_byte: float) -> None:
        """A landing's time per byte (a flushed one's with its flush) and the reference's."""
        if self.mode != "auto" or not self.can_flush:
            return
        if flushed:
            self._record_flushed(landing_s_per_byte)
        else:
            self._record_plain(landing_s_per_byte, reference_s_per_byte)

    def _record_flushed(self, cost: float) -> None:
        self._flushed.append(cost)
        self._since_plain += 1
        if self._trial_left:
            self._trial_left -= 1
            if not self._trial_left:
                self._choose(statistics.median(self._flushed) < statistics.median(self._plain))
                if not self.flushing:  # the flush lost: ask for a longer run of slow landings next time
                    self._slow_needed = self.config.recheck_every

    def _record_plain(self, cost: float, reference: float) -> None:
        self._plain.append(cost)
        if self.flushing:  # a recheck
            self._since_plain = 0
            if cost < statistics.median(self._flushed):
                self._choose(False)
            return
        self._slow_run = self._slow_run + 1 if cost > self.config.slow_ratio * reference else 0
        if self._slow_run >= self._slow_needed:
            self._slow_run = 0
            self._flushed.clear()
            self._trial_left = self.config.slow_after

    def _choose(self, flushing: bool) -> None:
        if flushing != self.flushing:
            self.switches += 1
        self.flushing = flushing
        self._since_plain = 0
        if not flushing:
            self._slow_run = 0
            self._flushed.clear()
        else:
            self._slow_needed = self.config.slow_after


class LandingChoices:
    """A LandingChoice per size class of landing: ``for_bytes(n)`` is the one for a
    landing of ``n`` bytes (classes from a power of two to the next)."""

    def __init__(self, mode: str = "auto", can_flush: bool = True, config: LandingConfig = LandingConfig()):
        LandingChoice(mode, can_flush, config)  # (refuses an unknown mode now, not at the first landing)
        self.mode, self.can_flush, self.config = mode, can_flush, config
        self._by_class: dict[int, LandingChoice] = {}

    def for_bytes(self, nbytes: int) -> LandingChoice:
        size_class = size_class_of(nbytes)
        choice = self._by_class.get(size_class)
        if choice is None:
            choice = self._by_class[size_class] = LandingChoice(self.mode, self.can_flush, self.config)
        return choice

    @property
    def flushing_classes(self) -> list[int]:
        """The size classes (their lower bound in bytes) whose landings flush now."""
        return sorted(c for c, choice in self._by_class.items() if choice.flushing)

    @property
    def switches(self) -> int:
        return sum(choice.switches for choice in self._by_class.values())


def size_class_of(nbytes: int) -> int:
    """The power of two at or below ``nbytes`` (1 for 0 and 1)."""
    return 1 << max(0, int(nbytes).bit_length() - 1)
