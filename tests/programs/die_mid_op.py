"""Rank 1 dies (SIGKILL) while the other ranks are inside an all_reduce waiting for it.

Each survivor prints how long it took to raise and what it raised, then checks
that the communicator refuses further use. With "mid-steps" after the count, rank 1
dies inside the steps that read across processes instead (cma_steps.py: a 16 MiB
all_reduce's direct path on 2 ranks; group_read_steps.py on 3 or more), after it
posted its buffers: the others may be reading them or waiting on a flag. With
"mid-rounds" (2 ranks, an all_reduce of 4-8 MiB: the outboxes in rounds,
shm_steps.py) rank 1 dies as it starts its second round: rank 0 finished the
first and waits for the second's flag. With
"pipe", the call is a broadcast from rank 1 (2 ranks: through the pipe,
pipe_steps.py, from above 384 KiB to 2 MiB), and rank 1 dies inside its steps
after it posted its first chunk: rank 0 took that one and waits for the next.
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
mid_rounds = sys.argv[2:] == ["mid-rounds"]
pipe = sys.argv[2:] == ["pipe"]
call = (lambda: comm.broadcast(x, root=1)) if pipe else (lambda: comm.all_reduce(x))
call()  # warm: endpoints and schedules exist
comm.barrier()
if comm.rank == 1 and pipe:
    from mpccs import pipe_steps

    def die_after_the_first_chunk(steps):
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)

    pipe_steps.PipeSteps.advance = die_after_the_first_chunk
elif comm.rank == 1 and mid_steps:
    from mpccs import cma_steps, group_read_steps

    def die(steps, *args):
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)

    cma_steps.CmaSteps._first_step = die
    group_read_steps.GroupReadSteps._first_step = die
elif comm.rank == 1 and mid_rounds:
    from mpccs import shm_steps

    copy_in = shm_steps.ShmSteps._copy_in

    def die_at_the_second_round(steps):
        if steps.round == 1:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        copy_in(steps)

    shm_steps.ShmSteps._copy_in = die_at_the_second_round
elif comm.rank == 1:
    time.sleep(0.3)  # rank 0 is inside its all_reduce by now
    os.kill(os.getpid(), signal.SIGKILL)
start = time.monotonic()
try:
    call()
    print("RESULT completed", flush=True)
except mpccs.MpccsError as exc:
    print(f"RESULT {time.monotonic() - start:.2f} {type(exc).__name__}: {exc}", flush=True)
    try:
        call()
    except mpccs.CommunicatorAborted:
        print("RESULT aborted", flush=True)
