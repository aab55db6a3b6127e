import os, sys, time, numpy as np, mpccs
comm = mpccs.init()
x = np.ones(2, np.float32)
for _ in range(2000): comm.all_reduce(x, async_op=True).wait()
N=10000
t=time.perf_counter()
for _ in range(N): comm.all_reduce(x, async_op=True).wait()
dt=(time.perf_counter()-t)/N
print(comm.rank, f"async {dt*1e6:.2f} us/call", comm.last_stats()["algorithm"])
t=time.perf_counter()
for _ in range(N): comm.all_reduce(x)
dt=(time.perf_counter()-t)/N
print(comm.rank, f"blocking {dt*1e6:.2f} us/call")
comm.close()
