"""A 2-rank all_reduce as one message each way per step: the two-step executor.

The DAG engine runs a 2-rank ring as two stages of chunks, with the per-stage
and per-chunk bookkeeping (cursors, windows, probes, split plans) that
splitting flows across planes needs. When every byte of a call goes on 'up'
anyway (policy 'up', or 'adaptive' with 'out' dropped on both ranks) that
bookkeeping is only cost: on the default planes a 4 MiB all_reduce took
~730 us on the DAG where the same two exchanges written out by hand took ~400
(bench/two_step_ab.py), and MPICH ~430.

Here each rank sends its peer the half of its input the peer owns, reduces
the half it owns (rank 0's operand on the left, as everywhere: with two
operands the order cannot change a bit anyway), and sends that half back:
two messages out, two in, one reduction, whole halves (one receive per step
is what shared-memory rendezvous moves fastest). The receive of the peer's
reduced half is posted at the start, straight into the output: the peer can
only send it after it received this rank's half, so even in place nothing is
overwritten that is still to be sent.

Both ranks must run the same executor: CollectiveOp decides after the
fingerprint exchange, from a flag each rank sets in its fingerprint message
(engine.DECLARES_TWO_STEP), and falls back to the DAG unless both set it.
The wire: collective-data tags of the operation's sequence number, with the
reserved flow ids wire.TWO_STEP_RS_FLOW and wire.TWO_STEP_AG_FLOW.
"""
from __future__ import annotations

import time

import numpy as np

from . import wire
from .errors import TransportError
from .reduce import reduce_to
from .telemetry import wall

STEPS = ("reduce-scatter", "all-gather")
# A half arrives in one receive, into a buffer the engine keeps for this
# (Engine.two_step_scratch): at most this much memory. Larger calls run on the
# DAG, in chunks.
MAX_HALF_BYTES = 8 << 20


def halves(n: int, rank: int) -> tuple[slice, slice]:
    """(the half rank owns, the half its peer owns) of n elements."""
    cut = n // 2
    first, second = slice(0, cut), slice(cut, n)
    return (first, second) if rank == 0 else (second, first)


class TwoStepAllReduce:
    """Drives one 2-rank all_reduce for its CollectiveOp (``op``), whose
    fingerprints have been checked; advance() until ``done``."""

    def __init__(self, op, min_sample_bytes: int):
        self.op = op
        engine = op.engine
        self.peer = peer = op.others[0]
        self.plane = plane = engine.control_plane(peer)
        src, out = op.buffers["in"], op.buffers["out"]
        mine, theirs = halves(src.size, op.rank)
        self.mine_in, self.mine_out = src[mine], out[mine]
        self.nbytes_mine = self.mine_in.nbytes
        self.nbytes_theirs = src[theirs].nbytes
        self.incoming = engine.two_step_scratch(self.nbytes_mine).view(src.dtype)
        seq = op.wire_seq
        self.tag_rs = wire.make_tag(wire.KIND_COLL, engine.comm_id, seq, wire.TWO_STEP_RS_FLOW)
        self.tag_ag = wire.make_tag(wire.KIND_COLL, engine.comm_id, seq, wire.TWO_STEP_AG_FLOW)
        self.min_sample_bytes = min_sample_bytes
        self.step = 0  # 0: waiting for the peer's half; 1: for its reduced half; 2: done
        self.t_step = time.perf_counter()
        self.theirs_in, self.theirs_out = src[theirs], out[theirs]
        self.recv_rs = plane.recv(self.incoming.view(np.uint8), self.tag_rs)
        self.recv_ag = plane.recv(self.theirs_out.view(np.uint8), self.tag_ag)
        self.send_rs = plane.send(peer, self.theirs_in.view(np.uint8), self.tag_rs)
        self.send_ag = None
        op.bytes_per_plane[plane.name] += self.nbytes_theirs

    @property
    def done(self) -> bool:
        return self.step == 2

    def advance(self) -> bool:
        if self.step == 0:
            if not self.recv_rs.completed:
                return False
            self._check(self.recv_rs)
            self._note_arrival(self.nbytes_mine)
            self._reduce()
            self.send_ag = self.plane.send(self.peer, self.mine_out.view(np.uint8), self.tag_ag)
            self.op.bytes_per_plane[self.plane.name] += self.nbytes_mine
            self._end_step(self.nbytes_theirs)
            return True
        if not (self.recv_ag.completed and self.send_rs.completed and self.send_ag.completed):
            return False
        for req in (self.recv_ag, self.send_rs, self.send_ag):
            self._check(req)
        self._note_arrival(self.nbytes_theirs)
        self._end_step(self.nbytes_mine)
        self._report_solo()
        return True

    def _reduce(self) -> None:
        """mine_out = in_0 op in_1 over the half this rank owns (rank 0's operand first)."""
        left, right = (self.mine_in, self.incoming) if self.op.rank == 0 else (self.incoming, self.mine_in)
        reduce_to(self.mine_out, left, right, self.op.op)

    def _note_arrival(self, nbytes: int) -> None:
        """What arrived from the peer in this step, as a delivery sample (adaptive only,
        like the DAG's): keeps the controller's estimate of 'up' current."""
        controller = self.op.engine.controller
        if controller is not None and self.op.splitter.policy == "adaptive" and nbytes >= self.min_sample_bytes:
            controller.on_delivery(self.plane.name, self.peer, nbytes, self.t_step, time.perf_counter())

    def _report_solo(self) -> None:
        """The two steps as solo stages of 'up' for the controller (adaptive only): what
        a probe of 'out' must beat is what 'up' alone delivers, and that is this."""
        controller = self.op.engine.controller
        if controller is not None and self.op.splitter.policy == "adaptive":
            steps = self.op.stage_log[-2:]
            controller.on_solo_stage(self.plane.name, max(self.nbytes_mine, self.nbytes_theirs),
                                     sum(s["duration_s"] for s in steps) / 2)

    def _end_step(self, sent: int) -> None:
        now = time.perf_counter()
        self.op.stage_log.append({
            "stage": self.step, "label": STEPS[self.step], "duration_s": now - self.t_step,
            "t_start_wall": wall(self.t_step), "bytes_per_plane": {self.plane.name: sent}, "split": {},
        })
        self.step += 1
        self.t_step = now

    def _check(self, req) -> None:
        try:
            req.check_error()
        except Exception as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}", rank=self.op.rank, plane=self.plane.name,
                                 peer=self.peer, op=self.op.name, stage=f"two-step {STEPS[min(self.step, 1)]}") from exc

    def pending(self) -> list:
        """(request, buffer) of every request UCX may still hold: a failed operation
        parks them, so that no buffer UCX may still read or write is freed first."""
        reqs = [(self.recv_rs, self.incoming), (self.recv_ag, self.theirs_out), (self.send_rs, self.theirs_in),
                (self.send_ag, self.mine_out)]
        pending = [(r, b) for r, b in reqs if r is not None and not r.completed]
        if not self.recv_rs.completed:
            self.op.engine.forget_two_step_scratch()  # UCX may still write there: the next call gets its own
        return pending

    def describe_stall(self) -> dict:
        step = STEPS[min(self.step, 1)]
        return {"stage": f"two-step {step}", "peer": [self.peer], "plane": self.plane.name,
                "waiting_for": f"the {step} message of rank {self.peer}" if self.step == 0 or not self.recv_ag.completed
                else "the peer to take this rank's messages"}
