import os, sys, time, numpy as np
import mpccs
from mpccs import cma_steps
pc = time.perf_counter
D = []
orig_rr = cma_steps.CmaSteps._read_and_reduce
def rr(self, address):
    t0 = pc(); orig_rr(self, address); D.append(pc() - t0)
cma_steps.CmaSteps._read_and_reduce = rr
n = (8 << 20) // 4
orig = np.ones(n, np.float32); x = orig.copy()
comm = mpccs.init(); rank = comm.rank
for i in range(200):
    np.copyto(x, orig); comm.barrier(); comm.all_reduce(x)
print(f"{mpccs.__file__.split('/mpccs/')[0]} rank {rank}: read_and_reduce of 4 MiB (8 parts) median {np.median(D[20:])*1e6:.0f} us", flush=True)
comm.close()
