"""Rank 1 dies (SIGKILL) while the other ranks are inside an all_reduce waiting for it.

Each survivor prints how long it took to raise and what it raised, then checks
that the communicator refuses further use. With "mid-steps" after the count, rank 1
dies inside the steps that read across processes instead (cma_steps.py: a 4 MiB
all_reduce's direct path on 2 ranks; group_read_steps.py on 3 or more), after it
posted its buffers: the others may be reading them or waiting on a flag.
"""
import os
import signal
import sys
import time

import numpy as np

import mpccs

comm = mpccs.init()
x = np.ones(int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20, np.float32)
mid_steps = sys.argv[2:] == ["mid-steps"]
comm.all_reduce(x)  # warm: endpoints and schedules exist
comm.barrier()
if comm.rank == 1 and mid_steps:
    from mpccs import cma_steps, group_read_steps

    def die(steps, *args):
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)

    cma_steps.CmaSteps._first_step = die
    group_read_steps.GroupReadSteps._first_step = die
elif comm.rank == 1:
    time.sleep(0.3)  # rank 0 is inside its all_reduce by now
    os.kill(os.getpid(), signal.SIGKILL)
start = time.monotonic()
try:
    comm.all_reduce(x)
    print("RESULT completed", flush=True)
except mpccs.MpccsError as exc:
    print(f"RESULT {time.monotonic() - start:.2f} {type(exc).__name__}: {exc}", flush=True)
    try:
        comm.all_reduce(x)
    except mpccs.CommunicatorAborted:
        print("RESULT aborted", flush=True)
