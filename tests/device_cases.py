"""Rank-side cases of tests/test_device_reduction.py (module level: sent by reference to the pool)."""
from __future__ import annotations

import numpy as np

from mpccs import staging
from mpccs.reduce import bfloat16_dtype, finish_avg, reduce_into


def inputs(rank: int, count: int, dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    if np.dtype(dtype).kind in "fV" or str(np.dtype(dtype)) == "bfloat16":
        return rng.standard_normal(count).astype(dtype)
    return rng.integers(-3, 4 if np.dtype(dtype).kind == "i" else 7, count).astype(dtype)


def reference(kind: str, rank: int, size: int, count: int, dtype, op: str, seed: int, root: int):
    """The reduction in rank order on the host (mpccs.reduce), as the device combines it."""
    xs = [inputs(r, count, dtype, seed) for r in range(size)]
    acc = xs[0].copy()
    for x in xs[1:]:
        reduce_into(acc, x, op)
    if op == "avg":
        finish_avg(acc, size)
    if kind == "reduce_scatter":
        m = count // size
        return acc[rank * m:(rank + 1) * m]
    if kind == "reduce" and rank != root:
        return None
    return acc


def device_reduction(comm, kind: str, count: int, dtype: str, op: str, policy, seed: int, in_place: bool,
                     direct: bool = False):
    """One reduction through the device steps with numpy standing in for the device; returns
    (result bytes or None, whether it matched the rank-order reference bit for bit).
    ``direct``: the GPU-direct steps (no mirrors: the steps run on the arrays themselves)."""
    dtype = bfloat16_dtype() if dtype == "bfloat16" else np.dtype(dtype)
    comm.set_path_policy(policy)
    size, rank, root = comm.size, comm.rank, seed % comm.size
    x = inputs(rank, count, dtype, seed)
    if kind == "reduce_scatter":
        out = np.empty(count // size, dtype)
    elif kind == "reduce" and rank != root:
        out = None
    else:
        out = x if in_place else np.empty(count, dtype)
    result = comm._reduce_on_device(kind, x, out, op, root if kind == "reduce" else None, False, out,
                                    backend=staging.NumpyBackend(), direct=direct)
    assert result is out
    want = reference(kind, rank, size, count, dtype, op, seed, root)
    if want is None:
        return None, True
    stats = comm.last_stats()["staging"]
    if direct:
        assert stats["memory"] == "device" and stats["h2d_bytes"] == stats["d2h_bytes"] == 0, stats
    else:
        assert stats["reduced_on"] == "numpy" and stats["h2d_bytes"] >= out.nbytes, stats
    return out.tobytes(), out.tobytes() == want.tobytes()


def async_pair(comm):
    """Two device reductions in flight, waited in reverse order: both right."""
    be = staging.NumpyBackend()
    a, b = inputs(comm.rank, 70_001, np.float32, 1), inputs(comm.rank, 9, np.int64, 2)
    wa = comm._reduce_on_device("all_reduce", a, a, "sum", None, True, a, backend=be)
    wb = comm._reduce_on_device("all_reduce", b, b, "max", None, True, b, backend=be)
    assert wb.wait() is b and wa.wait() is a
    ra = reference("all_reduce", comm.rank, comm.size, 70_001, np.float32, "sum", 1, 0)
    rb = reference("all_reduce", comm.rank, comm.size, 9, np.int64, "max", 2, 0)
    return a.tobytes() == ra.tobytes() and b.tobytes() == rb.tobytes() and "staging" in wa.stats()


def auto_choices(comm):
    """Where 'auto' reduces device arrays, and that always/never override it."""
    import dataclasses

    big, small = np.empty(16 << 20, np.uint8), np.empty(1 << 20, np.uint8)
    auto = [comm._device_reduces(k, x) for k in ("all_reduce", "reduce_scatter", "reduce") for x in (big, small)]
    saved = comm.options
    try:
        comm.options = dataclasses.replace(saved, device_reduce="always")
        always = comm._device_reduces("all_reduce", small)
        comm.options = dataclasses.replace(saved, device_reduce="never")
        never = comm._device_reduces("reduce_scatter", big)
    finally:
        comm.options = saved
    return auto, always, never
