"""Rank-side cases of tests/test_sender_chunks.py (module level: sent by reference to the pool)."""
from __future__ import annotations

import numpy as np


def mixed_policies(comm, policies: list, collective: str, count: int):
    """Each rank runs its own policy (so its own chunk); returns (exact?, chunk_bytes)."""
    size, rank = comm.size, comm.rank
    comm.set_path_policy(policies[rank])
    xs = [np.arange(count * size, dtype=np.int64) * (r + 1) % 1000 for r in range(size)]
    x = xs[rank]
    if collective == "all_reduce":
        out = comm.all_reduce(x[:count].copy())
        want = sum(v[:count] for v in xs)
    elif collective == "reduce_scatter":
        out = np.empty(count, np.int64)
        comm.reduce_scatter(x, out)
        want = sum(xs)[rank * count:(rank + 1) * count]
    elif collective == "all_gather":
        out = np.empty(count * size, np.int64)
        comm.all_gather(x[:count], out)
        want = np.concatenate([v[:count] for v in xs])
    else:  # all_to_all
        out = np.empty(count * size, np.int64)
        comm.all_to_all(x, out)
        want = np.concatenate([v[rank * count:(rank + 1) * count] for v in xs])
    stats = comm.last_stats()
    comm.set_path_policy("adaptive")
    return bool(np.array_equal(out, want)), (stats["chunk_bytes"], stats["whole_flows"])
