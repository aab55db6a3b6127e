"""mpccs as a torch.distributed backend and DDP hook, checked against gloo on the same inputs.

One pool of 2 ranks lives for the module: each rank runs
``init_process_group("mpccs")`` under torchrun's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and opens a gloo group beside it
(``new_group(backend="gloo")``), so every collective runs through both
backends in the same processes and the results are compared.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'mpccs[torch]', torch==2.13.0)")

from rankpool import RankPool  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
WORLD = 2


# ---------------------------------------------------------------------------
# the pool: 2 ranks with an mpccs default group and a gloo group
# ---------------------------------------------------------------------------
class Ctx:
    def __init__(self, rank, size, gloo):
        import torch.distributed as dist

        self.rank, self.size = rank, size
        self.mpccs = dist.group.WORLD
        self.gloo = gloo

    def close(self):
        import torch.distributed as dist

        dist.destroy_process_group()


def torch_groups(_kwargs) -> Ctx:
    """Each rank: the mpccs default group (env://, as torchrun sets it) and a gloo group beside it."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import mpccs.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("mpccs")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    gloo = dist.new_group(backend="gloo")
    return Ctx(dist.get_rank(), dist.get_world_size(), gloo)


@pytest.fixture(scope="module")
def pool():
    p = RankPool(WORLD, env={"OMP_NUM_THREADS": "1"}, setup=torch_groups, start_timeout=90)
    yield p
    p.close()


# ---------------------------------------------------------------------------
# cases (run on every rank; inputs depend on (rank, seed) only)
# ---------------------------------------------------------------------------
def _inp(rank, n, dtype, seed=0, low=-8, high=9):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 4).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randint(low, high, (n,), generator=g).to(dtype)


def _same(a, b, what):
    if a.dtype.is_floating_point:
        tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(a.dtype, 1e-5)
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, b), f"{what}: {a} != {b}"


def case_identity(ctx):
    import torch.distributed as dist
    import mpccs.torch as mt

    comm = mt.get_communicator()
    return {
        "backend": dist.get_backend(), "rank": dist.get_rank(), "size": dist.get_world_size(),
        "comm": (comm.rank, comm.size), "pg": type(ctx.mpccs).__name__, "gloo": dist.get_backend(ctx.gloo),
    }


ALLREDUCE = [
    ("sum", torch.float32), ("sum", torch.int64), ("sum", torch.float64), ("sum", torch.bfloat16),
    ("sum", torch.float16), ("sum", torch.int32), ("sum", torch.uint8),
    ("product", torch.float32), ("product", torch.int32), ("min", torch.float32), ("min", torch.int64),
    ("max", torch.float32), ("max", torch.int8), ("avg", torch.float32), ("avg", torch.bfloat16),
]


def case_all_reduce(ctx, opname, dtype, n):
    import torch.distributed as dist

    op = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
          "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}[opname]
    x = _inp(ctx.rank, n, dtype, 1, -3, 4) if opname == "product" else _inp(ctx.rank, n, dtype, 1)
    if dtype == torch.uint8:
        x = x.abs()
    mine, ref = x.clone(), x.clone()
    dist.all_reduce(mine, op=op)
    if opname == "avg":  # gloo has no AVG: the reference is SUM / size
        dist.all_reduce(ref, op=dist.ReduceOp.SUM, group=ctx.gloo)
        ref = (ref.double() / ctx.size).to(dtype)
    else:
        dist.all_reduce(ref, op=op, group=ctx.gloo)
    _same(mine, ref, f"all_reduce {opname} {dtype}")
    return True


def case_all_reduce_async_and_future(ctx):
    import torch.distributed as dist

    xs = [_inp(ctx.rank, 1000 + i, torch.float32, i) for i in range(3)]
    refs = [x.clone() for x in xs]
    works = [dist.all_reduce(x, async_op=True) for x in xs]  # three in flight at once
    for r in refs:
        dist.all_reduce(r, group=ctx.gloo)
    fut = works[2].get_future()
    assert fut.done()
    value = fut.value()
    assert isinstance(value, list) and value[0] is xs[2] or torch.equal(value[0], xs[2])
    for w in works[:2]:
        assert w.wait() is True
        assert w.is_completed()
    for x, r in zip(xs, refs):
        _same(x, r, "async all_reduce")
    # the torch-level Work type and its mpccs statistics
    w = dist.all_reduce(torch.ones(4096), async_op=True)
    w.wait()
    stats = w.stats()
    return type(works[0]).__name__, sorted(stats[0]["bytes_per_plane"]) if stats else None


def case_non_contiguous(ctx):
    import torch.distributed as dist

    base = _inp(ctx.rank, 6 * 5, torch.float32, 3).view(6, 5)
    mine = base.clone().t()  # a transposed view: staged through a copy, written back
    ref = base.clone().t()
    assert not mine.is_contiguous()
    dist.all_reduce(mine)
    dist.all_reduce(ref, group=ctx.gloo)
    _same(mine, ref, "non-contiguous all_reduce")
    b = base.clone()[:, 1:4]  # non-contiguous slice, broadcast from rank 1
    rb = base.clone()[:, 1:4].contiguous()
    dist.broadcast(b, src=1)
    dist.broadcast(rb, src=1, group=ctx.gloo)
    _same(b, rb, "non-contiguous broadcast")
    return True


def case_all_gather(ctx, dtype):
    import torch.distributed as dist

    x = _inp(ctx.rank, 37, dtype, 4)
    outs = [torch.empty(37, dtype=dtype) for _ in range(ctx.size)]  # separate tensors: staged
    dist.all_gather(outs, x)
    if dtype in (torch.float32, torch.int64):
        refs = [torch.empty(37, dtype=dtype) for _ in range(ctx.size)]
        dist.all_gather(refs, x, group=ctx.gloo)
    else:  # gloo has no int16/bool/complex all_gather: every rank's input is known here
        refs = [_inp(r, 37, dtype, 4) for r in range(ctx.size)]
    for o, r in zip(outs, refs):
        _same(o, r, f"all_gather {dtype}")
    flat = torch.empty(ctx.size * 37, dtype=dtype)  # consecutive chunks of one buffer: zero-copy
    dist.all_gather(list(flat.chunk(ctx.size)), x)
    _same(flat, torch.cat(refs), "all_gather into chunks")
    single = torch.empty(ctx.size, 37, dtype=dtype)
    dist.all_gather_into_tensor(single, x.view(1, 37))
    _same(single.view(-1), torch.cat(refs), "all_gather_into_tensor")
    return True


def case_reduce_scatter(ctx, dtype):
    import torch.distributed as dist

    n = 29
    x = _inp(ctx.rank, n * ctx.size, dtype, 5)
    out, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    dist.reduce_scatter(out, list(x.clone().chunk(ctx.size)))
    dist.reduce_scatter(ref, list(x.clone().chunk(ctx.size)), group=ctx.gloo)
    _same(out, ref, "reduce_scatter list")
    ins = [_inp(ctx.rank + 10 * j, n, dtype, 5) for j in range(ctx.size)]  # separate tensors: staged
    out2, ref2 = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    dist.reduce_scatter(out2, ins, op=dist.ReduceOp.MAX)
    dist.reduce_scatter(ref2, [i.clone() for i in ins], op=dist.ReduceOp.MAX, group=ctx.gloo)
    _same(out2, ref2, "reduce_scatter list max")
    out3 = torch.empty(n, dtype=dtype)
    dist.reduce_scatter_tensor(out3, x.clone())
    _same(out3, ref, "reduce_scatter_tensor")
    return True


def case_broadcast_reduce(ctx, root):
    import torch.distributed as dist

    x = _inp(ctx.rank, 513, torch.float32, 6)
    mine, ref = x.clone(), x.clone()
    dist.broadcast(mine, src=root)
    dist.broadcast(ref, src=root, group=ctx.gloo)
    _same(mine, ref, "broadcast")
    y = _inp(ctx.rank, 257, torch.int64, 7)
    mine, ref = y.clone(), y.clone()
    dist.reduce(mine, dst=root)
    dist.reduce(ref, dst=root, group=ctx.gloo)
    if ctx.rank == root:
        _same(mine, ref, "reduce")
    flags = torch.tensor([True, False, ctx.rank == 0])  # bool travels as bytes
    dist.broadcast(flags, src=root)
    assert flags.tolist() == [True, False, root == 0]
    return True


def case_all_to_all_single(ctx, uneven):
    import torch.distributed as dist

    size, rank = ctx.size, ctx.rank
    cols = 3
    if not uneven:
        x = _inp(rank, 4 * size * cols, torch.float32, 8).view(4 * size, cols)
        out, ref = torch.empty_like(x), torch.empty_like(x)
        dist.all_to_all_single(out, x)
        dist.all_to_all_single(ref, x, group=ctx.gloo)
        _same(out, ref, "all_to_all_single even")
        return True
    # rank r sends (r + j + 1) rows to rank j
    in_splits = [rank + j + 1 for j in range(size)]
    out_splits = [j + rank + 1 for j in range(size)]
    x = _inp(rank, sum(in_splits) * cols, torch.int32, 9).view(-1, cols)
    out = torch.full((sum(out_splits), cols), -1, dtype=torch.int32)
    ref = torch.full((sum(out_splits), cols), -2, dtype=torch.int32)
    dist.all_to_all_single(out, x, out_splits, in_splits)
    dist.all_to_all_single(ref, x, out_splits, in_splits, group=ctx.gloo)
    _same(out, ref, "all_to_all_single uneven")
    # list all_to_all with uneven sizes
    ins = [_inp(rank * 7 + j, rank + 2 * j + 1, torch.float64, 10) for j in range(size)]
    outs = [torch.empty(j + 2 * rank + 1, dtype=torch.float64) for j in range(size)]
    dist.all_to_all(outs, ins)
    # gloo's list all_to_all wants equal sizes: rank j's block for this rank is known here
    refs = [_inp(j * 7 + rank, j + 2 * rank + 1, torch.float64, 10) for j in range(size)]
    for o, r in zip(outs, refs):
        _same(o, r, "all_to_all list")
    return True


def case_barrier_p2p_gather_scatter(ctx):
    import torch.distributed as dist

    dist.barrier()
    rank, size = ctx.rank, ctx.size
    peer = 1 - rank
    x = torch.arange(10, dtype=torch.float32) + 100 * rank
    got = torch.empty(10)
    if rank == 0:
        dist.send(x, dst=peer)
        dist.recv(got, src=peer)
    else:
        dist.recv(got, src=peer)
        dist.send(x, dst=peer)
    assert torch.equal(got, torch.arange(10, dtype=torch.float32) + 100 * peer)
    g = [torch.empty(5) for _ in range(size)] if rank == 1 else None
    dist.gather(torch.full((5,), float(rank)), g, dst=1)
    if rank == 1:
        assert [t[0].item() for t in g] == list(range(size))
    out = torch.empty(4, dtype=torch.int64)
    dist.scatter(out, [torch.full((4,), 10 + r, dtype=torch.int64) for r in range(size)] if rank == 0 else None, src=0)
    assert out.tolist() == [10 + rank] * 4
    dist.barrier()
    return True


def case_subgroups(ctx):
    """new_group(backend="mpccs"): the whole world again, and a group of rank 1 alone."""
    import torch.distributed as dist

    both = dist.new_group(backend="mpccs")
    alone = dist.new_group([1], backend="mpccs")
    x = torch.full((5,), float(ctx.rank + 1))
    dist.all_reduce(x, group=both)
    y = torch.full((3,), 7.0)
    if ctx.rank == 1:
        dist.all_reduce(y, group=alone)
        assert dist.get_world_size(alone) == 1
    dist.destroy_process_group(alone)
    dist.destroy_process_group(both)
    return x[0].item(), y[0].item()


def case_port_rendezvous(ctx):
    """A second Communicator whose rendezvous runs through mpccs' own store on a free port."""
    import mpccs.torch as mt

    comm = mt.new_communicator(rendezvous="port")
    try:
        x = np.full(1000, ctx.rank + 1, np.float32)
        comm.all_reduce(x)
        return float(x[0]), comm.size
    finally:
        comm.close()


def case_errors(ctx):
    import torch.distributed as dist

    errors = []
    for bad in (lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND),
                lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool)),
                lambda: dist.all_reduce(torch.ones(3, dtype=torch.float8_e4m3fn))):
        try:
            bad()
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append(type(exc).__name__)
    dist.all_reduce(torch.ones(3))  # still usable: bad calls fail before any byte moves
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (ctx.rank + 1)  # torch passes it as real pairs
    dist.all_reduce(z)
    assert torch.equal(z, torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * 3)
    return errors


# -- DDP --------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def _train(ctx, mode, steps):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import mpccs.torch as mt

    model = _model()
    state = None
    if mode == "gloo":
        ddp = DDP(model, process_group=ctx.gloo)
    elif mode == "hook":  # gloo DDP, gradients averaged by an mpccs communicator
        ddp = DDP(model, process_group=ctx.gloo, bucket_cap_mb=0.002)  # several buckets: exercises overlap
        state = mt.hook_state(ctx.gloo)
        ddp.register_comm_hook(state, mt.allreduce_hook)
    elif mode == "hook-sync":
        ddp = DDP(model, process_group=ctx.gloo, bucket_cap_mb=0.002)
        state = mt.hook_state(comm=mt.get_communicator(), overlap=False)
        ddp.register_comm_hook(state, mt.allreduce_hook)
    else:  # DDP directly over the mpccs process group
        ddp = DDP(model, process_group=ctx.mpccs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(42 + ctx.rank)  # each rank its own data, one teacher
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(7)) / 4
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        y = torch.tanh(x @ teacher)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t, group=ctx.gloo)
        losses.append(t.item() / ctx.size)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(ctx.size)]
    dist.all_gather(everyone, flat, group=ctx.gloo)
    identical = all(torch.equal(everyone[0], e) for e in everyone)
    hook = (state.buckets, state.max_in_flight) if state is not None else None
    return losses, identical, flat.numpy().copy(), hook


def case_ddp(ctx, steps):
    return {mode: _train(ctx, mode, steps) for mode in ("gloo", "hook", "hook-sync", "mpccs")}


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------
def test_init_process_group_under_torchrun_variables(pool):
    for rank, info in enumerate(pool.run(case_identity)):
        assert info == {"backend": "mpccs", "rank": rank, "size": WORLD, "comm": (rank, WORLD),
                        "pg": "ProcessGroupMpccs", "gloo": "gloo"}


@pytest.mark.parametrize("opname,dtype", ALLREDUCE, ids=[f"{o}-{str(d)[6:]}" for o, d in ALLREDUCE])
def test_all_reduce_matches_gloo(pool, opname, dtype):
    pool.run(case_all_reduce, opname, dtype, 1001)


def test_all_reduce_large_matches_gloo(pool):
    pool.run(case_all_reduce, "sum", torch.float32, 1 << 20)


def test_async_work_and_future(pool):
    for name, planes in pool.run(case_all_reduce_async_and_future):
        assert name == "MpccsWork"
        assert planes is not None


def test_non_contiguous_tensors_are_staged(pool):
    pool.run(case_non_contiguous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int16, torch.bool, torch.complex64], ids=str)
def test_all_gather_matches_gloo(pool, dtype):
    pool.run(case_all_gather, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_reduce_scatter_matches_gloo(pool, dtype):
    pool.run(case_reduce_scatter, dtype)


@pytest.mark.parametrize("root", [0, 1])
def test_broadcast_and_reduce_match_gloo(pool, root):
    pool.run(case_broadcast_reduce, root)


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_all_to_all_matches_gloo(pool, uneven):
    pool.run(case_all_to_all_single, uneven)


def test_barrier_send_recv_gather_scatter(pool):
    pool.run(case_barrier_p2p_gather_scatter)


def test_subgroups(pool):
    assert pool.run(case_subgroups) == [(3.0, 7.0)] * WORLD


def test_port_rendezvous_mode(pool):
    assert pool.run(case_port_rendezvous) == [(3.0, WORLD)] * WORLD


def test_unsupported_ops_and_dtypes_fail_cleanly(pool):
    assert pool.run(case_errors) == [["ValueError", "TypeError", "TypeError"]] * WORLD


def test_ddp_hook_matches_gloo_and_weights_agree(pool):
    results = pool.run(case_ddp, 8, timeout=120)
    for mode in ("gloo", "hook", "hook-sync", "mpccs"):
        losses = [r[mode][0] for r in results]
        assert all(r[mode][1] for r in results), f"{mode}: ranks ended with different weights"
        assert losses[0] == losses[1]  # the loss is all-reduced: same curve on every rank
        np.testing.assert_allclose(losses[0], results[0]["gloo"][0], rtol=1e-4, atol=1e-6, err_msg=mode)
        np.testing.assert_allclose(results[0][mode][2], results[0]["gloo"][2], rtol=1e-4, atol=1e-5, err_msg=mode)
    assert results[0]["gloo"][0][-1] < results[0]["gloo"][0][0]  # it trains
    buckets, in_flight = results[0]["hook"][3]
    assert buckets > 8 and in_flight >= 1  # several buckets per step (overlap: test_hook_overlap_order)
    assert results[0]["hook-sync"][3][1] == 1


# -- in-process helpers ------------------------------------------------------
def test_contiguous_cpu_tensors_are_zero_copy():
    import mpccs.torch as mt

    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        t = torch.zeros(16, dtype=dtype)
        s = mt._stage(t)
        assert not s.copied and s.array.__array_interface__["data"][0] == t.data_ptr()
    t = torch.zeros(4, 4).t()
    s = mt._stage(t)
    assert s.copied and s.array.__array_interface__["data"][0] != t.data_ptr()
    flat = torch.zeros(12)
    assert not mt._StagedList(list(flat.chunk(3)), load=False).copied
    assert mt._StagedList([torch.zeros(4), torch.zeros(4)], load=False).copied


def test_gpu_direct_staging_leaves_host_tensors_as_they_were():
    # GPU-direct hands only contiguous CUDA tensors of cupy's dtypes over as they are
    # (tests/test_gpu.py on a GPU); every host tensor stages as without it
    import mpccs.torch as mt

    t = torch.zeros(16)
    s = mt._stage(t, direct=True)
    assert not s.copied and s.array.__array_interface__["data"][0] == t.data_ptr()
    assert mt._stage(torch.zeros(4, 4).t(), direct=True).copied
    assert not mt._direct_ok(t) and not mt._direct_ok(np.zeros(4))
    out, inp = mt._stage_pair(torch.zeros(8), torch.zeros(4, 2).t(), direct=True)
    assert type(out) is type(inp) is mt._Staged and inp.copied and not out.copied
    assert torch.bfloat16 not in mt._CUPY_DTYPES and torch.float16 in mt._CUPY_DTYPES


def test_row_counts_and_reduce_ops():
    import torch.distributed as dist
    import mpccs.torch as mt

    assert mt._row_counts(torch.zeros(6, 2), [], 2, "input") == [6, 6]
    assert mt._row_counts(torch.zeros(6, 2), [1, 5], 2, "input") == [2, 10]
    with pytest.raises(ValueError):
        mt._row_counts(torch.zeros(5, 2), [], 2, "input")
    with pytest.raises(ValueError):
        mt._row_counts(torch.zeros(6, 2), [1, 2], 2, "input")
    assert mt._reduce_op(dist.ReduceOp.AVG) == "avg"
    with pytest.raises(ValueError):
        mt._reduce_op(dist.ReduceOp.BXOR)


class _FakeWork:
    def __init__(self, log, i):
        self.log, self.i, self.done = log, i, False

    def is_completed(self):
        return self.done

    def wait(self, timeout=None):
        self.log.append(("wait", self.i))
        self.done = True


class _FakeComm:
    gpu_direct = False  # host tensors only

    def __init__(self):
        self.log, self.works = [], []

    def all_reduce(self, arr, op="sum", async_op=False):
        self.log.append(("submit", len(self.works), op))
        self.works.append(_FakeWork(self.log, len(self.works)))
        return self.works[-1]


class _FakeBucket:
    def __init__(self, tensor, last):
        self._t, self._last = tensor, last

    def buffer(self):
        return self._t

    def is_last(self):
        return self._last


def test_hook_overlap_order():
    """Buckets stay in flight until the last one's hook call, which completes all of them in order."""
    import mpccs.torch as mt

    comm = _FakeComm()
    state = mt.HookState(comm, overlap=True)
    futs = [mt.allreduce_hook(state, _FakeBucket(torch.ones(4) * i, i == 2)) for i in range(3)]
    assert comm.log == [("submit", 0, "avg"), ("submit", 1, "avg"), ("submit", 2, "avg"),
                        ("wait", 0), ("wait", 1), ("wait", 2)]
    assert state.max_in_flight == 3 and all(f.done() for f in futs)
    assert torch.equal(futs[1].value(), torch.ones(4))
    sync = mt.HookState(_FakeComm(), overlap=False)
    mt.allreduce_hook(sync, _FakeBucket(torch.ones(4), False))
    assert sync.max_in_flight == 1 and sync.comm.log == [("submit", 0, "avg"), ("wait", 0)]


# -- examples ----------------------------------------------------------------
def _last_json(stdout: str) -> dict:
    line = stdout.strip().splitlines()[-1]
    if line.startswith("[rank"):
        line = line.split("] ", 1)[1]
    return json.loads(line)


def _run_example(args, timeout=90):
    env = dict(os.environ, OMP_NUM_THREADS="1", UCX_WARN_UNUSED_ENV_VARS="n")
    return subprocess.run([sys.executable, "-m", "mpccs", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_train_numpy_example_two_ranks():
    proc = _run_example(["-n", "2", "--timeout", "80", str(EXAMPLES / "train_numpy.py"),
                         "--steps", "12", "--warmup", "3", "--hidden", "64", "--bucket-kb", "16"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = _last_json(proc.stdout)
    assert result["example"] == "train_numpy" and result["ranks"] == 2 and result["steps"] == 12
    assert result["weights_identical"] is True
    assert result["mean_step_ms"] > 0 and result["measured_steps"] == 9
    assert result["buckets_per_step"] >= 2
    assert result["final_loss"] < result["first_loss"]


def test_train_numpy_example_with_gloo_buckets_matches_mpccs():
    """--gloo (the step-time peer) trains the same model to the same loss curve as mpccs."""
    common = ["--steps", "8", "--warmup", "2", "--hidden", "64", "--bucket-kb", "16"]
    runs = {}
    for name, extra in (("mpccs", []), ("gloo", ["--gloo"])):
        proc = _run_example(["-n", "2", "--timeout", "80", str(EXAMPLES / "train_numpy.py"), *common, *extra])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[name] = _last_json(proc.stdout)
    assert runs["gloo"]["policy"] == "gloo" and runs["gloo"]["weights_identical"] is True
    assert runs["gloo"]["first_loss"] == runs["mpccs"]["first_loss"]
    # 2 ranks: both sum two values (a + b is exact in either order), then divide by 2
    assert abs(runs["gloo"]["final_loss"] - runs["mpccs"]["final_loss"]) < 1e-5


def test_train_ddp_example_with_hook():
    proc = _run_example(["-n", "2", "--timeout", "80", str(EXAMPLES / "train_ddp.py"),
                         "--steps", "6", "--warmup", "2", "--hidden", "32", "--bucket-mb", "0.001"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = _last_json(proc.stdout)
    assert result["example"] == "train_ddp" and result["backend"] == "mpccs" and result["ranks"] == 2
    assert result["weights_identical"] is True and result["measured_steps"] == 4
    assert result["hook_buckets"] >= 6


def test_gpu_check_without_gpu_skips_cleanly(capsys):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(EXAMPLES))
    ns = gpu_check.parse_args(["--ranks", "3", "--sizes", "1K,64K"])
    assert ns.ranks == 3 and ns.sizes == [1024, 65536]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--ranks", "5"])
    # the result checks the GPU run uses, on host arrays
    for name in gpu_check.COLLECTIVES:
        size, n = 3, 10
        inputs = [gpu_check.make_input(name, r, size, n, np) for r in range(size)]
        for r in range(size):
            out = gpu_check.expected(name, r, size, n, inputs)
            if out is None:  # reduce on a non-root rank: undefined, not checked
                assert name == "reduce" and r != gpu_check.root_of(size)
                assert gpu_check.check(name, np.zeros(1), r, size, n, inputs) is None
                continue
            assert gpu_check.check(name, out, r, size, n, inputs) is None
            assert gpu_check.check(name, out[:-1], r, size, n, inputs) is not None
            wrong = out.copy()
            wrong.reshape(-1)[0] += 1
            assert gpu_check.check(name, wrong, r, size, n, inputs) is not None
    if not gpu_check.gpu_present():
        capsys.readouterr()
        assert gpu_check.main([]) == 0
        assert "no GPU: skipped" in capsys.readouterr().out


def test_gpu_check_flow_simulated_on_cpu():
    """The GPU script's whole flow (spawn, every collective, the torch backend, checks, table) on the CPU."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "gpu_check.py"), "--simulate-cpu", "--sizes", "4K",
                           "--iters", "1", "--warmup", "0", "--timeout", "80"],
                          capture_output=True, text=True, timeout=100, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", UCX_WARN_UNUSED_ENV_VARS="n"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(next(line.split("] ", 1)[1] for line in proc.stdout.splitlines() if '"gpu_check"' in line))
    assert summary["gpu_check"] == "pass" and summary["failures"] == 0 and summary["torch"] is True
    assert summary["checks"] == 2 * 2 * 0 + 2 * (8 + 7)
