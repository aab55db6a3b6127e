"""A probe, not a feature: would flushing the outbox help a 2-rank all_reduce of 384 KiB-2 MiB in slow launches?

    python bench/outbox_flush_probe.py --out bench/results/outbox_flush_probe_s49 --launches 8   # ~1 min

Below 2 MiB a 2-rank all_reduce goes through the shared-memory outboxes
(shm_steps.py): each rank copies its operand of the peer's half into its own
outbox (step 1), the peer reduces over that outbox (step 2), and the owner
copies the result out (step 3). Each outbox line so moves between the two
cores' caches every call. In the launches where the in-place landing is slow
(docs/design.md, "The landing of an in-place all_reduce") this path slowed
3-5x too (bench/results/peer_rounds_s49/). Here each launch alternates, call
by call, the library's steps ("plain") with step 1 replaced by: flush the
outbox, copy in, flush it again ("flushed": transports/cacheflush.py), so
that neither rank's stores wait for lines the other holds. It patches
ShmSteps in the ranks it runs, without the library's own choice (which
now flushes the same way where it measures slow: shm_steps.py). Rank 0 reports,
per launch and way, the call and each step's median time. Writes probe.json
and probe.md.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from stats import host_text, ways_in_launches, write_results  # noqa: E402

WAYS = ("plain", "flushed")


def rank_main(nbytes: int, calls: int, out: str) -> None:
    """One rank of a launch: ShmSteps timed per step, the two ways alternating."""
    import mpccs
    from mpccs import shm_steps
    from mpccs.transports import cacheflush

    assert cacheflush.prepare(), cacheflush.failure
    way, steps = ["plain"], {}
    plain_init, plain_reduce, plain_advance = (shm_steps.ShmSteps.__init__, shm_steps.ShmSteps._reduce_own_half,
                                               shm_steps.ShmSteps.advance)

    def init(self, pair, seq, rank, src, out_, op, landing=None):  # (the library's own choice left out)
        start = time.perf_counter()
        if way[0] == "plain":
            plain_init(self, pair, seq, rank, src, out_, op)
        else:  # the library's step 1, with the outbox flushed before and after the copy
            post = pair.post
            pair.post = lambda *args: None
            try:
                plain_init(self, pair, seq, rank, src[:0], out_[:0], op)  # the fields, no copy, no post
            finally:
                pair.post = post
            mine, theirs = shm_steps.halves(src.size, rank)
            self.mine_in, self.mine_out, self.theirs_in, self.theirs_out = src[mine], out_[mine], src[theirs], out_[theirs]
            self.own_box = pair.own_box[:self.theirs_in.nbytes].view(src.dtype)
            cacheflush.flush(self.own_box)
            np.copyto(self.own_box, self.theirs_in)
            cacheflush.flush(self.own_box)
            pair.post(shm_steps.FLAG_POSTED, self._flag())
        steps["copy_in"] = time.perf_counter() - start

    def reduce_own_half(self):
        start = time.perf_counter()
        plain_reduce(self)
        steps["reduce"] = time.perf_counter() - start

    def advance(self):
        start, before = time.perf_counter(), self.stage
        moved = plain_advance(self)
        if self.stage == 2 and before < 2:
            steps["copy_out"] = time.perf_counter() - start - (steps["reduce"] if before == 0 else 0.0)
        return moved

    shm_steps.ShmSteps.__init__, shm_steps.ShmSteps._reduce_own_half = init, reduce_own_half
    shm_steps.ShmSteps.advance = advance
    comm = mpccs.init()
    original = (np.arange(nbytes // 4) % 7).astype(np.float32)
    x = original.copy()
    rows = []
    for k in range(calls):
        way[0] = WAYS[k % 2]
        x[...] = original
        comm.barrier()
        steps.clear()
        start = time.perf_counter()
        comm.all_reduce(x)
        rows.append((way[0], time.perf_counter() - start, steps["copy_in"], steps["reduce"], steps["copy_out"]))
    assert np.array_equal(x, 2 * original), "wrong result"
    assert comm.last_stats()["algorithm"] == "direct_shm"
    if comm.rank == 0:
        with open(out, "w") as fh:
            json.dump(rows, fh)
    comm.close()


def summary(rows: list, warmup: int) -> dict:
    return {way: {name: float(np.median([r[i] for r in rows[warmup:] if r[0] == way]) * 1e6)
                  for i, name in enumerate(("call_us", "copy_in_us", "reduce_us", "copy_out_us"), start=1)}
            for way in WAYS}


def report(launches: list[dict], meta: dict) -> str:
    lines = ["# The outboxes flushed around step 1 (a probe)", "",
             f"{meta['launches']} launches, 2 ranks, default planes, float32 all_reduce in place of "
             f"{meta['nbytes'] >> 10} KiB through the outboxes, {meta['calls']} calls each (the first "
             f"{meta['warmup']} left out), the two ways alternating; {meta['host']}; measured {meta['time']}.", "",
             "Rank 0's medians (us): the call, then step 1 (copy in; flushed: with the two flushes), step 2 "
             "(reduce over the peer's outbox), step 3 (copy out).", "",
             "| launch | plain: call | copy in | reduce | copy out | flushed: call | copy in | reduce | copy out | "
             "flushed / plain |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, s in enumerate(launches):
        p, f = s["plain"], s["flushed"]
        lines.append(f"| {k + 1} | {p['call_us']:.0f} | {p['copy_in_us']:.0f} | {p['reduce_us']:.0f} | "
                     f"{p['copy_out_us']:.0f} | {f['call_us']:.0f} | {f['copy_in_us']:.0f} | {f['reduce_us']:.0f} | "
                     f"{f['copy_out_us']:.0f} | {f['call_us'] / p['call_us']:.2f} |")
    return "\n".join(lines + [""])


def main() -> None:
    ran = ways_in_launches(__doc__, __file__, rank_main, launches=8, nbytes=2 << 20, calls=200)
    if ran is None:
        return
    args, per_launch = ran
    warmup = 20
    launches = [summary(rows, warmup) for rows in per_launch]
    meta = {"launches": args.launches, "nbytes": args.bytes, "calls": args.calls, "warmup": warmup,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": host_text()}
    write_results(args.out, "probe.json", {"meta": meta, "launches": launches}, "probe.md", report(launches, meta))


if __name__ == "__main__":
    main()
