"""mpccs-perf: nccl-tests' table, #wrong = 0 for every collective, the JSON schema."""
import json
import os
import subprocess
import sys

import pytest

BIN = os.path.dirname(sys.executable)


def clean_env():
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "MPCCS_"))}


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all",
                                        "broadcast", "reduce"])
def test_table_json_and_no_wrong_elements(tmp_path, collective):
    out = tmp_path / "r.json"
    p = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "2", "--no-prefix", os.path.join(BIN, "mpccs-perf"),
                        collective, "-b", "1K", "-e", "256K", "-f", "16", "-n", "3", "-w", "1", "-r", "1",
                        "--policies", "up,0.5", "-J", str(out)],
                       env=clean_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if line and not line.startswith("#")]
    assert len(rows) == 3 * 2  # sizes 1K, 16K, 256K x 2 policies
    for cols in rows:
        size, count, dtype, redop, root, policy, algorithm, time_us, algbw, busbw, wrong = cols[:11]
        assert int(wrong) == 0 and float(time_us) > 0 and float(busbw) >= 0
        assert policy in ("up", "0.5") and dtype == "float"
    assert "# Out of bounds values : 0 OK" in p.stdout
    assert "# Avg bus bandwidth (up)" in p.stdout
    data = json.loads(out.read_text())
    assert {"mpccs", "ucx", "ucxx", "numpy", "kernel", "planes", "nranks", "host_speed"} <= set(data["meta"])
    # one domain: the tuner plans by the priors (nothing measured: docs/controller.md, Plan rates)
    assert all(r["plan_rates"] == {"source": "priors", "up": 5e9, "out": 0.7e9} for r in data["rows"])
    speed = data["meta"]["host_speed"]
    assert speed["python_loop_ns"] > 0 and speed["copy_GBps"] > 0
    assert f"# host: python loop {speed['python_loop_ns']:.1f} ns/iteration" in p.stdout
    # which mpccs the ranks imported: this test's own (an A/B run checks its arms by it)
    from mpccs.info import code_identity
    assert data["meta"]["code"] == code_identity()
    assert f"# code: {code_identity()['path']} (sources {code_identity()['sources']})" in p.stdout
    for row in data["rows"]:
        assert {"collective", "size", "count", "type", "redop", "root", "policy", "time_us", "algbw", "busbw",
                "wrong", "up_share", "algorithm", "channels", "times_us", "steal", "landing", "steps_us"} <= set(row)
        assert row["steps_us"] is None  # (a timeline only where the pair reads across processes: above 4 MiB)
        # the landing flush choice (None: a pair that does not read across processes); nothing here lands in place
        assert row["landing"] is None or row["landing"] == {"mode": "auto", "flushing": [], "outbox_flushing": [],
                                                            "switches": 0}
        assert row["collective"] == collective and row["wrong"] == 0 and len(row["times_us"]) == 3
        assert row["steal"] is None or 0.0 <= row["steal"] <= 1.0  # None: no /proc/stat
        assert row["channels"] in (None, 1)  # one domain: no channels (None: the direct path keeps no schedule)


@pytest.mark.parametrize("max_size, shm, settles", [("2M", "0", True), ("64K", "0", False), ("2M", "1", False)])
def test_settle_runs_the_controllers_start_up_before_the_sweep(tmp_path, max_size, shm, settles):
    """--settle N: N 'adaptive' operations at the first swept size the controller may
    split (2 MiB here, with the pair's shared-memory segments closed), timed against N
    under 'up' and reported apart; where no swept size is one it splits (64 KiB; or
    2 MiB with the segments open: the direct path takes it), nothing runs and the
    report says so."""
    out = tmp_path / "s.json"
    p = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "2", "--no-prefix", os.path.join(BIN, "mpccs-perf"),
                        "all_reduce", "-b", "64K", "-e", max_size, "-f", "32", "-n", "2", "-w", "0",
                        "--policies", "up,adaptive", "--settle", "20", "-J", str(out)],
                       env={**clean_env(), "MPCCS_SHM": shm}, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("# settle:"))
    settle = json.loads(out.read_text())["meta"]["settle"]
    if not settles:
        assert "no swept size" in line and settle is None
        return
    assert settle["size"] == 2 << 20 and settle["ops"] == 20 and settle["epoch"] == 21  # + the one that found it
    assert settle["adaptive_s"] > 0 and settle["up_s"] > 0
    assert "20 operations of 2097152 B" in line
    rows = json.loads(out.read_text())["rows"]  # the sweep itself is unchanged: every size, both policies
    assert sorted((r["size"], r["policy"]) for r in rows) == [(64 << 10, "adaptive"), (64 << 10, "up"),
                                                               (2 << 20, "adaptive"), (2 << 20, "up")]


def test_stolen_share_is_the_steal_ticks_over_all_ticks_between_readings(tmp_path):
    from mpccs.perf import cpu_ticks, stolen_share

    assert stolen_share((10, 1000), (40, 1200)) == pytest.approx(30 / 200)
    assert stolen_share(None, (40, 1200)) is None and stolen_share((10, 1000), (10, 1000)) is None
    ticks = cpu_ticks()
    if os.path.exists("/proc/stat"):  # Linux: steal is the 8th field of the cpu line; counters only grow
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
        assert ticks is not None and 0 <= ticks[0] <= fields[7] and ticks[0] <= ticks[1] <= sum(fields)


def test_a_size_with_much_cpu_stolen_gets_a_warning_line():
    from mpccs.perf import STEAL_WARN, steal_note

    assert steal_note(None) is None and steal_note(STEAL_WARN) is None
    note = steal_note(0.31)
    assert note.startswith("# warning: 31% of this host's CPU time was stolen")  # a comment: tables still parse


def test_check_counts_wrong_elements_against_a_reference():
    from mpccs.perf import Case

    class OneRank:
        size, rank = 1, 0

    case = Case(OneRank(), "all_reduce", 4096, __import__("numpy").dtype("float32"), "sum", 0, False)
    case.recv[...] = case.original
    assert case.wrong() == 0
    case.recv[:7] += 1
    assert case.wrong() == 7


def test_hugepage_buffers_hold_the_same_values_on_aligned_pages():
    import numpy as np

    from mpccs.hostmem import HUGE_PAGE_BYTES
    from mpccs.perf import Case

    class OneRank:
        size, rank = 1, 0

    plain = Case(OneRank(), "all_gather", 3 << 20, np.dtype("float32"), "sum", 0, False)
    huge = Case(OneRank(), "all_gather", 3 << 20, np.dtype("float32"), "sum", 0, False, memory="hugepages")
    assert np.array_equal(plain.send, huge.send) and huge.recv.shape == plain.recv.shape
    assert huge.send.ctypes.data % HUGE_PAGE_BYTES == 0 and huge.recv.ctypes.data % HUGE_PAGE_BYTES == 0


def test_hugepage_buffers_run_under_the_launcher_without_wrong_elements():
    p = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "2", "--no-prefix", os.path.join(BIN, "mpccs-perf"),
                        "all_reduce", "-b", "1M", "-e", "16M", "-f", "4", "-n", "3", "-w", "1", "--path", "up",
                        "--memory", "hugepages"],
                       env=clean_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if line and not line.startswith("#")]
    assert len(rows) == 3 and all(int(cols[10]) == 0 for cols in rows), p.stdout
    assert "buffers in host memory on 2 MiB pages (mpccs.empty)" in p.stdout


def test_in_place_input_is_put_back_before_the_timed_call_not_inside_it():
    """nccl-tests leaves its copies out of the time: the timed call of an in-place
    all_reduce (or a broadcast) runs on the buffer as prepare() left it."""
    import numpy as np

    from mpccs.perf import Case

    class Doubling:  # one rank whose all_reduce doubles in place: shows what the call ran on
        size, rank = 1, 0

        def all_reduce(self, x, out=None, op="sum"):
            x *= 2

        def broadcast(self, x, root=0):
            pass

    for collective in ("all_reduce", "broadcast"):
        case = Case(Doubling(), collective, 4096, np.dtype("float32"), "sum", 0, in_place=True)
        case.recv[...] = 7
        case.run()
        expected_after_run = 14 if collective == "all_reduce" else 7
        assert np.all(case.recv == expected_after_run)  # no copy of the input inside the timed call
        case.prepare()
        assert np.array_equal(case.recv, case.original)
        case.run()
        if collective == "all_reduce":
            assert np.array_equal(case.recv, 2 * case.original)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "mpiexec")), reason="pip mpich (the 'mpi' extra) is not installed")
def test_mpi_peer_rows_share_the_perf_schema(tmp_path):
    out = tmp_path / "mpi.json"
    p = subprocess.run([os.path.join(BIN, "mpiexec"), "-n", "2", sys.executable, os.path.join(ROOT, "bench", "peers.py"),
                        "mpi", "-b", "8", "-e", "64K", "-f", "64", "-n", "3", "-w", "1", "-J", str(out)],
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert "MPICH" in data["meta"]["peer"] and data["meta"]["nranks"] == 2
    assert [r["size"] for r in data["rows"]] == [8, 512, 32768]
    for row in data["rows"]:
        assert row["policy"] == "mpi" and row["time_us"] > 0 and len(row["times_us"]) == 3
        assert row["busbw"] == pytest.approx(row["algbw"] * 2 * (2 - 1) / 2)
        assert row["wrong"] == 0 and row["in_place"] is False  # out of place, like mpccs-perf's default


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "mpiexec")), reason="pip mpich (the 'mpi' extra) is not installed")
def test_mpi_peer_in_place_is_checked_and_labelled(tmp_path):
    out = tmp_path / "mpi.json"
    p = subprocess.run([os.path.join(BIN, "mpiexec"), "-n", "2", sys.executable, os.path.join(ROOT, "bench", "peers.py"),
                        "mpi", "-b", "4K", "-e", "1M", "-f", "256", "-n", "3", "-w", "1", "--in-place", "-J", str(out)],
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert data["meta"]["in_place"] is True
    # Four in-place sums of ones: without the input put back before each they would read 2**4, and count as wrong.
    assert [(r["size"], r["wrong"], r["in_place"]) for r in data["rows"]] == [(4096, 0, True), (1 << 20, 0, True)]
    assert "#wrong 0" in p.stdout


def test_gloo_peer_rows_share_the_perf_schema(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed (the 'torch' extra)")
    out = tmp_path / "gloo.json"
    p = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "2", "--no-prefix", os.path.join(ROOT, "bench", "peers.py"),
                        "gloo", "-b", "8", "-e", "512", "-f", "64", "-n", "3", "-w", "1", "-J", str(out)],
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert "gloo" in data["meta"]["peer"]
    assert [(r["policy"], r["wrong"], r["in_place"]) for r in data["rows"]] == [("gloo", 0, False)] * 2


def test_device_memory_without_a_gpu_is_refused_before_any_rank_starts(capsys):
    import importlib.util

    from mpccs.perf import main

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed: the refusal needs a machine without it")
    with pytest.raises(SystemExit) as exc:
        main(["all_reduce", "--memory", "device"])
    assert exc.value.code == 2
    assert "--memory device needs cupy and a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("tool, argv, env, message", [
    ("mpccs-perf", ["all_reduce", "-b", "8", "-e", "8"], {"MPCCS_OUT_CAP": "2"}, "out_cap_share=2.0 is outside [0, 1]"),
    ("mpccs-perf", ["all_reduce", "-b", "8", "-e", "8", "--policies", "up,bogus"], {}, "unknown path policy 'bogus'"),
    ("mpccs-info", [], {"MPCCS_OUT_CAP_RATE": "fast"}, "MPCCS_OUT_CAP_RATE: cannot read rate 'fast'"),
])
def test_a_bad_setting_is_a_one_line_usage_error(tool, argv, env, message):
    p = subprocess.run([os.path.join(BIN, tool), *argv], capture_output=True, text=True, timeout=120,
                       env=dict(clean_env(), **env))
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"{tool}: error: {message}" in p.stderr
    assert "Traceback" not in p.stderr


def test_info_says_whether_the_shared_memory_segments_are_open_and_read_across():
    runs = {}
    for shm_setting, cma_setting in (("1", "1"), ("1", "0"), ("0", "1")):
        p = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "2", os.path.join(BIN, "mpccs-info")],
                           capture_output=True, text=True, timeout=120,
                           env=dict(clean_env(), MPCCS_SHM=shm_setting, MPCCS_CMA=cma_setting))
        assert p.returncode == 0, p.stderr
        lines = p.stdout.splitlines()
        runs[shm_setting + cma_setting] = (
            sorted(line.split("segments: ")[1].split()[0] for line in lines if "shared-memory segments:" in line),
            sorted(line.split("reads: ")[1].split()[0] for line in lines if "cross-memory reads:" in line))
    from mpccs.transports import cma, shm

    opened = "open" if shm.supported() else "closed"  # x86-64 with /dev/shm only
    reads = "on" if shm.supported() and cma.available() else "off"  # and a kernel that allows the read
    assert runs == {"11": ([opened] * 2, [reads] * 2), "10": ([opened] * 2, ["off"] * 2),
                    "01": (["closed"] * 2, ["off"] * 2)}


def test_info_says_whether_a_group_has_segments_and_reads_and_what_pages_mpccs_empty_gets():
    from mpccs.hostmem import huge_pages_setting
    from mpccs.transports import cma, shm

    p = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "3", os.path.join(BIN, "mpccs-info"), "--json"],
                       capture_output=True, text=True, timeout=120, env=clean_env())
    assert p.returncode == 0, p.stderr
    by_rank = {}
    for line in p.stdout.splitlines():  # the ranks' lines interleave: each carries its "[rank k] "
        tag, _, text = line.partition("] ")
        by_rank.setdefault(tag, []).append(text)
    infos = [json.loads("\n".join(lines)) for lines in by_rank.values()]
    assert len(infos) == 3
    for info in infos:
        assert info["group_segments"] == shm.supported() and not info["shm_segments"]
        assert info["group_reads"] == (shm.supported() and cma.available())
        assert info["transparent_hugepage"] == huge_pages_setting()
    p = subprocess.run([os.path.join(BIN, "mpccs-info")], capture_output=True, text=True, timeout=120,
                       env=clean_env())
    assert "# group segments (3-8 ranks on one host): closed" in p.stdout
    assert f"transparent_hugepage={huge_pages_setting()})" in p.stdout


def test_huge_pages_setting_is_the_bracketed_mode(tmp_path, monkeypatch):
    from mpccs import hostmem

    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(hostmem, "THP_SETTING", str(setting))
    assert hostmem.huge_pages_setting() == "madvise"
    monkeypatch.setattr(hostmem, "THP_SETTING", str(tmp_path / "absent"))
    assert hostmem.huge_pages_setting() is None


def test_info_says_how_device_arrays_travel():
    p = subprocess.run([os.path.join(BIN, "mpccs-info"), "--json"], capture_output=True, text=True, timeout=120,
                       env=dict(clean_env(), MPCCS_GPU_DIRECT="0"))
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["gpu_direct"] is False and "cuda" not in info["planes"]["up"]["tls"]
    from mpccs import staging

    if not staging.gpu_visible():  # CI: insisting on it is a one-line usage error
        p = subprocess.run([os.path.join(BIN, "mpccs-info")], capture_output=True, text=True, timeout=120,
                           env=dict(clean_env(), MPCCS_GPU_DIRECT="1"))
        assert p.returncode == 2 and "cupy sees no GPU" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_info_reports_the_qos_caps():
    p = subprocess.run([os.path.join(BIN, "mpccs-info"), "--json"], capture_output=True, text=True, timeout=120,
                       env=dict(clean_env(), MPCCS_OUT_CAP_RATE="250mbit", MPCCS_OUT_CAP="0.3"))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["qos"] == {"out_cap_share": 0.3, "out_cap_rate_Bps": 31.25e6}
    assert json.loads(p.stdout)["plane_rates"] == {"stated": False, "up": 5e9, "out": 0.7e9}


def test_info_reports_the_stated_plane_rates():
    p = subprocess.run([os.path.join(BIN, "mpccs-info")], capture_output=True, text=True, timeout=120,
                       env=dict(clean_env(), MPCCS_PLANE_RATES="out=1gbit"))
    assert p.returncode == 0, p.stderr
    assert "# plane rates the tuner plans by: up=5000 MB/s  out=125 MB/s (MPCCS_PLANE_RATES)" in p.stdout, p.stdout


def test_rows_of_a_pair_that_reads_across_processes_carry_its_steps(tmp_path):
    """A 2-rank all_reduce above 8 MiB reads its halves across processes (cma_steps.py):
    its rows carry rank 0's median time per step, in place and out of place."""
    from mpccs.transports import cma, shm

    if not (shm.supported() and cma.available()):
        pytest.skip("cross-memory reads need x86-64 Linux with process_vm_readv")
    for in_place in (False, True):
        out = tmp_path / f"steps{int(in_place)}.json"
        p = subprocess.run([os.path.join(BIN, "mpccs-run"), "-n", "2", "--no-prefix", os.path.join(BIN, "mpccs-perf"),
                            "all_reduce", "-b", "16M", "-e", "16M", "-n", "3", "-w", "1", "--path", "up", "-J", str(out),
                            *(["--in-place"] if in_place else [])],
                           env=clean_env(), capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, p.stdout + p.stderr
        row, = json.loads(out.read_text())["rows"]
        assert row["algorithm"] == "direct_shm" and row["wrong"] == 0
        steps = row["steps_us"]
        assert set(steps) == {"wait_post", "first_step", "wait_reduced", "landing", "wait_finish"}, steps
        assert steps["first_step"] > 0 and steps["landing"] > 0 and min(steps.values()) >= 0
        assert sum(steps.values()) <= row["time_us_p90"] * 1.5  # the steps are inside the call (rank 0's own)
