"""Calibration gate: can this machine actually carry the configured rates?

Both planes are loaded at once with the pattern a ring all_reduce puts on them:
every rank sends to the next rank and receives from the previous one, on the up
plane (ring inside its scale-up domain) and on the out plane (ring over all ranks),
so every shaped link carries its rate in both directions at the same time. On a
2-core machine the veths, bridges and qdiscs all run on the same CPUs as the
probes; when the CPUs run out, the planes deliver less than the sum of their rates,
and a benchmark on such a testbed would measure the machine, not the algorithm.
"""
from __future__ import annotations

import math
import time

from mpccs.testbed.netns import fmt_rate
from mpccs.testbed.traffic import run_flows

PASS_RATIO = 0.95
PROBE_PORT = 6000


class CalibrationError(RuntimeError):
    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def _ring(members: list) -> list:
    """(src, dst) pairs of a ring; two members make one bidirectional pair."""
    if len(members) < 2:
        return []
    return [(members[i], members[(i + 1) % len(members)]) for i in range(len(members))]


def probe_flows(cluster) -> list:
    """[(plane, src_rank, dst_rank, rate_bps)] that an all_reduce-like load puts on the links."""
    flows = [("out", s, d, cluster.out_bps) for s, d in _ring(list(range(cluster.n)))]
    if cluster.up == "tcp":
        for dom in dict.fromkeys(cluster.domains):
            members = [r.rank for r in cluster.ranks if r.domain == dom]
            flows += [("up", s, d, cluster.up_bps) for s, d in _ring(members)]
    return flows


def _expected_Bps(cluster, flows) -> float:
    """What the links should deliver: each flow its plane rate, capped per rank by a shared trunk."""
    per_src = {}
    for _plane, src, _dst, bps in flows:
        per_src[src] = per_src.get(src, 0.0) + bps
    if cluster.shared_bottleneck:
        per_src = {k: min(v, cluster.shared_bps) for k, v in per_src.items()}
    return sum(per_src.values()) / 8


def measure(cluster, flows, duration: float = 2.0, warmup: float = 0.3) -> list:
    """Run the flows at once; returns per-flow delivered bytes/s over a common window."""
    specs = {}
    for i, (plane, src, dst, _bps) in enumerate(flows):
        d, s = cluster.ranks[dst], cluster.ranks[src]
        addr, src_addr = (d.up_addr, s.up_addr) if plane == "up" else (d.out_addr, s.out_addr)
        specs.setdefault(dst, {"sinks": [], "sends": []})["sinks"].append(
            {"addr": addr, "port": PROBE_PORT + i})
        specs.setdefault(src, {"sinks": [], "sends": []})["sends"].append(
            {"addr": addr, "port": PROBE_PORT + i, "src": src_addr})
    results, plan = run_flows(cluster, specs, duration, warmup, timeout=duration + 15)
    span = plan["window"][1] - plan["window"][0]
    out = []
    for i, (plane, src, dst, bps) in enumerate(flows):
        sink = next(s for s in results[dst]["sinks"] if s["port"] == PROBE_PORT + i)
        out.append({"plane": plane, "src": src, "dst": dst, "configured_Bps": bps / 8,
                    "delivered_Bps": sink["window_bytes"] / span, "error": sink.get("error")})
    return out


def calibrate(cluster, duration: float = 2.0, threshold: float = PASS_RATIO) -> dict:
    """Measure; return the result dict with 'passed'. Never raises for a low number."""
    flows = probe_flows(cluster)
    if not flows:
        return {"passed": True, "skipped": "one rank: no links to measure", "flows": []}
    measured = measure(cluster, flows, duration)
    planes = {}
    for f in measured:
        p = planes.setdefault(f["plane"], {"configured_Bps": 0.0, "delivered_Bps": 0.0, "flows": 0})
        p["configured_Bps"] += f["configured_Bps"]
        p["delivered_Bps"] += f["delivered_Bps"]
        p["flows"] += 1
    expected = _expected_Bps(cluster, flows)
    delivered = sum(f["delivered_Bps"] for f in measured)
    ratio = delivered / expected
    res = {"passed": ratio >= threshold, "threshold": threshold, "ratio": ratio,
           "expected_Bps": expected, "delivered_Bps": delivered, "planes": planes,
           "flows": measured, "duration_s": duration, "time": time.time()}
    cluster.event("calibration", ratio=ratio, delivered_Bps=delivered, expected_Bps=expected,
                  passed=res["passed"])
    return res


def summary(res: dict) -> str:
    if res.get("skipped"):
        return f"calibration skipped: {res['skipped']}"
    parts = [f"{plane} {p['delivered_Bps'] / 1e9:.3f} GB/s of {p['configured_Bps'] / 1e9:.3f}"
             for plane, p in sorted(res["planes"].items())]
    return (f"calibration: {', '.join(parts)} ({res['planes']['out']['flows']} flows/plane, "
            f"both planes at once, both directions); together {res['delivered_Bps'] / 1e9:.3f} "
            f"GB/s of {res['expected_Bps'] / 1e9:.3f} GB/s expected = {res['ratio'] * 100:.1f}%")


def fix_hint(cluster, res: dict) -> str:
    """Lower both rates by the same factor, a little below what was measured."""
    f = res["ratio"] * 0.9
    opts = [("--up-rate", cluster.up_bps if cluster.up == "tcp" else None),
            ("--out-rate", cluster.out_bps), ("--shared-rate", cluster.shared_bps)]
    fix = " ".join(f"{opt} {fmt_rate(_round2(bps * f))}" for opt, bps in opts if bps)
    return (f"the planes delivered {res['ratio'] * 100:.1f}% of the configured rates "
            f"(needs {res['threshold'] * 100:.0f}%): this machine cannot carry them. "
            f"Lower the rates at the same ratio, e.g. {fix}, or pass --no-calibrate to run anyway")


def _round2(bits: float) -> float:
    """Two significant digits, rounded down: a rate a person would type."""
    e = 10 ** (math.floor(math.log10(bits)) - 1)
    return math.floor(bits / e) * e


def gate(cluster, duration: float = 2.0, threshold: float = PASS_RATIO) -> dict:
    """calibrate(), log the numbers, raise CalibrationError when they fall short."""
    res = calibrate(cluster, duration, threshold)
    cluster.log(summary(res))
    if not res["passed"]:
        raise CalibrationError(fix_hint(cluster, res), res)
    return res
