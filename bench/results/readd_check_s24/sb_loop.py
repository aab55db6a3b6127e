"""The shared-bottleneck testbed test's job, N times, optionally under a bursty
real-time CPU hog on both cores (cpu_hog.py: 15 ms on, 20/25 ms off): prints each
run's share on 'up' per operation and whether the last 4 ended on one plane.

    OPS=12 python sb_loop.py 6 hog      (root: network namespaces)
    PYTHONPATH=<other checkout> ...     runs that checkout's library
"""
import json, os, subprocess, sys, time, statistics
from mpccs.testbed import Cluster
HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "..", "..", "..", "tests", "programs", "testbed_job.py")
n, hog = int(sys.argv[1]), sys.argv[2] == "hog"
for i in range(n):
    with Cluster(n=2, up="tcp", up_rate="1gbit", out_rate="500mbit", shared_bottleneck=True, log=lambda m: None) as c:
        h = [subprocess.Popen(["chrt", "-f", "50", sys.executable, os.path.join(HERE, "cpu_hog.py"), str(k), "15", str(20 + 5 * k), "120"]) for k in (0, 1)] if hog else None
        t = time.time()
        run = c.run([sys.executable, JOB, "adaptive", str(32 << 20), os.environ.get("OPS", "10")], timeout=300, stream=open(os.devnull, "w"))
        [p.kill() for p in (h or [])]
    res = next(json.loads(l[7:]) for l in run.output[0] if l.startswith("RESULT "))
    settled = statistics.median(res["share"][-4:])
    ok = settled >= 0.9 or settled <= 0.1
    print("    up", [round(t*1e3) for t in res["up"]], "adaptive", [round(t*1e3) for t in res["adaptive"]])
    print(f"run {i} {'ok ' if ok else 'FAIL'} {time.time()-t:.0f}s share {[round(s,2) for s in res['share']]}", flush=True)
    for e in res["events"]:
        print("   ", json.dumps(e)[:300], flush=True)
