"""How much CPU the hypervisor takes from this VM right now: spin every core for a few
seconds and report the share of that time stolen (/proc/stat), then the host's reference
speeds (mpccs.perf.host_speed: a Python loop and an 8 MiB copy, as every mpccs-perf run
records them). Run it before a benchmark: the VMs here have slow spells, some stolen time
(20-40% stolen) and some not, in which every column of a report halves.

    python bench/host_steal.py [--seconds 3]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mpccs.perf import cpu_ticks, host_speed, host_speed_text, stolen_share  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def stolen_while_busy(seconds: float) -> float | None:
    """The stolen share of the host's CPU time while every core spins for ``seconds``."""
    workers = [multiprocessing.Process(target=_spin, args=(seconds,)) for _ in range(os.cpu_count() or 1)]
    for w in workers:
        w.start()
    before = cpu_ticks()
    time.sleep(seconds * 0.9)  # the readings stay inside the spin
    after = cpu_ticks()
    for w in workers:
        w.join()
    return stolen_share(before, after)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    share = stolen_while_busy(ap.parse_args().seconds)
    if share is None:
        print("no /proc/stat here: steal cannot be read")
        return 1
    print(f"stolen: {100 * share:.0f}% of the CPU time while every core was busy"
          + (" (a slow spell: benchmark later)" if share > 0.05 else ""))
    print(f"host: {host_speed_text(host_speed())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
