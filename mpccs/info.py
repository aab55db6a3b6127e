"""``mpccs-info``: version, planes, the UCX transports each plane opened, domains.

Run it alone for this process's view, or under a launcher
(``mpccs-run -n 2 mpccs-info``) to see which peers each plane reaches.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys


def sources_digest(package: str, names_from: str) -> str:
    """sha256 (12 hex digits) over every .py file below ``package``, each file's path
    relative to ``names_from`` and its bytes, in a fixed order."""
    digest = hashlib.sha256()
    for folder, subfolders, files in sorted(os.walk(package)):
        subfolders.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, names_from).encode())
                with open(path, "rb") as fh:
                    digest.update(fh.read())
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def code_identity() -> dict:
    """Where this process imported mpccs from, and a hash of its sources there
    (once per process: the code it imported).

    What a benchmark's ranks ran, in its results: an A/B run that puts another
    checkout on PYTHONPATH runs it only where the working directory holds no
    ``mpccs/`` (``python -m`` and ``-c`` look in the working directory first;
    from the repository's root both arms import the checkout itself)."""
    root = os.path.dirname(os.path.abspath(__file__))
    return {"path": root, "sources": sources_digest(root, root)}


def versions() -> dict:
    """The versions a results file records: mpccs, ucxx, UCX, numpy, Python."""
    import platform

    import numpy as np

    from . import __version__
    from .transports.ucx import ucx_version, ucxx_version

    return {"mpccs": __version__, "ucxx": ucxx_version(), "ucx": ucx_version(), "numpy": np.__version__,
            "python": platform.python_version()}


def collect(comm) -> dict:
    from .hostmem import huge_pages_setting

    return {
        **{k: v for k, v in versions().items() if k in ("mpccs", "ucxx", "ucx")},
        "rank": comm.rank,
        "size": comm.size,
        "local_rank": comm.local_rank,
        "domain": comm.domain,
        "domains": comm.domains,
        "path_policy": str(comm.path_policy),
        "qos": {"out_cap_share": comm.options.out_cap_share, "out_cap_rate_Bps": comm.options.out_cap_rate_Bps},
        # the rates the tuner plans by: MPCCS_PLANE_RATES where stated, else the built-in priors
        "plane_rates": {"stated": comm.options.plane_rates is not None,
                        **{plane: model.rate_Bps for plane, model in comm._prior_costs.items()}},
        # 2 ranks on one host: the shared-memory segments a medium all_reduce takes (transports/shm.py)
        "shm_segments": comm._engine.shm is not None,
        # and with them, whether 2-rank collectives read the peer's blocks across processes (cma_steps.py)
        "cma_reads": comm._engine.shm is not None and comm._engine.shm.cma,
        # 3-8 ranks on one host: the group's segments (the group lane) and their reads across processes
        "group_segments": comm._group is not None,
        "group_reads": comm._group is not None and comm._group.cma,
        # whether mpccs.empty's arrays get 2 MiB pages (hostmem.py): the kernel's THP mode
        "transparent_hugepage": huge_pages_setting(),
        # device (cupy) arrays: read by the planes themselves, or staged through pinned host mirrors
        "gpu_direct": comm.gpu_direct,
        "planes": {
            name: {
                "tls": plane.tls,
                "devices": plane.devices or "all",
                "active": plane.resources(),
                "reaches": plane.peers,
                "peer_failure_detection": plane.error_handling,
            }
            for name, plane in comm._planes.items()
        },
    }


def render(info: dict) -> str:
    lines = [
        f"# mpccs {info['mpccs']}  (ucxx {info['ucxx']}, UCX {info['ucx']})",
        f"# rank {info['rank']} of {info['size']}, local rank {info['local_rank']}, domain {info['domain']!r}",
        f"# path policy: {info['path_policy']}",
        f"# qos: out_cap_share={info['qos']['out_cap_share']:g}  out_cap_rate="
        + ("none" if info["qos"]["out_cap_rate_Bps"] is None else f"{info['qos']['out_cap_rate_Bps'] * 8 / 1e6:g} Mbit/s (paced)"),
        "# plane rates the tuner plans by: " + "  ".join(
            f"{p}={info['plane_rates'][p] / 1e6:g} MB/s" for p in ("up", "out"))
        + (" (MPCCS_PLANE_RATES)" if info["plane_rates"]["stated"] else " (built-in priors; MPCCS_PLANE_RATES states them)"),
        "# shared-memory segments: " + ("open (2-rank calls to 384 KiB whole, medium all_reduce halves, broadcast "
                                        "and reduce to 2 MiB in chunks)"
                                        if info["shm_segments"] else
                                        "closed (not 2 ranks on one host with a shared-memory 'up', or MPCCS_SHM=0)"),
        "# cross-memory reads: " + ("on (2-rank all_reduce to 256 MiB; reduce_scatter, all_gather, all_to_all "
                                    "blocks of 512 KiB-128 MiB, broadcast, reduce of 2-128 MiB)"
                                    if info["cma_reads"] else
                                    "off (no segments, MPCCS_CMA=0, or the kernel refused a cross-memory read)"),
        "# group segments (3-8 ranks on one host): " + (
            ("open, reads across processes on" if info["group_reads"] else "open, reads across processes off")
            if info["group_segments"] else "closed (not 3-8 ranks on one host, or MPCCS_SHM=0)"),
        "# mpccs.empty: " + ("2 MiB pages" if info["transparent_hugepage"] in ("always", "madvise") else
                             "ordinary pages") + f" (transparent_hugepage={info['transparent_hugepage']})",
        "# device arrays: " + ("GPU-direct (the planes read device memory: cuda_ipc / cuda_copy)" if info["gpu_direct"]
                               else "pinned host mirrors (no GPU seen by cupy on every rank, or MPCCS_GPU_DIRECT=0)"),
    ]
    for name, p in info["planes"].items():
        lines.append(
            f"# plane {name:<3}  UCX_TLS={p['tls']}  NET_DEVICES={p['devices']}  "
            f"active={','.join(p['active']) or '-'}  reaches={p['reaches']}  "
            f"peer-failure-detection={'yes' if p['peer_failure_detection'] else 'no (watchdog only)'}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mpccs-info", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    ns = parser.parse_args(argv)
    import mpccs
    from .errors import ConfigError

    try:
        comm = mpccs.init()
    except ConfigError as exc:
        parser.error(str(exc))  # a bad MPCCS_* setting: one line and exit status 2, not a traceback
    with comm:
        info = collect(comm)
        print(json.dumps(info, indent=2) if ns.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
