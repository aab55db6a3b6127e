"""Telemetry: per-operation records, counters, and exports for the people who
run the network.

- ``MPCCS_TRACE=/tmp/t.jsonl`` writes one JSON line per operation to
  ``/tmp/t.jsonl.rank<k>`` (or replaces ``{rank}`` in the path): the op's
  stats with every stage's decision record (estimates used, predicted times,
  split, why a plane was dropped or capped), when each plane's chunks arrived
  (``arrivals``) and wall-clock start times.
- ``Counters`` (``comm.metrics()``) count bytes per plane, operations,
  fallbacks, caps applied, plane failures and errors;
  ``prometheus_text`` renders them in Prometheus' text format.
- ``chrome_trace`` turns trace lines into Chrome-trace/Perfetto events: one
  process per rank, one track per plane, one slice per stage.
Recording costs one dict per operation (always on, in every benchmark number);
tracing adds one json.dumps and a buffered write: 25% of an 8-byte all_reduce,
within noise from 1 MiB (docs/benchmarks.md, bench/telemetry_cost.py).
"""
from __future__ import annotations

import functools
import json
import time
from collections import Counter
from typing import Iterable, Optional

# perf_counter() -> wall clock, fixed once per process so stage times line up
_WALL_OFFSET = time.time() - time.perf_counter()


def wall(perf_t: float) -> float:
    return perf_t + _WALL_OFFSET


@functools.lru_cache(maxsize=256)
def _labelled(metric: str, label: str, value: str) -> str:
    """A counter key with one label; cached (every operation counts under a few keys)."""
    return f'{metric}{{{label}="{value}"}}'


# The keys every operation counts under, looked up without a call (count_light
# runs once per operation: the 8-byte all_reduce is the latency figure).
_OPERATIONS_KEYS = {op: _labelled("operations_total", "op", op) for op in (
    "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_allv", "broadcast", "reduce", "barrier",
    "send", "recv")}
_BYTES_KEYS = {plane: _labelled("bytes_total", "plane", plane) for plane in ("up", "out")}


class Counters:
    def __init__(self):
        self.values: Counter = Counter()

    def observe(self, stats: dict) -> None:
        v = self.values
        self.count_light(stats.get("op", "?"), stats.get("bytes_per_plane", {}))
        if "error" in stats:
            v["errors_total"] += 1
        for stage in stats.get("stages", []):
            split = stage.get("split") or {}
            if split.get("fallback"):
                v["fallbacks_total"] += 1
            if split.get("capped"):
                v["caps_applied_total"] += 1
        for event in stats.get("events", []):
            if event.get("kind") == "plane_failure":
                v[f"plane_failures_total{{plane=\"{event.get('plane')}\"}}"] += 1
            elif event.get("kind") == "retry":
                v["retries_total"] += 1
            elif event.get("kind") == "plane_rejoined":
                v[f"plane_rejoins_total{{plane=\"{event.get('plane')}\"}}"] += 1

    def count_light(self, op: str, bytes_per_plane: dict) -> None:
        """The operation and byte counts: all of observe() for a successful
        operation without stages or events, whose record need not be built."""
        v = self.values
        v[_OPERATIONS_KEYS.get(op) or _labelled("operations_total", "op", op)] += 1
        for plane, nbytes in bytes_per_plane.items():
            v[_BYTES_KEYS.get(plane) or _labelled("bytes_total", "plane", plane)] += nbytes

    def as_dict(self) -> dict:
        return dict(self.values)


def prometheus_text(counters: dict, rank: int) -> str:
    lines = []
    seen = set()
    for key in sorted(counters):
        name, _, labels = key.partition("{")
        metric = f"mpccs_{name}"
        if metric not in seen:
            seen.add(metric)
            lines.append(f"# TYPE {metric} counter")
        label_text = f'rank="{rank}"' + ("," + labels.rstrip("}") if labels else "")
        lines.append(f"{metric}{{{label_text}}} {counters[key]}")
    return "\n".join(lines) + "\n"


class Telemetry:
    def __init__(self, path: Optional[str], rank: int):
        self.rank = rank
        self.counters = Counters()
        self._file = None
        if path:
            target = path.replace("{rank}", str(rank)) if "{rank}" in path else f"{path}.rank{rank}"
            self._file = open(target, "a", buffering=1 << 16)

    @property
    def tracing(self) -> bool:
        return self._file is not None

    def record(self, stats: dict) -> None:
        self.counters.observe(stats)
        if self._file is None:
            return
        line = {"t": time.time(), "rank": self.rank, **stats}
        self._file.write(json.dumps(line, default=_jsonable) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _jsonable(value):
    if hasattr(value, "__dict__"):
        return {k: v for k, v in vars(value).items() if not k.startswith("_")}
    return str(value)


def read_trace(paths: Iterable[str]) -> list[dict]:
    records = []
    for path in paths:
        with open(path) as fh:
            records.extend(json.loads(line) for line in fh if line.strip())
    return sorted(records, key=lambda r: r.get("t", 0))


def chrome_trace(records: list[dict]) -> dict:
    """Chrome-trace JSON (open in chrome://tracing or ui.perfetto.dev)."""
    events = []
    tids = {"up": 1, "out": 2, "op": 0}
    for rank in sorted({r.get("rank", 0) for r in records}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for name, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
    for r in records:
        rank = r.get("rank", 0)
        start = r.get("t_start_wall", r.get("t", 0) - r.get("duration_s", 0))
        events.append({"ph": "X", "name": f"{r.get('op')} #{r.get('seq')}", "pid": rank, "tid": 0,
                       "ts": start * 1e6, "dur": r.get("duration_s", 0) * 1e6,
                       "args": {"algorithm": r.get("algorithm"), "policy": r.get("policy"),
                                "bytes_per_plane": r.get("bytes_per_plane")}})
        for stage in r.get("stages", []):
            for plane, nbytes in (stage.get("bytes_per_plane") or {}).items():
                if not nbytes:
                    continue
                events.append({"ph": "X", "name": stage.get("label") or f"stage {stage.get('stage')}",
                               "pid": rank, "tid": tids.get(plane, 3), "ts": stage.get("t_start_wall", start) * 1e6,
                               "dur": stage.get("duration_s", 0) * 1e6,
                               "args": {"bytes": nbytes, "split": stage.get("split")}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def share_timeline(records: list[dict]) -> list[tuple[float, float, int]]:
    """(time, share of bytes on 'up', bytes) per operation that moved bytes."""
    out = []
    for r in records:
        bpp = r.get("bytes_per_plane") or {}
        total = sum(bpp.values())
        if total:
            out.append((r.get("t", 0), bpp.get("up", 0) / total, total))
    return out
