"""Trace lines, Prometheus counters, Chrome-trace export and mpccs-report."""
import json
import subprocess
import sys

import numpy as np
import pytest

from mpccs.telemetry import chrome_trace, read_trace
from rankpool import RankPool


def some_operations(comm):
    for policy in ("up", 0.5):
        comm.set_path_policy(policy)
        comm.all_reduce(np.ones(1 << 18, np.float32))
    text = comm.prometheus()
    return comm.metrics(), text


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trace")
    pool = RankPool(2, env={"MPCCS_TRACE": str(folder / "t.jsonl")})
    try:
        results = pool.run(some_operations)
    finally:
        pool.close()
    return folder, results


def test_counters_and_prometheus_text(traced):
    _, results = traced
    for metrics, text in results:
        assert metrics['operations_total{op="all_reduce"}'] == 2
        assert metrics['bytes_total{plane="out"}'] > 0 and metrics['bytes_total{plane="up"}'] > 0
        assert "# TYPE mpccs_bytes_total counter" in text
        assert 'mpccs_bytes_total{rank="' in text and 'plane="up"' in text


def test_trace_lines_carry_stage_decisions(traced):
    folder, _ = traced
    files = sorted(str(p) for p in folder.glob("t.jsonl.rank*"))
    assert len(files) == 2
    records = read_trace(files)
    all_reduces = [r for r in records if r["op"] == "all_reduce"]
    assert len(all_reduces) == 4  # 2 ranks x 2 operations (barriers are recorded too)
    half = [r for r in all_reduces if r["policy"] == "0.5"]
    assert all(r["bytes_per_plane"]["up"] > 0 and r["bytes_per_plane"]["out"] > 0 for r in half)
    assert all(s["split"]["policy"] == "0.5" for r in half for s in r["stages"] if s["split"])
    trace = chrome_trace(records)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in slices} >= {0, 1, 2}  # op track plus both plane tracks
    assert all(e["dur"] >= 0 for e in slices)


def test_trace_stages_say_when_each_plane_delivered(traced):
    # The realised side of a split: per plane, when this rank received the peer's
    # chunks in the stage, from its start, and how many bytes (the peer's sends).
    folder, _ = traced
    records = read_trace(sorted(str(p) for p in folder.glob("t.jsonl.rank*")))
    half = {(r["rank"], r["seq"]): r for r in records if r["op"] == "all_reduce" and r["policy"] == "0.5"}
    assert len(half) == 2
    for (rank, seq), record in half.items():
        peer = half[(1 - rank, seq)]
        for stage, sent in zip(record["stages"], peer["stages"]):
            arrivals = stage["arrivals"]
            assert set(arrivals) == {"up", "out"}
            for plane, seen in arrivals.items():
                assert seen["bytes"] == sent["bytes_per_plane"][plane] > 0
                assert 0 <= seen["first_s"] <= seen["last_s"] <= stage["duration_s"] + 1e-6


def test_report_cli(traced, tmp_path):
    folder, _ = traced
    files = sorted(str(p) for p in folder.glob("t.jsonl.rank*"))
    chrome, png = tmp_path / "c.json", tmp_path / "s.png"
    out = subprocess.run([sys.executable, "-m", "mpccs.report", *files, "--chrome", str(chrome), "--plot", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "all_reduce" in out.stdout and "up %" in out.stdout
    assert json.loads(chrome.read_text())["traceEvents"]
    assert png.stat().st_size > 1000
