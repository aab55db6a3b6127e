"""A job the testbed tests run as every rank; prints one JSON line on rank 0.

    p2p POLICY NBYTES          one point-to-point message rank 0 -> rank 1
    adaptive NBYTES REPEATS    all_reduce under 'adaptive' REPEATS times, then 'up' vs 'adaptive' 5 times
"""
import json
import sys
import time

import numpy as np

import mpccs


def p2p(comm, policy, nbytes):
    comm.set_path_policy(policy)
    buf = np.arange(nbytes, dtype=np.uint8) if comm.rank == 0 else np.zeros(nbytes, np.uint8)
    if comm.rank == 0:
        comm.send(buf, 1)
    else:
        comm.recv(buf, 0)
        assert np.array_equal(buf, np.arange(nbytes, dtype=np.uint8))
    return {"bytes_per_plane": comm.last_stats()["bytes_per_plane"]}


def timed_all_reduce(comm, x):
    comm.barrier()
    t0 = time.perf_counter()
    comm.all_reduce(x)
    dt = np.array([time.perf_counter() - t0])
    stats = comm.last_stats()
    comm.all_reduce(dt, op="max")
    return float(dt[0]), stats["bytes_per_plane"], stats.get("events", [])


def adaptive(comm, nbytes, repeats):
    """Let the controller settle on 'adaptive' alone, then time it against 'up', interleaved."""
    x = np.ones(nbytes // 4, np.float32)
    result = {"up": [], "adaptive": [], "share": [], "events": []}
    comm.set_path_policy("adaptive")
    for i in range(repeats):
        _, bpp, events = timed_all_reduce(comm, x)
        result["share"].append(bpp["up"] / max(1, bpp["up"] + bpp["out"]))
        # controller drops/re-adds, so a failed check shows why the split moved
        result["events"] += [{"op": i, **e} for e in events if e.get("kind") == "controller"]
    for _ in range(5):
        for policy in ("up", "adaptive"):
            comm.set_path_policy(policy)
            result[policy].append(timed_all_reduce(comm, x)[0])
    return result


def main():
    comm = mpccs.init()
    mode = sys.argv[1]
    if mode == "p2p":
        out = p2p(comm, mpccs.config.parse_policy(sys.argv[2]), int(sys.argv[3]))
    else:
        out = adaptive(comm, int(sys.argv[2]), int(sys.argv[3]))
    if comm.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    comm.close()


if __name__ == "__main__":
    main()
