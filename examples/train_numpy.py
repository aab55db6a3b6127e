#!/usr/bin/env python
"""Data-parallel training of a small MLP in plain numpy; gradients all-reduced by mpccs.

    mpccs-run -n 2 examples/train_numpy.py                      # 100 steps, both planes, adaptive split
    mpccs-run -n 2 examples/train_numpy.py --policy up          # single-plane baseline
    mpccs-run -n 2 examples/train_numpy.py --no-comm            # compute only: step time without communication
    mpccs-testbed -n 2 -- python examples/train_numpy.py        # on the emulated two-fabric cluster

Every rank holds the same model (same seed) and its own shard of a synthetic
classification task. Backward writes the gradients into one flat buffer, in
the order backward produces them, cut into buckets of about --bucket-kb; each
bucket's ``all_reduce(op="avg", async_op=True)`` starts as soon as its last
gradient is written, so communication overlaps the rest of backward (what DDP
does). After the last step the ranks compare a hash of their weights.

Rank 0 prints a progress line every tenth of the run and, as the last line,
one JSON object: mean step time (after --warmup steps), losses, bytes per plane.
"""
from __future__ import annotations

import argparse
import os
import sys

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMBA_NUM_THREADS")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="training steps (100)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the mean step time (5)")
    p.add_argument("--hidden", type=int, default=256, help="hidden layer width (256)")
    p.add_argument("--layers", type=int, default=2, help="hidden layers (2)")
    p.add_argument("--features", type=int, default=64, help="input features (64)")
    p.add_argument("--classes", type=int, default=10, help="output classes (10)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step (64)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (0.1)")
    p.add_argument("--bucket-kb", type=float, default=256, help="gradient bucket size in KiB (256)")
    p.add_argument("--policy", default=None, help="path policy: up, out, adaptive or a fraction on 'up' (MPCCS_PATH)")
    p.add_argument("--no-comm", action="store_true", help="skip communication: compute-only step time")
    p.add_argument("--gloo", action="store_true",
                   help="all-reduce the gradient buckets with torch.distributed gloo instead (the peer baseline; "
                        "GLOO_SOCKET_IFNAME picks its interface, MPCCS_OUT_DEVICES by default)")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per rank (1)")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    if ns.steps < 1 or ns.warmup < 0 or ns.hidden < 1 or ns.layers < 1 or ns.batch < 1 or ns.bucket_kb <= 0:
        p.error("--steps, --hidden, --layers, --batch must be positive, --warmup >= 0, --bucket-kb > 0")
    return ns


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    for _var in THREAD_VARS:  # before numpy is imported: one BLAS thread unless asked otherwise
        os.environ[_var] = str(ARGS.threads)

import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402


# ---------------------------------------------------------------------------
# model: MLP, ReLU, softmax cross-entropy, manual backprop
# ---------------------------------------------------------------------------
def init_params(sizes: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32))
        params.append(np.zeros(fan_out, np.float32))
    return params


def forward_backward(params, x, labels, grads):
    """Loss; writes d loss / d param into ``grads`` (views), last layer first, yielding after each layer."""
    acts = [x]
    n_layers = len(params) // 2
    h = x
    for i in range(n_layers):
        z = h @ params[2 * i] + params[2 * i + 1]
        h = np.maximum(z, 0) if i < n_layers - 1 else z
        acts.append(h)
    logits = acts[-1]
    logits = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(logits)
    probs = exp / exp.sum(axis=1, keepdims=True)
    batch = x.shape[0]
    loss = float(-np.log(probs[np.arange(batch), labels] + 1e-12).mean())
    delta = probs
    delta[np.arange(batch), labels] -= 1
    delta /= batch
    for i in reversed(range(n_layers)):
        np.matmul(acts[i].T, delta, out=grads[2 * i])
        np.sum(delta, axis=0, out=grads[2 * i + 1])
        if i > 0:
            delta = (delta @ params[2 * i].T) * (acts[i] > 0)
        yield 2 * i  # gradients of layer i are final
    return loss


def run_backward(params, x, labels, grads, on_layer_done):
    gen = forward_backward(params, x, labels, grads)
    while True:
        try:
            on_layer_done(next(gen))
        except StopIteration as stop:
            return stop.value


def make_data(rng, teacher, batch, features):
    x = rng.standard_normal((batch, features)).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=1)


# ---------------------------------------------------------------------------
# gradient buckets
# ---------------------------------------------------------------------------
class Buckets:
    """One flat gradient buffer in backward order, cut into buckets launched as soon as they are complete."""

    def __init__(self, params, bucket_bytes: int):
        order = list(reversed(range(len(params))))  # backward produces the last layer first
        total = sum(p.size for p in params)
        self.flat = np.zeros(total, np.float32)
        self.grads = [None] * len(params)
        self.end_of = {}
        offset = 0
        for i in order:
            self.grads[i] = self.flat[offset:offset + params[i].size].reshape(params[i].shape)
            offset += params[i].size
            self.end_of[i] = offset
        per = max(1, bucket_bytes // 4)
        self.bounds = [(s, min(s + per, total)) for s in range(0, total, per)]
        self.works = []
        self.next = 0

    def reset(self):
        self.works, self.next = [], 0

    def launch_ready(self, comm, ready_upto: int):
        while self.next < len(self.bounds) and self.bounds[self.next][1] <= ready_upto:
            s, e = self.bounds[self.next]
            if comm is not None:
                self.works.append(comm.all_reduce(self.flat[s:e], op="avg", async_op=True))
            self.next += 1

    def wait_all(self):
        stats = []
        for w in self.works:
            w.wait()
            stats.append(w.stats())
        return stats


class GlooBuckets:
    """Stands in for the communicator in Buckets: the same buckets through torch gloo (zero copy)."""

    def __init__(self, size: int):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.size = torch, dist, size

    def all_reduce(self, view, op="avg", async_op=True):
        work = self.dist.all_reduce(self.torch.from_numpy(view), async_op=True)
        return _GlooWork(work, view, self.size)


class _GlooWork:
    def __init__(self, work, view, size):
        self.work, self.view, self.size = work, view, size

    def wait(self):
        self.work.wait()
        self.view /= self.size  # gloo has no avg: sum, then divide, as DDP does

    def stats(self):
        return None


def init_gloo(rank: int, size: int):
    """torch.distributed gloo on the scale-out interface, next to mpccs's rendezvous port."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("MPCCS_OUT_DEVICES", "lo"))
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")) + 1
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size)
    return GlooBuckets(size)


def weights_digest(params) -> int:
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p).tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1  # fits int64


def progress_line(step, steps, loss, step_ms, width=24) -> str:
    filled = int(width * step / steps)
    return f"step {step:>{len(str(steps))}}/{steps} [{'#' * filled}{'.' * (width - filled)}] loss {loss:.4f}  step {step_ms:.2f} ms"


def main(args) -> int:
    import mpccs

    comm = mpccs.init()
    rank, size = comm.rank, comm.size
    if args.policy is not None:
        comm.set_path_policy(args.policy)
    use_comm = not args.no_comm
    reducer = init_gloo(rank, size) if args.gloo and use_comm else comm
    sizes = [args.features] + [args.hidden] * args.layers + [args.classes]
    params = init_params(sizes, args.seed)  # same on every rank
    teacher = np.random.default_rng(args.seed + 10_000).standard_normal((args.features, args.classes)).astype(np.float32)
    data_rng = np.random.default_rng(args.seed * 1000 + rank + 1)  # this rank's shard
    buckets = Buckets(params, int(args.bucket_kb * 1024))
    n_params = int(sum(p.size for p in params))
    if rank == 0:
        print(f"train_numpy: {size} rank(s), {n_params} parameters ({n_params * 4 / 2**20:.2f} MiB), "
              f"{len(buckets.bounds)} bucket(s) of <= {args.bucket_kb:g} KiB, policy "
              f"{'gloo' if args.gloo else comm.path_policy if use_comm else 'none (--no-comm)'}", flush=True)

    step_times, losses = [], []
    bytes_per_plane: dict = {}
    report_every = max(1, args.steps // 10)
    lr = np.float32(args.lr)
    for step in range(1, args.steps + 1):
        x, labels = make_data(data_rng, teacher, args.batch, args.features)
        t0 = time.perf_counter()
        buckets.reset()
        loss = run_backward(params, x, labels, buckets.grads,
                            lambda i: buckets.launch_ready(reducer if use_comm else None, buckets.end_of[i]))
        for stats in buckets.wait_all():
            for plane, n in (stats or {}).get("bytes_per_plane", {}).items():
                bytes_per_plane[plane] = bytes_per_plane.get(plane, 0) + int(n)
        for p, g in zip(params, buckets.grads):
            p -= lr * g
        step_times.append(time.perf_counter() - t0)
        # the reported loss is every rank's mean; reduced outside the timed step
        if use_comm and (step == 1 or step == args.steps or step % report_every == 0):
            mean = np.array([loss], np.float64)
            comm.all_reduce(mean, op="avg")
            loss = float(mean[0])
        losses.append(loss)
        if rank == 0 and (step == 1 or step == args.steps or step % report_every == 0):
            print(progress_line(step, args.steps, loss, step_times[-1] * 1e3), flush=True)

    identical = None
    if use_comm:
        digests = np.zeros(size, np.int64)
        comm.all_gather(np.array([weights_digest(params)], np.int64), digests)
        identical = bool(np.all(digests == digests[0]))
        comm.barrier()  # everybody's output is out before rank 0's last line
    measured = step_times[args.warmup:] or step_times
    result = {
        "example": "train_numpy", "ranks": size, "steps": args.steps, "warmup": args.warmup,
        "measured_steps": len(measured), "mean_step_ms": round(1e3 * float(np.mean(measured)), 4),
        "median_step_ms": round(1e3 * float(np.median(measured)), 4),
        "params": n_params, "hidden": args.hidden, "layers": args.layers, "batch": args.batch,
        "bucket_kb": args.bucket_kb, "buckets_per_step": len(buckets.bounds), "comm": use_comm,
        "policy": ("gloo" if args.gloo else str(comm.path_policy)) if use_comm else None,
        "first_loss": round(losses[0], 6), "final_loss": round(losses[-1], 6),
        "weights_identical": identical, "bytes_per_plane": bytes_per_plane,
    }
    if args.gloo and use_comm:
        import torch.distributed as dist

        dist.destroy_process_group()
    comm.close()
    if rank == 0:
        if identical is False:
            print("ERROR: ranks ended with different weights", flush=True)
        print(json.dumps(result), flush=True)
    return 1 if identical is False else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
