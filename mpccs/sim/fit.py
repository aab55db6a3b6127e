"""``--fit-testbed``: predict the dual-plane all_reduce of the namespace testbed.

The testbed (shared/reference/environment.md) has two ranks joined by two
shaped tcp planes. Given what each plane measured *alone*, either as a rate
and a latency or as single-plane all_reduce timings (size, seconds) from
which a rate and a per-step latency are fitted, this builds a two-rank
cluster whose planes are exactly those, and simulates the dual-plane run.
The prediction is to be compared with the measured dual-plane run later.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

from .presets import Link, Preset

TESTBED_SOURCES = ("measured single-plane numbers of the namespace testbed (input)",)


@dataclass(frozen=True)
class PlaneFit:
    rate_GBps: float
    latency_us: float
    points: int = 0          # measurements behind the fit (0: given directly)
    residual: float = 0.0    # max relative error of the fit over its points

    def to_json(self) -> dict:
        return dict(self.__dict__)


def fit_ring_all_reduce(samples: Sequence[tuple[float, float]], world: int) -> PlaneFit:
    """Least-squares alpha-beta fit of ring all_reduce times on one plane.

    t(S) = 2(p-1) alpha + 2(p-1)/p * S / B, S the buffer in bytes; returns
    B and alpha (the per-step latency the simulator uses)."""
    if len(samples) < 2:
        raise ValueError("need at least two (size, time) points to fit a rate and a latency")
    xs = [float(s) for s, _ in samples]
    ys = [float(t) for _, t in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("sizes must differ to separate rate from latency")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    if slope <= 0:
        raise ValueError("time does not grow with size: cannot fit a rate")
    steps = 2 * (world - 1)
    rate = steps / world / slope
    alpha = max(0.0, intercept / steps)
    residual = max(abs(intercept + slope * x - y) / y for x, y in zip(xs, ys))
    return PlaneFit(rate / 1e9, alpha * 1e6, n, residual)


def plane_from_spec(spec) -> PlaneFit:
    """A plane from JSON: {"rate_GBps": r, "latency_us": a} or
    {"all_reduce": [[size_bytes, time_us], ...], "world": p}."""
    if "all_reduce" in spec:
        samples = [(s, t * 1e-6) for s, t in spec["all_reduce"]]
        return fit_ring_all_reduce(samples, int(spec.get("world", 2)))
    return PlaneFit(float(spec["rate_GBps"]), float(spec.get("latency_us", 0.0)))


@dataclass
class Measurements:
    """What the testbed measured: each plane alone, and maybe both at once."""

    planes: dict                 # "up"/"out" -> PlaneFit
    world: int = 2
    # policy -> {size_bytes: busbw GB/s} of multipath runs (mpccs-perf rows
    # other than the single-plane policies), to set beside the prediction.
    multipath: dict = None


# Below this the fallback algorithm is recursive doubling (one step of the
# whole buffer), which an alpha-beta fit of the ring formula would misread.
MIN_FIT_BYTES = 64 * 1024


def load_measurements(path) -> Measurements:
    """Either ``{"up": {...}, "out": {...}}`` (see :func:`plane_from_spec`) or
    an ``mpccs-perf -J`` file of all_reduce rows: rows with policy ``up`` and
    ``out`` are fitted, rows of any other policy kept as measured multipath."""
    with open(path) as fh:
        data = json.load(fh)
    if "rows" in data:
        return _from_perf_rows(data["rows"], path)
    missing = {"up", "out"} - set(data)
    if missing:
        raise ValueError(f"{path}: needs entries for planes {sorted(missing)}")
    return Measurements({plane: plane_from_spec(data[plane]) for plane in ("up", "out")},
                        int(data.get("world", 2)), {})


def _from_perf_rows(rows, path) -> Measurements:
    rows = [r for r in rows if r.get("collective") == "all_reduce"]
    if not rows:
        raise ValueError(f"{path}: no all_reduce rows")
    world = int(rows[0].get("nranks", 2))
    planes = {}
    for plane in ("up", "out"):
        samples = [(r["size"], r["time_us"] * 1e-6) for r in rows
                   if r.get("policy") == plane and r["size"] >= MIN_FIT_BYTES]
        planes[plane] = fit_ring_all_reduce(samples, world)
    multipath: dict = {}
    for r in rows:
        if r.get("policy") not in ("up", "out") and "#" not in str(r.get("policy")):
            multipath.setdefault(str(r["policy"]), {})[int(r["size"])] = float(r["busbw"])
    return Measurements(planes, world, multipath)


def preset_for_testbed(up: PlaneFit, out: PlaneFit, world: int = 2,
                       shared_GBps: Optional[float] = None, reduce_GBps: float = float("inf")) -> Preset:
    """Two shaped planes between ``world`` ranks of one domain.

    ``shared_GBps``: a per-rank resource both planes cross (the CPU cores
    that run both tcp stacks); None = independent planes, which is what the
    prototype measured (97% of the sum)."""
    unbounded = Link(1e6, 1.0, "not a bottleneck on the testbed")
    return Preset(
        name="testbed",
        description=f"namespace testbed: {world} ranks, up {up.rate_GBps:.3g} GB/s, out {out.rate_GBps:.3g} GB/s",
        gpus_per_domain=world,
        up_kind="switch",
        up_port=Link(up.rate_GBps, 1.0, "measured alone"),
        up_latency_us=up.latency_us,
        nic=Link(out.rate_GBps, 1.0, "measured alone"),
        gpus_per_nic=1,
        out_latency_us=out.latency_us,
        gpu_pcie=unbounded,
        both_planes=Link(shared_GBps, 1.0, "shared host resource") if shared_GBps else None,
        reduce_GBps=reduce_GBps,
        sources=TESTBED_SOURCES,
    )
