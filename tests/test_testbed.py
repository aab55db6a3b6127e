"""The emulated two-fabric cluster (mpccs.testbed), checked with plain sockets only.

Root-only cases skip with the reason when not root or when iproute2 is missing.
Rates are kept modest (hundreds of Mbit/s) so the checks hold on a loaded 2-core VM.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from mpccs.testbed import (Cluster, NotRootError, TestbedUnavailable, TimedAction, check_available,
                           sweep)
from mpccs.testbed import calibrate as cal
from mpccs.testbed import cli, netns
from mpccs.testbed.traffic import run_flows

try:
    check_available()
    UNAVAILABLE = None
except TestbedUnavailable as e:
    UNAVAILABLE = str(e)

_skip = pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")


def needs_root(test):
    """Marked `root` (test-quick leaves these out) and skipped with the reason when unavailable."""
    return pytest.mark.root(_skip(test))


pytestmark = pytest.mark.timeout(60)
QUIET = dict(log=lambda m: None)
# payload / wire bytes of one full 9000-byte frame: 9000-20-32 TCP/IP over 9000+14 Ethernet
GOODPUT = (9000 - 52) / 9014


def _run_namespaces(run_id: str) -> list:
    return [ns for ns in netns.netns_list() if ns.startswith(run_id)]


def _cli_run_id(p: subprocess.Popen) -> str:
    """The run id from the CLI's 'mpccs-testbed: run mtXXXXXX: ...' line on stderr."""
    for line in p.stderr:
        if ": run mt" in line:
            return line.split("run ")[1].split(":")[0]
    raise AssertionError("the CLI never announced its run")


def _wait_for(pred, timeout: float = 15.0) -> None:
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _rank_pids(run_id: str, comm: str) -> list:
    """The run's rank processes: those in its namespaces running ``comm``.

    Why not every pid there: while the CLI sets a run up, its own ``ip -n``/``tc -n``
    commands enter the namespaces for a moment, so a bare count can reach the number
    of ranks before any rank has started (CI once saw 2 pids, then none).
    """
    return [pid for ns in _run_namespaces(run_id) for pid in netns.netns_pids(ns)
            if _comm(pid) == comm]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def clean_host():
    """Snapshot of the root namespace: whatever a test builds must be gone afterwards."""
    links = netns.root_links()
    yield
    assert netns.root_links() == links, "interfaces leaked into the root namespace"


def _send(c, src, dst, plane, port, nbytes=None, seconds=None, warmup=0.0):
    """One plain TCP flow from rank src to rank dst over a plane; returns (sink, sender) results.
    With seconds, the sink's window_bytes count what arrived from warmup to the end."""
    s, d = c.ranks[src], c.ranks[dst]
    addr, src_addr = (d.up_addr, s.up_addr) if plane == "up" else (d.out_addr, s.out_addr)
    specs = {dst: {"sinks": [{"addr": addr, "port": port}]},
             src: {"sends": [{"addr": addr, "port": port, "src": src_addr, "bytes": nbytes}]}}
    res, _ = run_flows(c, specs, duration=seconds, warmup=warmup)
    return res[dst]["sinks"][0], res[src]["sends"][0]


# -- no root needed ------------------------------------------------------------------------------

def test_not_root_raises_specific_error(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns.shutil, "which", lambda t: "/usr/sbin/" + t)
    with pytest.raises(NotRootError, match="needs root"):
        check_available()
    with pytest.raises(NotRootError):
        Cluster(n=2, **QUIET).start()
    assert cli.main(["-n", "2", "--", "true"]) == cli.EXIT_UNAVAILABLE
    assert "needs root" in capsys.readouterr().err


def test_parsers():
    assert netns.parse_rate("2.4gbit") == 2.4e9
    assert netns.parse_rate("100mbps") == 800e6
    assert netns.fmt_rate(1.2e9) == "1.2gbit"
    with pytest.raises(ValueError):
        netns.parse_rate("fast")
    assert cli.parse_background("300mbit@1-2.5:1") == {"rate": "300mbit", "start": 1.0, "stop": 2.5, "rank": 1}
    assert cli.parse_fail("2@3-4") == {"rank": 2, "start": 3.0, "stop": 4.0, "plane": "out"}
    assert cli.parse_fail("0@1-2:up")["plane"] == "up"
    for bad in ("3@4-1", "x@1-2", "1@2"):
        with pytest.raises(Exception):
            cli.parse_fail(bad)
    # the bucket holds at least one 64 KiB GSO packet, and 4 ms of line rate when that is more
    assert netns.tbf_burst_bytes(100e6) == 64 * 1024
    assert netns.tbf_burst_bytes(2.4e9) == 1_200_000


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="needs --up tcp"):
        Cluster(n=2, up="shm", shared_bottleneck=True, **QUIET)
    with pytest.raises(ValueError, match="names 3 ranks"):
        Cluster(n=2, domains="0,0,1", **QUIET)


# -- topology, environment, teardown --------------------------------------------------------------

@needs_root
def test_topology_env_and_clean_teardown(clean_host):
    prog = [sys.executable, "-c", "import os, json; print(json.dumps({k: v for k, v in "
            "os.environ.items() if k.startswith(('MPCCS_', 'RANK', 'WORLD', 'LOCAL', 'MASTER'))}))"]
    with Cluster(n=4, domains="a,a,b,b", up="tcp", up_rate="800mbit", out_rate="400mbit", **QUIET) as c:
        run_id = c.run_id
        # every link is RUNNING when start() returns: UCX refuses devices that are not
        for r in c.ranks:
            for dev in r.devices().values():
                assert c.exec(r.rank, ["cat", f"/sys/class/net/{dev}/operstate"]).stdout.strip() == "up"
        assert sorted(_run_namespaces(run_id)) == sorted([c.switch_ns] + [r.ns for r in c.ranks])
        res = c.run(prog, timeout=30, stream=open(os.devnull, "w"))
        assert res.exit_code == 0 and res.returncodes == [0, 0, 0, 0]
        envs = [json.loads(res.output[k][-1]) for k in range(4)]
        for k, e in enumerate(envs):
            assert (e["RANK"], e["WORLD_SIZE"]) == (str(k), "4")
            assert (e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == (str(k % 2), "2")
            assert e["MPCCS_DOMAIN"] == "ab"[k // 2]
            assert (e["MPCCS_UP_TLS"], e["MPCCS_UP_DEVICES"]) == ("tcp", f"up{k}")
            assert (e["MPCCS_OUT_TLS"], e["MPCCS_OUT_DEVICES"]) == ("tcp", f"out{k}")
            assert e["MASTER_ADDR"] == c.ranks[0].mgmt_addr and e["MPCCS_TESTBED"] == "1"
            assert e["MPCCS_TESTBED_OUT_ADDR"] == c.ranks[k].out_addr
            assert e["MPCCS_TESTBED_UP_ADDR"] == c.ranks[k].up_addr
        assert len({e["MPCCS_JOB_TOKEN"] for e in envs}) == 1 and len({e["MASTER_PORT"] for e in envs}) == 1
        # the up plane reaches its own domain only; out reaches everybody
        probe = ("import socket,sys; s=socket.socket(); s.settimeout(2)\n"
                 "try: s.connect((sys.argv[1], 9)); print('open')\n"
                 "except ConnectionRefusedError: print('reached')\n"
                 "except OSError as e: print('unreachable', e.errno)")
        reach = lambda dst: c.exec(0, [sys.executable, "-c", probe, dst], timeout=20).stdout.split()[0]
        assert reach(c.ranks[1].up_addr) == "reached"
        assert reach(c.ranks[2].up_addr) == "unreachable"
        assert reach(c.ranks[3].out_addr) == "reached"
        helper = c.popen(1, ["sleep", "30"])  # a straggler close() must kill
    assert _run_namespaces(run_id) == []
    assert helper.poll() is not None
    assert not os.path.exists(os.path.join("/run/mpccs-testbed", run_id + ".json"))


@needs_root
def test_rank_crash_exit_code_grace_and_teardown(clean_host):
    prog = ["sh", "-c", 'if [ "$RANK" = 1 ]; then echo boom; exit 7; fi; exec sleep 30']
    with Cluster(n=3, **QUIET) as c:
        t0 = time.monotonic()
        res = c.run(prog, grace=1.0, timeout=30, stream=open(os.devnull, "w"))
        run_id = c.run_id
    assert res.exit_code == 7 and res.first_failed_rank == 1
    assert res.output[1] == ["boom"]
    assert res.returncodes[0] == -signal.SIGTERM and res.returncodes[2] == -signal.SIGTERM
    assert time.monotonic() - t0 < 10
    assert not any(_alive(p) for p in res.pids)
    assert _run_namespaces(run_id) == []


@needs_root
def test_timeout_stops_ranks(clean_host):
    with Cluster(n=2, **QUIET) as c:
        res = c.run(["sleep", "30"], timeout=0.5, stream=open(os.devnull, "w"))
    assert res.timed_out and res.exit_code == 124 and res.duration_s < 6


@needs_root
def test_cli_sigint_tears_everything_down(clean_host):
    p = subprocess.Popen([sys.executable, "-m", "mpccs.testbed", "-n", "2", "--up", "tcp",
                          "--no-calibrate", "--", "sleep", "60"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        run_id = _cli_run_id(p)
        _wait_for(lambda: len(_rank_pids(run_id, "sleep")) == 2)
        pids = _rank_pids(run_id, "sleep")
        assert len(pids) == 2
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 130
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "SIGINT" in p.stderr.read()
    assert _run_namespaces(run_id) == []
    assert not any(_alive(pid) for pid in pids)


@needs_root
def test_sweeper_removes_orphans_only(clean_host):
    p = subprocess.Popen([sys.executable, "-m", "mpccs.testbed", "-n", "2", "--no-calibrate",
                          "--", "sleep", "60"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        run_id = _cli_run_id(p)
        _wait_for(lambda: len(_rank_pids(run_id, "sleep")) == 2)
        sweep()  # the owner is alive: nothing of that run may go
        assert len(_run_namespaces(run_id)) == 3
        p.kill()  # SIGKILL: no teardown runs, the namespaces are orphaned
        p.wait(timeout=10)
        assert len(_run_namespaces(run_id)) == 3
        assert cli.main(["--sweep"]) == 0
        assert _run_namespaces(run_id) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# -- shaping, counters, calibration ------------------------------------------------------------

@needs_root
def test_shaped_rates_capped_within_5_percent():
    with Cluster(n=2, up="tcp", up_rate="600mbit", out_rate="300mbit", **QUIET) as c:
        for i, (plane, bps) in enumerate((("up", 600e6), ("out", 300e6))):
            before = c.counters()
            got, _ = _send(c, 0, 1, plane, 7000 + i, seconds=1.5, warmup=0.3)
            after = c.counters()
            goodput = got["window_bytes"] / 1.2
            # The shaper's cap holds within 5%; the floor reads the host's CPU as much as
            # the shaper (4 flows at 1.2 Gbit/s in all read 92.3% in one CI run), so 10%.
            assert bps / 8 * GOODPUT * 0.90 <= goodput <= bps / 8 * GOODPUT * 1.05, (plane, goodput)
            wire = after[1][plane]["rx_bytes"] - before[1][plane]["rx_bytes"]
            assert wire / (got["last"] - got["first"]) == pytest.approx(bps / 8, rel=0.05), plane


@needs_root
def test_shared_bottleneck_planes_do_not_add_up():
    with Cluster(n=2, up="tcp", up_rate="600mbit", out_rate="300mbit", shared_bottleneck=True,
                 **QUIET) as c:
        assert c.shared_bps == 600e6
        # each plane alone looks like its own link ...
        alone, _ = _send(c, 0, 1, "out", 7100, seconds=1.3, warmup=0.3)
        assert alone["window_bytes"] / 1.0 == pytest.approx(300e6 / 8 * GOODPUT, rel=0.05)
        # ... but together both planes share the one trunk
        res = cal.calibrate(c, duration=1.5)
        assert res["expected_Bps"] == pytest.approx(2 * 600e6 / 8)
        trunk, unshared = 2 * 600e6 / 8 * GOODPUT, 2 * (600e6 + 300e6) / 8 * GOODPUT
        # At most the trunk's rate (the shaper's cap), far below the planes' sum; the floor
        # tells a working trunk from a broken one without reading the host's CPU as the link.
        assert 0.85 * trunk <= res["delivered_Bps"] <= 1.05 * trunk < 0.75 * unshared, res["delivered_Bps"]
        assert res["planes"]["up"]["delivered_Bps"] > 1.5 * res["planes"]["out"]["delivered_Bps"]


@needs_root
def test_counters_match_bytes_sent_on_one_plane():
    n = 20_000_000
    with Cluster(n=2, up="tcp", up_rate="800mbit", out_rate="800mbit", **QUIET) as c:
        for i, (plane, other) in enumerate((("out", "up"), ("up", "out"))):
            before = c.counters()
            got, sent = _send(c, 0, 1, plane, 7200 + i, nbytes=n)
            after = c.counters()
            assert sent["bytes"] == got["bytes"] == n
            d = lambda r, pl, k: after[r][pl][k] - before[r][pl][k]
            # payload plus per-frame headers (< 1% at 9000 MTU) plus handshake/ACKs
            for count in (d(0, plane, "tx_bytes"), d(1, plane, "rx_bytes")):
                assert n <= count <= n * 1.01 + 20_000, (plane, count)
            assert d(0, other, "tx_bytes") < 2_000 and d(1, other, "rx_bytes") < 2_000


@needs_root
def test_calibration_gate_passes_sane_rates_and_refuses_absurd_ones():
    # Sane: rates the 2-core VM carries even in a slow spell (at 400 / 200 Mbit/s one
    # fresh-clone CI run read 92.3% against the default 95% and failed), judged
    # against a threshold that still tells a working link from a broken one.
    with Cluster(n=2, up="tcp", up_rate="200mbit", out_rate="100mbit", **QUIET) as c:
        res = cal.gate(c, duration=1.2, threshold=0.85)
        assert res["passed"] and res["ratio"] > 0.85
        assert set(res["planes"]) == {"up", "out"} and len(res["flows"]) == 4
    with Cluster(n=2, up="tcp", up_rate="200gbit", out_rate="100gbit", **QUIET) as c:
        with pytest.raises(cal.CalibrationError, match="same ratio") as e:
            cal.gate(c, duration=1.0)
        assert not e.value.result["passed"]


# -- timed events ------------------------------------------------------------------------------

@needs_root
def test_background_and_link_failure_happen_on_time():
    """Background into rank 1 from 0.2 s; rank 1's out link down from 1.0 to 1.8 s."""
    with Cluster(n=2, up="tcp", up_rate="400mbit", out_rate="400mbit", **QUIET) as c:
        handle = {}
        actions = [
            TimedAction(0.2, "bg", lambda: handle.setdefault("bg", c.start_background(
                "200mbit", dst_rank=1, stop_after=3.3))),
            TimedAction(3.5, "bg stop", lambda: c.stop_background(handle["bg"]), at_end=True),
            TimedAction(1.0, "down", lambda: c.fail_link(1, "out")),
            TimedAction(1.8, "up", lambda: c.restore_link(1, "out"), at_end=True),
        ]
        samples = []
        sampler = threading.Thread(target=_sample, args=(c, samples, 4.0), daemon=True)
        sampler.start()
        res = c.run(["sleep", "4"], actions=actions, timeout=20, stream=open(os.devnull, "w"))
        sampler.join(timeout=10)
        assert res.exit_code == 0
    t0 = res.started
    ev = {e["event"]: e["wall"] - t0 for e in c.events if e["event"] in ("link_down", "link_up")}
    assert ev["link_down"] == pytest.approx(1.0, abs=0.2)
    assert ev["link_up"] == pytest.approx(1.8, abs=0.2)
    rec = c.background_records[0]
    assert rec["first_byte"] - t0 == pytest.approx(0.2, abs=0.4)
    assert rec["last_byte"] - t0 == pytest.approx(3.5, abs=0.4)
    # delivered: the asked rate, less the 0.8 s outage and TCP's retransmission back-off
    assert 0.4 * 25e6 < rec["delivered_Bps"] <= 25e6 * 1.05
    rx = lambda lo, hi: _bytes_between(samples, t0, lo, hi)
    # Windows from when the link went down and came up (each event is written once its
    # command returned, up to 0.2 s late), at least 30% of the asked rate where it flows.
    down, up = ev["link_down"], ev["link_up"]
    assert rx(0.5, down - 0.1) > 0.3 * 25e6 * (down - 0.6)  # flowing before the failure
    assert rx(down + 0.15, up - 0.05) < 20_000              # nothing reaches rank 1 while down
    assert rx(up + 0.2, 3.4) > 0.3 * 25e6 * (3.2 - up)      # flowing again after restore


def _sample(c, samples, seconds):
    """Rank 1's out rx byte counter, read from the kernel every 50 ms."""
    end = time.time() + seconds
    while time.time() < end:
        t = time.time()
        samples.append((t, netns.link_counters(c.ranks[1].ns)[c.ranks[1].out_dev]["rx_bytes"]))
        time.sleep(0.05)


def _bytes_between(samples, t0, lo, hi):
    inside = [(t - t0, b) for t, b in samples if lo <= t - t0 <= hi]
    return inside[-1][1] - inside[0][1]


@needs_root
def test_cli_results_json(tmp_path):
    # rank 1 fails at 1.5 s with 5, rank 2 would sleep on: --grace 1 stops it
    prog = ["sh", "-c", 'sleep 1.5; [ "$RANK" = 1 ] && exit 5; [ "$RANK" = 2 ] && exec sleep 30; exit 0']
    p = subprocess.run([sys.executable, "-m", "mpccs.testbed", "-n", "3", "--up", "tcp",
                        "--up-rate", "400mbit", "--out-rate", "200mbit", "--no-calibrate",
                        "--fail", "2@0.3-0.6", "--background", "100mbit@0.2-1.0:0",
                        "--grace", "1", "--results", str(tmp_path), "--", *prog],
                       capture_output=True, text=True, timeout=45)
    assert p.returncode == 5, p.stderr
    (path,) = tmp_path.glob("testbed-mt*.json")
    d = json.loads(path.read_text())
    assert d["exit_code"] == 5  # (the calibration gate has its own tests; a busy machine may refuse)
    assert [r["returncode"] for r in d["ranks"]] == [0, 5, -signal.SIGTERM]
    assert d["first_failed_rank"] == 1
    names = [e["event"] for e in d["events"]]
    for name in ("ranks_start", "background_start", "link_down", "link_up",
                 "background_stop", "rank_failed", "ranks_end"):
        assert name in names
    down = next(e for e in d["events"] if e["event"] == "link_down")
    assert down["t"] == pytest.approx(0.3, abs=0.2) and down["rank"] == 2
    assert d["background"][0]["delivered_Bps"] == pytest.approx(12.5e6, rel=0.1)
    # the outside view: rank 0 received the background bytes on its out link
    assert d["counters_delta"]["0"]["out"]["rx_bytes"] >= d["background"][0]["delivered_bytes"]
    assert set(d["counters_before"]["1"]) == {"up", "out", "mgmt"}
