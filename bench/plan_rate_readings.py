"""What the plan-rate meter reads per policy, from a run's traces (MPCCS_TRACE).

    python bench/plan_rate_readings.py TRACE [--ranks 4] [--min-bytes 4M]

TRACE is the MPCCS_TRACE path the ranks wrote (TRACE.rank0, TRACE.rank1, ...;
`bench/testbed_2x2.py --trace`). For every all_reduce of at least --min-bytes it
rebuilds the meter's sample per plane (the bytes that reached the rank on the
plane over the union of its stages' spans; control/plan_rates.py) with each span
from the stage's start to its last arrival there. The meter itself starts a span
later where the peer evidently started late (StageRun.delivery_samples), which
the trace cannot replay (it holds no look times): these readings are the raw
spans', lower than the meter's where a sender was ahead. It prints, per
(policy, bytes moved, plane), the median and the 10th-90th percentiles of those
readings over ranks and operations. Then every agreement the ranks made
(the trace's `plan_rates` events): the call, the policy it ran under, each
rank's rates and the agreed ones. docs/controller.md (Plan rates) says why a
plane that carries a small part of an operation reads wrong.
"""
from __future__ import annotations

import argparse
import json
import statistics

from mpccs.collective_op import _busy_time
from mpccs.config import parse_size
from mpccs.control.plan_rates import PlanRateConfig


def readings(record: dict) -> dict[str, float]:
    """Per plane, the meter's reading of one operation (bytes/s), where enough arrived to count."""
    spans: dict[str, list] = {}
    for stage in record.get("stages", ()):
        start = stage["t_start_wall"]
        for plane, arrived in (stage.get("arrivals") or {}).items():
            if arrived["bytes"] > 0:
                spans.setdefault(plane, []).append((start, start + arrived["last_s"], arrived["bytes"], None))
    out = {}
    for plane, items in spans.items():
        nbytes, busy, _ = _busy_time(items)  # the meter's own union (CollectiveOp)
        if nbytes >= PlanRateConfig().min_plane_bytes and busy > 0:
            out[plane] = nbytes / busy
    return out


def spread(values: list[float]) -> str:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return f"{statistics.median(values) / 1e6:6.1f} [{pick(0.1) / 1e6:6.1f}, {pick(0.9) / 1e6:6.1f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--min-bytes", default="4M", help="the meter's min_call_bytes (default 4M)")
    ns = ap.parse_args(argv)
    min_bytes = parse_size(ns.min_bytes)
    by_key: dict[tuple, list[float]] = {}
    agreements = []
    for rank in range(ns.ranks):
        with open(f"{ns.trace}.rank{rank}") as f:
            for line in f:
                record = json.loads(line)
                if record.get("op") != "all_reduce":
                    continue
                if rank == 0:
                    agreements += [(record["seq"], record.get("policy"), e) for e in record.get("events") or ()
                                   if e.get("kind") == "plan_rates"]
                size = sum(record["bytes_per_plane"].values())
                if size < min_bytes:
                    continue
                for plane, rate in readings(record).items():
                    by_key.setdefault((str(record.get("policy")), size, plane), []).append(rate)
    print("policy      bytes moved  plane  readings MB/s: median [p10, p90]   n")
    for (policy, size, plane), values in sorted(by_key.items()):
        print(f"{policy:10s} {size >> 20:8d} MiB  {plane:4s}  {spread(values)}  {len(values):5d}")
    print("\ncall  policy     agreed up / out MB/s   by rank (up; out)")
    for seq, policy, e in agreements:
        agreed = e["agreed_Bps"]
        ranks = "; ".join(" ".join(f"{v / 1e6:.0f}" for v in e["by_rank_Bps"][p]) for p in ("up", "out"))
        print(f"{seq:5d} {str(policy):10s} {agreed['up'] / 1e6:7.1f} / {agreed['out'] / 1e6:6.1f}       {ranks}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
