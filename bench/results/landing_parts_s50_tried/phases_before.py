import sys, time, numpy as np
import mpccs
from mpccs import cma_steps
T = {}
C = cma_steps.CmaSteps
oi, of, ol, oa = C.__init__, C._first_step, C._land_result, C.advance
def init(self, *a, **k):
    T['init0'] = time.perf_counter(); oi(self, *a, **k); T['init1'] = time.perf_counter()
def first(self, *a):
    T['first0'] = time.perf_counter(); of(self, *a); T['first1'] = time.perf_counter()
def land(self):
    T['land0'] = time.perf_counter(); ol(self); T['land1'] = time.perf_counter()
def adv(self):
    r = oa(self)
    if self.done and 'fin' not in T: T['fin'] = time.perf_counter()
    return r
C.__init__, C._first_step, C._land_result, C.advance = init, first, land, adv
comm = mpccs.init()
n = int(sys.argv[1]) // 4 if len(sys.argv) > 1 else (1 << 20)
x = np.ones(n, np.float32)
rows = []
for i in range(400):
    comm.barrier()
    T.clear()
    t0 = time.perf_counter()
    comm.all_reduce(x)
    t1 = time.perf_counter()
    if i >= 50:
        rows.append((T['init0'] - t0, T['first0'] - T['init1'], T['first1'] - T['first0'], T['land0'] - T['first1'],
                     T['land1'] - T['land0'], T['fin'] - T['land1'], t1 - T['fin'], t1 - t0))
a = np.array(rows) * 1e6
names = "entry wait_post first_rr wait_reduced land wait_done exit total".split()
print(f"[{comm.rank}] landing={comm.landing}")
print(f"[{comm.rank}] " + " ".join(f"{n}={v:.0f}" for n, v in zip(names, np.median(a, axis=0))))
