"""Inputs, references and tolerances for collective correctness tests.

Every rank builds every rank's input from (seed, rank), so each rank checks
its own output against a numpy reference without extra communication.
"""
from __future__ import annotations

import numpy as np

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None

DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64"]
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
EPS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}


def dtype_of(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def is_float(name: str) -> bool:
    return name in EPS


def make_input(name: str, n: int, rank: int, seed: int, op: str) -> np.ndarray:
    rng = np.random.default_rng(seed * 7919 + rank)
    dtype = dtype_of(name)
    if is_float(name):
        if op == "prod":
            values = rng.uniform(0.5, 1.5, n)
        else:
            values = rng.standard_normal(n) * 4
        return values.astype(np.float32).astype(dtype)
    info = np.iinfo(dtype)
    if op == "prod":
        return rng.integers(0 if info.min == 0 else -2, 3, n).astype(dtype)
    low, high = max(info.min, -100), min(info.max, 100)
    return rng.integers(low, high + 1, n).astype(dtype)


def input_size(collective: str, world: int, count: int) -> int:
    return count * world if collective in ("reduce_scatter", "all_to_all") else count


def output_size(collective: str, world: int, count: int) -> int:
    return count * world if collective in ("all_gather", "all_to_all") else count


def reduce_reference(inputs: list[np.ndarray], op: str, name: str) -> np.ndarray:
    """Exact (wrapping) for integers, float64 for floats."""
    fn = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    wide = [x.astype(np.float64) for x in inputs] if is_float(name) else [x.copy() for x in inputs]
    out = wide[0]
    for x in wide[1:]:
        with np.errstate(over="ignore"):
            out = fn(out, x)
    if op == "avg":
        out = out / len(inputs)
    return out


def expected_output(collective, inputs, op, name, rank, root, count):
    if collective == "all_reduce":
        return reduce_reference(inputs, op, name)
    if collective == "reduce":
        return reduce_reference(inputs, op, name) if rank == root else None
    if collective == "reduce_scatter":
        return reduce_reference(inputs, op, name)[rank * count:(rank + 1) * count]
    if collective == "all_gather":
        return np.concatenate(inputs)
    if collective == "all_to_all":
        return np.concatenate([x[rank * count:(rank + 1) * count] for x in inputs])
    if collective == "broadcast":
        return inputs[root]
    raise ValueError(collective)


def tolerance(inputs, op, name, world):
    """Error bound: each hop rounds once to the dtype, at most world-1 hops plus avg's division.

    For sums: |err| <= (world) * eps * sum_i |x_i| (a standard recursive-summation
    bound with one rounding per hop); for products: relative (world) * eps.
    """
    eps = EPS[name]
    hops = world + (1 if op == "avg" else 0)
    if op in ("sum", "avg"):
        scale = np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0)
        if op == "avg":
            scale = scale / world
        return 2 * hops * eps * scale + np.finfo(np.float32).tiny
    if op == "prod":
        ref = np.abs(reduce_reference(inputs, op, name))
        return 2 * hops * eps * ref + np.finfo(np.float32).tiny
    return np.zeros(1)  # min/max are exact


def check(got, expected, inputs, op, name, world, reducing: bool) -> str | None:
    """None if got matches; otherwise a short description of the first mismatch."""
    if got.shape != expected.shape:
        return f"shape {got.shape} != {expected.shape}"
    if not is_float(name) or not reducing:
        same = got.view(np.uint8) == np.ascontiguousarray(expected.astype(got.dtype)).view(np.uint8) \
            if got.size else np.array([True])
        if not same.all():
            bad = int(np.argmin(same.reshape(-1, got.dtype.itemsize).all(axis=1))) if got.size else 0
            return f"element {bad}: got {got[bad]!r}, expected {expected[bad]!r}"
        return None
    tol = tolerance(inputs, op, name, world)
    err = np.abs(got.astype(np.float64) - expected)
    ok = err <= tol
    if not ok.all():
        bad = int(np.argmin(ok))
        return f"element {bad}: got {got[bad]!r}, expected {expected[bad]!r} (err {err[bad]:.3g} > tol {np.broadcast_to(tol, err.shape)[bad]:.3g})"
    return None
