import json, sys, glob, os, statistics
d = sys.argv[1]
rows = {}
for f in sorted(glob.glob(f"{d}/*/verdicts.json")):
    tag = os.path.basename(os.path.dirname(f)).split("_")[0]
    for v in json.load(open(f))["results"]:
        rows.setdefault((v["collective"], v["size"]), {}).setdefault(tag, []).append((v["vs_sum"][0], v["vs_up"][0], v["share_up"]))
for k, t in sorted(rows.items()):
    print(f"{k[0]:15s} {k[1] >> 20:3d}MiB", " | ".join(f"{tag}: sum " + " ".join(f"{a:.2f}" for a, _, _ in xs) + "  up " + " ".join(f"{b:.2f}" for _, b, _ in xs) + "  share " + " ".join(f"{c:.2f}" for _, _, c in xs) for tag, xs in sorted(t.items())))
