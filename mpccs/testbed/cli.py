"""``mpccs-testbed -n N [options] -- prog args...``: run N ranks in an emulated two-plane cluster.

Every rank gets its own network namespace with a shaped scale-up link (or shared
memory) and a shaped scale-out link; see docs/testbed.md. Everything is torn down
afterwards, also on failure, timeout, Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from typing import Optional

from mpccs.testbed import calibrate as cal
from mpccs.testbed import netns
from mpccs.testbed.cluster import Cluster, TimedAction, sweep

EXIT_CALIBRATION = 3   # the gate refused: the machine cannot carry the configured rates
EXIT_UNAVAILABLE = 4   # not root, or iproute2 missing


class Interrupted(BaseException):
    """SIGINT/SIGTERM/SIGHUP: unwinds through every finally, which tears the cluster down."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_interrupted = []


def _on_signal(signum, _frame) -> None:
    # Raise once; a second Ctrl-C during teardown must not cut the teardown short.
    if not _interrupted:
        _interrupted.append(signum)
        raise Interrupted(signum)


def _window(text: str, what: str) -> tuple:
    m = re.fullmatch(r"([0-9.]+)-([0-9.]+)", text)
    if not m or float(m.group(1)) >= float(m.group(2)):
        raise argparse.ArgumentTypeError(f"{what}: want START-STOP seconds, e.g. 2-5, got {text!r}")
    return float(m.group(1)), float(m.group(2))


def parse_background(text: str) -> dict:
    """RATE@START-STOP[:RANK] -> {rate, start, stop, rank}; RANK receives (default 0)."""
    m = re.fullmatch(r"([^@]+)@([^:]+)(?::(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--background wants RATE@START-STOP[:RANK], got {text!r}")
    try:
        netns.parse_rate(m.group(1))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    start, stop = _window(m.group(2), "--background")
    return {"rate": m.group(1), "start": start, "stop": stop, "rank": int(m.group(3) or 0)}


def parse_fail(text: str) -> dict:
    """RANK@T1-T2[:PLANE] -> {rank, start, stop, plane}; PLANE is out (default) or up."""
    m = re.fullmatch(r"(\d+)@([^:]+)(?::(up|out))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--fail wants RANK@T1-T2[:up|out], got {text!r}")
    start, stop = _window(m.group(2), "--fail")
    return {"rank": int(m.group(1)), "start": start, "stop": stop, "plane": m.group(3) or "out"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpccs-testbed", description=__doc__.split("\n\n")[0],
        epilog="Exit code: the first failing rank's code; 124 on --timeout; 130/143 on "
               f"SIGINT/SIGTERM; {EXIT_CALIBRATION} when calibration refuses the rates; "
               f"{EXIT_UNAVAILABLE} when not root or iproute2 is missing.")
    p.add_argument("-n", "--np", dest="n", type=int, help="number of ranks")
    p.add_argument("--domains", help="scale-up domain of each rank, e.g. 0,0,1,1 (default: one)")
    p.add_argument("--up", choices=("shm", "tcp"), default="shm",
                   help="scale-up plane: shared memory or a shaped tcp link (default shm)")
    p.add_argument("--up-rate", default="2.4gbit", help="scale-up link rate (tcp only; 2.4gbit)")
    p.add_argument("--out-rate", default="1.2gbit", help="scale-out link rate (1.2gbit)")
    p.add_argument("--shared-bottleneck", action="store_true",
                   help="both planes ride ONE shaped trunk per rank (needs --up tcp)")
    p.add_argument("--shared-rate", help="trunk rate with --shared-bottleneck (default: the faster plane's)")
    p.add_argument("--background", action="append", type=parse_background, default=[],
                   metavar="RATE@START-STOP[:RANK]",
                   help="paced background traffic into RANK's out link (repeatable)")
    p.add_argument("--fail", action="append", type=parse_fail, default=[],
                   metavar="RANK@T1-T2[:PLANE]", help="take RANK's out (or up) link down from T1 to T2 s")
    p.add_argument("--timeout", type=float, help="stop every rank after this many seconds")
    p.add_argument("--grace", type=float, default=15.0,
                   help="seconds the other ranks get after one fails (15)")
    p.add_argument("--results", metavar="DIR", help="write testbed-<run>.json here")
    p.add_argument("--keep", action="store_true", help="leave the namespaces for debugging")
    p.add_argument("--calibrate", dest="calibrate", action="store_true", default=True,
                   help="measure both planes first and refuse rates the machine cannot carry (default)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false")
    p.add_argument("--calibrate-only", action="store_true",
                   help="build the cluster, calibrate, print the numbers, exit")
    p.add_argument("--calibrate-seconds", type=float, default=2.0, help="probe length (2.0)")
    p.add_argument("--sweep", action="store_true",
                   help="delete leftovers of earlier runs whose owner is gone (also --keep ones), exit")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output with [rank k]")
    p.add_argument("prog", nargs=argparse.REMAINDER, help="-- prog args...")
    return p


def _actions(c: Cluster, args) -> list:
    """TimedActions for --fail and --background; undo actions also run if the ranks end first."""
    acts = []
    for f in args.fail:
        r, plane = f["rank"], f["plane"]
        acts.append(TimedAction(f["start"], f"fail {r} {plane}", lambda r=r, p=plane: c.fail_link(r, p)))
        acts.append(TimedAction(f["stop"], f"restore {r} {plane}",
                                lambda r=r, p=plane: c.restore_link(r, p), at_end=True))
    for b in args.background:
        handle = {}

        def start(b=b, handle=handle):
            handle["bg"] = c.start_background(b["rate"], b["rank"], stop_after=b["stop"] - b["start"])

        def stop(handle=handle):
            if "bg" in handle:
                c.stop_background(handle["bg"])
        acts.append(TimedAction(b["start"], f"background {b['rate']}", start))
        acts.append(TimedAction(b["stop"], f"background {b['rate']} stop", stop, at_end=True))
    return acts


def _validate(p, args) -> None:
    if args.n is None or args.n < 1:
        p.error("-n N is required (N >= 1)")
    if not (args.prog or args.calibrate_only):
        p.error("no program given: mpccs-testbed -n N [options] -- prog args...")
    for f in args.fail:
        if f["rank"] >= args.n:
            p.error(f"--fail names rank {f['rank']} but there are {args.n} ranks")
        if f["plane"] == "up" and args.up != "tcp":
            p.error("--fail ...:up needs --up tcp (shared memory has no link to fail)")
    for b in args.background:
        if b["rank"] >= args.n:
            p.error(f"--background names rank {b['rank']} but there are {args.n} ranks")


def _delta(before: dict, after: dict) -> dict:
    out = {}
    for rank, planes in after.items():
        if rank == "switch":
            continue
        out[rank] = {plane: {k: st.get(k, 0) - before[rank].get(plane, {}).get(k, 0)
                             for k in ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets")}
                     for plane, st in planes.items()}
    return out


def write_results(path_dir: str, c: Cluster, payload: dict) -> str:
    os.makedirs(path_dir, exist_ok=True)
    t0 = payload.get("started") or (c.events[0]["wall"] if c.events else time.time())
    payload["events"] = [dict(ev, t=round(ev["wall"] - t0, 4)) for ev in c.events]
    payload["background"] = c.background_records
    payload["config"] = c.describe()
    path = os.path.join(path_dir, f"testbed-{c.run_id}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    return path


def _run(args) -> int:
    prog = args.prog[1:] if args.prog and args.prog[0] == "--" else args.prog
    c = Cluster(args.n, domains=args.domains, up=args.up, up_rate=args.up_rate,
                out_rate=args.out_rate, shared_bottleneck=args.shared_bottleneck,
                shared_rate=args.shared_rate, keep=args.keep)
    payload = {"argv": prog, "calibration": None}
    try:
        with c:
            c.log(f"run {c.run_id}: {args.n} ranks, up {args.up}"
                  + (f" {args.up_rate}" if args.up == "tcp" else "") + f", out {args.out_rate}"
                  + (" (shared bottleneck)" if args.shared_bottleneck else ""))
            if args.calibrate or args.calibrate_only:
                try:
                    payload["calibration"] = cal.gate(c, args.calibrate_seconds)
                except cal.CalibrationError as e:
                    payload["calibration"] = e.result
                    c.log(f"refusing to run: {e}")
                    payload["exit_code"] = EXIT_CALIBRATION
                    return EXIT_CALIBRATION
            if args.calibrate_only:
                payload["exit_code"] = 0
                return 0
            payload["counters_before"] = c.counters()
            res = c.run(prog, timeout=args.timeout, grace=args.grace, actions=_actions(c, args),
                        prefix=not args.no_prefix)
            payload["counters_after"] = c.counters()
            payload["counters_delta"] = _delta(payload["counters_before"], payload["counters_after"])
            payload.update(exit_code=res.exit_code, timed_out=res.timed_out, started=res.started,
                           duration_s=res.duration_s, first_failed_rank=res.first_failed_rank,
                           ranks=[{"rank": k, "returncode": rc} for k, rc in enumerate(res.returncodes)])
            return res.exit_code
    finally:
        if args.results:
            c.log(f"results: {write_results(args.results, c, payload)}")


def main(argv: Optional[list] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        netns.check_available()
    except netns.TestbedUnavailable as e:
        print(f"mpccs-testbed: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.sweep:
        swept = sweep(include_kept=True, log=lambda m: print(f"mpccs-testbed: {m}", file=sys.stderr))
        print(f"mpccs-testbed: swept {len(swept)} namespaces")
        return 0
    _validate(p, args)
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(args)
    except Interrupted as e:
        print(f"mpccs-testbed: {e} received, cluster torn down", file=sys.stderr)
        return 128 + e.signum
    except ValueError as e:
        print(f"mpccs-testbed: {e}", file=sys.stderr)
        return 2
    finally:
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
