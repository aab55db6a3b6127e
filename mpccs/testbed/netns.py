"""Low-level helpers around ``ip`` and ``tc``: namespaces, veths, bridges, shaping, counters.

Everything here shells out to iproute2 with a timeout; nothing keeps state. The
cluster module decides the topology, this module only knows how to build parts of it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from typing import Iterable, Optional

CMD_TIMEOUT_S = 20.0


class TestbedUnavailable(RuntimeError):
    """The testbed cannot run on this machine (tests skip with this message)."""
    __test__ = False  # the name starts with "Test"; pytest must not collect it


class NotRootError(TestbedUnavailable, PermissionError):
    """Network namespaces, veths and qdiscs need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)."""


class MissingToolError(TestbedUnavailable):
    """``ip`` or ``tc`` (iproute2) is not installed."""


class CommandError(RuntimeError):
    def __init__(self, argv, rc, stderr):
        super().__init__(f"{' '.join(argv)} failed (rc={rc}): {stderr.strip()}")
        self.argv, self.rc, self.stderr = argv, rc, stderr


def check_available() -> None:
    """Raise a TestbedUnavailable subclass saying exactly what is missing."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise MissingToolError(
            f"mpccs-testbed needs {' and '.join(missing)} from iproute2 "
            "(apt-get install -y iproute2, or scripts/install-system-deps.sh)")
    if os.geteuid() != 0:
        raise NotRootError(
            "mpccs-testbed needs root to create network namespaces, veths and tc qdiscs; "
            "run it as root (sudo mpccs-testbed ...)")
    missing_caps = [name for bit, name in ((12, "CAP_NET_ADMIN"), (21, "CAP_SYS_ADMIN"))
                    if not _effective_caps() >> bit & 1]
    if missing_caps:  # root inside a restricted container
        raise NotRootError(f"mpccs-testbed runs as root but without {' and '.join(missing_caps)} "
                           "(a restricted container?); namespaces and qdiscs need them")


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return ~0  # cannot tell: let the ip commands themselves report


def sh(argv: list, timeout: float = CMD_TIMEOUT_S, check: bool = True,
       stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], input=stdin, capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise CommandError(argv, p.returncode, p.stderr)
    return p


def ip_batch(lines: Iterable[str], ns: Optional[str] = None) -> None:
    """Run many ``ip`` commands in one process: setup cost is per process spawn."""
    _batch("ip", lines, ns)


def tc_batch(lines: Iterable[str], ns: Optional[str] = None) -> None:
    _batch("tc", lines, ns)


def _batch(tool: str, lines: Iterable[str], ns: Optional[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    if not text:
        return
    argv = [tool] + (["-n", ns] if ns else []) + ["-batch", "-"]
    sh(argv, stdin=text)


# -- namespaces ------------------------------------------------------------------------------

def netns_list() -> list[str]:
    out = sh(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    p = sh(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def netns_delete(ns: str) -> None:
    # Deleting the namespace destroys every interface inside it and the veth peers
    # elsewhere; processes still inside keep it alive anonymously, so kill them first.
    sh(["ip", "netns", "delete", ns], check=False)


def wait_oper_up(ns: str, devs, timeout: float = 10.0) -> None:
    """Wait until every device in ns reports operstate UP.

    Why: the kernel publishes a new veth's carrier through linkwatch, batched up to a
    second after creation; until then IFF_RUNNING is off and UCX's tcp transport
    refuses the device ("network device 'out0' is not available"), although sockets
    already work. A rank started in that second would fail to open its planes.
    """
    deadline = time.monotonic() + timeout
    while True:
        links = json.loads(sh(["ip", "-j", "-n", ns, "link", "show"]).stdout or "[]")
        state = {link["ifname"]: link.get("operstate") for link in links}
        pending = [d for d in devs if state.get(d) != "UP"]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{ns}: {', '.join(pending)} not up after {timeout:g} s ({state})")
        time.sleep(0.05)


# -- rates and shaping ------------------------------------------------------------------------

_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def parse_rate(text) -> float:
    """'2.4gbit' -> 2.4e9 bits/s (tc units; 'bps' means bytes/s as in tc)."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad rate {text!r}: use e.g. 2.4gbit, 800mbit, 100mbps")
    bits = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if bits <= 0:
        raise ValueError(f"rate must be positive: {text!r}")
    return bits


def fmt_rate(bits_per_s: float) -> str:
    """A tc-compatible spelling: 2400000000 -> '2.4gbit'."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.6g}{unit}"
    return f"{bits_per_s:.0f}bit"


def tbf_burst_bytes(bits_per_s: float) -> int:
    """Bucket size: 4 ms of line rate, at least 64 KiB.

    Why: the bucket must hold one full GSO/TSO packet (up to 64 KiB) or tbf has to
    segment it; it must also outlast the timer granularity of a loaded 2-core VM,
    else the link stalls between refills and delivers less than the rate. Past a
    few ms it only lets short spikes above the rate (1.2 MB at 2.4 gbit is 4 ms),
    which averages out over any transfer the tests or benchmarks time.
    """
    return max(64 * 1024, int(bits_per_s / 8 * 0.004))


def tbf_line(dev: str, bits_per_s: float, latency_ms: int = 10) -> str:
    return (f"qdisc replace dev {dev} root tbf rate {int(bits_per_s)}bit "
            f"burst {tbf_burst_bytes(bits_per_s)} latency {latency_ms}ms")


def htb_shared_lines(dev: str, total_bps: float, classes: list) -> list:
    """One htb per trunk: the trunk rate is shared, each class capped at its own ceil.

    classes: [(classid_minor, ceil_bps, match_dst_cidr)]. The guaranteed rate of each
    class is its share of the total in proportion to its ceil, so both planes keep
    their ratio when they compete and each alone reaches its own ceil.
    """
    burst = tbf_burst_bytes(total_bps)
    lines = [f"qdisc replace dev {dev} root handle 1: htb default {classes[-1][0]}",
             f"class add dev {dev} parent 1: classid 1:1 htb rate {int(total_bps)}bit "
             f"ceil {int(total_bps)}bit burst {burst} cburst {burst}"]
    ceil_sum = sum(c[1] for c in classes)
    for minor, ceil, cidr in classes:
        rate = min(ceil, total_bps * ceil / ceil_sum)
        b = tbf_burst_bytes(ceil)
        lines.append(f"class add dev {dev} parent 1:1 classid 1:{minor} htb rate {int(rate)}bit "
                     f"ceil {int(ceil)}bit burst {b} cburst {b}")
        lines.append(f"filter add dev {dev} parent 1: protocol ip prio 1 u32 "
                     f"match ip dst {cidr} flowid 1:{minor}")
    return lines


# -- counters ----------------------------------------------------------------------------------

def link_counters(ns: str) -> dict:
    """{ifname: {"rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "up"}} inside ns."""
    p = sh(["ip", "-j", "-s", "-n", ns, "link", "show"])
    out = {}
    for link in json.loads(p.stdout or "[]"):
        st = link.get("stats64", {})
        out[link["ifname"]] = {
            "rx_bytes": st.get("rx", {}).get("bytes", 0),
            "tx_bytes": st.get("tx", {}).get("bytes", 0),
            "rx_packets": st.get("rx", {}).get("packets", 0),
            "tx_packets": st.get("tx", {}).get("packets", 0),
            "up": "UP" in link.get("flags", []),
        }
    return out


def root_links() -> set:
    """Interface names in the root namespace (tests check nothing leaked there)."""
    p = sh(["ip", "-j", "link", "show"])
    return {link["ifname"] for link in json.loads(p.stdout or "[]")}
