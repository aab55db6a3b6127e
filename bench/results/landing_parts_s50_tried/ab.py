import sys, time, numpy as np
import mpccs
from mpccs import cma_steps
C = cma_steps.CmaSteps
oi = C.__init__
way = [True]
def init(self, *a, **k):
    oi(self, *a, **k)
    self.posts_parts = self.posts_parts and way[0]
C.__init__ = init
comm = mpccs.init()
for mib in [float(v) for v in sys.argv[1].split(",")]:
  for in_place in (True, False):
    n = int(mib * (1 << 20)) // 4
    x = np.ones(n, np.float32); y = np.empty_like(x)
    res = {True: [], False: []}
    for i in range(300):
        way[0] = bool(i % 2)
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(x, None if in_place else y)
        t1 = time.perf_counter()
        if i >= 40:
            res[way[0]].append(t1 - t0)
    t = np.array([np.median(res[False]), np.median(res[True])])
    m = comm.all_reduce(t, op="max")  # (small: another path)
    if comm.rank == 0:
        print(f"{mib:5} MiB {'in ' if in_place else 'out'} plain {m[0]*1e6:7.0f} parts {m[1]*1e6:7.0f}  parts/plain {m[1]/m[0]:.3f}", flush=True)
