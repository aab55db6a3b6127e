import os
exp = os.environ.get("MPCCS_EXP", "")
if exp:
    import mpccs.control.controller as C
    if "hyst0" in exp:
        C.ControlConfig.__dataclass_fields__["chunk_hysteresis"].default = 0.0
        orig_init = C.ControlConfig.__init__
        def init(self, *a, **k):
            orig_init(self, *a, **k)
            self.chunk_hysteresis = 0.0
        C.ControlConfig.__init__ = init
    if "half" in exp:
        import mpccs.comm as M
        orig = M.Communicator._chunking_for if hasattr(M, "Communicator") else None
        cls = next(v for v in vars(M).values() if isinstance(v, type) and hasattr(v, "_chunking_for"))
        orig = cls._chunking_for
        def ch(self, plan, one):
            c, w = orig(self, plan, one)
            if not w and self._policy == "adaptive":
                c = max(65536, c // 2)
            return c, w
        cls._chunking_for = ch

def capped_post_sends(self, cap):
    """CollectiveOp._post_sends posting at most ``cap`` chunks per plane in one pass."""
    from mpccs.windows import UP, OUT
    lanes = []
    for name in (UP, OUT):
        limit = self.window.get(name, 0)
        if name in self.engine.planes and self.inflight[name] < limit:
            lanes.append([name, self.engine.planes[name], limit, 0])
    if not lanes:
        return False
    flows = [(run, outflow) for run in self.active for outflow in run.outs]
    moved = False
    posted = {lane[0]: 0 for lane in lanes}
    while lanes:
        for lane in list(lanes):
            if posted[lane[0]] < cap and self._post_next(lane, flows):
                moved = True
                posted[lane[0]] += 1
            else:
                lanes.remove(lane)
    return moved


if exp.startswith("post"):  # postK: every operation capped at K
    import mpccs.collective_op as CO
    CO.CollectiveOp._post_sends = lambda self, _k=int(exp[4:]): capped_post_sends(self, _k)
if exp.startswith("alt"):  # altK: odd operations capped at K, even ones as shipped (alt_summ.py pairs them)
    import sys, time
    import mpccs.collective_op as CO
    K = int(exp[3:])
    orig_ps = CO.CollectiveOp._post_sends
    CO.CollectiveOp._post_sends = lambda self: capped_post_sends(self, K) if (self.epoch or 0) % 2 else orig_ps(self)
    orig_prep = CO.CollectiveOp._prepare
    def prep(self):
        self._t0x = time.perf_counter(); return orig_prep(self)
    CO.CollectiveOp._prepare = prep
    orig_c = CO.CollectiveOp._complete
    def comp(self):
        r = orig_c(self)
        if self.epoch:
            print(f"OPDUR rank={self.engine.rank} epoch={self.epoch} dur={(time.perf_counter()-self._t0x)*1e3:.3f}", file=sys.stderr, flush=True)
        return r
    CO.CollectiveOp._complete = comp
if exp == "cma4":
    import mpccs.direct_ops as D
    D.DIRECT_CMA_FROM_BYTES = 4 << 20
