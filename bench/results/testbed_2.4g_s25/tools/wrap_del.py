import sys, time
from mpccs import flows as F, collective_op as CO
orig = CO.CollectiveOp._teach_controller
def teach(self, run):
    if self.splitter.policy == "adaptive" and self.epoch and self.epoch > 14:
        for plane, sender, nbytes, t_first, t_last in run.delivery_samples():
            a = run.arrivals.get((plane, sender))
            print(f"DEL rank={self.rank} epoch={self.epoch} plane={plane} MB={nbytes/1e6:.2f} start={(t_first-run.t_start)*1e3:.2f} "
                  f"first_arr={(a[0]-run.t_start)*1e3:.2f} last_arr={(t_last-run.t_start)*1e3:.2f} chunks={a[3]} "
                  f"silent={(run.silent_until.get((plane, sender), run.t_start)-run.t_start)*1e3:.2f} rate={nbytes/(t_last-t_first)/1e6:.0f} stage={(run.t_end-run.t_start)*1e3:.2f}",
                  file=sys.stderr, flush=True)
    return orig(self, run)
CO.CollectiveOp._teach_controller = teach
from mpccs import perf
sys.exit(perf.main(sys.argv[1:]))
