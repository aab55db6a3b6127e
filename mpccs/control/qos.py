"""QoS: how much borrowed scale-out capacity a stage may use.

Only bytes that *could* have gone over 'up' are borrowed: a flow between
domains has no other plane, so it is never capped (capping it would only
fail the collective). Two caps, both optional, the smaller one wins:

* ``out_cap_share`` s in [0, 1]: each in-domain flow of ``n`` bytes may put at
  most ``floor(s * n)`` bytes (aligned down) on 'out', so the stage as a
  whole never puts more than a share ``s`` of its in-domain bytes there.
* ``out_cap_rate_Bps`` r: a sending rank may push at most ``r * T`` borrowed
  bytes in a stage predicted to last ``T`` seconds, split over its in-domain
  flows in proportion to their size (aligned down). ``T`` is the prediction
  before this cap applies, which is the shortest, so the realised borrowed
  rate stays at or below ``r``.

The result is a hard per-flow byte cap that the split respects and that the
engine applies to stealing as well.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .split import FlowDemand


def is_borrowable(flow: FlowDemand) -> bool:
    """In-domain flow: 'up' could carry it, so bytes on 'out' are borrowed."""
    return "up" in flow.planes and "out" in flow.planes


def align_down(nbytes: float, align: int) -> int:
    return int(nbytes // align) * align if align > 1 else int(nbytes)


def share_caps(flows: Sequence[FlowDemand], share: float, align: int) -> dict[int, int]:
    """Per-flow 'out' cap from the share cap; uncapped flows get their full size."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"out_cap_share must lie in [0, 1], got {share}")
    caps = {}
    for f in flows:
        if "out" not in f.planes:
            caps[f.flow_id] = 0
        elif not is_borrowable(f) or share >= 1.0:
            caps[f.flow_id] = f.nbytes
        else:
            caps[f.flow_id] = min(f.nbytes, align_down(share * f.nbytes, align))
    return caps


def rate_caps(flows: Sequence[FlowDemand], rate_Bps: Optional[float], stage_time_s: float,
              align: int) -> dict[int, int]:
    """Per-flow 'out' cap from a borrowed-rate cap and the predicted stage time."""
    caps = {f.flow_id: f.nbytes for f in flows}
    if rate_Bps is None:
        return caps
    if rate_Bps < 0:
        raise ValueError(f"out_cap_rate_Bps must be >= 0, got {rate_Bps}")
    by_src: dict[int, list[FlowDemand]] = {}
    for f in flows:
        if is_borrowable(f):
            by_src.setdefault(f.src, []).append(f)
    for fl in by_src.values():
        budget = rate_Bps * max(0.0, stage_time_s)
        total = sum(f.nbytes for f in fl)
        for f in fl:
            share_of_budget = budget * f.nbytes / total if total > 0 else 0.0
            caps[f.flow_id] = min(f.nbytes, align_down(share_of_budget, align))
    return caps


def combine(*caps: dict[int, int]) -> dict[int, int]:
    keys = set().union(*caps)
    return {k: min(c[k] for c in caps if k in c) for k in keys}
