"""Tuner: algorithm, channels, chunk size and split policy from one cost model.

Every algorithm is a sequence of steps; in each step every rank sends one
message of ``m`` bytes to one peer (Thakur, Rabenseifner and Gropp 2005). A
step costs the time of its slowest link:

* a step whose partners are all inside a domain costs ``a_up + m / B_up``
  on one plane, or with multipath the equal-finish time over both planes,
  ``T = (m + a_up B_up + a_out B_out) / (B_up + B_out)`` (a plane dropped
  when its latency exceeds T), the same formula the controller splits by;
  below ``min_multipath_bytes`` a step stays on one plane, as at runtime;
* a step with any partner in another domain costs ``a_out + m / B_out``.

Reductions add ``m / reduce_Bps`` per reduced byte when a reduction rate is
given. The closed forms this reproduces on a flat topology are in
shared/reference/anchors.md; assumptions the algorithms layer may not share:
recursive halving pairs ranks at distance 1, 2, 4 ... with halves n/2, n/4 ...
(so the large exchanges stay inside a domain), non-powers of two fold the
surplus ranks in one extra exchange of the full vector before and after, and
the pipeline broadcast/reduce runs along ranks in order, its chunks'
latencies overlapping (only the first chunk pays each hop's latency).

The cheapest (algorithm, split policy) wins; ties go to the earlier name in
``ALGORITHMS``. ``MPCCS_TUNE`` overrides it (``parse_tune``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Union

from .split import PathModel, equal_finish

KiB = 1024
MiB = 1024 * KiB

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "rhd", "rd", "tree", "hierarchical"),
    "reduce_scatter": ("ring", "rhd", "hierarchical"),
    "all_gather": ("ring", "rd", "hierarchical"),
    "all_to_all": ("pairwise",),
    "all_to_allv": ("pairwise",),
    "broadcast": ("pipeline", "tree"),
    "reduce": ("pipeline", "tree"),
}
SPLIT_POLICIES = ("multipath", "single")
MIN_CHUNK = 64 * KiB
MAX_CHUNK = 1 * MiB
DEFAULT_MIN_MULTIPATH = 1024 * KiB  # the same threshold as ControlConfig.min_multipath_bytes


@dataclass(frozen=True)
class Plan:
    algorithm: str
    channels: int
    chunk_bytes: int
    split_policy: str      # "multipath" (both planes, controller splits) or "single" (exactly one plane)
    reason: dict = field(default_factory=dict, compare=False)


# ------------------------------------------------------------------ MPCCS_TUNE
@dataclass(frozen=True)
class TuneRule:
    collective: str                  # a collective name or "*"
    lo: int                          # message range [lo, hi) in bytes
    hi: float
    algorithm: Optional[str] = None
    channels: Optional[int] = None
    chunk_bytes: Optional[int] = None
    multipath: Optional[bool] = None
    token: str = ""

    def matches(self, collective: str, nbytes: int) -> bool:
        return self.collective in ("*", collective) and self.lo <= nbytes < self.hi


@dataclass(frozen=True)
class TuneOverride:
    rules: tuple[TuneRule, ...] = ()
    multipath: Optional[bool] = None   # global multipath=0/1

    def match(self, collective: str, nbytes: int) -> Optional[TuneRule]:
        if not self.rules:  # MPCCS_TUNE unset: asked on every call, the 8-byte all_reduce's too
            return None
        return next((r for r in self.rules if r.matches(collective, nbytes)), None)


_SIZE = re.compile(r"^(\d+)\s*([kmgt]?)(i?b)?$", re.IGNORECASE)
_UNITS = {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB, "t": 1024 * 1024 * MiB}


def parse_size(text: str) -> float:
    """'0', '4096', '64K', '1M', '2GiB', 'inf' -> bytes (K = 1024)."""
    t = text.strip()
    if t.lower() in ("inf", "max"):
        return math.inf
    m = _SIZE.match(t)
    if not m:
        raise ValueError(f"bad size {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def _flag(value: str, token: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError(f"MPCCS_TUNE: multipath must be 0 or 1 in {token!r}")
    return value == "1"


def parse_tune(s: Optional[str]) -> TuneOverride:
    """Parse an MPCCS_TUNE string; ValueError names the offending token.

    Grammar (items separated by commas, first matching rule wins)::

        tune  := item ("," item)*
        item  := "multipath=" ("0"|"1")                       global
               | coll ":" range (":" field)*                  rule
        coll  := all_reduce | reduce_scatter | all_gather | all_to_all
               | all_to_allv | broadcast | reduce | "*"
        range := size "-" size | "*"                          [lo, hi)
        size  := INT [K|M|G|T][B|iB] | "inf"                  K = 1024
        field := ALGORITHM | "channels=" INT | "chunk=" size | "multipath=" ("0"|"1")
    """
    if s is None or not s.strip():
        return TuneOverride()
    rules: list[TuneRule] = []
    multipath: Optional[bool] = None
    for token in (t.strip() for t in s.split(",")):
        if not token:
            raise ValueError(f"MPCCS_TUNE: empty item in {s!r}")
        if token.lower().startswith("multipath="):
            multipath = _flag(token.split("=", 1)[1].strip(), token)
            continue
        rules.append(_parse_rule(token))
    return TuneOverride(tuple(rules), multipath)


def _parse_rule(token: str) -> TuneRule:
    parts = [p.strip() for p in token.split(":")]
    if len(parts) < 2:
        raise ValueError(f"MPCCS_TUNE: {token!r} needs at least collective:range")
    coll, rng, fields = parts[0].lower(), parts[1], parts[2:]
    if coll != "*" and coll not in ALGORITHMS:
        raise ValueError(f"MPCCS_TUNE: unknown collective {parts[0]!r} in {token!r}")
    if rng == "*":
        lo, hi = 0, math.inf
    else:
        bounds = rng.split("-")
        if len(bounds) != 2:
            raise ValueError(f"MPCCS_TUNE: bad range {rng!r} in {token!r} (want lo-hi)")
        try:
            lo, hi = parse_size(bounds[0]), parse_size(bounds[1])
        except ValueError:
            raise ValueError(f"MPCCS_TUNE: bad range {rng!r} in {token!r}") from None
        if math.isinf(lo) or lo >= hi:
            raise ValueError(f"MPCCS_TUNE: empty range {rng!r} in {token!r}")
    kw: dict = {}
    for fld in fields:
        key, _, value = fld.partition("=")
        key = key.strip().lower()
        try:
            if not _:
                algs = ALGORITHMS.get(coll) if coll != "*" else sorted({a for v in ALGORITHMS.values() for a in v})
                if key not in algs:
                    raise ValueError
                kw["algorithm"] = key
            elif key == "channels":
                kw["channels"] = int(value)
                if kw["channels"] < 1:
                    raise ValueError
            elif key == "chunk":
                kw["chunk_bytes"] = int(parse_size(value))
                if kw["chunk_bytes"] < 1:
                    raise ValueError
            elif key == "multipath":
                kw["multipath"] = _flag(value.strip(), token)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"MPCCS_TUNE: bad field {fld!r} in {token!r}") from None
    return TuneRule(coll, int(lo), hi, token=token, **kw)


def tune_from_env(environ: Mapping[str, str]) -> TuneOverride:
    """The override in ``environ['MPCCS_TUNE']`` (the caller passes os.environ)."""
    return parse_tune(environ.get("MPCCS_TUNE"))


# ------------------------------------------------------------------ cost model
PlaneCost = Union[PathModel, tuple]


def _as_model(cost) -> PathModel:
    if isinstance(cost, PathModel):
        return cost
    if hasattr(cost, "rate_Bps") and hasattr(cost, "latency_s"):
        return PathModel(float(cost.rate_Bps), float(cost.latency_s))
    latency, rate = cost  # (latency_s, rate_Bps)
    return PathModel(float(rate), float(latency))


@dataclass(frozen=True)
class _Fabric:
    """Per-step link costs of one topology under one split policy."""

    up: PathModel
    out: PathModel
    domain_of: tuple[int, ...]
    multipath: bool
    min_multipath_bytes: int
    gamma: float  # seconds per reduced byte

    @property
    def world(self) -> int:
        return len(self.domain_of)

    def cross(self, pairs) -> bool:
        return any(self.domain_of[a] != self.domain_of[b] for a, b in pairs)

    def step(self, m: float, cross: bool) -> float:
        if m <= 0:
            return 0.0
        if cross:
            return self.out.time(m)
        if self.multipath and m >= self.min_multipath_bytes:
            return equal_finish(m, [self.up, self.out])[0]
        return self.up.time(m)

    def stream(self, m: float, cross: bool) -> float:
        """Serialisation of one more message behind others (latency overlapped)."""
        if m <= 0:
            return 0.0
        if cross:
            return m / self.out.rate_Bps
        if self.multipath and m >= self.min_multipath_bytes:
            t, x = equal_finish(m, [self.up, self.out])
            return max(x[0] / self.up.rate_Bps, x[1] / self.out.rate_Bps)
        return m / self.up.rate_Bps


def _domain_sizes(domain_of) -> list[int]:
    """Ranks per scale-up domain."""
    sizes: dict[int, int] = {}
    for d in domain_of:
        sizes[d] = sizes.get(d, 0) + 1
    return list(sizes.values())


def _lg(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def _pow2_below(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _ring_cross(f: _Fabric) -> bool:
    p = f.world
    return f.cross((r, (r + 1) % p) for r in range(p))


def _xor_cross(f: _Fabric, k: int) -> bool:
    p2 = _pow2_below(f.world)
    return f.cross((r, r ^ (1 << k)) for r in range(p2))


def _fold(f: _Fabric, n: float) -> float:
    """Extra exchange of the full vector when p is not a power of two."""
    p, p2 = f.world, _pow2_below(f.world)
    if p == p2:
        return 0.0
    return f.step(n, f.cross((r, r - p2) for r in range(p2, p)))


def _ring_rs(f: _Fabric, n: float, reduce: bool) -> float:
    p = f.world
    return (p - 1) * f.step(n / p, _ring_cross(f)) + (f.gamma * n * (p - 1) / p if reduce else 0.0)


def _rhd_rs(f: _Fabric, n: float, reduce: bool) -> float:
    p2 = _pow2_below(f.world)
    t = sum(f.step(n / (2 << k), _xor_cross(f, k)) for k in range(_lg(p2)))
    return t + (f.gamma * n * (p2 - 1) / p2 if reduce else 0.0)


def _rd_ag(f: _Fabric, n: float) -> float:
    p2 = _pow2_below(f.world)
    return sum(f.step(n / p2 * (1 << k), _xor_cross(f, k)) for k in range(_lg(p2)))


def _hier_parts(domain_of) -> Optional[tuple[int, int]]:
    """(ranks per domain, domains) where a hierarchical schedule applies
    (>= 2 equal domains of >= 2 ranks), else None (it falls back to ring)."""
    sizes = _domain_sizes(domain_of)
    if len(sizes) < 2 or min(sizes) != max(sizes) or sizes[0] < 2:
        return None
    return sizes[0], len(sizes)


def _hier(f: _Fabric, n: float, reduce_scatter: bool, all_gather: bool) -> float:
    """Hierarchical phases on the channels the engine runs them on (pipeline_channels).

    Reduce-scatter: in-domain (L - 1 steps of n / L, on 'up'), then across
    domains (D - 1 steps of n / (L D), on 'out'); all-gather the reverse. One
    channel runs them one after the other. With c channels one channel's
    cross-domain phase overlaps another's in-domain phases: about
    ``max(intra, inter) + min(intra, inter) / c`` (on the 2x2 testbed it predicts
    busbw 3-8, 6-7 and 5-10% above what 1, 2 and 4 channels measured). With multipath the in-domain bytes may
    also take 'out', which the overlapped cross-domain phases occupy: balanced,
    both planes end at ``(intra B_up + inter B_out) / (B_up + B_out)``, unless
    the cross-domain phases alone take longer (mpccs.sim.bounds: from
    ``B_up / B_out >= (L - 1) D / (D - 1)`` on, splitting gains nothing).
    """
    parts = _hier_parts(f.domain_of)
    if parts is None:
        return math.inf
    local, doms = parts
    channels = _channels_for(local, n)
    on_up = replace(f, multipath=False) if channels > 1 else f  # one channel: a step splits as it runs
    intra = inter = 0.0
    for reduce in [True] * reduce_scatter + [False] * all_gather:
        intra += (local - 1) * on_up.step(n / local, False) + (f.gamma * n * (local - 1) / local if reduce else 0.0)
        inter += (doms - 1) * f.step(n / (local * doms), True) + (f.gamma * n / local * (doms - 1) / doms
                                                                  if reduce else 0.0)
    if channels == 1:
        return intra + inter
    busy = max(intra, inter)
    if f.multipath and n / local / channels >= f.min_multipath_bytes:
        up, out = f.up.rate_Bps, f.out.rate_Bps
        busy = max(inter, (intra * up + inter * out) / (up + out))
    return busy + min(intra, inter) / channels


def _cost_all_reduce(f: _Fabric, alg: str, n: float, chunk: int) -> float:
    p = f.world
    if alg == "ring":
        return _ring_rs(f, n, True) + _ring_rs(f, n, False)
    if alg == "rhd":
        return 2 * _fold(f, n) + _rhd_rs(f, n, True) + _rd_ag(f, n) + (f.gamma * n if p != _pow2_below(p) else 0.0)
    if alg == "rd":
        p2 = _pow2_below(p)
        steps = sum(f.step(n, _xor_cross(f, k)) for k in range(_lg(p2)))
        return 2 * _fold(f, n) + steps + f.gamma * n * (_lg(p2) + (p != p2))
    if alg == "tree":
        steps = sum(f.step(n, _xor_cross(f, k)) for k in range(_lg(_pow2_below(p))))
        return 2 * (_fold(f, n) + steps) + f.gamma * n * _lg(p)
    if alg == "hierarchical":
        # intra reduce-scatter, inter reduce-scatter + all-gather of n/L, intra all-gather
        return _hier(f, n, True, True)
    raise KeyError(alg)


def _cost(f: _Fabric, collective: str, alg: str, n: float, chunk: int) -> float:
    p = f.world
    if collective == "all_reduce":
        return _cost_all_reduce(f, alg, n, chunk)
    if collective == "reduce_scatter":
        if alg == "ring":
            return _ring_rs(f, n, True)
        if alg == "rhd":
            return _fold(f, n) + _rhd_rs(f, n, True)
        return _hier(f, n, True, False)
    if collective == "all_gather":
        if alg == "ring":
            return _ring_rs(f, n, False)
        if alg == "rd":
            return _fold(f, n) + _rd_ag(f, n)
        return _hier(f, n, False, True)
    if collective in ("all_to_all", "all_to_allv"):
        return sum(f.step(n / p, f.cross((r, (r + k) % p) for r in range(p))) for k in range(1, p))
    if collective in ("broadcast", "reduce"):
        red = f.gamma * n if collective == "reduce" else 0.0
        if alg == "pipeline":
            # Chain along ranks in chunks: the first chunk pays every hop's
            # latency, the rest stream behind it at the slowest hop's rate.
            k = max(1, math.ceil(n / chunk))
            chain_cross = f.cross((r, r + 1) for r in range(p - 1))
            m = n / k
            return (p - 1) * f.step(m, chain_cross) + (k - 1) * f.stream(m, chain_cross) + red
        steps = sum(f.step(n, _xor_cross(f, k)) for k in range(_lg(_pow2_below(p))))
        return _fold(f, n) + steps + red * _lg(p)
    raise KeyError(collective)


FINE_SPLIT_STEP = 8 << 20  # steps this large get FINE_SPLIT_CHUNKS chunks (chunk_for)
FINE_SPLIT_CHUNKS = 16


def chunk_for(step_bytes: float) -> int:
    """At least ~8 chunks per step (splitting and stealing granularity, window
    pipelining), 16 from 8 MiB steps, never below 64 KiB (per-chunk overhead)
    nor above 1 MiB (the prototype's chunk, which already reached 97 % of two
    links' sum).

    A split lands on whole chunks: with 8 per flow the share moves in steps of
    1/8, and a 2:1 pair of links (best share 0.67) gets 0.625 or 0.75, 12%
    slower than the best split (the testbed's 16 MiB points). 16 chunks cut
    that to 3%. Below 8 MiB steps halving the chunk cost the shared-memory
    plane 10-25% of its busbw (2-8 MiB all_reduce, per-chunk overhead), so
    those keep 8."""
    target = max(1.0, step_bytes / (FINE_SPLIT_CHUNKS if step_bytes >= FINE_SPLIT_STEP else 8))
    return int(min(MAX_CHUNK, max(MIN_CHUNK, 1 << int(math.floor(math.log2(target))))))


def _largest_step(collective: str, alg: str, world: int, nbytes: int) -> float:
    if collective == "all_reduce" and alg in ("rd", "tree"):
        return nbytes
    if collective in ("broadcast", "reduce"):
        return nbytes
    if alg in ("rhd",):
        return nbytes / 2
    return nbytes / max(1, world)


PIPELINE_STEP_MIN = 1 << 20  # a channel's intra-domain step at least this (per-chunk costs)
PIPELINE_CHANNELS_MAX = 16


def pipeline_channels(algorithm: str, topology, nbytes: int) -> int:
    """Channels for a hierarchical schedule across equal scale-up domains.

    Its intra-domain phases run on 'up' and its inter-domain phases on 'out'
    (the only plane between domains); one channel runs them one after the
    other, so each plane idles while the other works. With c channels (the
    buffer in c slices, each its own chain of phases) one channel's
    inter-domain phase overlaps another's intra-domain phases. On the 2x2
    testbed (1 / 0.5 Gbit/s) the hierarchical all_reduce on 'up' went from
    0.087-0.091 GB/s busbw (one channel) to 0.117-0.118 (two) and 0.136-0.143
    (four) at 16-64 MiB, about max(intra, inter) + min(intra, inter) / c (as
    the cost model prices it, _hier). Up to PIPELINE_CHANNELS_MAX, while a
    channel's intra-domain step (nbytes / domain size / c) stays at least
    PIPELINE_STEP_MIN.

    More channels shorten the pipeline's fill and drain, when one plane
    works alone; a split needs that most, since it fills both planes in the
    middle. On the 2x2 testbed at 1:1 (the channels taking turns,
    algorithms.hierarchical) a fixed 0.8 split took 216 ms at 16 MiB on 8
    channels and 866-880 ms at 64 MiB on 16, against 229-231 and 910-971 on
    4-8 channels; 'up' alone took the same 271-287 and 1085-1113 ms on 4, 8
    and 16 channels.
    """
    if algorithm != "hierarchical" or topology is None:
        return 1
    parts = _hier_parts(topology.domain_of)
    if parts is None:
        return 1  # the schedule falls back to ring
    return _channels_for(parts[0], nbytes)


def _channels_for(local: int, nbytes: float) -> int:
    channels = 1
    while channels < PIPELINE_CHANNELS_MAX and nbytes / local / (2 * channels) >= PIPELINE_STEP_MIN:
        channels *= 2
    return channels


def algorithm_times(collective: str, world: int, nbytes: int, topology, estimates: Mapping[str, PlaneCost],
                    multipath: bool, *, reduce_Bps: Optional[float] = None,
                    min_multipath_bytes: int = DEFAULT_MIN_MULTIPATH) -> dict[str, float]:
    """Predicted seconds of every algorithm of ``collective`` under one split policy."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}")
    domain_of = tuple(topology.domain_of) if topology is not None else tuple(0 for _ in range(world))
    if len(domain_of) != world:
        raise ValueError(f"topology has {len(domain_of)} ranks, world is {world}")
    fabric = _Fabric(_as_model(estimates["up"]), _as_model(estimates["out"]), domain_of, multipath,
                     min_multipath_bytes, 1.0 / reduce_Bps if reduce_Bps else 0.0)
    times = {}
    for alg in ALGORITHMS[collective]:
        chunk = chunk_for(_largest_step(collective, alg, world, nbytes))
        times[alg] = _cost(fabric, collective, alg, float(nbytes), chunk) if world > 1 else 0.0
    return times


def choose(collective: str, world: int, nbytes: int, topology, estimates: Mapping[str, PlaneCost],
           override: Union[TuneOverride, str, None] = None, *, reduce_Bps: Optional[float] = None,
           min_multipath_bytes: int = DEFAULT_MIN_MULTIPATH) -> Plan:
    """The cheapest (algorithm, split policy) for one call, unless overridden.

    ``estimates`` maps 'up' and 'out' to a PathModel (or anything with
    rate_Bps and latency_s, or a (latency_s, rate_Bps) pair), e.g.
    ``PathController.plane_costs()``. ``nbytes`` is the message size as
    nccl-tests counts it: the full vector for all_reduce, reduce_scatter's
    input, all_gather's output, a rank's whole all_to_all buffer, the
    broadcast/reduce buffer. ``topology`` has ``domain_of`` (None: one domain).
    """
    if isinstance(override, str):
        override = parse_tune(override)
    override = override or TuneOverride()
    if world < 1 or nbytes < 0:
        raise ValueError("world must be >= 1 and nbytes >= 0")
    rule = override.match(collective, nbytes)
    allow_multipath = override.multipath is not False and (rule is None or rule.multipath is not False)
    kw = dict(reduce_Bps=reduce_Bps, min_multipath_bytes=min_multipath_bytes)
    single = algorithm_times(collective, world, nbytes, topology, estimates, False, **kw)
    multi = algorithm_times(collective, world, nbytes, topology, estimates, True, **kw) if allow_multipath else {}
    candidates = [(t, i, alg, "single") for i, (alg, t) in enumerate(single.items())]
    candidates += [(t, i, alg, "multipath") for i, (alg, t) in enumerate(multi.items())]
    if rule is not None and rule.algorithm is not None:
        candidates = [c for c in candidates if c[2] == rule.algorithm]
    # Multipath must beat single by 1 % to be worth a second stream of chunks.
    best = min(candidates, key=lambda c: (c[0] * (1.01 if c[3] == "multipath" else 1.0), c[1], c[3] != "single"))
    _, _, algorithm, policy = best
    channels = pipeline_channels(algorithm, topology, nbytes)
    # A channel's step is what a split lands in: chunked for the whole vector's step, a 64 MiB
    # hierarchical all_reduce on 16 channels (2x2) cut its 2 MiB in-domain flows into 4 chunks,
    # the share moved in quarters against a model share of 10-20% on 'out', and ranks rounded to
    # none of it where their 'out' estimate sagged (1.00x 'up' in 12 of 30 iterations).
    step = _largest_step(collective, algorithm, world, nbytes)
    if channels > 1:  # hierarchical across equal domains: the in-domain step of one channel
        step = nbytes / _hier_parts(topology.domain_of)[0] / channels
    chunk = chunk_for(step)
    if rule is not None:
        channels = rule.channels or channels
        chunk = rule.chunk_bytes or chunk
    reason = {
        "model": "per-step latency + bytes/bandwidth (TRG closed forms); in-domain steps split by equal finish",
        "times_s": {alg: {"single": single[alg], **({"multipath": multi[alg]} if multi else {})} for alg in single},
        "estimates": {p: {"rate_Bps": _as_model(estimates[p]).rate_Bps,
                          "latency_s": _as_model(estimates[p]).latency_s} for p in ("up", "out")},
        "override": rule.token if rule is not None else None,
        "multipath_allowed": allow_multipath,
        "channels": "override" if rule is not None and rule.channels is not None else (
            f"{channels}: hierarchical, one channel's inter-domain phase ('out') overlaps another's intra-domain "
            f"phases ('up'), channel steps >= {PIPELINE_STEP_MIN >> 20} MiB, priced overlapped" if channels > 1 else
            "1: only hierarchical schedules across domains run channels, on steps of >= "
            f"{PIPELINE_STEP_MIN >> 20} MiB"),
    }
    return Plan(algorithm, channels, int(chunk), policy, reason)
