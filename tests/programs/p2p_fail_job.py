"""Rank 0's scale-out endpoints close under a point-to-point send to rank 1.

Point-to-point transfers are not retried on the plane left (collectives are):
the sender's operation fails, its communicator aborts and tells rank 1, whose
receive must fail within milliseconds, not at its 30 s no-progress timeout.
Each rank prints one RESULT line (JSON); P2P_FAIL_DONE_DIR is a directory both
ranks can write.
"""
import json
import os
import time

import numpy as np

import mpccs


def main():
    comm = mpccs.init(path_policy=0.5, timeout_s=30)
    n = 16 << 20
    buf = np.arange(n, dtype=np.uint8) if comm.rank == 0 else np.zeros(n, np.uint8)
    comm.barrier()
    t0 = time.monotonic()
    result = {"rank": comm.rank}
    try:
        if comm.rank == 0:
            work = comm.isend(buf, 1)
            while work._op.bytes_per_plane["out"] == 0 and not work.is_completed():
                pass
            comm._planes["out"].sever()
            work.wait()
        else:
            comm.recv(buf, 0)
        result["error"] = None
    except mpccs.MpccsError as exc:
        result.update(error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - t0)
    try:
        comm.barrier()
        result["after"] = "usable"
    except mpccs.MpccsError as exc:
        result["after"] = type(exc).__name__
    print("RESULT " + json.dumps(result), flush=True)
    # Rank 0 stays until rank 1 has its result: were rank 0 gone first, rank 1
    # could learn of it from its liveness check instead of rank 0's abort.
    done = os.path.join(os.environ["P2P_FAIL_DONE_DIR"], "rank1.done")
    if comm.rank == 1:
        open(done, "w").close()
    else:
        deadline = time.monotonic() + 30
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.01)


if __name__ == "__main__":
    main()
