"""Socket traffic for the testbed: probes, background load, exact byte counts.

This file is also a standalone script (stdlib only, no package imports): the
testbed runs it by path inside namespaces with ``ip netns exec NS python traffic.py
SPEC``, so it starts fast even when importing ``mpccs`` would pull in UCX.

SPEC is a JSON object:
  {"start": wall_s | null, "stop": wall_s | null, "window": [w0, w1] | null,
   "barrier": false,
   "sinks": [{"addr": ip, "port": p}],
   "sends": [{"addr": ip, "port": p, "src": ip | null, "rate_bps": bits/s | 0,
              "bytes": n | null}]}
Senders connect first (retrying until the sink listens), begin at ``start`` (now
when null) and stop at ``stop``, after ``bytes`` bytes, or on SIGTERM. ``rate_bps``
paces a sender (0 = as fast as the link allows). Sinks count everything and,
separately, only what arrives inside ``window`` (wall-clock, the same clock in every
namespace). With ``barrier`` the process prints ``{"ready": true}`` once all its
senders are connected and then reads start/stop/window as one JSON line on stdin:
run_flows() uses that so that flows in several namespaces start together however
slowly the processes came up. The result is one JSON line on stdout.
"""
from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time

CHUNK = 1 << 20           # unpaced senders/receivers move 1 MiB per syscall
PACED_CHUNK = 64 << 10    # paced senders move small chunks so the pace is smooth
SO_MAX_PACING_RATE = 47   # linux/asm-generic/socket.h; lets the kernel pace too

_stop = threading.Event()   # SIGTERM/SIGINT
_go = threading.Event()     # start/stop/window are known


def _now() -> float:
    return time.time()


def _sink(spec: dict, plan: dict, result: dict) -> None:
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((spec["addr"], spec["port"]))
    ls.listen(4)
    ls.settimeout(0.1)
    result.update(bytes=0, window_bytes=0, first=None, last=None)
    conn = None
    try:
        while conn is None and not _stop.is_set():
            if _go.is_set() and plan["stop"] is not None and _now() > plan["stop"] + 1:
                return  # nobody came
            try:
                conn, _ = ls.accept()
            except socket.timeout:
                continue
        if conn is None:
            return
        conn.settimeout(0.1)
        buf = memoryview(bytearray(CHUNK))
        while not _stop.is_set():
            try:
                n = conn.recv_into(buf)
            except socket.timeout:
                if plan["stop"] is not None and _now() > plan["stop"] + 2:
                    break
                continue
            if n == 0:
                break
            t = _now()
            result["bytes"] += n
            if result["first"] is None:
                result["first"] = t
            result["last"] = t
            w = plan["window"]
            if w and w[0] <= t < w[1]:
                result["window_bytes"] += n
    except OSError as e:
        result["error"] = str(e)
    finally:
        if conn is not None:
            conn.close()
        ls.close()


def _connect(spec: dict) -> socket.socket:
    deadline = _now() + 15
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if spec.get("src"):
            s.bind((spec["src"], 0))
        s.settimeout(1.0)
        try:
            s.connect((spec["addr"], spec["port"]))
            return s
        except OSError:
            s.close()
            if _now() > deadline or _stop.is_set():
                raise
            time.sleep(0.02)  # the sink's process may still be starting


def _send(spec: dict, plan: dict, result: dict, connected: threading.Event) -> None:
    result.update(bytes=0, first=None, last=None)
    try:
        s = _connect(spec)
    except OSError as e:
        result["error"] = f"connect: {e}"
        return
    finally:
        connected.set()
    try:
        while not (_go.wait(0.1) or _stop.is_set()):
            pass
        while _now() < plan["start"] and not _stop.is_set():
            time.sleep(min(0.005, plan["start"] - _now()))
        _pump(s, spec, plan["stop"], result)
        s.shutdown(socket.SHUT_WR)
    except OSError as e:
        result["error"] = str(e)
    finally:
        s.close()


def _pump(s: socket.socket, spec: dict, stop_at, result: dict) -> None:
    rate = float(spec.get("rate_bps") or 0) / 8  # bytes/s
    limit = spec.get("bytes")
    if rate:
        s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, min(int(rate), 2**32 - 1))
    s.settimeout(0.2)
    buf = memoryview(bytearray(PACED_CHUNK if rate else CHUNK))
    # 50 ms of credit rides out scheduling delays on a busy 2-core machine without the
    # pace falling short, yet is nothing against an outage of a second.
    burst = max(2 * PACED_CHUNK, rate * 0.05)
    result["first"] = tokens_at = _now()
    tokens = burst
    while not _stop.is_set():
        now = _now()
        if stop_at is not None and now >= stop_at:
            break
        if limit is not None and result["bytes"] >= limit:
            break
        if rate:
            # Token bucket capped at `burst`: time the link was down is not made up
            # later, as a real paced source (video, storage replication) would not.
            tokens, tokens_at = min(burst, tokens + rate * (now - tokens_at)), now
            if tokens < PACED_CHUNK:
                time.sleep((PACED_CHUNK - tokens) / rate)
                continue
        view = buf if limit is None else buf[:min(len(buf), limit - result["bytes"])]
        try:
            n = s.send(view)
        except socket.timeout:
            continue  # link down or queue full; keep trying until stop
        result["bytes"] += n
        tokens -= n
    result["last"] = _now()


def run(spec: dict) -> dict:
    plan = {"start": spec.get("start"), "stop": spec.get("stop"), "window": spec.get("window")}
    out = {"sinks": [dict(s) for s in spec.get("sinks", [])],
           "sends": [dict(s) for s in spec.get("sends", [])]}
    threads = [threading.Thread(target=_sink, args=(s, plan, r), daemon=True)
               for s, r in zip(spec.get("sinks", []), out["sinks"])]
    connected = [threading.Event() for _ in out["sends"]]
    threads += [threading.Thread(target=_send, args=(s, plan, r, ev), daemon=True)
                for s, r, ev in zip(spec.get("sends", []), out["sends"], connected)]
    for t in threads:
        t.start()
    if spec.get("barrier"):
        for ev in connected:
            while not (ev.wait(0.1) or _stop.is_set()):
                pass
        print(json.dumps({"ready": True}), flush=True)
        plan.update(json.loads(sys.stdin.readline() or "{}"))
    plan["start"] = plan["start"] or _now()
    _go.set()
    for t in threads:
        while t.is_alive():
            t.join(0.1)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, lambda *_: _stop.set())
    signal.signal(signal.SIGINT, lambda *_: _stop.set())
    print(json.dumps(run(json.loads(argv[0]))), flush=True)
    return 0


# -- parent side: used by the testbed, never inside the namespaces ---------------------------

def collect(proc, timeout: float = 10.0) -> dict:
    """Wait for a traffic.py process and parse its last JSON line (SIGTERM it if it lingers)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # its SIGTERM handler still prints what it measured
        out, err = proc.communicate(timeout=5)
    lines = [line for line in (out or "").splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"traffic probe printed no result (rc={proc.returncode}): {err.strip()}")
    return json.loads(lines[-1])


def _await_ready(procs: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for where, p in procs.items():
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or p.poll() is not None:
                raise RuntimeError(f"traffic probe in {where} never got ready "
                                   f"(rc={p.poll()}): {p.stderr.read() if p.poll() is not None else ''}")
            if select.select([p.stdout], [], [], left)[0]:
                if json.loads(p.stdout.readline() or "{}").get("ready"):
                    break


def run_flows(cluster, specs: dict, duration=None, warmup: float = 0.0,
              timeout: float = 30.0) -> tuple:
    """Start traffic.py in several namespaces, connect everything, then start all flows at
    one instant; returns ({where: result}, {"start", "stop", "window"}).

    ``duration`` None: senders stop after their ``bytes``. The window is
    [start + warmup, start + duration]: it leaves out TCP's first round trips.
    """
    procs = {w: cluster.traffic(w, dict(spec, barrier=True), stdin=subprocess.PIPE)
             for w, spec in specs.items()}
    try:
        _await_ready(procs, timeout=15)
    except BaseException:
        for p in procs.values():
            p.kill()
        raise
    start = time.time() + 0.05
    plan = {"start": start, "stop": start + duration if duration else None,
            "window": [start + warmup, start + duration] if duration else None}
    for p in procs.values():
        p.stdin.write(json.dumps(plan) + "\n")
        p.stdin.flush()
    return {w: collect(p, timeout) for w, p in procs.items()}, plan


def rate_of(rec: dict) -> float:
    """Bytes/s a sink saw from its first to its last byte."""
    span = (rec.get("last") or 0) - (rec.get("first") or 0)
    return rec.get("bytes", 0) / span if span > 0 else 0.0


class Background:
    """One paced background flow: sender in the testbed's extra host, sink in a rank."""

    def __init__(self, cluster, rate_bps: float, dst_rank: int, port: int, stop_after=None):
        self.rate_bps, self.dst_rank, self.port = rate_bps, dst_rank, port
        self.started = _now()
        stop = self.started + stop_after if stop_after else None
        dst = cluster.ranks[dst_rank].out_addr
        self._sink = cluster.traffic(dst_rank, {"stop": stop, "sinks": [
            {"addr": dst, "port": port}]})
        self._send = cluster.traffic(cluster.bg_ns, {"stop": stop, "sends": [
            {"addr": dst, "port": port, "src": cluster.bg_addr, "rate_bps": rate_bps}]})

    def stop(self) -> dict:
        """Stop the sender, let the sink drain, and return what was delivered."""
        self._send.send_signal(signal.SIGTERM)
        sent = collect(self._send)["sends"][0]
        sink = collect(self._sink)["sinks"][0]
        return {"rate_bps": self.rate_bps, "dst_rank": self.dst_rank, "requested_start": self.started,
                "first_byte": sink.get("first"), "last_byte": sink.get("last"),
                "sent_bytes": sent.get("bytes", 0), "delivered_bytes": sink.get("bytes", 0),
                "delivered_Bps": rate_of(sink), "error": sent.get("error") or sink.get("error")}

    def terminate(self) -> None:
        for p in (self._send, self._sink):
            if p.poll() is None:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
