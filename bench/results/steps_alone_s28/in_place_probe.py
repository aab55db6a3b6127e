import os, sys, time, numpy as np, mpccs
pc = time.perf_counter
comm = mpccs.init()
out = {}
for size in (1 << 20, 2 << 20, 4 << 20, 8 << 20):
    x = np.zeros(size // 4, np.float32)
    for _ in range(30): comm.all_reduce(x)
    lat = []
    for _ in range(300):
        comm.barrier(); t = pc(); comm.all_reduce(x); lat.append(pc() - t)
    out[size >> 20] = np.median(lat) * 1e6
if comm.rank == 0: print("RES", " ".join(f"{k}M={v:.0f}" for k, v in out.items()))
comm.close()
