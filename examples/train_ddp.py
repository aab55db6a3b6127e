#!/usr/bin/env python
"""torch DistributedDataParallel with gradients all-reduced by mpccs (or gloo, for comparison).

    mpccs-run -n 2 examples/train_ddp.py                    # gloo group for DDP, mpccs allreduce_hook for gradients
    mpccs-run -n 2 examples/train_ddp.py --backend gloo     # plain gloo DDP: the baseline
    mpccs-run -n 2 examples/train_ddp.py --backend mpccs-pg # DDP directly over init_process_group("mpccs")
    torchrun --nproc-per-node 2 examples/train_ddp.py       # the same under torchrun

Same model on every rank (same seed), each rank its own shard of a synthetic
classification task. Rank 0 prints a progress line every tenth of the run and,
as the last line, one JSON object with the mean step time (after --warmup
steps), the losses, and whether every rank ended with identical weights.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time

BACKENDS = ("mpccs", "gloo", "mpccs-pg")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=BACKENDS, default="mpccs",
                   help="mpccs: gloo DDP + mpccs hook (default); gloo: plain gloo DDP; mpccs-pg: DDP over the mpccs backend")
    p.add_argument("--steps", type=int, default=100, help="training steps (100)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the mean step time (5)")
    p.add_argument("--hidden", type=int, default=256, help="hidden layer width (256)")
    p.add_argument("--layers", type=int, default=2, help="hidden layers (2)")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step (64)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (25)")
    p.add_argument("--policy", default=None, help="mpccs path policy: up, out, adaptive or a fraction on 'up'")
    p.add_argument("--no-overlap", action="store_true", help="hook: finish each bucket inside its own hook call")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model and batches live (cuda: every rank on GPU 0; gradients reach mpccs "
                        "through pinned host copies)")
    ns = p.parse_args(argv)
    if ns.steps < 1 or ns.warmup < 0 or ns.hidden < 1 or ns.layers < 1 or ns.batch < 1 or ns.bucket_mb <= 0:
        p.error("--steps, --hidden, --layers, --batch must be positive, --warmup >= 0, --bucket-mb > 0")
    return ns


def progress_line(step, steps, loss, step_ms, width=24) -> str:
    filled = int(width * step / steps)
    return f"step {step:>{len(str(steps))}}/{steps} [{'#' * filled}{'.' * (width - filled)}] loss {loss:.4f}  step {step_ms:.2f} ms"


def main(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(args.threads)
    if "RANK" not in os.environ:  # a plain `python train_ddp.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if os.environ.get("MPCCS_TESTBED") and os.environ.get("MPCCS_OUT_DEVICES"):
        # mpccs-testbed: every rank has its own network namespace, where gloo's default (the address the
        # host name resolves to) is loopback. Put gloo on the shaped scale-out link, mpccs' 'out' plane.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ["MPCCS_OUT_DEVICES"])
    import mpccs.torch as mt

    dist.init_process_group("mpccs" if args.backend == "mpccs-pg" else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("train_ddp: --device cuda but this torch sees no GPU")
        torch.cuda.set_device(0)
    torch.manual_seed(args.seed)  # same weights everywhere
    dims = [args.features] + [args.hidden] * args.layers + [args.classes]
    layers = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(device)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb, device_ids=[0] if device.type == "cuda" else None)
    comm = state = None
    if args.backend == "mpccs":
        state = mt.hook_state(overlap=not args.no_overlap)  # an mpccs communicator over the gloo group's store
        ddp.register_comm_hook(state, mt.allreduce_hook)
        comm = state.comm
    elif args.backend == "mpccs-pg":
        comm = mt.get_communicator()
    if comm is not None and args.policy is not None:
        comm.set_path_policy(args.policy)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    teacher = torch.randn(args.features, args.classes,
                          generator=torch.Generator().manual_seed(args.seed + 10_000)).to(device)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)  # this rank's shard
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"train_ddp: {size} rank(s), backend {args.backend}, {n_params} parameters on {device}, "
              f"policy {comm.path_policy if comm is not None else 'n/a'}", flush=True)

    report_every = max(1, args.steps // 10)
    step_times, losses = [], []
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.features, generator=gen).to(device)
        y = torch.argmax(x @ teacher, dim=1)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step ends when the GPU's work does
        step_times.append(time.perf_counter() - t0)
        value = loss.item()
        if step == 1 or step == args.steps or step % report_every == 0:
            t = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(t)  # every rank's mean, outside the timed step
            value = t.item() / size
            if rank == 0:
                print(progress_line(step, args.steps, value, step_times[-1] * 1e3), flush=True)
        losses.append(value)

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    digest = torch.tensor([int.from_bytes(h.digest()[:8], "little") >> 1], dtype=torch.int64)
    digests = [torch.zeros_like(digest) for _ in range(size)]
    dist.all_gather(digests, digest)
    identical = all(int(d) == int(digests[0]) for d in digests)
    measured = step_times[args.warmup:] or step_times
    result = {
        "example": "train_ddp", "backend": args.backend, "ranks": size, "steps": args.steps, "warmup": args.warmup,
        "measured_steps": len(measured), "mean_step_ms": round(1e3 * sum(measured) / len(measured), 4),
        "params": n_params, "hidden": args.hidden, "bucket_mb": args.bucket_mb, "device": str(device),
        "policy": str(comm.path_policy) if comm is not None else None,
        "hook_buckets": state.buckets if state is not None else None,
        "first_loss": round(losses[0], 6), "final_loss": round(losses[-1], 6), "weights_identical": identical,
    }
    # Tear down in order: DDP's reducer holds the process group, and gloo aborts
    # the process at exit ("terminate called without an active exception") when
    # a group outlives its users into interpreter shutdown.
    dist.barrier()
    del ddp, opt
    gc.collect()
    if state is not None:
        state.comm.close()
    dist.destroy_process_group()
    if rank == 0:
        if not identical:
            print("ERROR: ranks ended with different weights", flush=True)
        print(json.dumps(result), flush=True)
    return 0 if identical else 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main(parse_args()))
