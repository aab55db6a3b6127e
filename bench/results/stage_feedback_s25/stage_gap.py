import json, statistics, sys
d0 = sys.argv[1]
for r in (0, 1):
    rows = {}
    for l in open(f'{d0}.rank{r}'):
        d = json.loads(l)
        if d.get('op') != 'all_reduce' or d['seq'] < 30: continue
        st = d.get('stages') or []
        if len(st) < 2: continue
        gap = st[1]['t_start_wall'] - (st[0]['t_start_wall'] + st[0]['duration_s'])
        rows.setdefault(d['policy'], []).append((d['duration_s'], gap))
    for pol, xs in rows.items():
        print(r, pol, len(xs), "op median %.2f ms | stage gap median %.3f ms" % (statistics.median(x[0] for x in xs) * 1e3, statistics.median(x[1] for x in xs) * 1e3))
