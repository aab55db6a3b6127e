"""Render a schedule for people: a text plan and a Graphviz dot graph.

Text format, one line per stage::

    stage 3 ch0 deps=[2] "rs 1": 0->1 out[4:+2] reduce, 1->2 out[0:+2] reduce

A flow is ``src->dst buf[off:+n]`` when it lands at the same buffer and
offset it was read from, ``src->dst in[off:+n]=>out[off2]`` otherwise, then
``copy`` or ``reduce``. Offsets and counts are elements; ``?`` marks the far
side's offset in a rank-local (all_to_allv) schedule.
"""
from __future__ import annotations

from .schedule import Flow, LocalCopy, Schedule


def _offset(off: int) -> str:
    return "?" if off < 0 else str(off)


def format_flow(flow: Flow) -> str:
    text = f"{flow.src}->{flow.dst} {flow.src_buf}[{_offset(flow.src_off)}:+{flow.count}]"
    if (flow.dst_buf, flow.dst_off) != (flow.src_buf, flow.src_off):
        text += f"=>{flow.dst_buf}[{_offset(flow.dst_off)}]"
    return text + (" reduce" if flow.reduce else " copy")


def format_copy(copy: LocalCopy) -> str:
    return f"r{copy.rank} {copy.src_buf}[{copy.src_off}:+{copy.count}]=>{copy.dst_buf}[{copy.dst_off}]"


def describe(schedule: Schedule) -> str:
    """A text plan: header, prologue, one line per stage, epilogue."""
    s = schedule
    header = (
        f"{s.collective} {s.algorithm} world={s.world} count={s.count} channels={s.channels} "
        f"stages={len(s.stages)} flows={sum(len(st.flows) for st in s.stages)} work={s.work_count}"
    )
    if s.root is not None:
        header += f" root={s.root}"
    if s.local_rank is not None:
        header += f" local_rank={s.local_rank}"
    lines = [header]
    if s.meta:
        lines.append("meta: " + ", ".join(f"{k}={v}" for k, v in sorted(s.meta.items())))
    if s.prologue:
        lines.append("prologue: " + ", ".join(format_copy(c) for c in s.prologue))
    for st in s.stages:
        flows = ", ".join(format_flow(f) for f in st.flows) or "(no flows)"
        lines.append(f"stage {st.id} ch{st.channel} deps={list(st.deps)} \"{st.label}\": {flows}")
    if s.epilogue:
        lines.append("epilogue: " + ", ".join(format_copy(c) for c in s.epilogue))
    return "\n".join(lines)


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def to_dot(schedule: Schedule, max_flows_listed: int = 6) -> str:
    """Graphviz dot: one node per stage (clustered by channel), edges = deps."""
    s = schedule
    title = f"{s.collective} {s.algorithm} world={s.world} count={s.count}"
    lines = ["digraph schedule {", f'  label="{_dot_escape(title)}";', "  node [shape=box, fontsize=10];"]
    for channel in sorted({st.channel for st in s.stages}):
        lines.append(f"  subgraph cluster_ch{channel} {{")
        lines.append(f'    label="channel {channel}";')
        for st in s.stages:
            if st.channel != channel:
                continue
            listed = [format_flow(f) for f in st.flows[:max_flows_listed]]
            if len(st.flows) > max_flows_listed:
                listed.append(f"... {len(st.flows) - max_flows_listed} more")
            text = "\\n".join([_dot_escape(f"{st.id}: {st.label}")] + [_dot_escape(x) for x in listed])
            lines.append(f'    s{st.id} [label="{text}"];')
        lines.append("  }")
    for st in s.stages:
        for d in st.deps:
            lines.append(f"  s{d} -> s{st.id};")
    lines.append("}")
    return "\n".join(lines)
