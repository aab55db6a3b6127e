"""``mpccs-run -n N [options] prog args...``: a local launcher.

Starts N ranks with the env:// variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and a random MPCCS_JOB_TOKEN,
prefixes every output line with ``[rank k]``, and when one rank fails gives
the others a grace period to finish or fail on their own before stopping
them. Exits with the first failing rank's code (0 when all succeed).
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rank_environment(rank: int, size: int, port: int, token: str, base=None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MPCCS_JOB_TOKEN=token, MPCCS_RUN="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def command_for(prog: str, args: list[str]) -> list[str]:
    """A .py script runs under this interpreter; anything else as given."""
    if prog.endswith(".py"):
        return [sys.executable, prog, *args]
    return [prog, *args]


def _pump(stream, prefix: str, sink) -> None:
    """Copy a rank's output to ``sink`` line by line. Once the sink's reader is gone
    (``mpccs-run ... | head``), keep reading the rank's lines and drop them: a rank
    blocked on a full pipe would never exit."""
    open_sink = True
    for line in iter(stream.readline, b""):
        if not open_sink:
            continue
        try:
            sink.write(prefix + line.decode(errors="replace"))
            sink.flush()
        except BrokenPipeError:
            open_sink = False
            _discard_into(sink)
    stream.close()


def _discard_into(sink) -> None:
    """Point ``sink``'s file descriptor at /dev/null: what it still buffers, and the
    interpreter's flush at exit, then go nowhere instead of raising again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sink.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a sink without a descriptor (a test's StringIO)
        pass


def _stop(procs: list[subprocess.Popen], sig=signal.SIGTERM, wait_s: float = 3.0) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def run(nranks: int, argv: list[str], grace_s: float = 15.0, timeout_s: Optional[float] = None,
        env_extra: Optional[dict] = None, prefix: bool = True) -> int:
    if nranks < 1:
        raise SystemExit("mpccs-run: -n must be at least 1")
    port, token = free_port(), secrets.token_hex(16)
    procs, pumps = [], []
    for rank in range(nranks):
        env = rank_environment(rank, nranks, port, token)
        env.update(env_extra or {})
        p = subprocess.Popen(
            command_for(argv[0], argv[1:]), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: we can stop a rank and its children
        )
        procs.append(p)
        tag = f"[rank {rank}] " if prefix else ""
        t = threading.Thread(target=_pump, args=(p.stdout, tag, sys.stdout), daemon=True)
        t.start()
        pumps.append(t)
    return _supervise(procs, pumps, grace_s, timeout_s)


def _supervise(procs, pumps, grace_s, timeout_s) -> int:
    first_failure: Optional[int] = None
    failure_at = None
    start = time.monotonic()
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0) and first_failure is None:
                    first_failure, failure_at = code, time.monotonic()
                    sys.stderr.write(
                        f"mpccs-run: rank {rank} exited with code {code}; "
                        f"stopping the others in {grace_s:g} s unless they finish\n"
                    )
            if all(c is not None for c in codes):
                break
            if interrupted:
                sys.stderr.write("mpccs-run: interrupted, stopping all ranks\n")
                _stop(procs)
                return 130
            if failure_at is not None and time.monotonic() - failure_at > grace_s:
                _stop(procs)
                break
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                sys.stderr.write(f"mpccs-run: timeout after {timeout_s:g} s, stopping all ranks\n")
                _stop(procs)
                return first_failure or 124
            time.sleep(0.02)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for t in pumps:
            t.join(timeout=2)
    if first_failure is not None:
        return first_failure
    return next((c for c in (p.returncode for p in procs) if c), 0)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mpccs-run", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of ranks")
    parser.add_argument("--grace", type=float, default=15.0, help="seconds the others get after one rank fails (15)")
    parser.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank k]")
    parser.add_argument("prog", help="program (a .py file runs under this Python)")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    return run(ns.n, [ns.prog, *ns.args], ns.grace, ns.timeout, prefix=not ns.no_prefix)


if __name__ == "__main__":
    sys.exit(main())
