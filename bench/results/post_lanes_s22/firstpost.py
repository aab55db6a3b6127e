import json, statistics
ev={r:json.load(open(f"/tmp/chunks.{r}")) for r in (0,1)}
for r in (0,1):
    seqs=sorted({e[1] for e in ev[r]})
    offs=[]; offs_up=[]
    for s in seqs[3:]:
        posts=[e for e in ev[r] if e[1]==s and e[0]=="post"]
        if not posts: continue
        t0=min(e[4] for e in posts)
        o=[e[4] for e in posts if e[2]=="out"]
        if o: offs.append((min(o)-t0)*1e3)
    print(r, "first out post after first post (ms): median", round(statistics.median(offs),2), "range", round(min(offs),2), round(max(offs),2), "n", len(offs))
