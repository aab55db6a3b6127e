#!/usr/bin/env python
"""One prepared GPU check: 2-4 ranks share one GPU, every collective with cupy arrays, the torch backend
with CUDA tensors; results checked against host references, a short timing table; under 5 minutes.

    python examples/gpu_check.py                          # 2 ranks, spawned here (mpccs-run semantics)
    python examples/gpu_check.py --ranks 4 --sizes 4K,1M,16M --iters 5
    python examples/gpu_check.py --simulate-cpu           # the same flow on the CPU (numpy, CPU tensors)

Without a GPU it prints "no GPU: skipped" and exits 0. With a GPU but neither
cupy nor a CUDA build of torch it exits 2 (install 'mpccs[gpu]').

Memory path: the Communicator takes cupy arrays; on GPU-direct planes (cupy
sees a GPU on every rank, MPCCS_GPU_DIRECT not 0) the planes read and write them
in place (cuda_ipc / cuda_copy), else it stages them through pinned host mirrors
(mpccs.staging: device -> host before any byte moves, the collective on the
mirrors, host -> device at completion); the torch backend passes CUDA tensors
the same way (cupy views, or pinned host tensors). The table says which path ran.
Exit code: 0 when every check passed, 1 when one failed, 124 on timeout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

COLLECTIVES = ("all_reduce", "all_reduce_avg", "reduce_scatter", "all_gather", "all_to_all", "all_to_allv",
               "broadcast", "reduce")
TORCH_COLLECTIVES = ("all_reduce", "all_reduce_avg", "reduce_scatter", "all_gather", "all_to_all", "all_to_allv",
                     "broadcast")
SKIP_LINE = "gpu_check: no GPU: skipped"


# ---------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------
def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r} (examples: 4K, 1M, 4096)") from None
    if value < 4 or value > (256 << 20):
        raise argparse.ArgumentTypeError(f"size {text!r} is outside 4 B .. 256 MiB")
    return value


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, choices=(2, 3, 4), default=2, help="ranks sharing the GPU (2)")
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("4K,1M,16M"),
                   help="bytes per rank block, comma-separated (4K,1M,16M)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per case (5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per case (2)")
    p.add_argument("--timeout", type=float, default=270.0, help="stop every rank after this many seconds (270)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch backend part")
    p.add_argument("--simulate-cpu", action="store_true",
                   help="run the whole flow on the CPU: numpy stands in for cupy, CPU tensors for CUDA ones")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.iters < 1 or ns.warmup < 0 or not ns.sizes:
        p.error("--iters must be >= 1, --warmup >= 0, --sizes not empty")
    return ns


def worker_argv(ns: argparse.Namespace) -> list[str]:
    argv = ["--worker", "--ranks", str(ns.ranks), "--sizes", ",".join(str(s) for s in ns.sizes),
            "--iters", str(ns.iters), "--warmup", str(ns.warmup), "--timeout", str(ns.timeout)]
    return argv + (["--no-torch"] if ns.no_torch else []) + (["--simulate-cpu"] if ns.simulate_cpu else [])


# ---------------------------------------------------------------------------
# GPU detection
# ---------------------------------------------------------------------------
def _cupy_devices() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _torch_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _driver_sees_gpu() -> bool:
    if os.path.exists("/dev/nvidia0"):
        return True
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def gpu_present() -> bool:
    """A GPU that this Python can use (through cupy or a CUDA build of torch)."""
    return _cupy_devices() > 0 or _torch_cuda()


# ---------------------------------------------------------------------------
# inputs and the result checks (host arrays; pure, testable without a GPU)
# ---------------------------------------------------------------------------
def root_of(size: int) -> int:
    return size - 1  # a root other than 0


def allv_counts(rank: int, size: int, n: int) -> tuple[list[int], list[int]]:
    """all_to_allv: rank r sends n + (r + j) % 3 elements to rank j."""
    send = [n + (rank + j) % 3 for j in range(size)]
    recv = [n + (i + rank) % 3 for i in range(size)]
    return send, recv


def input_count(name: str, rank: int, size: int, n: int) -> int:
    if name in ("reduce_scatter", "all_to_all"):
        return n * size
    if name == "all_to_allv":
        return sum(allv_counts(rank, size, n)[0])
    return n


def output_count(name: str, rank: int, size: int, n: int) -> int:
    if name in ("all_gather", "all_to_all"):
        return n * size
    if name == "all_to_allv":
        return sum(allv_counts(rank, size, n)[1])
    return n


def make_input(name: str, rank: int, size: int, n: int, xp=np):
    """Small integers in float32: sums over ranks are exact, every rank's block differs."""
    count = input_count(name, rank, size, n)
    values = ((np.arange(count, dtype=np.int64) * (2 * rank + 3) + 5 * rank) % 13 - 6).astype(np.float32)
    return values if xp is np else xp.asarray(values)


def expected(name: str, rank: int, size: int, n: int, inputs: list):
    """This rank's output; None where it is undefined (reduce on a non-root rank)."""
    if name in ("all_reduce", "all_reduce_avg"):
        total = np.sum([x.astype(np.float64) for x in inputs], axis=0)
        return (total / size if name == "all_reduce_avg" else total).astype(np.float32)
    if name == "reduce":
        if rank != root_of(size):
            return None
        return np.sum([x.astype(np.float64) for x in inputs], axis=0).astype(np.float32)
    if name == "reduce_scatter":
        blocks = [x[rank * n:(rank + 1) * n].astype(np.float64) for x in inputs]
        return np.sum(blocks, axis=0).astype(np.float32)
    if name == "all_gather":
        return np.concatenate(inputs)
    if name == "all_to_all":
        return np.concatenate([x[rank * n:(rank + 1) * n] for x in inputs])
    if name == "all_to_allv":
        parts = []
        for i, x in enumerate(inputs):
            send, _ = allv_counts(i, size, n)
            start = sum(send[:rank])
            parts.append(x[start:start + send[rank]])
        return np.concatenate(parts)
    if name == "broadcast":
        return inputs[root_of(size)].copy()
    raise ValueError(f"unknown collective {name!r}")


def check(name: str, out, rank: int, size: int, n: int, inputs: list):
    """None when ``out`` (a host array) is right, else a one-line description of the first difference."""
    want = expected(name, rank, size, n, inputs)
    if want is None:
        return None
    got = np.asarray(out).reshape(-1)
    if got.shape != want.shape:
        return f"{name}: {got.size} elements, expected {want.size}"
    if name == "all_reduce_avg":
        bad = ~np.isclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        bad = got != want
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        return f"{name}: {int(bad.sum())} of {want.size} elements differ; first at {i}: {got[i]!r} != {want[i]!r}"
    return None


# ---------------------------------------------------------------------------
# device arrays
# ---------------------------------------------------------------------------
class CupyDevice:
    name = "cupy"

    def __init__(self):
        import cupy

        self.cp = cupy
        cupy.cuda.Device(0).use()  # every rank shares GPU 0

    def to_device(self, host):
        return self.cp.asarray(host)

    def to_host(self, arr):
        return self.cp.asnumpy(arr)

    def empty(self, count):
        return self.cp.empty(count, dtype=self.cp.float32)

    def sync(self):
        self.cp.cuda.Device(0).synchronize()


class TorchCudaDevice:
    name = "torch.cuda"

    def __init__(self):
        import torch

        self.torch = torch
        torch.cuda.set_device(0)

    def to_device(self, host):
        return self.torch.from_numpy(np.ascontiguousarray(host)).to("cuda")

    def to_host(self, arr):
        return arr.cpu().numpy()

    def empty(self, count):
        return self.torch.empty(count, dtype=self.torch.float32, device="cuda")

    def sync(self):
        self.torch.cuda.synchronize()


class HostDevice:
    """--simulate-cpu: numpy stands in for the device arrays."""

    name = "numpy (simulated device)"

    def to_device(self, host):
        return np.array(host, copy=True)

    def to_host(self, arr):
        return np.asarray(arr)

    def empty(self, count):
        return np.empty(count, np.float32)

    def sync(self):
        pass


def accepts_directly(arr) -> bool:
    """Does mpccs take this array as it is (the caller stages nothing)?"""
    from mpccs import staging

    return isinstance(arr, np.ndarray) or staging.is_device_array(arr)


# ---------------------------------------------------------------------------
# the ranks' work
# ---------------------------------------------------------------------------
def run_comm(comm, name: str, send, recv, rank: int, size: int, n: int) -> None:
    root = root_of(size)
    if name == "all_reduce":
        comm.all_reduce(send, recv)
    elif name == "all_reduce_avg":
        comm.all_reduce(send, recv, op="avg")
    elif name == "reduce_scatter":
        comm.reduce_scatter(send, recv)
    elif name == "all_gather":
        comm.all_gather(send, recv)
    elif name == "all_to_all":
        comm.all_to_all(send, recv)
    elif name == "all_to_allv":
        s, r = allv_counts(rank, size, n)
        comm.all_to_allv(send, s, recv, r)
    elif name == "broadcast":
        recv[...] = send
        comm.broadcast(recv, root=root)
    elif name == "reduce":
        comm.reduce(send, recv if rank == root else None, root=root)
    else:
        raise ValueError(name)


def mpccs_case(comm, dev, direct: bool, name: str, n: int, iters: int, warmup: int):
    rank, size = comm.rank, comm.size
    host_in = make_input(name, rank, size, n)
    x = dev.to_device(host_in)
    out_count = output_count(name, rank, size, n)
    out = None
    times = []
    memory = "staged via host"  # the path the call took (mpccs says in its stats)
    for it in range(warmup + iters):
        comm.barrier()
        dev.sync()
        t0 = time.perf_counter()
        if direct:
            out = dev.empty(out_count)
            run_comm(comm, name, x, out, rank, size, n)
            staged = (comm.last_stats() or {}).get("staging") or {}
            memory = {"device": "gpu-direct", "pinned host": "mpccs mirrors"}.get(staged.get("memory"), memory)
        else:  # staged: device -> host, collective on host memory, host -> device
            h_in = dev.to_host(x)
            h_out = np.empty(out_count, np.float32)
            run_comm(comm, name, h_in, h_out, rank, size, n)
            out = dev.to_device(h_out)
        dev.sync()
        if it >= warmup:
            times.append(time.perf_counter() - t0)
    inputs = [make_input(name, r, size, n) for r in range(size)]
    return times, check(name, dev.to_host(out), rank, size, n, inputs), memory


def torch_case(device: str, name: str, n: int, rank: int, size: int, iters: int, warmup: int):
    import torch
    import torch.distributed as dist

    x = torch.from_numpy(make_input(name, rank, size, n)).to(device)
    out = None
    times = []
    root = root_of(size)
    for it in range(warmup + iters):
        dist.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if name in ("all_reduce", "all_reduce_avg"):
            out = x.clone()
            dist.all_reduce(out, op=dist.ReduceOp.AVG if name == "all_reduce_avg" else dist.ReduceOp.SUM)
        elif name == "reduce_scatter":
            out = torch.empty(n, device=device)
            (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x)
        elif name == "all_gather":
            out = torch.empty(n * size, device=device)
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x)
        elif name == "all_to_all":
            out = torch.empty(n * size, device=device)
            dist.all_to_all_single(out, x)
        elif name == "all_to_allv":
            s, r = allv_counts(rank, size, n)
            out = torch.empty(sum(r), device=device)
            dist.all_to_all_single(out, x, r, s)
        elif name == "broadcast":
            out = x.clone()
            dist.broadcast(out, src=root)
        if device == "cuda":
            torch.cuda.synchronize()
        if it >= warmup:
            times.append(time.perf_counter() - t0)
    assert out is not None and out.device.type == torch.device(device).type
    inputs = [make_input(name, r, size, n) for r in range(size)]
    return times, check(name, out.cpu().numpy(), rank, size, n, inputs)


def fmt_bytes(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def worker(args) -> int:
    rank_env = int(os.environ.get("RANK", "0"))
    use_torch = not args.no_torch
    torch_note = "torch part skipped (--no-torch)"
    torch_device = "cpu" if args.simulate_cpu else "cuda"
    if use_torch:
        try:
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            if torch_device == "cuda" and not torch.cuda.is_available():
                use_torch = False
                torch_note = "torch part skipped: this torch has no CUDA"
        except ImportError:
            use_torch = False
            torch_note = "torch part skipped: torch is not installed"
    if use_torch:
        import mpccs.torch as mt

        # torch's TCPStore takes MASTER_PORT; the mpccs group rendezvouses through it
        dist.init_process_group("mpccs")
        comm = mt.get_communicator()
        torch_note = f"torch backend 'mpccs' on {torch_device} tensors" + (
            "" if torch_device != "cuda" else " (cupy views of the tensors, GPU-direct)" if comm.gpu_direct
            else " (staged through pinned host tensors inside the backend)")
    else:
        import mpccs

        comm = mpccs.init()
    rank, size = comm.rank, comm.size
    assert rank == rank_env
    if args.simulate_cpu:
        dev = HostDevice()
    elif _cupy_devices() > 0:
        dev = CupyDevice()
    else:
        dev = TorchCudaDevice()
    direct = accepts_directly(dev.to_device(np.zeros(1, np.float32)))
    # "direct": the caller passes device arrays; mpccs then moves them GPU-direct or through its mirrors
    path = ("gpu-direct" if comm.gpu_direct else "mpccs mirrors") if direct else "staged via host"
    if rank == 0:
        print(f"gpu_check: {size} ranks, device arrays: {dev.name}, "
              f"{'passed to mpccs directly' if direct else 'staged by the caller through host copies'}"
              f"{' (GPU-direct planes)' if direct and comm.gpu_direct else ''}; {torch_note}", flush=True)

    rows, failures = [], []
    for name in COLLECTIVES:
        for nbytes in args.sizes:
            n = max(1, nbytes // 4)
            times, problem, took = mpccs_case(comm, dev, direct, name, n, args.iters, args.warmup)
            rows.append(("mpccs", name, nbytes, times, problem, took if dev.name == "cupy" else path))
            if problem:
                failures.append(f"rank {rank}: mpccs {name} {fmt_bytes(nbytes)}: {problem}")
    if use_torch:
        for name in TORCH_COLLECTIVES:
            for nbytes in args.sizes:
                n = max(1, nbytes // 4)
                times, problem = torch_case(torch_device, name, n, rank, size, args.iters, args.warmup)
                rows.append(("torch", name, nbytes, times, problem, "backend" if torch_device == "cpu"
                             else "gpu-direct" if comm.gpu_direct else "staged via host"))
                if problem:
                    failures.append(f"rank {rank}: torch {name} {fmt_bytes(nbytes)}: {problem}")

    bad = np.array([len(failures)], np.int64)
    comm.all_reduce(bad)
    # the slowest rank's time is the collective's time
    means = np.array([1e3 * float(np.mean(r[3])) for r in rows], np.float64)
    comm.all_reduce(means, op="max")
    for line in failures:
        print("FAIL", line, flush=True)
    comm.barrier()
    if rank == 0:
        print(f"{'part':<6} {'collective':<15} {'block':>9} {'ms':>9} {'GB/s':>8}  {'path':<16} result")
        for (part, name, nbytes, _, problem, p), ms in zip(rows, means):
            moved = output_count(name, 0, size, max(1, nbytes // 4)) * 4
            gbs = moved / (ms * 1e-3) / 1e9 if ms > 0 else 0.0
            print(f"{part:<6} {name:<15} {fmt_bytes(nbytes):>9} {ms:>9.3f} {gbs:>8.2f}  {p:<16} "
                  f"{'ok' if not problem else 'FAIL'}")
        verdict = "PASS" if int(bad[0]) == 0 else "FAIL"
        print(json.dumps({"gpu_check": verdict.lower(), "ranks": size, "device": dev.name, "path": path,
                          "checks": len(rows) * size, "failures": int(bad[0]), "torch": use_torch}), flush=True)
    if use_torch:
        dist.destroy_process_group()
    else:
        comm.close()
    return 0 if int(bad[0]) == 0 else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if not args.simulate_cpu and not gpu_present():
        if _driver_sees_gpu():
            print("gpu_check: a GPU is present but neither cupy nor a CUDA build of torch is importable; "
                  "install 'mpccs[gpu]' (cupy-cuda12x)", flush=True)
            return 2
        print(f"{SKIP_LINE} (no CUDA device visible to cupy or torch); nothing to check on this machine", flush=True)
        return 0
    from mpccs.launch import run

    t0 = time.perf_counter()
    rc = run(args.ranks, [os.path.abspath(__file__), *worker_argv(args)], grace_s=10.0, timeout_s=args.timeout)
    print(f"gpu_check: {'passed' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.1f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
