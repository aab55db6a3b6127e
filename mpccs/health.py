"""Plane health: heartbeats that find a silent plane, and rejoining a plane that came back.

A link that goes down gives no UCX error at first (tcp just retransmits and
an eager send completes once the socket took the bytes), and shared memory
has no peer-failure handler at all. So when an operation stalls, the engine
asks directly: a PING on every live plane to each peer it waits for, which
the peer answers with a PONG on the plane the ping came on. A plane that stays
silent for the plane timeout while another plane answered the same peer is
down; if no plane answers, the peer is busy or gone, which is the liveness
check's and the operation timeout's business, not a plane failure.

A plane marked down is re-probed after ``reprobe_s``: fresh endpoints, a PING
to every peer; when all answer on it, it carries bytes again. Every rank
rejoins on its own evidence: receivers look on every plane they ever knew a
peer on, so ranks that disagree for a moment about a plane stay correct.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from . import wire

PING_BYTES = 8


class PlaneHealth:
    def __init__(self, rank: int, comm_id: int, planes: dict, timeout_s: float, reprobe_s: float):
        self.rank = rank
        self.comm_id = comm_id
        self.planes = planes
        self.timeout_s = timeout_s
        self.reprobe_s = reprobe_s
        self.down: dict[str, float] = {}  # plane -> when it was marked down (perf_counter)
        self.events: list[dict] = []  # plane_failure / plane_rejoined, picked up by telemetry
        self._nonce = 0
        self._pongs: set = set()  # (plane, peer, nonce)
        self._sends: list = []  # (request, buffer): kept alive until complete
        self._check: Optional[dict] = None
        self._rejoin: dict[str, dict] = {}

    # -- messages --------------------------------------------------------
    def _next_nonce(self) -> int:
        self._nonce = (self._nonce + 1) % wire.SEQ_MOD
        return self._nonce

    def _send(self, plane, peer: int, nonce: int, kind: int) -> None:
        buf = np.zeros(PING_BYTES, dtype=np.uint8)
        tag = wire.make_tag(wire.KIND_CTRL, self.comm_id, nonce, self.rank, kind)
        try:
            self._sends.append((plane.send(peer, buf, tag), buf))
        except Exception:  # no endpoint (down) or refused: silence is the answer
            pass

    def _take(self, plane, kind: int):
        """(sender, nonce) of every message of this control type waiting on a plane."""
        tag = wire.make_tag(wire.KIND_CTRL, self.comm_id, 0, 0, kind)
        got = []
        while True:
            probe = plane.probe(tag, wire.ctrl_any_seq_mask())
            if probe is None:
                return got
            _, _, nonce, sender, _ = wire.split_tag(probe.sender_tag.value)
            plane.take(probe, timeout_s=1.0)
            got.append((sender, nonce))

    def serve(self) -> None:
        """Answer peers' pings (on every plane, down ones included) and collect pongs."""
        for name, plane in self.planes.items():
            for sender, nonce in self._take(plane, wire.CTRL_PING):
                try:
                    plane.reconnect(sender)  # a peer rejoining reaches us on a plane we closed
                except Exception:  # noqa: BLE001 - e.g. no route yet right after a link returns
                    continue  # unanswered: the peer's rejoin probe times out and rests again
                self._send(plane, sender, nonce, wire.CTRL_PONG)
            for sender, nonce in self._take(plane, wire.CTRL_PONG):
                self._pongs.add((name, sender, nonce))
        self._sends = [(r, b) for r, b in self._sends if not r.completed]

    # -- finding a silent plane -------------------------------------------
    def live(self) -> dict:
        return {n: p for n, p in self.planes.items() if n not in self.down}

    def check(self, peers, now: float, key=None) -> Optional[tuple[str, int]]:
        """Drive a heartbeat round for a stalled operation.

        Returns (plane, peer) once a plane stayed silent to a peer that
        another plane reached; None while waiting or when nothing is wrong.
        """
        if self._check is not None and self._check["key"] != key:
            self._finish_check()  # a round left over from another operation
        if self._check is None:
            nonce = self._next_nonce()
            expect = set()
            for name, plane in self.live().items():
                for peer in peers:
                    if plane.reaches(peer):
                        self._send(plane, peer, nonce, wire.CTRL_PING)
                        expect.add((name, peer))
            self._check = {"t": now, "nonce": nonce, "expect": expect, "key": key}
            return None
        self.serve()
        nonce, expect = self._check["nonce"], self._check["expect"]
        answered = {(p, q) for p, q in expect if (p, q, nonce) in self._pongs}
        if answered == expect:
            self._finish_check()
            return None
        if now - self._check["t"] < self.timeout_s:
            return None
        silent = expect - answered
        self._finish_check()
        for plane, peer in sorted(silent):
            if any(q == peer for _, q in answered):
                return plane, peer
        return None  # nothing answered: the peer is busy or gone, not a plane

    def _finish_check(self) -> None:
        nonce = self._check["nonce"]
        self._pongs = {k for k in self._pongs if k[2] != nonce}
        self._check = None

    # -- marking down and rejoining ------------------------------------------
    def mark_down(self, name: str, reason: str, now: float) -> bool:
        """Take a plane out of use; False if it already was."""
        if name in self.down:
            return False
        self.down[name] = now
        self._rejoin.pop(name, None)
        self.planes[name].fail()
        self._sends = [(r, b) for r, b in self._sends if not r.completed]
        return True

    def try_rejoin(self, now: float) -> None:
        """Re-probe planes that have been down for reprobe_s (call between operations)."""
        for name, since in list(self.down.items()):
            attempt = self._rejoin.get(name)
            if attempt is None:
                if now - since < self.reprobe_s:
                    continue
                plane = self.planes[name]
                nonce = self._next_nonce()
                peers = plane.known_peers
                for peer in peers:
                    try:
                        plane.reconnect(peer)
                    except Exception:
                        continue
                    self._send(plane, peer, nonce, wire.CTRL_PING)
                self._rejoin[name] = {"t": now, "nonce": nonce, "peers": set(peers)}
                continue
            self.serve()
            waiting = {q for q in attempt["peers"] if (name, q, attempt["nonce"]) not in self._pongs}
            if not waiting:
                del self.down[name]
                del self._rejoin[name]
                self.events.append({"kind": "plane_rejoined", "plane": name, "t_wall": time.time()})
            elif now - attempt["t"] > self.timeout_s:
                # Not back (or a peer was busy): wait another reprobe period.
                # The fresh endpoints stay open: a peer that did hear us may
                # already be sending on them, and cancelling would drop that.
                del self._rejoin[name]
                self.down[name] = now

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events
