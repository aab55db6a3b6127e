"""mpccs.perf with every delivery sample and the estimate it left logged to stderr (DEL lines): how the
thirty-eighth session found 'up' planned at 0.8x its samples' rate. Run as each rank by testbed_run.py."""
import sys
import time

from mpccs.control import controller as C

_on_delivery = C.PathController.on_delivery


def on_delivery(self, plane, sender, nbytes, t_start, t_last, **kw):
    _on_delivery(self, plane, sender, nbytes, t_start, t_last, **kw)
    now = time.perf_counter()
    path = self.estimator._paths.get(sender, {}).get((plane, self.rank))
    rate = path.rate(now) if path else None
    fresh = len(path._fresh(path._clean_delays, now)) if path else -1
    print(f"DEL t={now:.3f} rank={self.rank} from={sender} plane={plane} MB={nbytes / 1e6:.2f} "
          f"dur={(t_last - t_start) * 1e3:.2f} rate={nbytes / (t_last - t_start) / 1e6:.0f} "
          f"est={rate / 1e6 if rate else 0:.0f} fresh={fresh} kw={kw} larger={path._larger if path else None}",
          file=sys.stderr, flush=True)


C.PathController.on_delivery = on_delivery
from mpccs import perf  # noqa: E402

sys.exit(perf.main(sys.argv[1:]))
