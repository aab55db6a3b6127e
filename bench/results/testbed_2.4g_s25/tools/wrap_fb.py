import sys, time, collections, atexit
from mpccs.control import controller as C
from mpccs import collective_op as CO
rec = collections.defaultdict(list)
for name in ("on_delivery", "on_stage", "decide"):
    f = getattr(C.PathController, name)
    def g(self, *a, _f=f, _n=name, **k):
        t = time.perf_counter(); r = _f(self, *a, **k); rec[_n].append(time.perf_counter() - t); return r
    setattr(C.PathController, name, g)
orig = CO.CollectiveOp._retire_stages
def ret(self):
    t = time.perf_counter(); m = orig(self)
    if m: rec["retire_moved"].append(time.perf_counter() - t)
    return m
CO.CollectiveOp._retire_stages = ret
orig_s = CO.CollectiveOp._start_stage
def ss(self, st):
    t = time.perf_counter(); r = orig_s(self, st); rec["start_stage"].append(time.perf_counter() - t); return r
CO.CollectiveOp._start_stage = ss
def report():
    med = lambda v: sorted(v)[len(v)//2]
    print("FB " + "; ".join(f"{k} n={len(v)} med {med(v)*1e6:.0f} us p90 {sorted(v)[int(len(v)*.9)]*1e6:.0f}" for k, v in rec.items() if v), file=sys.stderr, flush=True)
atexit.register(report)
from mpccs import perf
sys.exit(perf.main(sys.argv[1:]))
