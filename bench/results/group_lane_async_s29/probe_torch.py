import os, sys, time, torch, torch.distributed as dist
backend = sys.argv[1]
if backend == "mpccs":
    import mpccs.torch
dist.init_process_group(backend)
res = []
for n in (2, 16384):
    t = torch.ones(n)
    for _ in range(100): dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(1000): dist.all_reduce(t)
    res.append((time.perf_counter() - t0) / 1000 * 1e6)
if dist.get_rank() == 0: print(backend, dist.get_world_size(), " ".join(f"{v:.1f}us" for v in res), flush=True)
dist.destroy_process_group()
