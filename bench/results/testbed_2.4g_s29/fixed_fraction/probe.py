import json, os, sys, numpy as np
sys.path.insert(0, "/work/main/bench")
from mpccs.testbed import Cluster
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
with Cluster(n=2, up="tcp", up_rate="2.4gbit", out_rate="1.2gbit", log=lambda m: None) as cluster:
    for coll in sys.argv[2].split(","):
        path = os.path.join(out, f"{coll}.json")
        argv = [sys.executable, "-m", "mpccs.perf", coll, "-b", "16M", "-e", "64M", "-f", "4", "-n", "10", "-w", "3",
                "--policies", "up,0.667,adaptive,out", "--quiet", "-J", path, "--settle", "12"]
        r = cluster.run(argv, timeout=1800, stream=open(os.devnull, "w"))
        assert r.exit_code == 0, r.output[0][-20:]
        d = json.load(open(path))
        for row in d["rows"]:
            t = np.array(row["times_us"]) / 1e3
            print(coll, row["size"] >> 20, row["policy"], f"median {np.median(t):.1f} min {t.min():.1f} max {t.max():.1f}", "share", row["up_share"], flush=True)
