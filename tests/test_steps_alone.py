"""direct_ops.run_steps_alone: a blocking call's steps through the segments run
without an Operation, and when it hands them to one (DirectShmAllReduceOp(started=...)).
Both ranks' segments in this process; the steps scripted, so each case is exact."""
import mmap
import time

import numpy as np
import pytest

from mpccs import direct_ops, fingerprint
from mpccs.direct_ops import run_steps_alone
from mpccs.transports import shm
from mpccs.transports.shm import SEGMENT_BYTES, ShmPair

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory segments need x86-64 and /dev/shm")

FP = fingerprint.make("all_reduce", "sum", np.float32, "direct_shm", None, 0, 1 << 20)
OTHER = fingerprint.make("all_reduce", "sum", np.float32, "direct_shm", None, 0, 1 << 19)  # another size


class ScriptedSteps:
    """Steps whose advance() follows a script: "move" (a step moved), "wait"
    (nothing moved), "last" (the last step moved: done), an exception (raised);
    "wait" once the script runs out."""

    def __init__(self, *script):
        self.script, self.done, self.advances = list(script), False, 0

    def advance(self) -> bool:
        self.advances += 1
        answer = self.script.pop(0) if self.script else "wait"
        if isinstance(answer, BaseException):
            raise answer
        self.done = answer == "last"
        return answer != "wait"


@pytest.fixture
def pairs(monkeypatch):
    # Long enough that a case which must not hand over never does, even with the
    # process descheduled between two looks (a VM's stolen time); the cases that
    # time out on purpose shorten it (short_spin).
    monkeypatch.setattr(direct_ops, "PEER_SPIN_S", 1.0)
    a, b = (mmap.mmap(-1, SEGMENT_BYTES) for _ in range(2))
    return ShmPair(a, b), ShmPair(b, a)


def test_the_steps_run_to_the_end_once_the_peer_published_the_same_fingerprint(pairs):
    pairs[1].post_fingerprint(FP.encode(), 5)
    steps = ScriptedSteps("move", "wait", "wait", "last")
    assert run_steps_alone(pairs[0], 5, steps, FP) == (True, True)
    assert steps.done and steps.advances == 4


@pytest.fixture
def short_spin(monkeypatch):
    monkeypatch.setattr(direct_ops, "PEER_SPIN_S", 2e-3)


def test_a_peer_not_there_is_left_to_the_operation_after_peer_spin_s(pairs, short_spin):
    steps = ScriptedSteps("last")
    start = time.perf_counter()
    assert run_steps_alone(pairs[0], 5, steps, FP) == (False, False)
    assert time.perf_counter() - start >= 2e-3
    assert steps.advances == 0  # nothing of the peer's is read before the meeting
    pairs[1].post_fingerprint(FP.encode(), 4)  # the peer's previous operation is not this one
    assert run_steps_alone(pairs[0], 5, steps, FP) == (False, False) and steps.advances == 0


def test_a_fingerprint_that_differs_or_a_sleeping_peer_goes_to_the_operation_before_any_step(pairs):
    pairs[1].post_fingerprint(OTHER.encode(), 5)
    steps = ScriptedSteps("last")
    assert run_steps_alone(pairs[0], 5, steps, FP) == (False, False)  # its MismatchError is the operation's
    assert steps.advances == 0
    pairs[1].post_fingerprint(FP.encode(), 6)
    pairs[1].post_waiting(6)  # the peer sleeps on its planes: the operation rings it
    assert run_steps_alone(pairs[0], 6, steps, FP) == (False, False) and steps.advances == 0


def test_without_fingerprints_only_the_peers_arrival_is_looked_at(pairs):
    pairs[1].post_fingerprint(OTHER.encode(), 5)
    assert run_steps_alone(pairs[0], 5, ScriptedSteps("last"), None) == (True, True)


def test_a_step_that_waits_longer_is_handed_over_met(pairs, short_spin):
    pairs[1].post_fingerprint(FP.encode(), 5)
    steps = ScriptedSteps("move", "move")  # then the peer's next flag never comes
    start = time.perf_counter()
    assert run_steps_alone(pairs[0], 5, steps, FP) == (False, True)
    assert not steps.done and steps.advances > 2 and time.perf_counter() - start >= 2e-3


def test_a_failed_step_raises_with_the_steps_as_they_stood(pairs):
    pairs[1].post_fingerprint(FP.encode(), 5)
    steps = ScriptedSteps("wait", ConnectionError("the peer's process is gone"), "last")
    with pytest.raises(ConnectionError):
        run_steps_alone(pairs[0], 5, steps, FP)
    assert not steps.done and steps.advances == 2
