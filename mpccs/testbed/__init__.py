"""The emulated two-fabric cluster on one machine (``mpccs-testbed``); see docs/testbed.md.

    from mpccs.testbed import Cluster
    with Cluster(n=2, up="tcp", up_rate="2.4gbit", out_rate="1.2gbit") as c:
        c.run([sys.executable, "prog.py"], timeout=60)
"""
# The calibrate module stays reachable as mpccs.testbed.calibrate (no function shadows it).
from mpccs.testbed.calibrate import CalibrationError, gate
from mpccs.testbed.cluster import Cluster, RankNet, RunResult, TimedAction, sweep
from mpccs.testbed.netns import (MissingToolError, NotRootError, TestbedUnavailable,
                                 check_available, parse_rate)

__all__ = ["Cluster", "RankNet", "RunResult", "TimedAction", "sweep", "gate",
           "CalibrationError", "TestbedUnavailable", "NotRootError", "MissingToolError",
           "check_available", "parse_rate"]
