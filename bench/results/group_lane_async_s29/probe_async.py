import time, collections, numpy as np, mpccs
comm = mpccs.init()
x = np.ones(2, np.float32)
for mode in ("block", "async", "block", "async"):
    for _ in range(200):
        comm.all_reduce(x) if mode == "block" else comm.all_reduce(x, async_op=True).wait()
    comm.barrier()
    c = collections.Counter()
    t0 = time.perf_counter()
    for _ in range(2000):
        if mode == "block":
            comm.all_reduce(x)
        else:
            w = comm.all_reduce(x, async_op=True); w.wait()
        c[type(comm._last_stats).__name__] += 1
    if comm.rank == 0: print(mode, f"{(time.perf_counter()-t0)/2000*1e6:.1f}us", dict(c), flush=True)
comm.close()
