import os, time, numpy as np, mpccs
comm = mpccs.init()
x = np.ones(2, np.float32)
for _ in range(300): comm.all_reduce(x)
cpus=set(); ts=[]
for i in range(3000):
    t=time.perf_counter(); comm.all_reduce(x); ts.append(time.perf_counter()-t)
    if i % 100 == 0: cpus.add(int(open("/proc/self/stat").read().split()[38]))
ts=np.array(ts)*1e6
print(f"rank {comm.rank} med {np.median(ts):.1f} p10 {np.percentile(ts,10):.1f} p90 {np.percentile(ts,90):.1f} cpus {sorted(cpus)}", flush=True)
comm.close()
