import os, sys, time
# bursty high-priority CPU hog pinned to one core: spin `on` ms, sleep `off` ms, for `dur` s
core, on, off, dur = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
os.sched_setaffinity(0, {core})
end = time.time() + dur
while time.time() < end:
    t = time.perf_counter() + on / 1e3
    while time.perf_counter() < t: pass
    time.sleep(off / 1e3)
