"""Point-to-point send and receive: a header, the receiver's accept, then
chunks on both planes; small payloads inside the header."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from . import wire
from .algorithms.schedule import Flow
from .errors import MismatchError, ProtocolError, TransportError
from .flows import MIN_CHUNK_BYTES, InFlow, OutFlow, Splitter
from .operation import Operation
from .windows import OUT, UP, chunk_range, flow_chunk_elems


# Point-to-point messages up to this size ride inside their header message on
# the control plane (P2P_INLINE in the header's size word) under the policies
# that would send them there ('up', and 'adaptive', which keeps small flows on
# one plane): the payload then travels with the request instead of after the
# receiver's accept, one message and one reply instead of three messages.
# Every receive posts room for it (a pooled inbox, Engine.p2p_inbox), so a
# sender's choice needs no agreement.
P2P_INLINE_MAX_BYTES = 64 << 10
P2P_INBOX_BYTES = 8 + P2P_INLINE_MAX_BYTES  # what every receive has room for (fixed: senders may inline less)
P2P_INLINE = 1 << 63
P2P_INBOXES_KEPT = 16  # pooled receive buffers (receives in flight at once reuse them)


def _completed(pending: list, rank: int, peer: int, op: str) -> tuple[list, list]:
    """Split a point-to-point operation's (request, plane, bytes) entries into the
    finished ones, as (plane, bytes), and those still in flight; a request that
    failed raises TransportError naming the plane and the peer."""
    done, still = [], []
    for req, plane, n in pending:
        if not req.completed:
            still.append((req, plane, n))
            continue
        try:
            req.check_error()
        except Exception as exc:
            raise TransportError(str(exc), rank=rank, plane=plane.name, peer=peer, op=op) from exc
        done.append((plane, n))
    return done, still


class SendOp(Operation):
    """Header -> wait for the receiver's accept -> chunks on both planes; or
    (small, P2P_INLINE_MAX_BYTES) the header with the payload inside -> the accept."""

    name = "send"

    def __init__(self, engine, seq, buf: np.ndarray, dst: int, splitter: Splitter, chunk_bytes: int):
        super().__init__(engine, seq)
        self.buf = buf
        self.dst = dst
        self.splitter = splitter
        self.chunk_bytes = chunk_bytes
        self.ctrl = engine.control_plane(dst)
        self.inline = buf.nbytes <= P2P_INLINE_MAX_BYTES and splitter.name in (UP, "adaptive")
        if self.inline:
            header = np.empty(8 + buf.nbytes, dtype=np.uint8)
            header[:8].view(np.uint64)[0] = buf.nbytes | P2P_INLINE
            header[8:] = buf
            self.bytes_per_plane[self.ctrl.name] += buf.nbytes
        else:
            header = np.array([buf.nbytes], dtype=np.uint64).view(np.uint8)
        self._header = header
        me = engine.rank
        self._header_req = self.ctrl.send(dst, header, wire.make_tag(wire.KIND_CTRL, engine.comm_id, seq, me, wire.CTRL_P2P_HEADER))
        self._reply = np.zeros(2, dtype=np.uint64)
        self._reply_req = self.ctrl.recv(
            self._reply.view(np.uint8), wire.make_tag(wire.KIND_CTRL, engine.comm_id, seq, dst, wire.CTRL_P2P_REPLY)
        )
        self.outflow: Optional[OutFlow] = None
        self.pending: list = []
        self.inflight = {UP: 0, OUT: 0}
        self.window = dict(splitter.window_bytes)

    def _advance(self) -> bool:
        if self.outflow is None:
            if not (self._reply_req.completed and self._header_req.completed):
                return False
            self._check_ctrl(self._header_req)
            self._check_ctrl(self._reply_req)
            if int(self._reply[0]) != 1:
                raise MismatchError(
                    f"rank {self.engine.rank}: send of {self.buf.nbytes} bytes to rank {self.dst} refused: "
                    f"the receiver posted {int(self._reply[1])} bytes"
                )
            if self.inline:  # the payload went with the header
                self._finish()
                return True
            flow = Flow(id=0, src=self.engine.rank, dst=self.dst, src_buf="in", src_off=0, dst_buf="out", dst_off=0, count=self.buf.nbytes)
            plan = self.splitter.plan([(flow, self.buf.nbytes)], time.perf_counter())
            self.window = plan.window_bytes
            ce = flow_chunk_elems(self.buf.nbytes, self.chunk_bytes, MIN_CHUNK_BYTES)
            tag = wire.make_tag(wire.KIND_P2P, self.engine.comm_id, self.seq, self.engine.rank)
            self.outflow = OutFlow(flow, self.buf, ce, plan.splits[0], tag, self.splitter.reach(self.dst))
            return True
        moved = self._reap()
        moved |= self._post()
        if self.outflow.done:
            self._finish()
            return True
        return moved

    def _post(self) -> bool:
        moved = False
        of = self.outflow
        for name, plane in self.engine.planes.items():
            if not plane.reaches(self.dst):
                continue
            pacer = self.engine.pacer_for(name, self.splitter, self.dst)
            while self.inflight[name] < self.window.get(name, 0) and of.cursor.wants(name):
                if pacer is not None and not pacer.ready(time.perf_counter()):
                    break  # borrowed bytes wait for the QoS pacer, as in collectives
                index = of.cursor.next_chunk(name)
                offset, n = chunk_range(index, of.flow.count, of.chunk_elems)
                if pacer is not None:
                    pacer.take(n, time.perf_counter())
                req = plane.send(self.dst, self.buf[offset : offset + n], of.tag_base | index)
                of.pending += 1
                self.inflight[name] += n
                self.bytes_per_plane[name] += n
                self.pending.append((req, plane, n))
                moved = True
        return moved

    def _reap(self) -> bool:
        done, self.pending = _completed(self.pending, self.engine.rank, self.dst, "send")
        for plane, n in done:
            self.outflow.pending -= 1
            self.inflight[plane.name] -= n
        return bool(done)

    def _check_ctrl(self, req) -> None:
        try:
            req.check_error()
        except Exception as exc:
            raise TransportError(str(exc), rank=self.engine.rank, plane=self.ctrl.name, peer=self.dst, op="send") from exc

    def describe_stall(self) -> dict:
        state = "waiting for the receiver to post" if self.outflow is None else "sending"
        return {"peer": self.dst, "plane": self.ctrl.name, "state": state}


class RecvOp(Operation):
    name = "recv"

    def __init__(self, engine, seq, buf: np.ndarray, src: int, chunk_bytes: int):
        super().__init__(engine, seq)
        self.buf = buf
        self.src = src
        self.chunk_bytes = chunk_bytes
        self.ctrl = engine.control_plane(src)
        self._inbox = engine.p2p_inbox()  # room for a header with its payload inside (SendOp.inline)
        cid, me = engine.comm_id, engine.rank
        self._header_req = self.ctrl.recv(self._inbox, wire.make_tag(wire.KIND_CTRL, cid, seq, src, wire.CTRL_P2P_HEADER))
        self._inline_done = False
        self._reply = np.zeros(2, dtype=np.uint64)
        self._reply_req = None
        self._reply_tag = wire.make_tag(wire.KIND_CTRL, cid, seq, me, wire.CTRL_P2P_REPLY)
        self.inflow: Optional[InFlow] = None
        self.pending: list = []

    def _advance(self) -> bool:
        if self.inflow is None:
            if not self._header_req.completed:
                return False
            try:
                self._header_req.check_error()
            except Exception as exc:  # a header longer than 8 bytes arrives truncated
                raise ProtocolError(f"malformed point-to-point header: {type(exc).__name__}: {exc}",
                                    rank=self.engine.rank, peer=self.src, op="recv") from None
            word = int(self._inbox[:8].view(np.uint64)[0])
            sent, inline = word & ~P2P_INLINE, bool(word & P2P_INLINE)
            ok = sent == self.buf.nbytes
            self._reply[:] = (1 if ok else 0, self.buf.nbytes)
            self._reply_req = self.ctrl.send(self.src, self._reply.view(np.uint8), self._reply_tag)
            if not ok:
                self._drain_reply()
                raise MismatchError(
                    f"rank {self.engine.rank}: receive of {self.buf.nbytes} bytes from rank {self.src} "
                    f"does not match the {sent} bytes sent; nothing was written"
                )
            if inline:
                self.buf[...] = self._inbox[8:8 + sent]
                self.bytes_per_plane[self.ctrl.name] += sent
                self._inline_done = True
                self._finish_inline()
                return True
            flow = Flow(id=0, src=self.src, dst=self.engine.rank, src_buf="in", src_off=0, dst_buf="out", dst_off=0, count=sent)
            ce = flow_chunk_elems(sent, self.chunk_bytes, MIN_CHUNK_BYTES)
            tag = wire.make_tag(wire.KIND_P2P, self.engine.comm_id, self.seq, self.src)
            self.inflow = InFlow(flow, self.buf, ce, tag, self.engine.planes_from(self.src))
            return True
        if self._inline_done:
            return self._finish_inline()
        moved = False
        for plane in self.inflow.planes:
            while True:
                probe = plane.probe(self.inflow.tag_base, wire.MASK_STREAM)
                if probe is None:
                    break
                try:
                    _, offset, n = self.inflow.claim(probe, 1)
                except ValueError as exc:
                    self.engine.discard(plane, probe)
                    raise ProtocolError(str(exc), rank=self.engine.rank, plane=plane.name, peer=self.src,
                                        op="recv") from None
                self.pending.append((plane.recv_probed(self.buf[offset : offset + n], probe), plane, n))
                moved = True
        done, self.pending = _completed(self.pending, self.engine.rank, self.src, "recv")
        for plane, n in done:
            self.inflow.arrived += 1
            self.bytes_per_plane[plane.name] += n
        moved |= bool(done)
        if self.inflow.done and (self._reply_req is None or self._reply_req.completed):
            self._finish()
            return True
        return moved

    def _finish_inline(self) -> bool:
        """An inline message is placed: done once the accept has gone (its buffer is this op's)."""
        if not self._reply_req.completed:
            return False
        self.engine.give_p2p_inbox(self._inbox)
        self._finish()
        return True

    def _drain_reply(self) -> None:
        deadline = time.perf_counter() + 5
        while not self._reply_req.completed and time.perf_counter() < deadline:
            self.engine.progress_planes()

    def describe_stall(self) -> dict:
        state = "waiting for the sender's header" if self.inflow is None else f"{self.inflow.arrived}/{self.inflow.nchunks} chunks"
        return {"peer": self.src, "plane": [p.name for p in self.engine.planes_to(self.src)], "state": state}
