"""A rank killed with SIGKILL while the others wait on it: every survivor raises an
mpccs error naming it within seconds (liveness, not the operation timeout), never
hangs, and the communicator is aborted afterwards."""
import os
import re
import subprocess
import sys
import time

import pytest

BIN = os.path.dirname(sys.executable)
PROG = os.path.join(os.path.dirname(__file__), "programs", "die_mid_op.py")
TRIALS = 20


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "MPCCS_"))}
    env["MPCCS_TIMEOUT"] = "60"  # far above the 10 s bound: only liveness can explain a fast error
    return env


# 1 MiB: the direct path through the outboxes, 20 trials; 16 MiB: the direct path reading
# across processes (the peer dies before it calls), 3 trials; 16 MiB with the peer dying
# inside those steps (rank 0 reads from it or waits on a flag in memory), 2 trials; 8 MiB
# through the outboxes in two rounds, the peer dying at its second, 2 trials; 8 bytes
# through the lane (lane_ops.py: rank 0 hands the call to the engine once it stops polling), 3 trials;
# a 1 MiB broadcast from rank 1 through the pipe (pipe_steps.py), rank 1 dying after its first chunk, 2 trials.
CASES = ([(1 << 18, "", trial) for trial in range(TRIALS)] + [(4 << 20, "", trial) for trial in range(3)]
         + [(4 << 20, "mid-steps", trial) for trial in range(2)] + [(2 << 20, "mid-rounds", trial) for trial in range(2)]
         + [(2, "", trial) for trial in range(3)]
         + [(1 << 18, "pipe", trial) for trial in range(2)])


@pytest.mark.parametrize("count,mode,trial", CASES)
def test_survivor_raises_naming_the_lost_rank(count, mode, trial):
    start = time.monotonic()
    p = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "2", "--grace", "20", PROG, str(count), *mode.split()],
                       env=clean_env(), capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    lines = [line for line in p.stdout.splitlines() if "RESULT" in line]
    assert lines and "completed" not in lines[0], p.stdout + p.stderr
    seconds, kind = re.search(r"RESULT ([\d.]+) (\w+):", lines[0]).groups()
    assert kind == "TransportError" and "rank(s) [1] are gone" in lines[0]
    assert float(seconds) < 10
    assert any("RESULT aborted" in line for line in lines)
    assert elapsed < 20  # the survivor exits on its own, well inside the launcher's grace period


# 3 ranks: 8 bytes through the group lane (group_lane_ops.py: ranks 0 and 2 wait asleep for
# rank 1's entry), 4 MiB read across processes (group_read_steps.py: rank 1 dies before it
# calls, or inside the steps after it posted its buffers, while the others read them or wait
# on its flags); two trials each.
GROUP_CASES = [(count, mode, stage, trial) for count, mode, stage in
               ((2, "", "direct lane"), (1 << 20, "", "group reads"), (1 << 20, "mid-steps", "group reads"))
               for trial in range(2)]


@pytest.mark.parametrize("count,mode,stage,trial", GROUP_CASES)
def test_every_survivor_of_a_group_call_raises_naming_the_lost_rank(count, mode, stage, trial):
    """Each survivor raises within seconds, by its own liveness check or by the
    other's abort, naming rank 1 and the stage, and refuses further use."""
    p = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "3", "--grace", "20", PROG, str(count),
                        *mode.split()], env=clean_env(), capture_output=True, text=True, timeout=60)
    results = [line for line in p.stdout.splitlines() if "RESULT" in line and "RESULT aborted" not in line]
    assert sorted(line.split("]")[0] for line in results) == ["[rank 0", "[rank 2"], p.stdout + p.stderr
    for line in results:
        seconds, kind = re.search(r"RESULT ([\d.]+) (\w+):", line).groups()
        assert kind == "TransportError" and "rank(s) [1] are gone" in line and stage in line, line
        assert float(seconds) < 10
    assert sum("RESULT aborted" in line for line in p.stdout.splitlines()) == 2
