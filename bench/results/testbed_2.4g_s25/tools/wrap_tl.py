"""Timeline of the first stage of each adaptive op: fingerprint verified, posts, arrivals (stderr TL lines)."""
import sys, time
from mpccs import flows as F, collective_op as CO
T = {}
def rel(op):
    return round((time.perf_counter() - op._t0) * 1e3, 2)
orig_prep = CO.CollectiveOp._prepare
def prep(self):
    self._t0 = time.perf_counter(); self._tl = []
    return orig_prep(self)
CO.CollectiveOp._prepare = prep
orig_fp = CO.CollectiveOp._check_fingerprints
def fp(self):
    before = set(self.verified); m = orig_fp(self)
    for p in set(self.verified) - before: self._tl.append(("fp", p, rel(self)))
    return m
CO.CollectiveOp._check_fingerprints = fp
orig_ss = CO.CollectiveOp._start_stage
def ss(self, st):
    self._tl.append(("start", st.id, rel(self))); r = orig_ss(self, st); self._tl.append(("started", st.id, rel(self))); return r
CO.CollectiveOp._start_stage = ss
orig_send = CO.CollectiveOp._send_chunk
def send(self, run, outflow, plane, index):
    n = orig_send(self, run, outflow, plane, index); self._tl.append(("post", plane.name, rel(self))); return n
CO.CollectiveOp._send_chunk = send
orig_note = F.StageRun.note_arrival
def note(self, plane, peer, nbytes, now):
    self._arr = getattr(self, "_arr", 0) + 1
    return orig_note(self, plane, peer, nbytes, now)
F.StageRun.note_arrival = note
orig_pr = CO.CollectiveOp._post_receives
def pr(self):
    m = orig_pr(self)
    self._tl.append(("look", int(m), rel(self)))
    return m
CO.CollectiveOp._post_receives = pr
orig_c = CO.CollectiveOp._complete
def comp(self):
    r = orig_c(self)
    if self.splitter.name == "adaptive" and self.epoch and self.epoch > 16:
        # compress looks: keep the first look that found something and empty looks count
        out, empties = [], 0
        for e in self._tl:
            if e[0] == "look" and e[1] == 0:
                empties += 1; last_empty = e[2]; continue
            if empties: out.append(("empty", empties, last_empty)); empties = 0
            out.append(e)
        print(f"TL rank={self.engine.rank} epoch={self.epoch} {out[:60]}", file=sys.stderr, flush=True)
    return r
CO.CollectiveOp._complete = comp
from mpccs import perf
sys.exit(perf.main(sys.argv[1:]))
