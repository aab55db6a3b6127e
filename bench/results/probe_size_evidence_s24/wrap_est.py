import os, runpy, sys
from mpccs.control import estimator as E
orig = E.PathEstimator._fit_idle_only
last = {}
def fit(self, clean, now=None):
    res = orig(self, clean, now)
    if res is None: return res
    a = self._fit_delay(clean)
    med = E._lower_median_rate(clean[-E.IDLE_RATE_SAMPLES:], a)
    larger = self._larger_rate(clean, a, now)
    key = (id(self))
    sig = (round(med/1e6), None if larger is None else round(larger/1e6), round(a*1e3, 2), len(clean))
    if last.get(key) != sig and med < 2e8 and (larger is not None or med < 1.4e8):
        last[key] = sig
        print(f"EST r={os.environ.get('RANK')} med={sig[0]}MB/s larger={sig[1]} a={sig[2]}ms n={sig[3]} sizes={[n>>10 for _,_,n in clean[-6:]]} lat_ms={[round(l*1e3,1) for _,l,_ in clean[-6:]]}", file=sys.stderr, flush=True)
    return res
E.PathEstimator._fit_idle_only = fit
sys.argv = ["mpccs.perf"] + sys.argv[1:]
runpy.run_module("mpccs.perf", run_name="__main__")
