import mmap, os, time, numpy as np, sys
m = mmap.mmap(-1, 4096)
a = np.frombuffer(m, np.int64)
pid = os.fork()
me = 0 if pid else 1
N=200000
t=time.perf_counter()
for i in range(1, N+1):
    if me == 0:
        a[0] = i
        while a[8] != i: pass
    else:
        while a[0] != i: pass
        a[8] = i
dt=(time.perf_counter()-t)/N*1e6
if me==0: os.waitpid(pid,0); print(f"round trip {dt:.2f} us")
else: os._exit(0)
