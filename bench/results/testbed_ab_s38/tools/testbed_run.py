"""One testbed run (2.4 / 1.2 Gbit/s, 2 ranks) of COLLECTIVE at 16-64 MiB, policies up,up,out,adaptive,0.667,
with delivery_log.py's DEL lines in OUT (and mpccs-perf's JSON in OUT.json). Root; run from the checkout
whose mpccs the ranks should import:

    python bench/results/testbed_ab_s38/tools/testbed_run.py /tmp/del.log [all_reduce]
"""
import os
import sys

sys.path.insert(0, os.getcwd())
from mpccs.testbed import Cluster  # noqa: E402

out = sys.argv[1]
collective = sys.argv[2] if len(sys.argv) > 2 else "all_reduce"
wrapper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delivery_log.py")
with Cluster(n=2, up="tcp", up_rate="2.4gbit", out_rate="1.2gbit", log=lambda m: None) as cluster:
    argv = [sys.executable, wrapper, collective, "-b", "16M", "-e", "64M", "-f", "4", "-n", "20", "-w", "3",
            "--policies", "up,up,out,adaptive,0.667", "--settle", "12", "-J", out + ".json"]
    result = cluster.run(argv, env={"PYTHONPATH": os.getcwd()}, timeout=900, stream=open(out, "w"))
sys.exit(result.exit_code)
