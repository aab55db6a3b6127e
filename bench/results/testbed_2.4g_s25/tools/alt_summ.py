import re, sys, statistics, collections
d = collections.defaultdict(dict)
for l in open(sys.argv[1]):
    m = re.search(r"OPDUR rank=(\d) epoch=(\d+) dur=([\d.]+)", l)
    if m: d[int(m.group(2))][int(m.group(1))] = float(m.group(3))
ep = sorted(e for e in d if e > 20 and len(d[e]) == 2)
op = {e: max(d[e].values()) for e in ep}
pairs = [op[e + 1] / op[e] for e in ep if e % 2 == 0 and e + 1 in op]  # capped (odd) / default (even)
ev = [op[e] for e in ep if e % 2 == 0]; od = [op[e] for e in ep if e % 2]
print(f"ops {len(ep)}: default(even) median {statistics.median(ev):.2f} ms, capped(odd) median {statistics.median(od):.2f} ms; paired ratio capped/default median {statistics.median(pairs):.3f} (n {len(pairs)}, q25 {sorted(pairs)[len(pairs)//4]:.3f} q75 {sorted(pairs)[3*len(pairs)//4]:.3f})")
