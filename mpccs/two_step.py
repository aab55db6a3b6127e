"""2-rank all_reduce, reduce_scatter and all_gather as one message each way per
step: the two-step executor (all_reduce takes both steps, the others one).

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
(collective_op.DECLARES_TWO_STEP), and falls back to the DAG unless both set it.
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
# (Engine.kept_scratch): at most this much memory. Larger calls run on the
# DAG, in chunks.
MAX_HALF_BYTES = 8 << 20


def halves(n: int, rank: int) -> tuple[slice, slice]:
    """(the half rank owns, the half its peer owns) of n elements."""
    return _split_at(n // 2, n, rank)


def _split_at(cut: int, end: int, rank: int) -> tuple[slice, slice]:
    """(rank's part, its peer's part) of [0, end) cut at ``cut``: rank 0 owns the first."""
    first, second = slice(0, cut), slice(cut, end)
    return (first, second) if rank == 0 else (second, first)


class TwoStepExecutor:
    """Drives one 2-rank collective for its CollectiveOp (``op``), whose
    fingerprints have been checked; advance() until ``done``.

    all_reduce runs both steps over halves of its buffers; reduce_scatter
    (blocks of its input) the reduce-scatter step alone, all_gather (blocks of
    its output) the all-gather step alone: the same messages, one step."""

    def __init__(self, op, min_sample_bytes: int):
        self.op = op
        engine = op.engine
        self.peer = peer = op.others[0]
        self.plane = plane = engine.control_plane(peer)
        self.steps, geometry = _geometry(op.name, op.buffers["in"], op.buffers["out"], op.rank)
        # mine_in: this rank's operand of the block it owns; mine_out: where that block's
        # result goes (and what the all-gather step sends); theirs_in: what the
        # reduce-scatter step sends; theirs_out: where the peer's block lands.
        self.mine_in, self.mine_out, self.theirs_in, self.theirs_out = geometry
        seq = op.wire_seq
        self.tag_rs = wire.make_tag(wire.KIND_COLL, engine.comm_id, seq, wire.TWO_STEP_RS_FLOW)
        self.tag_ag = wire.make_tag(wire.KIND_COLL, engine.comm_id, seq, wire.TWO_STEP_AG_FLOW)
        self.min_sample_bytes = min_sample_bytes
        self.step = 0  # index into self.steps; len(self.steps): done
        self.reduced = False  # the reduce-scatter step's reduction is made (once)
        self.t_step = time.perf_counter()
        self.incoming = self.recv_rs = self.send_rs = self.recv_ag = self.send_ag = None
        reduces = self.steps[0] == STEPS[0]
        # Receives first, so the peer's messages find them posted.
        if reduces:
            self.incoming = self._incoming_buffer(engine)
            self.recv_rs = plane.recv(self.incoming.view(np.uint8), self.tag_rs)
        if STEPS[1] in self.steps:
            self.recv_ag = plane.recv(self.theirs_out.view(np.uint8), self.tag_ag)
        if reduces:
            self.send_rs = self._send(self.theirs_in, self.tag_rs)
        else:  # all_gather: this rank's block goes at once
            if self.mine_out.ctypes.data != self.mine_in.ctypes.data:  # not in place
                self.mine_out[...] = self.mine_in
            self.send_ag = self._send(self.mine_in, self.tag_ag)

    @property
    def done(self) -> bool:
        return self.step == len(self.steps)

    def advance(self) -> bool:
        moved = False
        if self.recv_rs is not None and not self.reduced:
            if not self.recv_rs.completed:
                return False
            self._check(self.recv_rs)
            self._note_arrival(self.mine_in.nbytes)
            self._reduce()
            self.reduced = moved = True
            if STEPS[1] in self.steps:
                self.send_ag = self._send(self.mine_out, self.tag_ag)
                self._end_step(self.theirs_in.nbytes)
                return True
        pending = [r for r in (self.send_rs, self.recv_ag, self.send_ag) if r is not None]
        if not all(r.completed for r in pending):
            return moved
        for req in pending:
            self._check(req)
        if self.recv_ag is not None:
            self._note_arrival(self.theirs_out.nbytes)
        self._end_step(self.mine_out.nbytes if self.send_ag is not None else self.theirs_in.nbytes)
        self._report_solo()
        return True

    def _send(self, view: np.ndarray, tag: int):
        self.op.bytes_per_plane[self.plane.name] += view.nbytes
        return self.plane.send(self.peer, view.view(np.uint8), tag)

    def _incoming_buffer(self, engine) -> np.ndarray:
        """Where the peer's part of the block this rank owns arrives: straight into
        that block's output when it is not this rank's own operand (out of place),
        so that the reduction writes over one of its operands; else (in place) a
        buffer the engine keeps. numpy's ufuncs here ran 2.4-2.7x faster writing
        over an operand than into a third array (float32 sum of 1 MiB halves: 44
        against 118 us; of 8 MiB: 603 against 1008), and copying first costs as much
        as it saves."""
        if not np.may_share_memory(self.mine_in, self.mine_out):
            return self.mine_out
        return engine.kept_scratch("two_step", self.mine_in.nbytes).view(self.mine_in.dtype)

    def _reduce(self) -> None:
        """mine_out = in_0 op in_1 over the block this rank owns (rank 0's operand
        first), written over whichever operand mine_out holds (_incoming_buffer)."""
        left, right = (self.mine_in, self.incoming) if self.op.rank == 0 else (self.incoming, self.mine_in)
        reduce_to(self.mine_out, left, right, self.op.op)

    def _note_arrival(self, nbytes: int) -> None:
        """What arrived from the peer in this step, as a delivery sample (adaptive only,
        like the DAG's): keeps the controller's estimate of 'up' current. Only
        operations the controller plans report (splitter policy 'adaptive'); a settled
        one runs as 'up' (comm._splitter), and the operation before each probe, which
        is never settled, refreshes what the probe is judged against."""
        controller = self.op.engine.controller
        if controller is not None and self.op.splitter.policy == "adaptive" and nbytes >= self.min_sample_bytes:
            # Whole blocks on one plane: a rate, not evidence of how time grows with a split's size.
            controller.on_delivery(self.plane.name, self.peer, nbytes, self.t_step, time.perf_counter(),
                                   size_evidence=False)

    def _report_solo(self) -> None:
        """The two steps as solo stages of 'up' for the controller (adaptive only): what
        a probe of 'out' must beat is what 'up' alone delivers, and that is this."""
        controller = self.op.engine.controller
        if controller is not None and self.op.splitter.policy == "adaptive":
            steps = self.op.stage_log[-len(self.steps):]
            controller.on_solo_stage(self.plane.name, max(self.mine_out.nbytes, self.theirs_out.nbytes),
                                     sum(s["duration_s"] for s in steps) / len(steps))

    def _end_step(self, sent: int) -> None:
        now = time.perf_counter()
        self.op.stage_log.append({
            "stage": self.step, "label": self.steps[self.step], "duration_s": now - self.t_step,
            "t_start_wall": wall(self.t_step), "bytes_per_plane": {self.plane.name: sent}, "split": {},
        })
        self.step += 1
        self.t_step = now

    def _check(self, req) -> None:
        try:
            req.check_error()
        except Exception as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}", rank=self.op.rank, plane=self.plane.name,
                                 peer=self.peer, op=self.op.name, stage=f"two-step {self._step_name()}") from exc

    def pending(self) -> list:
        """(request, buffer) of every request UCX may still hold: a failed operation
        parks them, so that no buffer UCX may still read or write is freed first."""
        reqs = [(self.recv_rs, self.incoming), (self.recv_ag, self.theirs_out), (self.send_rs, self.theirs_in),
                (self.send_ag, self.mine_out if self.steps[0] == STEPS[0] else self.mine_in)]
        pending = [(r, b) for r, b in reqs if r is not None and not r.completed]
        if self.recv_rs is not None and not self.recv_rs.completed and self.incoming is not self.mine_out:
            self.op.engine.forget_kept_scratch("two_step")  # UCX may still write there: the next call gets its own
        return pending

    def let_go_of_arrays(self) -> None:
        """(The operation succeeded: Operation._let_go_of_arrays) its views and requests."""
        self.mine_in = self.mine_out = self.theirs_in = self.theirs_out = self.incoming = None
        self.recv_rs = self.send_rs = self.recv_ag = self.send_ag = None

    def _step_name(self) -> str:
        return self.steps[min(self.step, len(self.steps) - 1)]

    def describe_stall(self) -> dict:
        step = self._step_name()
        waiting = self.recv_rs if step == STEPS[0] else self.recv_ag
        return {"stage": f"two-step {step}", "peer": [self.peer], "plane": self.plane.name,
                "waiting_for": f"the {step} message of rank {self.peer}" if waiting is not None and not waiting.completed
                else "the peer to take this rank's messages"}


def _geometry(collective: str, src: np.ndarray, out: np.ndarray, rank: int):
    """(steps, (mine_in, mine_out, theirs_in, theirs_out)) of a 2-rank call."""
    if collective == "all_reduce":
        mine, theirs = halves(src.size, rank)
        return STEPS, (src[mine], out[mine], src[theirs], out[theirs])
    if collective == "reduce_scatter":  # src: two blocks of out.size; this rank's block reduced into out
        mine, theirs = _split_at(out.size, src.size, rank)
        return STEPS[:1], (src[mine], out, src[theirs], out[:0])
    if collective == "all_gather":  # out: two blocks of src.size; this rank's src goes to block rank
        mine, theirs = _split_at(src.size, out.size, rank)
        return STEPS[1:], (src, out[mine], src[:0], out[theirs])
    raise ValueError(f"no two-step executor for {collective}")
