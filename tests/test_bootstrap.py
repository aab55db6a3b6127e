"""Rendezvous, the store, the launchers (mpccs-run, mpiexec) and configuration."""
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from mpccs.bootstrap import rendezvous
from mpccs.config import load_options
from mpccs.errors import ConfigError, RendezvousError
from mpccs.store import MAGIC, StoreClient, StoreServer
from rankpool import free_port

BIN = os.path.dirname(sys.executable)
SCRIPT = textwrap.dedent(
    """
    import numpy as np, mpccs
    comm = mpccs.init()
    peer = (comm.rank + 1) % comm.size
    src = (comm.rank - 1) % comm.size
    w = comm.isend(np.full(1000, comm.rank, np.int32), peer)
    got = np.zeros(1000, np.int32)
    comm.recv(got, src)
    w.wait()
    assert (got == src).all()
    print(f"OK rank={comm.rank} size={comm.size} local={comm.local_rank}", flush=True)
    comm.close()
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "ring.py"
    path.write_text(SCRIPT)
    return str(path)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "PMI_", "OMPI_", "SLURM_", "MPCCS_"))}
    env.update(extra)
    return env


def test_mpccs_run_starts_ranks_and_prefixes_output(script):
    out = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "3", script], env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in range(3):
        assert f"[rank {rank}] OK rank={rank} size=3 local={rank}" in out.stdout


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "mpiexec")), reason="pip mpich (the 'mpi' extra) is not installed")
def test_mpiexec_from_pip_mpich(script):
    out = subprocess.run([os.path.join(BIN, "mpiexec"), "-n", "2", sys.executable, script], env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK rank=0 size=2" in out.stdout and "OK rank=1 size=2" in out.stdout


# Open MPI's own launcher by path: a bare "mpirun" is pip mpich's when the venv's bin/ comes first on PATH.
OPEN_MPI_RUN = next((p for p in ("/usr/bin/mpirun.openmpi", "/usr/bin/orterun", "/usr/bin/prterun") if os.path.exists(p)),
                    None)


@pytest.mark.skipif(OPEN_MPI_RUN is None, reason="Open MPI (Debian openmpi-bin) is not installed")
def test_mpirun_from_open_mpi(script):
    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run([OPEN_MPI_RUN, "--oversubscribe", "-n", "2", sys.executable, script], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK rank=1 size=2" in out.stdout


def test_launcher_stops_all_ranks_when_one_fails(tmp_path):
    prog = tmp_path / "fail.py"
    prog.write_text("import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(120)\n")
    start = time.monotonic()
    out = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "3", "--grace", "1", str(prog)],
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    assert time.monotonic() - start < 20
    assert "rank 1 exited with code 3" in out.stderr


def test_a_reader_that_goes_away_neither_hangs_the_ranks_nor_prints_tracebacks(tmp_path):
    """``mpccs-run ... | head -1``: once the pipe closes, the ranks' further output
    (far more than a pipe holds) is dropped, they finish, and nothing is printed about it."""
    prog = tmp_path / "chatty.py"
    prog.write_text("for i in range(20000):\n    print('line', i, 'x' * 60)\n")
    launcher = subprocess.Popen([os.path.join(BIN, "mpccs-run"), "-n", "2", str(prog)], env=clean_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert launcher.stdout.readline().startswith(b"[rank ")
        launcher.stdout.close()  # the reader is gone
        assert launcher.wait(timeout=60) == 0
        assert b"Traceback" not in launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_missing_variable_is_named():
    with pytest.raises(RendezvousError, match="MASTER_ADDR"):
        rendezvous({"RANK": "0", "WORLD_SIZE": "2"}, timeout_s=1)
    with pytest.raises(RendezvousError, match="WORLD_SIZE"):
        rendezvous({"RANK": "0"}, timeout_s=1)
    with pytest.raises(RendezvousError, match="out of range"):
        rendezvous({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, timeout_s=1)


def test_rendezvous_timeout_names_missing_ranks():
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "MPCCS_JOB_TOKEN": "t"}
    boot = rendezvous(env, timeout_s=5)
    try:
        boot.store.set("info/0", b"x")
        with pytest.raises(RendezvousError, match=r"rank\(s\) \[1, 2\] never published"):
            boot.store.gather("info", 3, timeout_s=0.5)
    finally:
        boot.close()


def test_singleton_without_any_launcher():
    boot = rendezvous({}, timeout_s=1)
    assert (boot.rank, boot.size, boot.store) == (0, 1, None)


def test_wrong_job_token_is_refused():
    server = StoreServer("127.0.0.1", 0, "right-token")
    try:
        good = StoreClient("127.0.0.1", server.port, "right-token", timeout_s=5)
        good.set("k", b"v")
        bad = StoreClient("127.0.0.1", server.port, "wrong-token", timeout_s=5)
        with pytest.raises(RendezvousError, match="refused the job token"):
            bad.get("k", timeout_s=1)
        assert good.get("k") == b"v"
    finally:
        server.close()


def raw_request(port, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            part = sock.recv(4096)
            if not part:
                return data
            data += part


def test_store_rejects_malformed_and_oversized_requests():
    server = StoreServer("127.0.0.1", 0, "tok")
    try:
        assert raw_request(server.port, b"GET / HTTP/1.0\r\n\r\n")[:1] == b"\x03"
        assert raw_request(server.port, MAGIC + struct.pack("!I", 1 << 30))[:1] == b"\x03"
        assert raw_request(server.port, MAGIC + struct.pack("!I", 3) + b"\x09\x00\x00")[:1] == b"\x03"
        client = StoreClient("127.0.0.1", server.port, "tok", timeout_s=5)
        client.set("still", b"alive")
        assert client.get("still") == b"alive"
    finally:
        server.close()


def test_store_rejection_reaches_a_client_that_sent_more():
    # The server used to close with the client's bytes unread: the kernel's reset
    # then destroyed the error reply now and then (8 of 300 here). Every one must arrive.
    server = StoreServer("127.0.0.1", 0, "tok")
    try:
        replies = [raw_request(server.port, b"GET / HTTP/1.0\r\n\r\n" + b"x" * 3000)[:1] for _ in range(150)]
        assert replies == [b"\x03"] * 150
    finally:
        server.close()


def test_store_counter_and_bounded_wait():
    server = StoreServer("127.0.0.1", 0, "")
    try:
        client = StoreClient("127.0.0.1", server.port, "", timeout_s=5)
        assert [client.add("c") for _ in range(3)] == [1, 2, 3]
        start = time.monotonic()
        with pytest.raises(KeyError):
            client.get("never", timeout_s=0.3)
        assert time.monotonic() - start < 3
    finally:
        server.close()


def test_configuration_is_validated():
    with pytest.raises(ConfigError, match="unknown plane 'side'"):
        load_options({"MPCCS_PLANES": "up,side"})
    with pytest.raises(ConfigError, match="unknown UCX transport 'tcpx'"):
        load_options({"MPCCS_OUT_TLS": "tcpx"})
    with pytest.raises(ConfigError, match="unknown option"):
        load_options({}, colour="blue")
    with pytest.raises(ConfigError, match="path policy"):
        load_options({"MPCCS_PATH": "sideways"})
    opts = load_options({"MPCCS_OUT_TLS": "rc,ud", "MPCCS_UP_TLS": "cuda_ipc,cuda_copy", "MPCCS_CHUNK": "256K"})
    assert (opts.out_tls, opts.up_tls, opts.chunk_bytes) == ("rc,ud", "cuda_ipc,cuda_copy", 256 << 10)
    assert load_options({"MPCCS_MULTIPATH": "0"}).path_policy == "up"
    assert [load_options({"MPCCS_DEVICE_REDUCE": v}).device_reduce for v in ("1", "0", "Auto", "never")] == [
        "always", "never", "auto", "never"]
    assert load_options({}).device_reduce == "auto"
    with pytest.raises(ConfigError, match="MPCCS_DEVICE_REDUCE.*use one of auto, always, never"):
        load_options({"MPCCS_DEVICE_REDUCE": "gpu"})
    assert load_options({}, path_policy="0.25").path_policy == 0.25
    assert [load_options({"MPCCS_GPU_DIRECT": v}).gpu_direct for v in ("1", "0", "Auto", "off")] == [
        "on", "off", "auto", "off"]
    with pytest.raises(ConfigError, match="MPCCS_GPU_DIRECT.*use one of auto, on, off"):
        load_options({"MPCCS_GPU_DIRECT": "nvlink"})


def test_gpu_direct_adds_the_device_transports_to_each_plane():
    from mpccs.comm import plane_settings

    host = plane_settings(load_options({}), gpu_direct=False, one_host=True)
    assert host == {"up": ("posix,cma,sysv,self", None), "out": ("tcp", "lo")}
    direct = plane_settings(load_options({}), gpu_direct=True, one_host=False)
    assert direct == {"up": ("posix,cma,sysv,self,cuda_copy,cuda_ipc", None), "out": ("tcp,cuda_copy", None)}
    # a list that names them already, or excludes by '^', or 'all', is kept as given
    given = load_options({"MPCCS_UP_TLS": "cuda_ipc,posix", "MPCCS_OUT_TLS": "^ud"})
    assert plane_settings(given, gpu_direct=True, one_host=True) == {
        "up": ("cuda_ipc,posix,cuda_copy", None), "out": ("^ud", "lo")}
    assert plane_settings(load_options({"MPCCS_OUT_TLS": "all"}), True, True)["out"] == ("all", "lo")
    # the device copy transports leave host memory's protocol as it was: eager on sockets
    from mpccs.transports.plane import default_rndv_thresh

    assert default_rndv_thresh("tcp,cuda_copy") == default_rndv_thresh("tcp") == "inf"
    assert default_rndv_thresh("posix,cma,sysv,self,cuda_copy,cuda_ipc") == "ucx"


def test_tcp_planes_send_in_64k_segments_unless_the_user_chose(monkeypatch):
    from mpccs.transports.plane import TCP_TX_SEG_SIZE, Plane, tcp_config

    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE", raising=False)
    assert tcp_config("tcp") == tcp_config("tcp,cuda_copy") == {"TCP_TX_SEG_SIZE": TCP_TX_SEG_SIZE} == {
        "TCP_TX_SEG_SIZE": "64K"}
    assert tcp_config("all") == tcp_config("^ud") == tcp_config("tcp")
    assert tcp_config("posix,cma,sysv,self") == tcp_config("^tcp,ud") == {}
    # the context carries it (ucxx lists a transport's settings without the transport's prefix)
    tcp = Plane("out", "tcp", devices="lo")
    shm = Plane("up", "posix,cma,sysv,self")
    try:
        assert tcp._context.config.get("TX_SEG_SIZE") == "64K"
        assert "TX_SEG_SIZE" not in shm._context.config
    finally:
        tcp.close()
        shm.close()
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "16K")  # the user's own wins
    assert tcp_config("tcp") == {}


def test_gpu_direct_carries_calls_from_its_size_bound():
    # the routing rule alone (the GPU runs of tests/test_gpu.py cover both sides of it)
    import types

    import numpy as np
    from mpccs.comm import GPU_DIRECT_MIN_BYTES, GPU_DIRECT_READS_MIN_BYTES, Communicator

    def comm(gpu_direct, device_reduce="auto", reads=False, policy="adaptive"):
        c = types.SimpleNamespace(gpu_direct=gpu_direct, options=load_options({}, device_reduce=device_reduce),
                                  _engine=types.SimpleNamespace(shm=types.SimpleNamespace(cma=reads)), _policy=policy)
        for name in ("_gpu_direct_for", "_pair_reads"):
            setattr(c, name, types.MethodType(getattr(Communicator, name), c))
        return c

    on, off = comm(True), comm(False)
    assert on._gpu_direct_for(GPU_DIRECT_MIN_BYTES) and on._gpu_direct_for(None)
    assert not on._gpu_direct_for(GPU_DIRECT_MIN_BYTES - 1)
    assert not off._gpu_direct_for(1 << 30) and not off._gpu_direct_for(None)
    big, small = np.empty(GPU_DIRECT_MIN_BYTES, np.uint8), np.empty(GPU_DIRECT_MIN_BYTES - 1, np.uint8)
    reduces = Communicator._device_reduces
    # GPU-direct: every reduction from the bound on the device; below it, as on the mirrors
    assert reduces(on, "all_reduce", big) and not reduces(on, "all_reduce", small)
    assert not reduces(off, "all_reduce", big) and not reduces(off, "reduce_scatter", big)
    assert not reduces(comm(True, "never"), "all_reduce", big) and reduces(comm(False, "always"), "all_reduce", small)
    # a pair that reads across processes keeps all_reduce and reduce_scatter on the mirrors longer
    reads = comm(True, reads=True)
    below = np.empty(GPU_DIRECT_READS_MIN_BYTES - 1, np.uint8)
    assert not reduces(reads, "all_reduce", below) and not reduces(reads, "reduce_scatter", below)
    assert reduces(reads, "all_reduce", np.empty(GPU_DIRECT_READS_MIN_BYTES, np.uint8))
    assert reads._gpu_direct_for(GPU_DIRECT_MIN_BYTES, "all_gather")  # data movement keeps the first bound
    assert reads._gpu_direct_for(GPU_DIRECT_MIN_BYTES) and reads._gpu_direct_for(None, "all_reduce")
    for other in (comm(True, reads=True, policy=0.8), comm(True, reads=False)):  # no reads: the first bound
        assert reduces(other, "all_reduce", big)


def test_gpu_direct_needs_cuda_copy_on_every_plane():
    # what the H200's planes reported (mpccs-info), and a UCX without CUDA support
    import types

    from mpccs.comm import check_device_transports

    def plane(tls, *resources):
        return types.SimpleNamespace(tls=tls, resources=lambda: list(resources))

    check_device_transports({"up": plane("posix,cuda_copy,cuda_ipc", "posix/memory", "cuda_copy/cuda",
                                         "cuda_ipc/cuda"),
                             "out": plane("tcp,cuda_copy", "tcp/lo", "cuda_copy/cuda")})
    with pytest.raises(ConfigError, match="plane 'out' opened no cuda_copy.*MPCCS_GPU_DIRECT=0"):
        check_device_transports({"up": plane("posix,cuda_copy", "cuda_copy/cuda"), "out": plane("tcp,cuda_copy",
                                                                                                "tcp/lo")})


def test_gpu_direct_is_not_offered_on_a_gpu_without_a_context(monkeypatch):
    # a GPU that cupy sees but cannot give a context (exclusive mode, a driver fault)
    from mpccs import staging

    def no_context():
        raise RuntimeError("cudaErrorDevicesUnavailable")

    monkeypatch.setattr(staging, "gpu_visible", lambda: True)
    monkeypatch.setattr(staging, "_make_cuda_context", no_context)
    assert staging.offers_gpu_direct("auto") is False
    with pytest.raises(ConfigError, match="no CUDA context.*DevicesUnavailable"):
        staging.offers_gpu_direct("on")
    monkeypatch.setattr(staging, "_make_cuda_context", lambda: None)
    assert staging.offers_gpu_direct("auto") is True


def test_gpu_direct_offer_follows_the_machine():
    from mpccs import staging

    assert staging.offers_gpu_direct("off") is False
    if staging.gpu_visible():
        assert staging.offers_gpu_direct("auto") and staging.offers_gpu_direct("on")
    else:  # CI: no cupy, or no GPU
        assert staging.offers_gpu_direct("auto") is False
        with pytest.raises(ConfigError, match="cupy sees no GPU"):
            staging.offers_gpu_direct("on")


def test_plane_rates_are_read_and_checked():
    opts = load_options({"MPCCS_PLANE_RATES": "out=500mbit, up=1gbit"})
    assert opts.plane_rates == (("up", 125e6), ("out", 62.5e6))  # plane order, bytes/s
    assert load_options({}, plane_rates={"out": "700MB"}).plane_rates == (("out", 700e6),)
    assert load_options({}).plane_rates is None
    for value, error in [("side=1gbit", "unknown plane 'side'"), ("up", "needs plane=rate"),
                         ("up=fast", "cannot read rate"), ("up=0", "not positive"),
                         ("up=1gbit,up=2gbit", "two rates"), (",", "no plane rate")]:
        with pytest.raises(ConfigError, match=error):
            load_options({"MPCCS_PLANE_RATES": value})


def test_stated_plane_rates_replace_the_priors_the_tuner_plans_by():
    # 2 domains of 2 at 1:1: the priors (5 GB/s shm against 700 MB/s tcp) keep the
    # hierarchical all_reduce on one plane; the stated rates let it split in-domain steps.
    import types

    from mpccs.algorithms import Topology
    from mpccs.comm import Communicator
    from mpccs.control.tuner import choose

    def plan(**options):
        c = types.SimpleNamespace(options=load_options({}, **options), rank=0)
        controller = Communicator._make_controller(c)
        return controller, choose("all_reduce", 4, 64 << 20, Topology((0, 0, 1, 1)), c._prior_costs, reduce_Bps=5e9)

    controller, default = plan()
    assert default.split_policy == "single" and controller.config.prior_rate_Bps == {"up": 5e9, "out": 0.7e9}
    controller, stated = plan(plane_rates="up=500mbit,out=500mbit")
    assert (stated.algorithm, stated.split_policy) == ("hierarchical", "multipath")
    assert controller.config.prior_rate_Bps == {"up": 62.5e6, "out": 62.5e6}
    assert controller.estimator.rate_ceiling_Bps == {"up": 62.5e6, "out": 62.5e6}  # the line rates
    assert plan(plane_rates="up=1gbit,out=500mbit")[1].split_policy == "single"  # 2:1: the bound is 1.00x
    only_out = plan(plane_rates="out=500mbit")[0]
    assert only_out.config.prior_rate_Bps == {"up": 5e9, "out": 62.5e6}
    assert only_out.estimator.rate_ceiling_Bps == {"out": 62.5e6}  # 'up' stated nothing: no ceiling
    assert plan()[0].estimator.rate_ceiling_Bps == {}


@pytest.mark.parametrize("var, values, shown", [
    ("MPCCS_PLANE_RATES", ("up=1gbit,out=500mbit", "up=1gbit,out=1gbit"), '[["up", 125000000.0], ["out", 62500000.0]]'),
    # the ranks agree on measured rates at the same calls: all of them or none
    ("MPCCS_MEASURE_PLAN_RATES", ("0", "1"), "false"),
])
def test_ranks_that_plan_by_different_rates_refuse_to_start(tmp_path, var, values, shown):
    path = tmp_path / "rates.py"
    path.write_text(textwrap.dedent(
        f"""
        import os
        os.environ["{var}"] = "{values[0]}" if os.environ["RANK"] == "0" else "{values[1]}"
        import mpccs
        from mpccs.errors import ConfigError
        try:
            mpccs.init()
        except ConfigError as exc:
            print("REFUSED", exc, flush=True)
        """))
    out = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "2", str(path)], env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"[rank 0] REFUSED rank 0: {var} {shown} differs on rank(s) [1]" in out.stdout, out.stdout
    assert f"[rank 1] REFUSED rank 1: {var}" in out.stdout and "differs on rank(s) [0]" in out.stdout
