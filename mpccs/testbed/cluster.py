"""The emulated two-fabric cluster: one network namespace per rank, two shaped planes.

Topology (docs/testbed.md has the drawing): a "switch" namespace holds one bridge
per plane (one up-bridge per scale-up domain) and an unshaped management bridge.
Each rank namespace has one veth per plane into those bridges, shaped by tbf on
both ends. With ``shared_bottleneck`` both planes instead ride macvlans on ONE
trunk veth per rank, shaped by one htb on each end.

All interfaces are created directly inside run-private namespaces named
``mt<6 hex>-...``; none ever exists in the root namespace, so deleting the
namespaces removes everything. A state file per run in /run/mpccs-testbed names
the owner process; the sweeper removes namespaces whose owner is gone.
"""
from __future__ import annotations

import atexit
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from mpccs.launch import command_for
from mpccs.testbed import netns
from mpccs.testbed.netns import fmt_rate, parse_rate

STATE_DIR = "/run/mpccs-testbed"
RUN_RE = re.compile(r"^(mt[0-9a-f]{6})-")
TRAFFIC_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traffic.py")
SHM_TLS = "posix,cma,sysv,self"
DATA_MTU = 9000   # jumbo frames: TCP goodput is 99.3% of the shaped rate (95.6% at 1500)
BG_PORT = 5201

# Subnets exist only inside the run's namespaces; nothing here touches the host's network.
MGMT_NET, UP_NET, OUT_NET = "10.200", "10.201", "10.202"


@dataclass
class RankNet:
    rank: int
    ns: str
    domain: str
    domain_index: int
    local_rank: int
    local_world_size: int
    out_dev: str
    out_addr: str
    mgmt_dev: str
    mgmt_addr: str
    up_dev: Optional[str] = None      # None when the up plane is shared memory
    up_addr: Optional[str] = None
    trunk_dev: Optional[str] = None   # set with shared_bottleneck

    def devices(self) -> dict:
        """plane -> interface name inside the rank namespace."""
        d = {"out": self.out_dev, "mgmt": self.mgmt_dev}
        if self.up_dev:
            d["up"] = self.up_dev
        if self.trunk_dev:
            d["trunk"] = self.trunk_dev
        return d


@dataclass
class RunResult:
    returncodes: list
    exit_code: int
    output: dict                      # rank -> list of lines (without the prefix)
    started: float                    # wall clock when the ranks were launched
    duration_s: float
    timed_out: bool = False
    first_failed_rank: Optional[int] = None
    pids: list = field(default_factory=list)


@dataclass
class TimedAction:
    """Something the run does at ``at_s`` after the ranks start (link down, background on)."""
    at_s: float
    label: str
    fn: Callable[[], None]
    at_end: bool = False   # also run it when the ranks finish first (undo actions)
    done: bool = field(default=False, init=False)


def _addr(net: str, index: int) -> str:
    return f"{net}.{index // 250}.{index % 250 + 1}"


def _proc_start_time(pid: int) -> Optional[str]:
    """Field 22 of /proc/pid/stat: tells a live owner from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(state: dict) -> bool:
    pid = state.get("pid")
    return bool(pid) and _proc_start_time(pid) == state.get("pid_start")


def _signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_pids(pids) -> None:
    for pid in pids:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def sweep(include_kept: bool = True, log: Callable[[str], None] = lambda m: None) -> list:
    """Delete namespaces of earlier runs whose owner process is gone.

    Namespaces are listed before the state files are read: a run writes its state
    file before creating any namespace, so a live run is never mistaken for a leftover.
    ``include_kept=False`` spares runs left with --keep (the automatic sweep at start).
    """
    netns.check_available()
    runs: dict = {}
    for ns in netns.netns_list():
        m = RUN_RE.match(ns)
        if m:
            runs.setdefault(m.group(1), []).append(ns)
    states = {}
    if os.path.isdir(STATE_DIR):
        for name in os.listdir(STATE_DIR):
            try:
                with open(os.path.join(STATE_DIR, name)) as f:
                    states[name[:-5]] = json.load(f)
            except (OSError, ValueError):
                continue
    swept = []
    for run_id in set(runs) | set(states):
        st = states.get(run_id, {})
        if _owner_alive(st) or (st.get("keep") and not include_kept):
            continue
        for ns in runs.get(run_id, []):
            _kill_pids(netns.netns_pids(ns))
            netns.netns_delete(ns)
            swept.append(ns)
        try:
            os.unlink(os.path.join(STATE_DIR, run_id + ".json"))
        except OSError:
            pass
    if swept:
        log(f"swept {len(swept)} namespaces left by earlier runs: {' '.join(sorted(swept))}")
    return swept


def _parse_domains(n: int, domains) -> list:
    if domains is None:
        return ["0"] * n
    if isinstance(domains, str):
        domains = domains.split(",")
    domains = [str(d).strip() for d in domains]
    if len(domains) != n:
        raise ValueError(f"--domains names {len(domains)} ranks but -n is {n}")
    return domains


class Cluster:
    """An emulated two-plane cluster; use as a context manager.

    >>> with Cluster(n=2, up="tcp", up_rate="2.4gbit", out_rate="1.2gbit") as c:
    ...     c.run([sys.executable, "prog.py"], timeout=60)
    """

    def __init__(self, n: int, domains=None, up: str = "shm", up_rate="2.4gbit",
                 out_rate="1.2gbit", shared_bottleneck: bool = False, shared_rate=None,
                 keep: bool = False, log: Optional[Callable[[str], None]] = None):
        if n < 1:
            raise ValueError("n must be at least 1")
        if up not in ("shm", "tcp"):
            raise ValueError(f"up must be 'shm' or 'tcp', not {up!r}")
        if shared_bottleneck and up != "tcp":
            raise ValueError("--shared-bottleneck needs --up tcp: shared memory uses no link")
        self.n, self.up = n, up
        self.domains = _parse_domains(n, domains)
        self.up_bps, self.out_bps = parse_rate(up_rate), parse_rate(out_rate)
        self.shared_bottleneck = shared_bottleneck
        # A shared trunk as fast as the faster plane: each plane alone looks intact,
        # together they cannot add up. That is the trap this mode exists to show.
        self.shared_bps = (parse_rate(shared_rate) if shared_rate is not None
                           else max(self.up_bps, self.out_bps)) if shared_bottleneck else None
        self.keep = keep
        self.log = log or (lambda m: print(f"mpccs-testbed: {m}", file=sys.stderr, flush=True))
        self.run_id = "mt" + secrets.token_hex(3)
        self.switch_ns = f"{self.run_id}-sw"
        self.bg_ns = f"{self.run_id}-bg"
        self.bg_addr = f"{OUT_NET}.255.1"  # the extra host, outside every rank's address
        self.ranks: list = []
        self.events: list = []
        self.background_records: list = []
        self.master_port = random.randrange(20000, 40000)  # fresh namespace: nothing listens
        self.job_token = secrets.token_hex(16)
        self._namespaces: list = []
        self._procs: list = []
        self._bg: list = []
        self._bg_ns_ready = False
        self._closed = False
        self._old_term = None
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Cluster":
        netns.check_available()
        sweep(include_kept=False, log=self.log)
        atexit.register(self.close)
        self._take_sigterm()
        self._write_state()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.event("cluster_up", run_id=self.run_id, ranks=self.n)
        return self

    def close(self) -> None:
        """Stop everything we started and delete the run's namespaces. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for bg in list(self._bg):
            bg.terminate()
        for p in self._procs:
            if p.poll() is None:
                _signal_group(p.pid, signal.SIGKILL)
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        try:
            if self.keep:
                self.log(f"--keep: left namespaces {' '.join(self._namespaces)} "
                         f"(mpccs-testbed --sweep removes them)")
                self._write_state(keep=True)
                return
            for ns in reversed(self._namespaces):
                _kill_pids(netns.netns_pids(ns))
                netns.netns_delete(ns)
            try:
                os.unlink(self._state_path())
            except OSError:
                pass
        finally:
            atexit.unregister(self.close)
            self._give_back_sigterm()

    def _take_sigterm(self) -> None:
        """SIGTERM's default action skips finally and atexit; turn it into SystemExit so the
        namespaces go too. Only from the main thread, and only if nobody else handles it."""
        self._old_term = None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            self._old_term = signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def _give_back_sigterm(self) -> None:
        if self._old_term is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def _state_path(self) -> str:
        return os.path.join(STATE_DIR, self.run_id + ".json")

    def _write_state(self, keep: bool = False) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        state = {"run_id": self.run_id, "pid": os.getpid(), "pid_start": _proc_start_time(os.getpid()),
                 "keep": keep, "created": time.time(), "argv": sys.argv}
        with open(self._state_path(), "w") as f:
            json.dump(state, f)

    # -- building the topology -------------------------------------------------------------

    def _plan_ranks(self) -> None:
        order = list(dict.fromkeys(self.domains))  # domain ids in order of first appearance
        for k, dom in enumerate(self.domains):
            members = [r for r, d in enumerate(self.domains) if d == dom]
            di, lr = order.index(dom), members.index(k)
            rn = RankNet(rank=k, ns=f"{self.run_id}-r{k}", domain=dom, domain_index=di,
                         local_rank=lr, local_world_size=len(members),
                         out_dev=f"out{k}", out_addr=_addr(OUT_NET, k),
                         mgmt_dev=f"mg{k}", mgmt_addr=_addr(MGMT_NET, k))
            if self.up == "tcp":
                rn.up_dev, rn.up_addr = f"up{k}", f"{UP_NET}.{di}.{lr + 1}"
            if self.shared_bottleneck:
                rn.trunk_dev = f"tr{k}"
            for name in rn.devices().values():
                assert len(name) <= 15, name
            self.ranks.append(rn)

    def _build(self) -> None:
        self._plan_ranks()
        all_ns = [self.switch_ns] + [r.ns for r in self.ranks]
        # Recorded before creation: close() must remove half-built runs too.
        self._namespaces.extend(all_ns)
        netns.ip_batch([f"netns add {ns}" for ns in all_ns])
        netns.ip_batch(self._veth_lines())
        self._configure_switch()
        for r in self.ranks:
            self._configure_rank(r)
        for r in self.ranks:
            netns.wait_oper_up(r.ns, list(r.devices().values()))

    def _veth_lines(self) -> list:
        sw, lines = self.switch_ns, []

        def veth(ns, dev, peer, mtu):
            lines.append(f"link add {dev} mtu {mtu} netns {ns} type veth "
                         f"peer name {peer} mtu {mtu} netns {sw}")
        for r in self.ranks:
            veth(r.ns, r.mgmt_dev, f"m{r.rank}", 1500)
            if self.shared_bottleneck:
                veth(r.ns, r.trunk_dev, f"t{r.rank}", DATA_MTU)
                continue
            veth(r.ns, r.out_dev, f"o{r.rank}", DATA_MTU)
            if r.up_dev:
                veth(r.ns, r.up_dev, f"u{r.rank}", DATA_MTU)
        return lines

    def _up_bridge(self, r: RankNet) -> str:
        return f"brup{r.domain_index}"

    def _configure_switch(self) -> None:
        bridges = {"brmg"}
        ports = []  # (port, bridge)
        for r in self.ranks:
            ports.append((f"m{r.rank}", "brmg"))
            if self.shared_bottleneck:
                ports.append((f"t{r.rank}", "brdata"))
                bridges.add("brdata")
                continue
            ports.append((f"o{r.rank}", "brout"))
            bridges.add("brout")
            if r.up_dev:
                ports.append((f"u{r.rank}", self._up_bridge(r)))
                bridges.add(self._up_bridge(r))
        lines = ["link set lo up"]
        for br in sorted(bridges):
            # addrgenmode none: no IPv6 link-local chatter polluting the byte counters
            lines += [f"link add {br} type bridge", f"link set {br} addrgenmode none",
                      f"link set {br} up"]
        for port, br in ports:
            lines += [f"link set {port} addrgenmode none", f"link set {port} master {br}",
                      f"link set {port} up"]
        netns.ip_batch(lines, ns=self.switch_ns)
        netns.tc_batch(self._switch_shaping(), ns=self.switch_ns)

    def _shaping(self, r: RankNet, side: str) -> list:
        """tc lines for one end of a rank's data links; side is 'rank' or 'switch'."""
        if self.shared_bottleneck:
            dev = r.trunk_dev if side == "rank" else f"t{r.rank}"
            return netns.htb_shared_lines(dev, self.shared_bps, [
                (10, self.up_bps, f"{UP_NET}.0.0/16"), (20, self.out_bps, f"{OUT_NET}.0.0/16")])
        out_dev = r.out_dev if side == "rank" else f"o{r.rank}"
        lines = [netns.tbf_line(out_dev, self.out_bps)]
        if r.up_dev:
            up_dev = r.up_dev if side == "rank" else f"u{r.rank}"
            lines.append(netns.tbf_line(up_dev, self.up_bps))
        return lines

    def _switch_shaping(self) -> list:
        return [line for r in self.ranks for line in self._shaping(r, "switch")]

    def _configure_rank(self, r: RankNet) -> None:
        lines = ["link set lo up"]
        if self.shared_bottleneck:
            lines += [f"link set {r.trunk_dev} addrgenmode none", f"link set {r.trunk_dev} up"]
            for dev in (r.out_dev, r.up_dev):
                lines.append(f"link add {dev} link {r.trunk_dev} type macvlan mode bridge")
        lines += self._addr_lines(r.mgmt_dev, f"{r.mgmt_addr}/16")
        lines += self._addr_lines(r.out_dev, f"{r.out_addr}/16")
        if r.up_dev:
            lines += self._addr_lines(r.up_dev, f"{r.up_addr}/24")  # /24: own domain only
        netns.ip_batch(lines, ns=r.ns)
        netns.tc_batch(self._shaping(r, "rank"), ns=r.ns)

    @staticmethod
    def _addr_lines(dev: str, cidr: str) -> list:
        return [f"link set {dev} addrgenmode none", f"addr add {cidr} dev {dev}",
                f"link set {dev} up"]

    # -- events ----------------------------------------------------------------------------

    def event(self, name: str, **fields) -> dict:
        ev = {"wall": time.time(), "event": name, **fields}
        with self._lock:
            self.events.append(ev)
        return ev

    # -- running things inside namespaces --------------------------------------------------

    def _ns_of(self, where) -> str:
        if isinstance(where, int):
            return self.ranks[where].ns
        return where

    def popen(self, where, argv: list, **kw) -> subprocess.Popen:
        """Start argv inside a rank namespace (int) or a named namespace; killed at close()."""
        kw.setdefault("start_new_session", True)  # own group: killing it gets its children too
        p = subprocess.Popen(["ip", "netns", "exec", self._ns_of(where), *map(str, argv)], **kw)
        self._procs.append(p)
        return p

    def exec(self, rank, argv: list, timeout: float = 60.0, check: bool = False,
             env: Optional[dict] = None) -> subprocess.CompletedProcess:
        """Run a helper command inside a rank namespace and wait for it (captured output)."""
        p = self.popen(rank, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=env)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(p.pid, signal.SIGKILL)
            p.communicate()
            raise
        cp = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            cp.check_returncode()
        return cp

    def traffic(self, where, spec: dict, **kw) -> subprocess.Popen:
        """Start traffic.py with SPEC inside a namespace (see traffic.py)."""
        return self.popen(where, [sys.executable, TRAFFIC_SCRIPT, json.dumps(spec)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)

    # -- the rank environment --------------------------------------------------------------

    def env_for(self, rank: int, base: Optional[dict] = None) -> dict:
        r = self.ranks[rank]
        env = dict(os.environ if base is None else base)
        for stale in ("MPCCS_UP_DEVICES", "MPCCS_TESTBED_UP_ADDR"):
            env.pop(stale, None)
        env.update(
            RANK=str(rank), WORLD_SIZE=str(self.n), LOCAL_RANK=str(r.local_rank),
            LOCAL_WORLD_SIZE=str(r.local_world_size), MASTER_ADDR=self.ranks[0].mgmt_addr,
            MASTER_PORT=str(self.master_port), MPCCS_JOB_TOKEN=self.job_token,
            MPCCS_DOMAIN=r.domain, MPCCS_OUT_TLS="tcp", MPCCS_OUT_DEVICES=r.out_dev,
            MPCCS_TESTBED="1", MPCCS_TESTBED_RUN=self.run_id,
            MPCCS_TESTBED_OUT_ADDR=r.out_addr, MPCCS_TESTBED_MGMT_ADDR=r.mgmt_addr,
            PYTHONUNBUFFERED="1",
        )
        if self.up == "shm":
            env["MPCCS_UP_TLS"] = SHM_TLS
        else:
            env.update(MPCCS_UP_TLS="tcp", MPCCS_UP_DEVICES=r.up_dev,
                       MPCCS_TESTBED_UP_ADDR=r.up_addr)
        return env

    # -- running the job -------------------------------------------------------------------

    def run(self, argv: list, env: Optional[dict] = None, timeout: Optional[float] = None,
            grace: float = 15.0, actions: tuple = (), stream=None,
            prefix: bool = True) -> RunResult:
        """Run argv as every rank; returns when all exit, after grace, or at timeout.

        ``actions`` (TimedAction) fire at their time after launch; undo actions still
        pending when the ranks finish run then. Output lines go to ``stream``
        (default stdout) prefixed with ``[rank k]`` and are kept in the result.
        """
        stream = sys.stdout if stream is None else stream
        out_lock = threading.Lock()
        output = {k: [] for k in range(self.n)}
        procs, pumps = [], []
        started = time.time()
        self.event("ranks_start", argv=list(map(str, argv)))
        sched = _Scheduler(self, started, actions)
        try:
            for k in range(self.n):
                e = self.env_for(k)
                e.update(env or {})
                p = self.popen(k, command_for(argv[0], list(argv[1:])), env=e,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                procs.append(p)
                t = threading.Thread(target=_pump, daemon=True,
                                     args=(p.stdout, k, output[k], stream, out_lock, prefix))
                t.start()
                pumps.append(t)
            sched.start()
            first, timed_out = self._supervise(procs, timeout, grace)
        finally:
            sched.finish()
            _stop_procs(procs)
            for t in pumps:
                t.join(timeout=2)
        codes = [p.returncode for p in procs]
        code = _exit_code(first[1]) if first else (124 if timed_out else 0)
        self.event("ranks_end", exit_code=code, returncodes=codes, timed_out=timed_out)
        return RunResult(codes, code, output, started, time.time() - started, timed_out,
                         first[0] if first else None, [p.pid for p in procs])

    def _supervise(self, procs, timeout, grace):
        first, fail_at, t0 = None, None, time.monotonic()
        while True:
            for k, p in enumerate(procs):
                code = p.poll()
                if code not in (None, 0) and first is None:
                    first, fail_at = (k, code), time.monotonic()
                    self.event("rank_failed", rank=k, code=code)
                    self.log(f"rank {k} exited with code {code}; stopping the others in "
                             f"{grace:g} s unless they finish")
            if all(p.poll() is not None for p in procs):
                return first, False
            now = time.monotonic()
            if fail_at is not None and now - fail_at > grace:
                self.log("grace period over, stopping the remaining ranks")
                return first, False
            if timeout is not None and now - t0 > timeout:
                self.log(f"timeout after {timeout:g} s, stopping all ranks")
                self.event("timeout", after_s=timeout)
                return first, True
            time.sleep(0.02)

    # -- the outside view -------------------------------------------------------------------

    def counters(self) -> dict:
        """{rank: {plane: {rx_bytes, tx_bytes, rx_packets, tx_packets, up}}} from the kernel,
        read on the rank's side of each link; plus 'switch' with every switch port."""
        out = {}
        for r in self.ranks:
            stats = netns.link_counters(r.ns)
            out[r.rank] = {plane: stats.get(dev, {}) for plane, dev in r.devices().items()}
        out["switch"] = netns.link_counters(self.switch_ns)
        return out

    # -- failures ----------------------------------------------------------------------------

    def _link_of(self, rank: int, plane: str) -> tuple:
        """(namespace, device) that fail_link toggles for a plane of a rank."""
        r = self.ranks[rank]
        if plane not in ("up", "out") or (plane == "up" and not r.up_dev):
            raise ValueError(f"rank {rank} has no {plane!r} link to fail (up is {self.up})")
        if self.shared_bottleneck:
            # One trunk carries both planes: failing one plane downs its macvlan on the rank.
            return r.ns, r.out_dev if plane == "out" else r.up_dev
        # Switch port down: the rank keeps its address and sees NO-CARRIER, like a pulled cable.
        return self.switch_ns, f"{'o' if plane == 'out' else 'u'}{rank}"

    def fail_link(self, rank: int, plane: str = "out") -> None:
        ns, dev = self._link_of(rank, plane)
        netns.sh(["ip", "-n", ns, "link", "set", dev, "down"])
        self.event("link_down", rank=rank, plane=plane, dev=dev)
        self.log(f"link down: rank {rank} {plane} ({dev})")

    def restore_link(self, rank: int, plane: str = "out") -> None:
        ns, dev = self._link_of(rank, plane)
        netns.sh(["ip", "-n", ns, "link", "set", dev, "up"])
        self.event("link_up", rank=rank, plane=plane, dev=dev)
        self.log(f"link up: rank {rank} {plane} ({dev})")

    # -- background traffic -----------------------------------------------------------------

    def _ensure_bg_ns(self) -> None:
        """An extra host on the scale-out bridge, with a NIC shaped like a rank's."""
        if self._bg_ns_ready:
            return
        ns, sw = self.bg_ns, self.switch_ns
        self._namespaces.append(ns)
        netns.ip_batch([f"netns add {ns}",
                        f"link add bg0 mtu {DATA_MTU} netns {ns} type veth "
                        f"peer name b0 mtu {DATA_MTU} netns {sw}"])
        bridge = "brdata" if self.shared_bottleneck else "brout"
        netns.ip_batch(["link set b0 addrgenmode none", f"link set b0 master {bridge}",
                        "link set b0 up"], ns=sw)
        netns.ip_batch(["link set lo up"] + self._addr_lines("bg0", f"{self.bg_addr}/16"), ns=ns)
        netns.tc_batch([netns.tbf_line("bg0", self.out_bps)], ns=ns)
        netns.tc_batch([netns.tbf_line("b0", self.out_bps)], ns=sw)
        netns.wait_oper_up(ns, ["bg0"])
        self._bg_ns_ready = True

    def start_background(self, rate, dst_rank: int = 0, stop_after: Optional[float] = None):
        """Paced TCP from an extra host on the out bridge into a rank's out address.

        It crosses the switch->rank out link, so it competes with the job's scale-out
        traffic there, as another tenant's flow would.
        """
        from mpccs.testbed.traffic import Background
        self._ensure_bg_ns()
        port = BG_PORT + len(self.background_records) + len(self._bg)  # one per flow ever started
        bg = Background(self, parse_rate(rate), dst_rank, port, stop_after)
        self._bg.append(bg)
        self.event("background_start", rate_bps=bg.rate_bps, dst_rank=dst_rank)
        self.log(f"background {fmt_rate(bg.rate_bps)} into rank {dst_rank} out started")
        return bg

    def stop_background(self, handle=None) -> float:
        """Stop one background flow (or all); returns delivered bytes/s, summed."""
        total = 0.0
        for bg in [handle] if handle is not None else list(self._bg):
            if bg not in self._bg:
                continue  # already stopped
            self._bg.remove(bg)
            rec = bg.stop()
            self.background_records.append(rec)
            self.event("background_stop", **{k: rec[k] for k in
                                             ("rate_bps", "dst_rank", "delivered_Bps",
                                              "delivered_bytes", "first_byte", "last_byte")})
            self.log(f"background stopped: delivered {rec['delivered_Bps'] / 1e6:.1f} MB/s "
                     f"of {rec['rate_bps'] / 8e6:.1f} MB/s asked")
            total += rec["delivered_Bps"]
        return total

    def describe(self) -> dict:
        return {
            "run_id": self.run_id, "n": self.n, "domains": self.domains, "up": self.up,
            "up_rate": fmt_rate(self.up_bps), "out_rate": fmt_rate(self.out_bps),
            "shared_bottleneck": self.shared_bottleneck,
            "shared_rate": fmt_rate(self.shared_bps) if self.shared_bps else None,
            "mtu": DATA_MTU,
            "ranks": [{"rank": r.rank, "ns": r.ns, "domain": r.domain, "local_rank": r.local_rank,
                       "devices": r.devices(), "out_addr": r.out_addr, "up_addr": r.up_addr,
                       "mgmt_addr": r.mgmt_addr} for r in self.ranks],
        }


class _Scheduler(threading.Thread):
    """Fires TimedActions relative to the run's start; finish() runs pending undo actions."""

    def __init__(self, cluster: Cluster, t0: float, actions):
        super().__init__(daemon=True)
        self.cluster, self.t0 = cluster, t0
        self.actions = sorted(actions, key=lambda a: a.at_s)
        self._halt = threading.Event()

    def run(self) -> None:
        for a in self.actions:
            if self._halt.wait(max(0.0, self.t0 + a.at_s - time.time())):
                return
            self._fire(a)

    def _fire(self, a: TimedAction) -> None:
        if a.done:
            return
        a.done = True
        try:
            a.fn()
        except Exception as e:  # an action failing must not kill the run's supervision
            self.cluster.event("action_failed", label=a.label, error=str(e))
            self.cluster.log(f"{a.label} failed: {e}")

    def finish(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=30)
        for a in self.actions:
            if a.at_end:
                self._fire(a)


def _pump(stream, rank: int, lines: list, sink, lock, prefix: bool) -> None:
    tag = f"[rank {rank}] " if prefix else ""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        lines.append(line)
        with lock:
            sink.write(f"{tag}{line}\n")
            sink.flush()
    stream.close()


def _stop_procs(procs, wait_s: float = 3.0) -> None:
    """SIGTERM every live rank group, SIGKILL what is left after wait_s."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p.pid, signal.SIGKILL)
            p.wait(timeout=5)


def _exit_on_sigterm(signum, _frame):
    raise SystemExit(128 + signum)


def _exit_code(code: int) -> int:
    """A signal death (-N) becomes 128+N, as a shell reports it."""
    return 128 - code if code < 0 else code
