"""Rate and delay of each (sending rank, plane, peer), from chunk completions only.

Hardware offload hides acknowledgements, so the only signals are the ones a
window sees: when a chunk was posted and when its completion was reported.
From those, BBR style:

* delivered rate ``B``: windowed max of rate samples. A chunk's sample is
  ``nbytes / (t_done - max(t_post, previous completion on the same plane))``,
  the max(send elapsed, ack elapsed) rule: while the plane is busy the gap
  between two completions is the time the link needed for this chunk; after
  an idle gap the elapsed time also holds the path delay, so the sample is
  only a lower bound. While a path has only such samples (every part fits
  in one chunk; the engine's one delivery sample per stage), ``a`` comes
  from a line through (size, latency), or is the prior delay when the sizes
  are too alike, and ``B`` is the median of ``n / (latency - a)`` over the
  latest five samples (they err both ways: see _fit_idle_only). Full samples
  are summed into rounds of a few chunks (bytes / elapsed over the round,
  as a BBR delivery-rate sample spans many ACKs) and the max filter runs
  over rounds: a max over single noisy chunks would overestimate every
  plane by the full noise amplitude (+10 % here), a max over 4-chunk
  rounds by about half of it.
* fixed delay ``a``: windowed min of ``latency - nbytes / B``, the part of a
  chunk's completion latency that is not serialisation. ``R``, the base
  delay, is the windowed min of the raw completion latency (``a`` plus one
  chunk's serialisation) and sizes the window. Only chunks posted to an idle
  plane give clean delay samples: a chunk posted behind others also waits
  for them, and a min over queued chunks grows the window, which queues
  more (a feedback loop). Queued samples are used only while no clean one
  is known.
* window = ceil(g * B * R / chunk) * chunk, at least two chunks, so a plane
  always has a chunk on the wire while the previous one completes.

Samples are forgotten by count (ring buffers) and by age. A max filter only
learns increases quickly, so a step down is detected explicitly: when the
latest round sits below ``drop_ratio`` of the older rounds' max, the older
rounds are discarded. ``drop_ratio`` (0.75) is below the worst ratio two
honest rounds reach under +-10 % noise (0.9 / 1.1 = 0.82).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

PLANES = ("up", "out")
IDLE_RATE_SAMPLES = 5  # idle-start samples whose median rate is the estimate (see _fit_idle_only)
# Fewer fresh idle-start samples than this: the newest older ones make up the
# count for the rate's median (see _fit_idle_only).
MIN_RATE_SAMPLES = 3
STALE_ROUNDS = 2  # rounds that stand in when none is fresh (see PathEstimator._snapshot)

IDLE_STEP_SAMPLES = 3  # idle-start samples all beyond drop_ratio of the older median: a step (see _idle_step)
# ... or this many beyond STRONG_STEP_RATIO: a step as large as a competing flow
# taking half the link shows in two stages, one operation sooner.
STRONG_STEP_SAMPLES = 2
STRONG_STEP_RATIO = 0.6


# A link whose latency grows faster than the transfer (a competing flow's
# backlog, a token bucket, a queue that absorbs a small transfer and not a
# larger one) reads faster at the size it carries now than at a larger one.
# Testbed, a paced flow taking half of a 62.5 MB/s link: per-stage samples of
# 1.5 MiB read 45-54 MB/s once the queue drained, of 2 MiB 32-44 as it built,
# so the split planned at 1.5 MiB moved 2 MiB to 'out', where the rate fell
# and the plan moved back: a saw-tooth of the share every ~7 operations, the
# slower step 5-25% slower. When the recent idle-start samples differ in size
# by at least this ratio and the line through (size, latency) meets zero size
# below zero, the plane is planned at the lower of its recent rate and the
# rate of its largest recent transfers (those within LARGE_GROUP_RATIO of the
# largest): a split that moves toward them will be timed by them. Their
# rate, as a ratio to the smaller transfers' rate, is remembered for
# SUPERLINEAR_MEMORY_S after they leave the samples' age window (until a step
# is seen): forgotten with them after 2 s, the split went back to the larger
# size every 2-3 s for 3-5 operations. A ratio, not a rate: when the load
# goes, the smaller transfers speed up and the remembered rate with them
# (held as a rate, it kept the split off the freed link for ~1 s).
SUPERLINEAR_MIN_SIZE_RATIO = 1.2
LARGE_GROUP_RATIO = 1.1
SUPERLINEAR_MEMORY_S = 8.0


def _lower_median_rate(samples: list, delay_s: float) -> float:
    """The lower middle of the samples' rates with ``delay_s`` removed."""
    rates = sorted(_idle_rate(x, delay_s) for x in samples)
    return rates[(len(rates) - 1) // 2]


def _line(samples: list) -> Optional[tuple[float, float]]:
    """Least-squares (intercept, slope) of latency against size, None when all sizes are equal."""
    m = sn = sl = snn = snl = 0.0
    for _, lat, n in samples:  # one pass: this runs for every idle-start sample (_note_larger)
        m += 1
        sn += n
        sl += lat
        snn += n * n
        snl += n * lat
    var = snn - sn * sn / m
    if var <= 1e-9 * snn:
        return None
    slope = (snl - sn * sl / m) / var
    return (sl - slope * sn) / m, slope


def _size_groups(samples: list) -> tuple[int, list, list]:
    """(largest size, the latest samples within LARGE_GROUP_RATIO of it, the latest of the others)."""
    largest = max(n for _, _, n in samples)
    larger = [x for x in samples if x[2] * LARGE_GROUP_RATIO >= largest]
    smaller = [x for x in samples if x[2] * LARGE_GROUP_RATIO < largest]
    return largest, larger[-IDLE_RATE_SAMPLES:], smaller[-IDLE_RATE_SAMPLES:]


def _superlinear(samples: list) -> bool:
    """Latency grows faster than size across the samples (see SUPERLINEAR_MIN_SIZE_RATIO)."""
    if len(samples) < 3:
        return False
    sizes = [n for _, _, n in samples]
    if max(sizes) < SUPERLINEAR_MIN_SIZE_RATIO * min(sizes):
        return False  # the common case: one size, no line to fit
    line = _line(samples)
    return line is not None and line[1] > 0 and line[0] < 0


def _idle_rate(sample: tuple, delay_s: float) -> float:
    """Rate of one idle-start sample (t_done, latency, nbytes) with ``delay_s`` removed."""
    _, lat, n = sample
    return n / max(lat - delay_s, 0.1 * lat)


# Rates and delays below these are treated as "nothing measured" (a clock that
# did not move, a zero-byte chunk) rather than as a plane of zero capacity.
_MIN_ELAPSED_S = 1e-12


@dataclass(frozen=True)
class PathEstimate:
    """What the controller believes about one path (or one plane of a rank)."""

    rate_Bps: float        # B: delivered bytes per second
    latency_s: float       # a: fixed delay before the first byte lands
    base_delay_s: float    # R: min chunk completion latency (a + one chunk's serialisation)
    samples: int           # rate samples behind the estimate (0: prior)
    measured: bool         # False when it is the configured prior

    @property
    def bdp_bytes(self) -> float:
        return self.rate_Bps * self.base_delay_s

    def to_json(self) -> dict:
        return {
            "rate_Bps": self.rate_Bps,
            "latency_s": self.latency_s,
            "base_delay_s": self.base_delay_s,
            "samples": self.samples,
            "measured": self.measured,
        }


def window_bytes(rate_Bps: float, base_delay_s: float, chunk_bytes: int, gain: float) -> int:
    """ceil(g * B * R / chunk) * chunk, floor of two chunks."""
    chunk = max(1, int(chunk_bytes))
    chunks = math.ceil(gain * rate_Bps * base_delay_s / chunk) if rate_Bps > 0 else 0
    return max(2, chunks) * chunk


class PathEstimator:
    """Windowed max of delivered rate and windowed min of delay, for one path."""

    def __init__(self, max_samples: int = 32, max_age_s: float = 2.0,
                 drop_ratio: float = 0.75, drop_samples: int = 4, round_samples: int = 4,
                 prior_latency_s: float = 0.0):
        self.round_samples = max(1, round_samples)
        self.prior_latency_s = prior_latency_s
        # Rounds of round_samples full-rate chunk samples: (t_done, bytes / elapsed).
        self._rounds: deque = deque(maxlen=max(2, max_samples // self.round_samples))
        self._pending = [0, 0.0, 0, 0.0]          # bytes, elapsed, samples, t_done of the open round
        # (t_done, latency, nbytes): chunks posted to an idle plane, and all chunks
        self._clean_delays: deque = deque(maxlen=max_samples)
        self._delays: deque = deque(maxlen=max_samples)
        self.max_age_s = max_age_s
        self.drop_ratio = drop_ratio
        self.drop_rounds = max(1, -(-drop_samples // self.round_samples))
        self.step_downs = 0
        self.step_ups = 0
        # (t, size, rate, rate / the smaller ones' rate) of the largest recent
        # transfers when latency last grew faster than size across the fresh
        # samples (see SUPERLINEAR_MIN_SIZE_RATIO), else None
        self._larger: Optional[tuple[float, int, float, float, int]] = None
        self._no_size_evidence: deque = deque(maxlen=max_samples)  # t_done of idle-start samples from probes, rates
        self._rate_only: deque = deque(maxlen=max_samples)  # t_done of samples that hold no path delay (add)
        self._version = 0
        self._cache = None

    def add(self, nbytes: int, t_post: float, t_done: float, prev_done: Optional[float],
            size_evidence: bool = True, rate_only: bool = False) -> None:
        """One completion. ``size_evidence`` False: a rate sample, not evidence of how
        latency grows with size (a probe's stage, the first on a plane that was
        dropped: see _note_larger). ``rate_only``: nor of the path's delay, and
        so left out of the delay fit (_fit_delay): a pipelined operation's bytes
        over the time they were arriving (collective_op._teach_port_rates), whose
        time is not a delay plus bytes over rate. Fitted beside each other, the
        16 MiB points' 8 MiB and the 64 MiB points' 48 MiB gave 'out' a 0.29 s
        delay at 80 MB/s on a 62.5 MB/s testbed link, and the ranks of one
        operation put 0, 25 and 50% of their in-domain bytes on it."""
        latency = t_done - t_post
        if nbytes <= 0 or latency <= _MIN_ELAPSED_S:
            return
        self._version += 1
        idle_start = prev_done is None or t_post >= prev_done
        self._delays.append((t_done, latency, nbytes))
        if idle_start:
            self._clean_delays.append((t_done, latency, nbytes))
            if not size_evidence or rate_only:
                self._no_size_evidence.append(t_done)
            if rate_only:
                self._rate_only.append(t_done)
            self._idle_step()
            self._note_larger(t_done)
        start = t_post if prev_done is None else max(t_post, prev_done)
        elapsed = t_done - start
        if elapsed <= _MIN_ELAPSED_S:
            return  # completions reported out of order: no rate information
        if idle_start:
            return  # a lower bound only: it also holds the path delay (see _idle_only_model)
        p = self._pending
        p[0] += nbytes
        p[1] += elapsed
        p[2] += 1
        p[3] = t_done
        if p[2] >= self.round_samples:
            # One round: completed bytes over elapsed across several chunks, so
            # per-chunk noise averages out before the max filter sees it.
            self._rounds.append((t_done, p[0] / p[1]))
            self._pending = [0, 0.0, 0, 0.0]
            self._forget_after_step_down()

    def _idle_step(self) -> None:
        """A step in the idle-start samples (the engine's per-stage delivery
        samples): the last IDLE_STEP_SAMPLES all beyond ``drop_ratio`` of the
        median of the five before them, or the last STRONG_STEP_SAMPLES beyond
        STRONG_STEP_RATIO, either way, their rates taken with the prior delay
        removed (sizes differ: a stolen part is smaller). The older samples
        are forgotten, so the median holds no sample from before the step,
        and the step counts as a regime change: the judge gives the new
        estimates a chance before it reads slow stages as harm, and peers
        learn of it from the exported count.

        The strong rule exists for convergence: with three samples (one per
        stage, two stages per all_reduce) a background flow that took half of
        a 500 Mbit/s link reached the split one operation later than two
        would, and the 5-operation mean of the share missed the issue's
        5-operation bound by one (testbed series). It reads steps down only:
        next to a competing tcp flow the link's share swings for a stage or
        two, and a two-sample step up then took the loaded link for free
        (testbed: 53 MB/s read on a ~34 MB/s share, 0.69 of the bytes on 'up'
        instead of 0.81, operations 1.3-1.5x slower), while a late step up
        only leaves a little rate unused for one operation more."""
        clean = list(self._clean_delays)
        a = self.prior_latency_s
        for n, ratio, ups in ((STRONG_STEP_SAMPLES, STRONG_STEP_RATIO, False), (IDLE_STEP_SAMPLES, self.drop_ratio, True)):
            if len(clean) < n + 3:
                continue
            recent = clean[-n:]
            ref = statistics.median(_idle_rate(x, a) for x in clean[-n - IDLE_RATE_SAMPLES:-n])
            rates = [_idle_rate(x, a) for x in recent]
            if max(rates) < ratio * ref:
                self.step_downs += 1
            elif ups and min(rates) * ratio > ref:
                self.step_ups += 1
            else:
                continue
            self._clean_delays.clear()
            self._clean_delays.extend(recent)
            self._larger = None
            return

    def _note_larger(self, now: float) -> None:
        """Remember the rate of the largest recent transfers while the fresh
        idle-start samples grow superlinearly (see SUPERLINEAR_MIN_SIZE_RATIO).

        A probe's samples do not count: a probe carries the largest share a
        plane gets (probe_share) on a connection that sat idle while the plane
        was dropped, so its stages are both the largest and the slowest for a
        reason other than size. On the 2.4 / 1.2 Gbit/s testbed the probe's two
        2.5 MiB samples read 98-119 MB/s, the 2 MiB ones after it 134-196, and
        the rule planned 'out' at 119 for the 2 s they stayed fresh: the 16 MiB
        all_reduce split 0.75 on 'up' instead of 0.69 for ~50 operations."""
        probes = set(self._no_size_evidence)
        fresh = [x for x in self._clean_delays if now - x[0] <= self.max_age_s and x[0] not in probes]
        if not _superlinear(fresh):
            return
        a = self._fit_delay(fresh)
        largest, larger, smaller = _size_groups(fresh)
        rate = _lower_median_rate(larger, a)
        self._larger = (now, largest, rate, rate / _lower_median_rate(smaller, a), max(n for _, _, n in smaller))

    def _larger_rate(self, clean: list, a: float, now: Optional[float]) -> Optional[float]:
        """The rate of the largest recent transfers where latency grows faster
        than size: as measured when the latest sample showed it, else, once
        they have left the samples, as a ratio to the smaller ones' rate (see
        SUPERLINEAR_MIN_SIZE_RATIO). Worked out when a sample arrives
        (_note_larger), not per query: the engine asks for estimates far more
        often than samples come.

        The ratio holds for transfers of the sizes it was measured against,
        the smaller group's, and no larger: the 2.4 / 1.2 Gbit/s testbed's
        16 MiB all_reduce left 2.6 MB parts on 'out' at 185 MB/s (tbf's burst
        counts for much in them) beside the 64 MiB point's first 12.6 MB parts
        at 150, a ratio of 0.8; applied to the 10.5 MB parts that followed,
        which read 150-178 themselves, it planned 'out' at 121-124 MB/s for the
        next 6 s."""
        if self._larger is None or not clean:
            return None
        t, largest, rate, ratio, smaller_max = self._larger
        if now is not None and now - t > SUPERLINEAR_MEMORY_S:
            return None
        recent_max = max(n for _, _, n in clean)
        if recent_max * LARGE_GROUP_RATIO >= largest:
            # the samples hold transfers that large: they tell, superlinear or not
            return rate if t == clean[-1][0] else None
        if recent_max > smaller_max * LARGE_GROUP_RATIO:
            return None  # transfers between the two groups: their own rate tells
        return ratio * _lower_median_rate(clean[-IDLE_RATE_SAMPLES:], a)

    def _forget_after_step_down(self) -> None:
        rounds = list(self._rounds)
        if len(rounds) <= self.drop_rounds:
            return
        older_max = max(r for _, r in rounds[:-self.drop_rounds])
        recent_max = max(r for _, r in rounds[-self.drop_rounds:])
        if recent_max < self.drop_ratio * older_max:
            self._rounds.clear()
            self._rounds.extend(rounds[-self.drop_rounds:])
            self.step_downs += 1
        elif recent_max * self.drop_ratio > older_max:
            self.step_ups += 1  # the max filter follows by itself; counted as a regime change

    @property
    def regime_changes(self) -> int:
        return self.step_downs + self.step_ups

    def _fresh(self, samples: Iterable, now: Optional[float]):
        if now is None:
            return list(samples)
        return [s for s in samples if now - s[0] <= self.max_age_s]

    def _snapshot(self, now: Optional[float]) -> "_Fresh":
        """The samples still inside the age window, filtered once per query.

        When none is, the newest ones stand (``stale``) until fresh ones
        arrive: a path used once every few seconds (one large all_reduce per
        training step, a benchmark interleaving policies at 64 MiB) would
        otherwise be planned from the configured prior at every use (5 GB/s
        for a 125 MB/s link on the testbed: 12% of the bytes on the second
        plane instead of 31%). Age still retires old samples once new ones
        exist, so a max or median never mixes two regimes far apart in time.
        """
        p = self._pending
        pending = p[0] / p[1] if p[2] and (now is None or now - p[3] <= self.max_age_s) else None
        fresh = _Fresh(self._fresh(self._rounds, now), pending, p[2],
                       self._fresh(self._clean_delays, now), self._fresh(self._delays, now), now=now)
        if fresh.rounds or fresh.clean or fresh.delays or pending is not None or not self._delays:
            return fresh
        return _Fresh(list(self._rounds)[-STALE_ROUNDS:], None, 0, list(self._clean_delays)[-IDLE_RATE_SAMPLES:],
                      list(self._delays)[-IDLE_RATE_SAMPLES:], stale=True, now=now)

    @staticmethod
    def _full_rate(fresh: "_Fresh") -> Optional[float]:
        if fresh.rounds:
            return max(r for _, r in fresh.rounds)
        return fresh.pending_rate  # not a full round yet (or None)

    def _idle_only_model(self, fresh: "_Fresh") -> Optional[tuple[float, float]]:
        """(rate, fixed delay) when every chunk started an idle plane.

        Then each completion latency is ``a + n / B`` and no sample isolates
        ``B``: taking ``n / latency`` as the rate and ``min(latency - n / B)``
        as the delay gives a slow plane with no delay, which invites small
        parts that each pay the real delay. With sizes at least 2x apart a
        least-squares line through (n, latency) gives the delay; otherwise
        the configured prior delay is assumed. The rate is then a median of
        per-sample rates with that delay removed.
        """
        if fresh.idle_model is _UNSET:
            fresh.idle_model = self._fit_idle_only(fresh.clean, fresh.now)
        return fresh.idle_model

    def _fit_idle_only(self, clean: list, now: Optional[float] = None) -> Optional[tuple[float, float]]:
        if not clean:
            return None
        a = self._fit_delay(clean)
        # The rate: the median over the latest samples, not the max. These are
        # per-stage delivery samples (flows.StageRun.delivery_samples) and err
        # both ways: fast when the peer started the stage early and its data
        # waited in the receive buffers (700 MB/s read on a 62.5 MB/s link
        # after it came back), slow when it started late. A max held the
        # fastest outlier for max_age_s and split by it; the median of five
        # drops such outliers and follows a real step within three stages.
        # With an even count (two samples are all a step leaves) the lower
        # middle: one stage whose data waited in the buffers beside a real step
        # up read 3.7 GB/s on a 35 MB/s testbed link, and the upper middle put
        # 35% of a stage on it (that operation took 1.8x the others).
        #
        # A path used once a second or so (one large all_reduce per training
        # step; a benchmark interleaving policies at 64 MiB) has two samples
        # in the age window, and the lower middle of two is the slower one: one
        # stage stalled by its sender's host (198 MB/s read on a 310 MB/s
        # testbed link) planned the next operation at 189 MB/s, 0.56 of its
        # bytes on 'up' instead of 0.69, and it took 1.27x the others. Below
        # MIN_RATE_SAMPLES fresh ones, the newest older samples make up the
        # count; a detected step has cleared them (_idle_step).
        #
        # Where latency grew faster than size (_superlinear), the rate is the
        # lower of that and the rate of the largest recent transfers: see
        # SUPERLINEAR_MIN_SIZE_RATIO.
        recent = clean[-IDLE_RATE_SAMPLES:]
        if len(recent) < MIN_RATE_SAMPLES:
            older = [x for x in self._clean_delays if x[0] < clean[0][0]]  # clean: the newest, in order
            recent = (older + clean)[-MIN_RATE_SAMPLES:]
        rate = _lower_median_rate(recent, a)
        larger = self._larger_rate(clean, a, now)
        if larger is not None:
            rate = min(rate, larger)
        return rate, min(a, min(lat for _, lat, _ in clean))

    def _fit_delay(self, clean: list) -> float:
        """The fixed delay: a least-squares line through (size, latency) when sizes are at least 2x apart, else the prior.

        Rate-only samples (see add) stay out of the line."""
        rate_only = set(self._rate_only)
        clean = [x for x in clean if x[0] not in rate_only]
        sizes = [n for _, _, n in clean]
        if sizes and max(sizes) >= 2 * min(sizes):
            a, slope = _line(clean)
            if slope > 0 and a >= 0:
                return a
        return self.prior_latency_s

    def rate(self, now: Optional[float] = None) -> Optional[float]:
        return self._rate(self._snapshot(now))

    def _rate(self, fresh: "_Fresh") -> Optional[float]:
        full = self._full_rate(fresh)
        if full is not None:
            return full
        model = self._idle_only_model(fresh)
        return model[0] if model else None

    def samples(self, now: Optional[float] = None) -> int:
        return self._samples(self._snapshot(now))

    def _samples(self, fresh: "_Fresh") -> int:
        full = len(fresh.rounds) * self.round_samples + fresh.pending_samples
        return full or len(fresh.clean)

    @staticmethod
    def _delay_samples(fresh: "_Fresh"):
        return fresh.clean or fresh.delays

    def base_delay(self, now: Optional[float] = None) -> Optional[float]:
        return self._base_delay(self._snapshot(now))

    def _base_delay(self, fresh: "_Fresh") -> Optional[float]:
        return min((s[1] for s in self._delay_samples(fresh)), default=None)

    def latency(self, rate_Bps: float, now: Optional[float] = None) -> Optional[float]:
        """min(latency - nbytes / B): the fixed delay, serialisation removed."""
        return self._latency(rate_Bps, self._snapshot(now))

    def _latency(self, rate_Bps: float, fresh: "_Fresh") -> Optional[float]:
        if self._full_rate(fresh) is None:
            model = self._idle_only_model(fresh)
            return model[1] if model else None
        samples = self._delay_samples(fresh)
        if not samples or rate_Bps <= 0:
            return None
        return max(0.0, min(lat - n / rate_Bps for _, lat, n in samples))

    def estimate(self, now: Optional[float] = None) -> Optional[PathEstimate]:
        # Cached until a sample arrives or the oldest one ages out.
        cached = self._cache
        if cached is not None and cached[0] == self._version and now is not None and now < cached[1]:
            return cached[2]
        fresh = self._snapshot(now)
        est = self._compute(fresh)
        if now is not None:
            times = [s[0] for s in fresh.rounds] + [s[0] for s in fresh.clean] + [s[0] for s in fresh.delays]
            if fresh.pending_rate is not None:
                times.append(self._pending[3])
            oldest = math.inf if fresh.stale else min(times, default=math.inf)  # stale: until the next sample
            expires = oldest + self.max_age_s
            if self._larger is not None and self._larger[0] + SUPERLINEAR_MEMORY_S > now:
                expires = min(expires, self._larger[0] + SUPERLINEAR_MEMORY_S)  # the memory's end
            self._cache = (self._version, expires, est)
        return est

    def _compute(self, fresh: "_Fresh") -> Optional[PathEstimate]:
        # One filtered snapshot serves rate, delays and the sample count
        # (this runs for every adaptive operation's estimate export).
        rate = self._rate(fresh)
        base = self._base_delay(fresh)
        if rate is None or base is None:
            return None
        lat = self._latency(rate, fresh)
        return PathEstimate(rate, lat if lat is not None else 0.0, base, self._samples(fresh), True)


_UNSET = object()


@dataclass
class _Fresh:
    """A path's samples inside the age window at one instant."""

    rounds: list
    pending_rate: Optional[float]
    pending_samples: int
    clean: list
    delays: list
    stale: bool = False  # nothing was inside the age window: the newest samples stand in
    now: Optional[float] = None
    idle_model: object = _UNSET  # _idle_only_model's fit, computed at most once


class Estimator:
    """All paths a controller knows about: measured here, reported by peers, or prior.

    Keyed by (src, plane, dst): ``src`` is the sending rank. Each path is
    measured at one rank, its *port*: the receiver for delivery samples
    (``observe(..., port=dst)``, what the engine reports), the sender for
    completions of its own sends (the simulator's view). Ranks export what
    they measured (``reported``) and the blobs arrive here through
    ``set_remote``; a reporter's blob takes precedence over what this
    estimator measured at that reporter's port, so every rank decides from
    the same numbers. Where a path is reported by both of its ends the
    receiver's report wins: it saw the bytes arrive.
    """

    def __init__(self, prior_rate_Bps: Mapping[str, float], prior_latency_s: Mapping[str, float],
                 max_samples: int = 32, max_age_s: float = 2.0,
                 drop_ratio: float = 0.75, drop_samples: int = 4, round_samples: int = 4,
                 rate_ceiling_Bps: Optional[Mapping[str, float]] = None):
        self.prior_rate_Bps = dict(prior_rate_Bps)
        self.prior_latency_s = dict(prior_latency_s)
        self.rate_ceiling_Bps = dict(rate_ceiling_Bps or {})  # plane -> no estimate above it (ControlConfig)
        self._params = (max_samples, max_age_s, drop_ratio, drop_samples, round_samples)
        self._paths: dict[int, dict[tuple[str, int], PathEstimator]] = {}   # src -> (plane, dst) -> path
        self._port_of: dict[tuple[int, str, int], int] = {}  # (src, plane, dst) -> the rank it is measured at
        self._last_done: dict[tuple[int, str], float] = {}
        self._remote: dict[int, dict[tuple[int, str, int], tuple[float, float, int]]] = {}  # reporter -> its paths
        self._remote_by_src: Optional[dict[int, dict[tuple[str, int], tuple[float, float, int]]]] = None
        self.samples_seen = 0  # observations so far: unchanged means every local estimate is as it was (but for age)

    # -- observations ---------------------------------------------------
    def observe(self, src: int, plane: str, peer: int, nbytes: int, t_post: float, t_done: float,
                port: Optional[int] = None, size_evidence: bool = True, rate_only: bool = False) -> None:
        """One sample of the path ``src`` -> ``peer``, seen at rank ``port``
        (default ``src``: a sender's own completion). ``t_post`` counts as an
        idle start unless the port's previous completion on the plane came
        later. ``size_evidence``, ``rate_only``: see PathEstimator.add."""
        if plane not in PLANES:
            raise ValueError(f"unknown plane {plane!r}")
        port = src if port is None else port
        self.samples_seen += 1
        paths = self._paths.setdefault(src, {})
        path = paths.get((plane, peer))
        if path is None:
            path = paths[(plane, peer)] = PathEstimator(*self._params,
                                                        prior_latency_s=float(self.prior_latency_s[plane]))
            self._port_of[(src, plane, peer)] = port
        prev = self._last_done.get((port, plane))
        path.add(nbytes, t_post, t_done, prev, size_evidence, rate_only)
        self._last_done[(port, plane)] = t_done if prev is None else max(prev, t_done)

    def set_remote(self, reporter: int, entries: Mapping[tuple[int, str, int], tuple[float, float, int]]) -> None:
        """What rank ``reporter`` measured, as it exported it: (src, plane, dst) ->
        (rate, latency, the path's regime count there, modulo 256)."""
        self._remote[reporter] = dict(entries)
        self._remote_by_src = None

    # -- queries -----------------------------------------------------------
    def prior(self, plane: str, chunk_bytes: int = 0) -> PathEstimate:
        rate = float(self.prior_rate_Bps[plane])
        lat = float(self.prior_latency_s[plane])
        return PathEstimate(rate, lat, lat + chunk_bytes / rate, 0, False)

    def _reports(self) -> dict[int, dict[tuple[str, int], tuple[float, float, int]]]:
        """Every reported path by sender; the receiver's report where both ends sent one."""
        if self._remote_by_src is None:
            index: dict[int, dict[tuple[str, int], tuple[float, float, int]]] = {}
            for reporter in sorted(self._remote):
                for (src, plane, dst), value in self._remote[reporter].items():
                    held = index.setdefault(src, {})
                    if (plane, dst) not in held or reporter == dst:
                        held[(plane, dst)] = value
            self._remote_by_src = index
        return self._remote_by_src

    def measured(self, src: int, now: Optional[float] = None,
                 chunk_bytes: int = 0) -> dict[tuple[str, int], PathEstimate]:
        """Every measured (plane, dst) of ``src``: as reported, else as measured here."""
        out = {}
        for (plane, dst), path in self._paths.get(src, {}).items():
            if self._port_of[(src, plane, dst)] in self._remote:
                continue  # that port's own report stands for it
            est = path.estimate(now)
            if est is not None:
                out[(plane, dst)] = self._under_ceiling(plane, est)
        for key, (rate, lat, _) in self._reports().get(src, {}).items():
            out[key] = self._under_ceiling(key[0], PathEstimate(rate, lat, lat + chunk_bytes / rate, 1, True))
        return out

    def _under_ceiling(self, plane: str, est: PathEstimate) -> PathEstimate:
        ceiling = self.rate_ceiling_Bps.get(plane)
        if ceiling is None or est.rate_Bps <= ceiling:
            return est
        return PathEstimate(ceiling, est.latency_s, est.base_delay_s, est.samples, est.measured)

    def view(self, now: Optional[float] = None, chunk_bytes: int = 0) -> "EstimateView":
        """Estimates frozen at ``now``, computed once per rank (one decision's worth)."""
        return EstimateView(self, now, chunk_bytes)

    def plane(self, src: int, plane: str, now: Optional[float] = None, chunk_bytes: int = 0) -> PathEstimate:
        """The plane's port at ``src``: best rate and smallest delay over its peers, else prior."""
        return self.view(now, chunk_bytes).plane(src, plane)

    def path(self, src: int, plane: str, peer: int, now: Optional[float] = None,
             chunk_bytes: int = 0) -> PathEstimate:
        """One path; a peer never measured inherits its plane's port estimate."""
        return self.view(now, chunk_bytes).path(src, plane, peer)

    def reported(self, port: int, now: Optional[float] = None) -> dict[tuple[int, str, int], tuple[float, float, int]]:
        """What was measured at rank ``port``, for export: (src, plane, dst) ->
        (rate, latency, regime count modulo 256)."""
        out = {}
        for src, plane, dst in self._measured_at(port):
            path = self._paths[src][(plane, dst)]
            est = path.estimate(now)
            if est is not None:
                out[(src, plane, dst)] = (est.rate_Bps, est.latency_s, path.regime_changes % 256)
        return out

    def srcs(self) -> set[int]:
        return set(self._paths) | set(self._reports())

    def _measured_at(self, port: int) -> list[tuple[int, str, int]]:
        return [path for path, at in self._port_of.items() if at == port]

    def local_regime_changes(self, port: int) -> int:
        """Step changes (down or up) seen on any path measured at ``port``."""
        return sum(self._paths[src][(plane, dst)].regime_changes for src, plane, dst in self._measured_at(port))

    def regime_changes(self, rank: int) -> int:
        """A count that moves whenever a path into or out of ``rank`` stepped:
        those measured at ``rank`` and, as their receivers report them, those
        it sends on (measured elsewhere: a stage that slowed because its
        outgoing link did is new information here only through the report)."""
        reported = sum(regime for (_, _, regime) in self._reports().get(rank, {}).values())
        return self.local_regime_changes(rank) + reported

    def snapshot(self, now: Optional[float] = None) -> dict:
        reports = self._reports()
        out: dict = {}
        for src in sorted(self.srcs()):
            out[str(src)] = {
                "paths": {f"{p}:{peer}": dict(e.to_json(), view="reported" if (p, peer) in reports.get(src, {})
                                              else "local")
                          for (p, peer), e in sorted(self.measured(src, now).items())},
            }
        return out


class EstimateView:
    """Per-rank estimates computed once, for the many lookups of one decision."""

    def __init__(self, estimator: Estimator, now: Optional[float], chunk_bytes: int):
        self._est = estimator
        self.now = now
        self.chunk_bytes = chunk_bytes
        self._measured: dict[int, dict[tuple[str, int], PathEstimate]] = {}
        self._planes: dict[tuple[int, str], PathEstimate] = {}

    def measured(self, src: int) -> dict[tuple[str, int], PathEstimate]:
        got = self._measured.get(src)
        if got is None:
            got = self._measured[src] = self._est.measured(src, self.now, self.chunk_bytes)
        return got

    def plane(self, src: int, plane: str) -> PathEstimate:
        key = (src, plane)
        got = self._planes.get(key)
        if got is None:
            ests = [e for (p, _), e in self.measured(src).items() if p == plane]
            if not ests:
                got = self._est.prior(plane, self.chunk_bytes)
            else:
                got = PathEstimate(
                    max(e.rate_Bps for e in ests),
                    min(e.latency_s for e in ests),
                    min(e.base_delay_s for e in ests),
                    sum(e.samples for e in ests),
                    True,
                )
            self._planes[key] = got
        return got

    def path(self, src: int, plane: str, peer: int) -> PathEstimate:
        est = self.measured(src).get((plane, peer))
        return est if est is not None else self.plane(src, plane)
