"""A 2-rank all_reduce of N MiB: one call (read across processes) against consecutive 4 MiB calls
over its slices (each through the outboxes), interleaved, with an A/A floor (a measurement of the
fifty-second session, not a path the library takes).

    mpccs-run -n 2 --no-prefix python bench/results/outbox_4m_s52/chunked/chunked.py 8,16
"""
import os
import sys
import numpy as np
import mpccs
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from stats import interleaved_modes, time_block, ratio_ci, noise_floor
def main():
    comm = mpccs.init()
    for nbytes in [int(a) << 20 for a in sys.argv[1].split(",")]:
        for in_place in (False, True):
            x = (np.arange(nbytes // 4) % 7).astype(np.float32); out = np.empty_like(x)
            step = (4 << 20) // 4
            def whole():
                comm.all_reduce(x, op="max") if in_place else comm.all_reduce(x, out)
            def chunked():
                for lo in range(0, x.size, step):
                    if in_place:
                        comm.all_reduce(x[lo:lo + step], op="max")
                    else:
                        comm.all_reduce(x[lo:lo + step], out[lo:lo + step])
            calls = {"whole": whole, "chunked": chunked, "whole_again": whole}
            def time_mode(m):
                calls[m]()
                return time_block(comm, calls[m], 5)
            times, _ = interleaved_modes(comm, list(calls), time_mode, 15, 2)
            if comm.rank == 0:
                p, lo, hi = ratio_ci(times["chunked"], times["whole"], paired=True)
                print(f"{nbytes>>20} MiB in_place={in_place:d} whole {np.median(times['whole'])*1e6:.0f} chunked {np.median(times['chunked'])*1e6:.0f} "
                      f"whole/chunked {p:.3f} [{lo:.3f},{hi:.3f}] floor {noise_floor(times['whole'], times['whole_again']):.3f}", flush=True)
if __name__ == "__main__":
    main()
