"""Plan rates: the per-plane rates the tuner plans by, measured and agreed by every rank.

The tuner's plan (algorithm, channels, single plane or both) must be the same
on every rank, so it is made from rates every rank holds: the stated ones
(``MPCCS_PLANE_RATES``) or the priors. The priors were measured on the
development machines (shm against tcp on loopback, 7:1); on planes closer than
that (2 domains of 2 at 1:1) they keep a hierarchical all_reduce on one plane
where both would carry it 1.25x faster.

Without stated rates, each rank measures what its planes deliver in its
'adaptive' calls (``PlaneRateMeter``: a large operation's bytes that reached
this rank on a plane over the time any of them was arriving; the communicator
says why only those), and at call counts every rank
shares (``AgreementClock``) the ranks agree on one rate per plane, the lower
median of what they measured (``agree``), and on the highest, which caps the
controller's estimates as a stated line rate would. The plan is
rebuilt from the agreed rates when they differ enough from the ones it was made
by (``replan_rates``), and only when every rank measured every plane.

Pure logic: no clocks, no I/O; the communicator feeds it and runs the agreement.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Optional

PLANES = ("up", "out")
MiB = 1 << 20


@dataclass(frozen=True)
class PlanRateConfig:
    # Calls of at least this many bytes are measured and counted by the clock: below it a plane's
    # time is mostly fixed costs, and its bytes over its busy time are not its rate.
    min_call_bytes: int = 4 * MiB
    # A plane's part of one operation is a sample when it carried at least this many bytes here.
    min_plane_bytes: int = 1 * MiB
    samples_kept: int = 8           # the meter answers with the median of the last this-many
    first_agreement: int = 4        # the first agreement at this measured call ...
    agreement_every: int = 32       # ... then every this-many measured calls
    # The plan is rebuilt when a plane's agreed rate is this factor off the rate it was planned by
    # (either way): below it the plan would not change much, and a plan rebuilt on noise changes
    # the schedule under a benchmark's baseline.
    replan_factor: float = 1.5


class PlaneRateMeter:
    """One rank's measured rate of each plane: the median of its last samples."""

    def __init__(self, config: PlanRateConfig = PlanRateConfig()):
        self.config = config
        self._samples = {p: deque(maxlen=config.samples_kept) for p in PLANES}

    def add(self, plane: str, nbytes: int, busy_s: float) -> None:
        """``nbytes`` reached this rank on ``plane`` while it was busy for ``busy_s``."""
        if plane in self._samples and nbytes >= self.config.min_plane_bytes and busy_s > 0:
            self._samples[plane].append(nbytes / busy_s)

    def rates(self) -> dict[str, float]:
        """Bytes/s per plane; 0.0 for a plane with no sample yet."""
        return {p: statistics.median(q) if q else 0.0 for p, q in self._samples.items()}


class AgreementClock:
    """When the ranks agree: counted in measured calls, which every rank makes in
    the same order (collectives are called in the same order everywhere), so every
    rank reaches an agreement at the same call. Until an agreement finds every
    plane measured by every rank, the next comes ``first_agreement`` calls later;
    after, ``agreement_every`` calls later. What an agreement found is the same on
    every rank, so the next one falls on the same call everywhere too."""

    def __init__(self, config: PlanRateConfig = PlanRateConfig()):
        self.config = config
        self.calls = 0
        self.next_at = config.first_agreement

    def measured(self, collective: str, nbytes: int) -> bool:
        """Whether a call is measured and counted. all_to_allv's size differs per rank."""
        return collective != "all_to_allv" and nbytes >= self.config.min_call_bytes

    def tick(self) -> bool:
        """Count one measured call; True when the ranks agree before running it."""
        self.calls += 1
        return self.calls == self.next_at

    def agreed(self, agreed: Mapping[str, float]) -> None:
        """What the agreement due at this call found: it sets the next."""
        complete = measured_everywhere(agreed)
        self.next_at = self.calls + (self.config.agreement_every if complete else self.config.first_agreement)


def measured_everywhere(agreed: Mapping[str, float], planes=PLANES) -> bool:
    """Whether every rank measured each of ``planes`` (an agreed 0: some rank has no sample)."""
    return all(agreed.get(p, 0.0) > 0 for p in planes)


def agree(measured: list[Mapping[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Every rank's measured rates -> (agreed, highest) per plane.

    Agreed: the lower median over the ranks, 0 where some rank has no sample. Not
    the lowest, though a step lasts as long as its slowest link: a rank reads what
    reaches it, over spans its other flows stretch, and on 2 domains of 2 at 1:1
    one rank of four read 'out' at 47.8 MB/s where the others read ~60 on 62.5 MB/s
    links; planned by the lowest, that run read 1.13x 'up' against 1.25 in the
    others (testbed_2x2_s44). The plan is made once for every rank, so it follows
    what most ranks see; a link that is slow in fact is the controller's to split
    around, stage by stage. Lower: a rate some rank measured, and with 2 ranks the
    lower of the two. Highest: the line rate as far as the ranks can tell."""
    agreed, highest = {}, {}
    for p in PLANES:
        rates = [float(m.get(p, 0.0)) for m in measured]
        agreed[p] = statistics.median_low(rates) if all(r > 0 for r in rates) else 0.0
        highest[p] = max(rates)
    return agreed, highest


def replan_rates(agreed: Mapping[str, float], planned: Mapping[str, float],
                 factor: float = PlanRateConfig.replan_factor) -> Optional[dict[str, float]]:
    """The rates to plan by from now on, or None to keep the plan.

    Only when every plane is measured (an agreed 0: some rank has no sample of
    it, and one plane's measurement against the other's prior compares two
    different machines), and some plane's agreed rate is ``factor`` or more off
    the rate the plan was made by."""
    if not measured_everywhere(agreed, planned):
        return None
    if all(1 / factor < agreed[p] / planned[p] < factor for p in planned):
        return None
    return {p: float(agreed[p]) for p in planned}
