"""``mpccs-perf COLLECTIVE``: an nccl-tests-style benchmark.

    mpccs-run -n 2 mpccs-perf all_reduce -b 8 -e 64M -f 4 --compare

Flags follow nccl-tests (-b -e -f -n -w -c -o -d -r -J). Every point is timed
per iteration (barrier, then the operation; per-op time = the slowest rank),
and the median over -n iterations is reported. With --compare the policies
(up, out, 0.8, adaptive) run interleaved iteration by iteration, in a shuffled
order per iteration, so drift on a noisy machine and the wake of the previous
operation hit them alike, and ratio columns compare each with 'up'.
busbw uses nccl-tests' factors; see docs/benchmarks.md. --settle N runs the
'adaptive' controller's start-up (its first probes, at its 4th, 16th and 32nd
operations) before the sweep instead of inside its first points, and reports
what that start-up cost against the same operations under 'up'.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np

from .config import parse_policy, parse_size
from .errors import ConfigError
from .info import code_identity, versions
from .reduce import bfloat16_dtype

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")
DTYPE_ALIASES = {
    "float": "float32", "half": "float16", "double": "float64", "bfloat16": "bfloat16",
    "int": "int32", "int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32",
    "int64": "int64", "uint64": "uint64", "float16": "float16", "float32": "float32", "float64": "float64",
}
COMPARE_POLICIES = ("up", "out", 0.8, "adaptive")


def dtype_of(name: str) -> np.dtype:
    if name not in DTYPE_ALIASES:
        raise SystemExit(f"mpccs-perf: unknown dtype {name!r}; valid: {', '.join(sorted(DTYPE_ALIASES))}")
    if DTYPE_ALIASES[name] == "bfloat16":
        return bfloat16_dtype()
    return np.dtype(DTYPE_ALIASES[name])


def bus_factor(collective: str, n: int) -> float:
    if n == 1:
        return 0.0 if collective not in ("broadcast", "reduce") else 1.0
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


def sizes(begin: int, end: int, factor: float) -> list[int]:
    out, s = [], begin
    while s <= end:
        out.append(s)
        s = int(s * factor) if factor > 1 else s + max(1, int(factor))
    return out


def _on_huge_pages(a: np.ndarray) -> np.ndarray:
    """``a``'s values in an array of mpccs.empty (2 MiB pages, 2 MiB aligned)."""
    from .hostmem import empty

    b = empty(a.shape, a.dtype)
    b[...] = a
    return b


class Case:
    """Buffers and a runner for one collective at one size (count = elements per the nccl-tests size)."""

    def __init__(self, comm, collective: str, nbytes: int, dtype: np.dtype, op: str, root: int, in_place: bool,
                 memory: str = "host"):
        self.comm, self.collective, self.op, self.root, self.in_place = comm, collective, op, root, in_place
        n, item = comm.size, dtype.itemsize
        elements = nbytes // item
        if collective in ("all_gather", "reduce_scatter"):
            self.count = elements // n  # per-rank send (all_gather) or recv (reduce_scatter)
        elif collective == "all_to_all":
            self.count = (elements // n) * n  # whole send buffer, n equal blocks
        else:
            self.count = elements
        self.nbytes = self._size_bytes(n, item)
        rng = np.random.default_rng(1234 + comm.rank)
        if dtype.kind in "iu":
            make = lambda k: rng.integers(0, 8, k).astype(dtype)  # noqa: E731 - small values: sums stay exact
        else:
            make = lambda k: rng.integers(-4, 5, k).astype(np.float32).astype(dtype)  # noqa: E731
        c = self.count
        if collective == "all_reduce":
            self.send, self.recv = make(c), np.empty(c, dtype)
        elif collective == "reduce_scatter":
            self.send, self.recv = make(c * n), np.empty(c, dtype)
        elif collective == "all_gather":
            self.send, self.recv = make(c), np.empty(c * n, dtype)
        elif collective == "all_to_all":
            self.send, self.recv = make(c), np.empty(c, dtype)
        elif collective == "broadcast":
            self.send = make(c)
            self.recv = self.send.copy()
        else:  # reduce
            self.send, self.recv = make(c), np.empty(c, dtype)
        self.original = self.send.copy()
        self.xp = np
        if memory == "hugepages":  # the same values in mpccs.empty's arrays (hostmem.py)
            self.send, self.recv = _on_huge_pages(self.send), _on_huge_pages(self.recv)
        elif memory == "device":  # the same values in GPU memory (mpccs stages them: docs/design.md)
            import cupy

            self.xp = cupy
            self.send, self.recv, self.original = (cupy.asarray(a) for a in (self.send, self.recv, self.original))

    def sync(self) -> None:
        """Wait for the device's work (device memory): the time then covers the copies back."""
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()

    def _size_bytes(self, n: int, item: int) -> int:
        if self.collective in ("all_gather", "reduce_scatter"):
            return self.count * n * item
        return self.count * item

    def prepare(self) -> None:
        """Put back the input an in-place all_reduce or a broadcast overwrote, before the
        barrier and outside the timed call (as nccl-tests leaves its copies out): an
        8 MiB copy here costs as much as a third of the operation it would be charged to."""
        if self.collective == "broadcast" or (self.collective == "all_reduce" and self.in_place):
            self.recv[...] = self.original

    def run(self):
        comm, c = self.comm, self.collective
        if c == "all_reduce":
            if self.in_place:
                return comm.all_reduce(self.recv, op=self.op)
            return comm.all_reduce(self.send, self.recv, op=self.op)
        if c == "reduce_scatter":
            return comm.reduce_scatter(self.send, self.recv, op=self.op)
        if c == "all_gather":
            return comm.all_gather(self.send, self.recv)
        if c == "all_to_all":
            return comm.all_to_all(self.send, self.recv)
        if c == "broadcast":
            return comm.broadcast(self.recv, root=self.root)
        return comm.reduce(self.send, self.recv, op=self.op, root=self.root)

    def wrong(self) -> int:
        """Elements that differ from a reference computed from every rank's (reproducible) input."""
        comm, n, dtype = self.comm, self.comm.size, np.dtype(self.send.dtype)
        inputs = [_input_of(r, self) for r in range(n)]
        c = self.collective
        if c in ("all_reduce", "reduce_scatter", "reduce"):
            expected = _reduce(inputs, self.op, dtype)
            if c == "reduce_scatter":
                expected = expected.reshape(n, -1)[comm.rank]
            if c == "reduce" and comm.rank != self.root:
                return 0
            got = self.recv
        elif c == "all_gather":
            expected, got = np.concatenate(inputs), self.recv
        elif c == "all_to_all":
            expected = np.concatenate([x.reshape(n, -1)[comm.rank] for x in inputs]) if self.count else inputs[0]
            got = self.recv
        else:
            expected, got = inputs[self.root], self.recv
        got = got if self.xp is np else self.xp.asnumpy(got)
        return int(np.count_nonzero(~_close(got, expected)))


def _input_of(rank: int, case: Case) -> np.ndarray:
    rng = np.random.default_rng(1234 + rank)
    k, dtype = case.original.size, np.dtype(case.original.dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 8, k).astype(dtype)
    return rng.integers(-4, 5, k).astype(np.float32).astype(dtype)


def _reduce(inputs, op, dtype):
    wide = [x.astype(np.float64) if dtype.kind == "f" or "bfloat16" in str(dtype) else x for x in inputs]
    fn = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    out = wide[0].copy()
    for x in wide[1:]:
        fn(out, x, out=out)
    if op == "avg":
        out = out / len(inputs)
    return out.astype(dtype)


def _close(got, expected):
    if got.dtype.kind in "iu":
        return got == expected
    return np.isclose(got.astype(np.float64), expected.astype(np.float64), rtol=1e-2, atol=1e-2)


def timed(comm, case: Case, policy) -> tuple[float, dict]:
    comm.set_path_policy(policy.base if isinstance(policy, Repeat) else policy)
    case.prepare()
    comm.barrier()
    case.sync()
    t0 = time.perf_counter()
    case.run()
    case.sync()
    dt = time.perf_counter() - t0
    return dt, comm.last_stats() or {}


def slowest(comm, values: list[float]) -> np.ndarray:
    """Per-iteration maximum across ranks."""
    arr = np.asarray(values, dtype=np.float64)
    if comm.size > 1 and arr.size:
        comm.all_reduce(arr, op="max")
    return arr


def iteration_order(policies, iteration: int) -> list:
    """The policies of one iteration in a shuffled order, the same on every
    rank (seeded by the iteration): an operation is slowed by what ran just
    before it (a split leaves the scale-out plane busy for a while: ~50 us at
    2 MiB here), and a fixed order charged that to one policy every time."""
    if len(policies) < 2:
        return list(policies)
    order = np.random.default_rng(0x5EED + iteration).permutation(len(policies))
    return [policies[i] for i in order]


def measure(comm, case: Case, policies, iters: int, warmup: int):
    """Per policy: every iteration's time (the slowest rank's), this rank's share on 'up' per
    iteration, and its last call's record with ``steps_us`` replaced by each step's median
    over the iterations (where the pair's steps kept a timeline: cma_steps.step_times_us)."""
    times = {p: [] for p in policies}
    shares = {p: [] for p in policies}
    steps = {p: [] for p in policies}
    last = {}
    for _ in range(warmup):
        for p in policies:
            timed(comm, case, p)
    for it in range(iters):
        for p in iteration_order(policies, it):
            dt, stats = timed(comm, case, p)
            times[p].append(dt)
            bpp = stats.get("bytes_per_plane", {})
            total = sum(bpp.values())
            shares[p].append(bpp.get("up", 0) / total if total else float("nan"))
            if "steps_us" in stats:
                steps[p].append(stats["steps_us"])
            last[p] = stats
    for p, per_call in steps.items():
        if per_call:
            last[p] = {**last[p], "steps_us": median_steps(per_call)}
    return {p: slowest(comm, times[p]) for p in policies}, shares, last


def median_steps(per_call: list[dict]) -> dict:
    """Each step's median over the calls that had it, in microseconds."""
    names = dict.fromkeys(name for call in per_call for name in call)
    return {name: float(np.median([call[name] for call in per_call if name in call])) for name in names}


def cpu_ticks() -> tuple[int, int] | None:
    """(stolen, all) CPU ticks of this host so far (/proc/stat), None where it cannot be read.

    Stolen time is time the hypervisor ran another guest while this one wanted the CPU:
    on the shared VMs here it came in spells that halved every column of a report, so each
    point records the share of its time that was stolen (``steal`` in the JSON rows)."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    return ticks[7], sum(ticks[:8])


def stolen_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the host's CPU time stolen between two cpu_ticks() readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


STEAL_WARN = 0.05  # a point with more of the host's CPU stolen than this measured the host (docs/benchmarks.md)


def steal_note(steal: float | None) -> str | None:
    """The line printed under a size whose CPU time was largely stolen by the hypervisor, else None."""
    if steal is None or steal <= STEAL_WARN:
        return None
    return (f"# warning: {100 * steal:.0f}% of this host's CPU time was stolen by the hypervisor during this size; "
            "its numbers measure the host as much as the library")


HOST_LOOP_ITERS = 300_000
HOST_COPY_BYTES = 8 << 20


def host_speed() -> dict:
    """Two reference speeds of this host now, measured on every rank at once before
    the communicator starts (~0.1 s): a pure-Python loop in ns per iteration (what the
    per-call path of a small collective is made of) and an 8 MiB numpy copy in GB/s
    (what shared-memory steps are made of). The VMs here have slow spells with little
    stolen time that still halve every column (8-byte latency 28 -> 71-80 us, MPICH
    2.5 -> 3.7 us): with these figures a results file says which kind of host it saw."""
    t0 = time.perf_counter()
    total = 0
    for i in range(HOST_LOOP_ITERS):
        total += i
    loop_ns = (time.perf_counter() - t0) / HOST_LOOP_ITERS * 1e9
    src = np.ones(HOST_COPY_BYTES // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # pages touched
    copies = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
    return {"python_loop_ns": round(loop_ns, 1), "copy_GBps": round(HOST_COPY_BYTES / min(copies) / 1e9, 2)}


def host_speed_text(speed: dict) -> str:
    return f"python loop {speed['python_loop_ns']:.1f} ns/iteration, 8 MiB copy {speed['copy_GBps']:.2f} GB/s"


def host_speed_line(speed: dict | None) -> str:
    """The header line of mpccs-perf's table."""
    if not speed:
        return "# host: not measured"
    return f"# host: {host_speed_text(speed)} (at the start; docs/benchmarks.md, method)"


def settle(comm, make_case, size_list, ops: int):
    """Run the controller's start-up before the sweep: at the first swept size
    where its clock advances (one operation there finds it: a size it may
    split) or where the ranks measure their planes for the plan rates (several
    domains without stated rates: until they agree, the tuner plans from the
    priors, on one plane), ``ops`` operations under 'adaptive', then as many
    under 'up', each series timed whole (the slowest rank). None when no swept
    size is either."""
    for nbytes in size_list:
        case = make_case(nbytes)
        before = (comm.adaptive_epoch, comm.plan_rate_calls)  # counters: they only grow
        timed(comm, case, "adaptive")
        if (comm.adaptive_epoch, comm.plan_rate_calls) != before:
            break
    else:
        return None
    spent = {}
    for policy in ("adaptive", "up"):
        comm.set_path_policy(policy)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(ops):
            case.prepare()
            case.run()
            case.sync()
        spent[policy] = float(slowest(comm, [time.perf_counter() - t0])[0])
    return {"size": case.nbytes, "ops": ops, "adaptive_s": spent["adaptive"], "up_s": spent["up"],
            "epoch": comm.adaptive_epoch}


class Repeat(str):
    """A policy listed again (an A/A control): runs as ``base``, labelled apart."""

    base = None


def labelled(policies) -> tuple:
    seen, out = {}, []
    for p in policies:
        name = f"{p:g}" if isinstance(p, float) else p
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            r = Repeat(f"{name}#{seen[name]}")
            r.base = p
            out.append(r)
        else:
            out.append(p)
    return tuple(out)


def policy_label(p) -> str:
    return f"{p:g}" if isinstance(p, float) else str(p)


def _memory_text(comm, memory: str) -> str:
    if memory == "hugepages":
        return "host memory on 2 MiB pages (mpccs.empty)"
    if memory != "device":
        return "host memory"
    how = "read by the planes (GPU-direct)" if comm.gpu_direct else "staged through pinned host mirrors"
    return f"GPU memory (cupy, {how})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mpccs-perf", description=__doc__.split("\n\n")[0])
    ap.add_argument("collective", choices=COLLECTIVES)
    ap.add_argument("-b", "--minbytes", default="8")
    ap.add_argument("-e", "--maxbytes", default="64M")
    ap.add_argument("-f", "--stepfactor", type=float, default=2.0)
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup_iters", type=int, default=5)
    ap.add_argument("-c", "--check", type=int, default=1)
    ap.add_argument("-o", "--op", default="sum")
    ap.add_argument("-d", "--datatype", default="float")
    ap.add_argument("-r", "--root", type=int, default=0)
    ap.add_argument("-J", "--json", default=None, help="write results as JSON to this file")
    ap.add_argument("--path", default="adaptive", help="adaptive | up | out | fraction on up")
    ap.add_argument("--compare", action="store_true", help="up, out, 0.8 and adaptive interleaved")
    ap.add_argument("--policies", default=None,
                    help="comma list of policies run interleaved, e.g. up,up,adaptive (a repeat is an A/A control)")
    ap.add_argument("--in-place", action="store_true", help="in-place variant (all_reduce)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--settle", type=int, default=0, metavar="N",
                    help="run N 'adaptive' operations (the controller's start-up probes) before the sweep, "
                         "and report them against N under 'up'")
    ap.add_argument("--memory", choices=("host", "hugepages", "device"), default="host",
                    help="buffers in host memory (numpy), host memory on 2 MiB pages (mpccs.empty) "
                         "or GPU memory (cupy; needs a GPU)")
    ns = ap.parse_args(argv)
    if ns.memory == "device":
        try:
            import cupy

            cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # no cupy, no driver, no device
            ap.error(f"--memory device needs cupy and a GPU ({type(exc).__name__}: {exc})")

    import mpccs

    speed = host_speed()  # every rank at once, before any progress runs
    try:  # a bad setting (flag or MPCCS_* variable) is a usage error, not a traceback
        if ns.policies:
            policies = tuple(parse_policy(p) for p in ns.policies.split(","))
            ns.compare = True
        else:
            policies = COMPARE_POLICIES if ns.compare else (parse_policy(ns.path),)
        comm = mpccs.init()
    except ConfigError as exc:
        ap.error(str(exc))
    dtype = dtype_of(ns.datatype)
    policies = labelled(policies)
    rows = []
    size_list = sizes(parse_size(ns.minbytes), parse_size(ns.maxbytes), ns.stepfactor)
    if comm.rank == 0:
        print(header(comm, ns, policies, speed), flush=True)

    def make_case(nbytes):
        return Case(comm, ns.collective, nbytes, dtype, ns.op, ns.root, ns.in_place, ns.memory)

    settled = None
    if ns.settle > 0 and "adaptive" in policies:
        settled = settle(comm, make_case, size_list, ns.settle)
        if comm.rank == 0:
            print(settle_line(settled, ns.settle), flush=True)
    for index, nbytes in enumerate(size_list):
        case = make_case(nbytes)
        ticks = cpu_ticks()
        times, shares, last = measure(comm, case, policies, ns.iters, ns.warmup_iters)
        steal = stolen_share(ticks, cpu_ticks())
        wrong = case.wrong() if ns.check else 0
        wrong_total = np.array([wrong], dtype=np.int64)
        if comm.size > 1:
            comm.all_reduce(wrong_total)
        for p in policies:
            row = make_row(comm, case, ns, p, times[p], shares[p], last.get(p, {}), int(wrong_total[0]))
            row["steal"] = steal  # rank 0's host, the same for every policy of the size
            rows.append(row)
        if comm.rank == 0:
            print_rows(rows[-len(policies):], policies, rows, ns.compare)
            note = steal_note(steal)
            if note:
                print(note, flush=True)
            if not ns.quiet and len(size_list) > 4:
                print(f"# progress: {index + 1}/{len(size_list)} sizes", file=sys.stderr, flush=True)
    if comm.rank == 0:
        footer(rows, policies)
        if ns.json:
            with open(ns.json, "w") as fh:
                meta = {**environment(comm, ns), "host_speed": speed, "settle": settled}
                json.dump({"meta": meta, "rows": rows}, fh, indent=1, default=str)
    wrong_any = any(r["wrong"] for r in rows)
    comm.close()
    return 1 if wrong_any else 0


def make_row(comm, case, ns, policy, times, shares, stats, wrong) -> dict:
    t = float(np.median(times)) if len(times) else 0.0
    algbw = case.nbytes / t / 1e9 if t > 0 else 0.0
    return {
        "collective": ns.collective, "size": case.nbytes, "count": case.count, "type": ns.datatype,
        "redop": ns.op if ns.collective in ("all_reduce", "reduce_scatter", "reduce") else "none",
        "root": ns.root if ns.collective in ("broadcast", "reduce") else -1,
        "policy": policy_label(policy), "time_us": t * 1e6,
        "time_us_p10": float(np.percentile(times, 10)) * 1e6 if len(times) else 0.0,
        "time_us_p90": float(np.percentile(times, 90)) * 1e6 if len(times) else 0.0,
        "algbw": algbw, "busbw": algbw * bus_factor(ns.collective, comm.size), "wrong": wrong,
        "up_share": float(np.nanmedian(shares)) if shares and not np.all(np.isnan(shares)) else None,
        "algorithm": stats.get("algorithm"), "channels": stats.get("channels"), "times_us": [x * 1e6 for x in times],
        "split": [s.get("split") for s in stats.get("stages", [])][:4],
        "nranks": comm.size,
        "plan_rates": comm.plan_rates,  # what the tuner planned by at the point's end (stated, priors, measured)
        "landing": comm.landing,  # rank 0's landing flush choice at the point's end (control/landing.py)
        # rank 0's steps on a pair that reads across processes, medians (cma_steps.step_times_us); else None
        "steps_us": stats.get("steps_us"),
    }


def code_line() -> str:
    """Which mpccs this rank imported (info.code_identity): an A/B run shows each arm's code."""
    code = code_identity()
    return f"# code: {code['path']} (sources {code['sources']})"


def header(comm, ns, policies, speed: dict | None = None) -> str:
    from . import __version__
    from .transports.ucx import ucx_version

    planes = ", ".join(f"{name}={plane.tls}@{plane.devices or 'all'}" for name, plane in comm._planes.items())
    cols = "#       size      count      type   redop    root   policy  algorithm         time     algbw     busbw  #wrong   up%"
    if ns.compare:
        cols += "  x_up"
    return "\n".join([
        f"# mpccs-perf {ns.collective}  mpccs {__version__}  UCX {ucx_version()}  nranks {comm.size}",
        f"# planes: {planes}; buffers in {_memory_text(comm, ns.memory)}",
        f"# iters {ns.iters} warmup {ns.warmup_iters}; time = median over iterations of the slowest rank (us); GB/s = 1e9 B/s",
        f"# policies: {', '.join(policy_label(p) for p in policies)}",
        code_line(),
        host_speed_line(speed),
        "#",
        cols,
        "#                                                                            (us)    (GB/s)    (GB/s)",
    ])


def print_rows(new_rows, policies, all_rows, compare: bool) -> None:
    base = next((r for r in new_rows if r["policy"] == "up"), None)
    for r in new_rows:
        share = "   -" if r["up_share"] is None else f"{100 * r['up_share']:5.1f}"
        line = (f"{r['size']:12d} {r['count']:10d} {r['type']:>9s} {r['redop']:>7s} {r['root']:7d} "
                f"{r['policy']:>8s}  {str(r['algorithm']):<13s} {r['time_us']:9.1f} {r['algbw']:9.3f} "
                f"{r['busbw']:9.3f} {r['wrong']:7d} {share}")
        if compare and base is not None and r["time_us"] > 0:
            line += f"  {base['time_us'] / r['time_us']:5.2f}"
        print(line, flush=True)


def settle_line(settled, ops: int) -> str:
    if settled is None:
        return f"# settle: no swept size is one the controller splits; {ops} operations not run"
    a, u = settled["adaptive_s"], settled["up_s"]
    return (f"# settle: {settled['ops']} operations of {settled['size']} B before the sweep (the controller's start-up): "
            f"'adaptive' {1e3 * a:.1f} ms, 'up' {1e3 * u:.1f} ms ({a / u if u > 0 else float('nan'):.2f}x)")


def footer(rows, policies) -> None:
    print("# Out of bounds values : 0 OK" if not any(r["wrong"] for r in rows) else
          f"# Out of bounds values : {sum(r['wrong'] for r in rows)} FAILED")
    for p in policies:
        label = policy_label(p)
        bw = [r["busbw"] for r in rows if r["policy"] == label]
        print(f"# Avg bus bandwidth ({label}) : {np.mean(bw) if bw else 0:.4f}")


def environment(comm, ns) -> dict:
    return {
        **versions(), "kernel": platform.release(), "cpu": platform.processor() or platform.machine(),
        "nranks": comm.size, "args": vars(ns), "planes": {n: {"tls": p.tls, "devices": p.devices} for n, p in comm._planes.items()},
        "domains": comm.domains, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "code": code_identity(),
    }


if __name__ == "__main__":
    sys.exit(main())
