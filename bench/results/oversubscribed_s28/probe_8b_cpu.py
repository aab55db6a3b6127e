import os, time, numpy as np, mpccs
comm = mpccs.init()
x = np.zeros(2, np.float32)
for _ in range(300): comm.all_reduce(x)
N = 2000
c0 = time.process_time(); t0 = time.perf_counter()
for _ in range(N): comm.all_reduce(x)
c1 = time.process_time(); t1 = time.perf_counter()
print(comm.rank, f"wall {(t1-t0)/N*1e6:.0f} us cpu {(c1-c0)/N*1e6:.0f} us per op")
comm.close()
