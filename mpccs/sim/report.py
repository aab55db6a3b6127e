"""Predicted busbw tables, gains, step-time translation, plots (SIMULATED).

Sizes follow nccl-tests: ``S`` is the full buffer (count x typesize for
all_reduce; count x typesize x n for reduce_scatter, all_gather and
all_to_all), algbw = S / t, busbw = algbw x factor.

Everything computed here is produced by the simulator and labelled
SIMULATED wherever it is written.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Optional, Sequence

from mpccs.algorithms import ALGORITHMS, build_schedule
from mpccs.algorithms.schedule import Topology
from mpccs.control.tuner import pipeline_channels

from .fabric import Cluster
from .presets import PUBLISHED_ALLREDUCE_BUSBW_GBps, Preset
from .run import FixedShare, NominalSplit, SimResult, simulate

LABEL = "SIMULATED"
ITEMSIZE = 4  # float32, as nccl-tests' default
REPORT_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


def busbw_factor(collective: str, world: int) -> float:
    """nccl-tests bus bandwidth factor."""
    if collective == "all_reduce":
        return 2 * (world - 1) / world
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (world - 1) / world
    return 1.0


def count_for_size(collective: str, size_bytes: int, world: int, itemsize: int = ITEMSIZE) -> int:
    """Builder ``count`` (elements per rank as the API defines it) for full buffer S."""
    elements = size_bytes // itemsize
    return elements if collective in ("all_reduce", "broadcast", "reduce") else elements // world


def busbw_GBps(collective: str, size_bytes: int, world: int, time_s: float) -> float:
    return size_bytes / time_s * busbw_factor(collective, world) / 1e9


def step_speedup(exposed_share: float, collective_speedup: float) -> float:
    """Amdahl on the exposed communication share f: 1 / ((1 - f) + f / S_c)."""
    return 1.0 / ((1.0 - exposed_share) + exposed_share / collective_speedup)


def algorithms_for(collective: str, domains: int) -> tuple[str, ...]:
    """Candidate algorithms; hierarchical only makes sense across domains."""
    algos = ALGORITHMS[collective]
    return tuple(a for a in algos if domains > 1 or a != "hierarchical")


@lru_cache(maxsize=64)
def cached_schedule(collective: str, world: int, count: int, algorithm: str, per_domain: int, channels: int = 1):
    return build_schedule(collective, world, count, algorithm=algorithm,
                          topology=Topology.blocks(world, per_domain), channels=channels)


@dataclass
class Scenario:
    """One point of a table: a cluster, a collective, a size."""

    preset: Preset
    domains: int
    collective: str
    size_bytes: int
    local_copies: bool = False  # NCCL's ring reads its input in place

    @property
    def world(self) -> int:
        return self.preset.gpus_per_domain * self.domains

    def schedule(self, algorithm: str):
        count = count_for_size(self.collective, self.size_bytes, self.world)
        # The channels the engine's tuner gives it: a hierarchical schedule on one
        # channel idles each plane while the other works, and priced so the
        # second plane looked worth +4.6% across H100 domains where the engine's
        # channels (four then, sixteen now) run 1.46x (1.71x) faster on 'up' alone
        # and splitting adds nothing.
        topology = Topology.blocks(self.world, self.preset.gpus_per_domain)
        channels = pipeline_channels(algorithm, topology, self.size_bytes)
        return cached_schedule(self.collective, self.world, count, algorithm, self.preset.gpus_per_domain, channels)

    def run(self, algorithm: str, policy=None, *, make_policy=None, policy_factory=None, **kw) -> SimResult:
        """One simulation. ``make_policy(cluster)`` builds a shared policy;
        ``policy_factory(cluster, rank)`` one controller per rank."""
        preset = self.preset if self.local_copies else self.preset.with_(copy_GBps=math.inf)
        cluster = Cluster(preset, self.domains)
        if make_policy is not None:
            policy = make_policy(cluster)
        factory = (lambda rank: policy_factory(cluster, rank)) if policy_factory else None
        result = simulate(self.schedule(algorithm), cluster, policy, policy_factory=factory,
                          itemsize=ITEMSIZE, **kw)
        if not result.ok:
            raise RuntimeError(f"{self}: {result.error}")
        return result

    def series(self, algorithm: str, policy_factory, ops: int, **kw) -> list[SimResult]:
        """``ops`` back-to-back operations on one clock, with one controller per
        rank kept across them (as in a training loop). ``policy_factory`` may
        also be a stateless policy object, shared by every operation."""
        controllers: dict = {}

        def persistent(cluster, rank):
            if rank not in controllers:
                controllers[rank] = policy_factory(cluster, rank)
            return controllers[rank]

        stateless = hasattr(policy_factory, "decide")
        results, now = [], 0.0
        for op in range(ops):
            if stateless:
                res = self.run(algorithm, policy_factory, start_s=now, **kw)
            else:
                res = self.run(algorithm, policy_factory=persistent, start_s=now, epoch=op, **kw)
            results.append(res)
            now += res.time_s
        return results

    def busbw(self, time_s: float) -> float:
        return busbw_GBps(self.collective, self.size_bytes, self.world, time_s)


def golden_min(fn: Callable[[float], float], lo: float, hi: float, tol: float = 0.004) -> tuple[float, float]:
    """Minimise a unimodal ``fn`` on [lo, hi]; also tries the ends."""
    ratio = (math.sqrt(5) - 1) / 2
    seen: dict[float, float] = {}

    def f(x: float) -> float:
        if x not in seen:
            seen[x] = fn(x)
        return seen[x]

    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    while b - a > tol:
        if f(c) <= f(d):
            b, d = d, c
            c = b - ratio * (b - a)
        else:
            a, c = c, d
            d = a + ratio * (b - a)
    for x in (lo, (a + b) / 2):
        f(x)
    best = min(seen, key=seen.get)
    return best, seen[best]


@dataclass
class Outcome:
    algorithm: str
    time_s: float
    busbw_GBps: float
    out_share: float = 0.0

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Row:
    scenario: Scenario
    single: Outcome
    tuned: Outcome                      # one out share for every flow, searched offline
    static: Optional[Outcome] = None    # equal finish from link specs, no feedback
    controller: Optional[Outcome] = None  # mpccs.control, steady state
    extra: dict = field(default_factory=dict)

    def gain_of(self, outcome: Optional[Outcome]) -> Optional[float]:
        return None if outcome is None else outcome.busbw_GBps / self.single.busbw_GBps - 1

    @property
    def best(self) -> Outcome:
        """The fastest multipath outcome (never worse than single plane:
        a tuned share of 0 is single plane)."""
        return max((o for o in (self.tuned, self.static, self.controller) if o is not None),
                   key=lambda o: o.busbw_GBps)

    @property
    def gain(self) -> float:
        return self.gain_of(self.best)

    def to_json(self) -> dict:
        s = self.scenario
        return {
            "label": LABEL,
            "preset": s.preset.name, "domains": s.domains, "world": s.world,
            "collective": s.collective, "size_bytes": s.size_bytes,
            "single_plane": self.single.to_json(),
            "tuned_fixed_share": self.tuned.to_json(),
            "spec_split": self.static.to_json() if self.static else None,
            "controller": self.controller.to_json() if self.controller else None,
            "gain_best": self.gain,
            "gain_tuned": self.gain_of(self.tuned),
            "gain_spec_split": self.gain_of(self.static),
            "gain_controller": self.gain_of(self.controller),
            **self.extra,
        }


def evaluate(scenario: Scenario, algorithms: Optional[Sequence[str]] = None,
             controller_factory=None, warmup: int = 3, iters: int = 5, max_share: float = 0.7,
             **run_kw) -> Row:
    """Single plane vs multipath for one scenario.

    single: best algorithm with every in-domain byte on 'up' (inter-domain
    bytes on 'out', as NCCL); tuned: best algorithm x best single out share
    (golden-section search); static: spec-rate equal-finish split per flow;
    controller: mpccs.control in steady state (mean of ``iters`` operations
    after ``warmup``, like nccl-tests), if a factory is given. ``run_kw``
    (events, chunk_bytes, ...) goes to every simulation.
    """
    algorithms = tuple(algorithms or algorithms_for(scenario.collective, scenario.domains))
    singles = {a: scenario.run(a, FixedShare(0.0), **run_kw).time_s for a in algorithms}
    single_algo = min(singles, key=singles.get)
    single = Outcome(single_algo, singles[single_algo], scenario.busbw(singles[single_algo]))

    tuned = single
    # An algorithm far behind on one plane cannot catch up with a second
    # plane worth a fraction of the first; skip its search.
    for algo in (a for a in algorithms if singles[a] <= 2.0 * single.time_s):
        share, t = golden_min(lambda x: scenario.run(algo, FixedShare(x), **run_kw).time_s, 0.0, max_share)
        if t < tuned.time_s:
            tuned = Outcome(algo, t, scenario.busbw(t), share)

    algo = tuned.algorithm
    res = scenario.run(algo, make_policy=NominalSplit, **run_kw)
    static = Outcome(algo, res.time_s, scenario.busbw(res.time_s), res.out_share)
    controller = None
    if controller_factory is not None:
        runs = scenario.series(algo, controller_factory, warmup + iters, **run_kw)[warmup:]
        t = sum(r.time_s for r in runs) / len(runs)
        share = sum(r.out_share for r in runs) / len(runs)
        controller = Outcome(algo, t, scenario.busbw(t), share)
    return Row(scenario, single, tuned, static, controller)


def bandwidth_bound(preset: Preset) -> float:
    """out/up per GPU: the most a second plane can add to an up-bound collective."""
    out = preset.nic.usable_GBps / preset.gpus_per_nic
    up = preset.up_port.usable_GBps if preset.up_kind == "switch" else (
        preset.mesh_aggregate.usable_GBps if preset.up_kind == "mesh" else preset.gpu_pcie.usable_GBps)
    return out / up


def published_comparison(presets: Sequence[Preset], size_bytes: int = 8 << 30) -> list[dict]:
    """Predicted single-node ring all_reduce busbw vs published nccl-tests figures."""
    rows = []
    for preset in presets:
        published = PUBLISHED_ALLREDUCE_BUSBW_GBps.get(preset.name)
        if published is None:
            continue
        sc = Scenario(preset, 1, "all_reduce", size_bytes)
        t = sc.run("ring", FixedShare(0.0)).time_s
        predicted = sc.busbw(t)
        rows.append({"label": LABEL, "preset": preset.name, "size_bytes": size_bytes,
                     "predicted_busbw_GBps": predicted, "published_busbw_GBps": published,
                     "difference": predicted / published - 1,
                     "up_port_usable_GBps": preset.up_port.usable_GBps})
    return rows


# --- formatting ----------------------------------------------------------------
def human_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(text)


def gbps(x: float) -> str:
    """GB/s with three significant digits (testbed rates are below 1)."""
    return f"{x:.1f}" if x >= 100 else f"{x:.3g}"


def pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def markdown_table(rows: Sequence[Row]) -> str:
    head = ("| preset | ranks | collective | size | single plane busbw (algo) | tuned fixed share: busbw, out share "
            "| spec split: busbw, out share | controller: busbw, out share | gain tuned | gain spec | gain controller |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        s = r.scenario

        def cell(o: Optional[Outcome]) -> str:
            return "-" if o is None else f"{gbps(o.busbw_GBps)}, {o.out_share:.0%}"

        lines.append(
            f"| {s.preset.name} | {s.world} | {s.collective} | {human_size(s.size_bytes)} "
            f"| {gbps(r.single.busbw_GBps)} ({r.single.algorithm}) | {cell(r.tuned)} | {cell(r.static)} "
            f"| {cell(r.controller)} | {pct(r.gain_of(r.tuned))} | {pct(r.gain_of(r.static))} "
            f"| {pct(r.gain_of(r.controller))} |")
    return "\n".join(lines)


def nccl_style_table(rows: Sequence[Row]) -> str:
    """nccl-tests-like columns, one line per row, for the CLI."""
    out = [f"# {LABEL}: predicted, not measured",
           "#       size    count   type  collective       algo    time(us)  algbw(GB/s)  busbw(GB/s)  out-share"]
    for r in rows:
        s = r.scenario
        for tag, o in (("1-plane", r.single), ("tuned", r.tuned), ("spec", r.static), ("ctrl", r.controller)):
            if o is None:
                continue
            count = count_for_size(s.collective, s.size_bytes, s.world)
            algbw = s.size_bytes / o.time_s / 1e9
            out.append(f"{s.size_bytes:12d} {count:9d}  float {s.collective:14s} {o.algorithm:>8s} "
                       f"{o.time_s * 1e6:10.1f} {algbw:12.2f} {o.busbw_GBps:12.2f}  {o.out_share:8.1%}  {tag}")
    return "\n".join(out)


def write_json(path, payload) -> None:
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1, sort_keys=True, default=str)
