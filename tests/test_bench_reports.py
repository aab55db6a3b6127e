"""The reports of bench/peer_rounds.py, two_step_ab.py, blocks_ab.py, cma_ab.py, group_lane_ab.py,
setup_timeline.py, testbed_targets.py, shared_bottleneck.py and testbed_2x2.py, bench/stats.py's interleaving and adaptive_overhead.py's clock, on synthetic
timings (the runs themselves are benchmarks, not tests)."""
import importlib.util
import json
import math
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")


def load(name):
    sys.path.insert(0, BENCH)  # the scripts import bench/stats.py
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_bench", os.path.join(BENCH, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(BENCH)


def table_rows(text: str) -> dict:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0].endswith(("MiB", "KiB")):
            rows[cells[0]] = cells[1:]
    return rows


def test_peer_rounds_report_takes_the_median_of_per_round_ratios():
    rounds_mod = load("peer_rounds")
    mib = 1 << 20
    # MPICH over mpccs per round: 0.5, 2.0, 0.8 at 1 MiB (median 0.8, one round >= 1.0x);
    # the libraries' own medians are taken over all rounds separately.
    out_of_place = [{"mpccs_us": {mib: 200.0}, "mpi_us": {mib: 100.0}},
                    {"mpccs_us": {mib: 100.0}, "mpi_us": {mib: 200.0}},
                    {"mpccs_us": {mib: 250.0}, "mpi_us": {mib: 200.0}}]
    # In place, each library against its own in-place call: MPICH 1.5x, 1.0x, 1.2x mpccs's speed.
    # mpccs flushed its landings in two of the in-place rounds (rounds.json of older runs has no such key)
    # and its steps in two rounds (None: a size below the reads across processes, or an older run)
    steps = {"wait_post": 2.0, "first_step": 60.0, "wait_reduced": 3.0, "landing": 30.0, "wait_finish": 5.0}
    in_place = [{"mpccs_us": {mib: 100.0}, "mpi_us": {mib: 150.0}, "mpccs_flushing": {mib: True},
                 "mpccs_steps_us": {mib: steps}},
                {"mpccs_us": {mib: 120.0}, "mpi_us": {mib: 120.0}, "mpccs_flushing": {mib: False},
                 "mpccs_steps_us": {mib: {**steps, "first_step": 80.0, "landing": 20.0, "wait_finish": 9.0}}},
                {"mpccs_us": {mib: 100.0}, "mpi_us": {mib: 120.0}, "mpccs_flushing": {mib: True},
                 "mpccs_steps_us": {mib: None}}]
    rounds = [{"out": o, "in": i} for o, i in zip(out_of_place, in_place)]
    text = rounds_mod.report(rounds, {"rounds": 3, "iters": "20", "host": "test", "time": "now", "modes": ["out", "in"]})
    out_text, in_text = text.split("## in place")
    assert "## out of place" in out_text
    assert table_rows(out_text)["1 MiB"] == ["200", "200", "0.80", "0.50-2.00", "1/3", "0/3", "-"]
    # first step median(60, 80) = 70, landing median(30, 20) = 25, waits median(10, 14) = 12
    assert table_rows(in_text)["1 MiB"] == ["100", "120", "1.20", "1.00-1.50", "3/3", "2/3", "70 / 25 / 12"]


def test_peer_rounds_reads_whether_mpccs_flushed_from_its_rows():
    rounds_mod = load("peer_rounds")
    mib = 1 << 20
    landing = {"mode": "auto", "flushing": [4 * mib, 16 * mib], "outbox_flushing": [mib // 2, 2 * mib], "switches": 2}
    rows = [{"size": k * mib, "landing": landing} for k in (1, 2, 8, 16, 32)]
    # 1 MiB: through the outboxes, its 512 KiB half flushing; 2 MiB: its 1 MiB half not; 8 MiB: through
    # the outboxes in two rounds of 2 MiB, flushing (the 4 MiB in "flushing" is a landing's); 16 MiB: read
    # across processes, its 8 MiB landing not flushing; 32 MiB: its 16 MiB landing flushing.
    assert {r["size"] // mib: rounds_mod.flushing(r) for r in rows} == {1: True, 2: False, 8: True, 16: False, 32: True}


def test_two_step_ab_reports_speedup_and_share_of_the_floor():
    ab = load("two_step_ab")
    n = 12
    row = {"size": 2 << 20, "algorithm": {"two_step": "two_step", "dag": "ring"},
           "times_s": {"two_step": [400e-6] * n, "dag": [500e-6] * n, "dag_again": [500e-6] * n,
                       "by_hand": [300e-6] * n}}
    s = ab.summarise(row)
    assert s["speedup"][0] == pytest.approx(1.25) and s["of_floor"][0] == pytest.approx(0.75)
    assert s["noise_floor"] == pytest.approx(0.0)
    cells = table_rows("\n".join(ab.report_lines([row], {"mpccs": "x", "iters": n, "block": 5, "host": "test"})))
    assert cells["2 MiB"][:4] == ["400", "500", "300", "ring"]


def test_blocks_ab_reports_the_full_exchange_over_the_blocks():
    ab = load("blocks_ab")
    n = 12
    row = {"size": 1 << 20, "algorithm": {"full": "direct", "blocks": "direct_blocks", "full_again": "direct"},
           "times_s": {"full": [300e-6] * n, "blocks": [250e-6] * n, "full_again": [300e-6] * n}}
    meta = {"mpccs": "x", "iters": n, "block": 10, "host": "test", "world": 2}
    cells = table_rows("\n".join(ab.report_lines([row], meta)))
    assert cells["1024 KiB"] == ["300", "250", "1.20 [1.20, 1.20]", "0.00"]


def test_setup_timeline_report_lists_each_point_for_both_ranks_in_call_order():
    timeline = load("setup_timeline")
    marks = {"plan found, operation set-up starts": 14.0, "reduction done": 290.0}

    def rank(shift):
        row = {"marks_us": {k: v + shift for k, v in marks.items()}, "total_us": 450.0 + shift,
               "unmarked_us": 470.0 + shift, "algorithm": "two_step"}
        return {"up": row, "adaptive": dict(row), "by_hand": {"unmarked_us": 330.0 + shift}}

    lines = timeline.report([rank(0.0), rank(2.5)], {"size": 2 << 20, "mpccs": "t", "ops": 10, "host": "h"})
    text = "\n".join(lines)
    assert "| plan found, operation set-up starts | 14.0 | 16.5 |" in text
    assert text.index("plan found") < text.index("reduction done")
    assert "| unmarked operation | 470.0 | 472.5 |" in text
    assert "## `adaptive` (two_step)" in text and "330.0 / 332.5 us" in text


def test_setup_timeline_keeps_the_first_occurrence_of_each_mark(monkeypatch):
    """A mark met twice in one operation (a method called again) counts where it was first met."""
    timeline = load("setup_timeline")
    clock = iter([100.0, 100.0005] * 5)  # each call: starts at 100 s, returns 500 us later
    monkeypatch.setattr(timeline.time, "perf_counter", lambda: next(clock))

    class Comm:
        def barrier(self):
            pass

    def call():
        timeline._marks.extend([("a", 100.00001), ("b", 100.00002), ("a", 100.00003)])

    out = timeline.timeline(Comm(), call, lambda: None, ops=4, warmup=1)
    assert list(out["marks_us"]) == ["a", "b"]
    assert out["marks_us"]["a"] == pytest.approx(10.0) and out["marks_us"]["b"] == pytest.approx(20.0)
    assert out["total_us"] == pytest.approx(500.0)


def test_interleaved_modes_keeps_rounds_after_the_warm_up_in_order():
    stats = load("stats")

    class Comm:  # one rank: the "slowest rank" is this one
        last = None

        def all_reduce(self, send, recv, op):
            recv[...] = send
            return recv

        def last_stats(self):
            return {"algorithm": self.last}

    comm, calls = Comm(), []

    def time_mode(mode):
        calls.append(mode)
        comm.last = f"path-{mode}"
        return float(len(calls))

    times, ran = stats.interleaved_modes(comm, ("a", "b"), time_mode, iters=2, warmup=1)
    assert calls == ["a", "b"] * 3  # interleaved within every round
    assert times == {"a": [3.0, 5.0], "b": [4.0, 6.0]}  # the warm-up round left out
    assert ran == {"a": "path-a", "b": "path-b"}


def test_cma_ab_reports_the_reads_over_the_messages():
    ab = load("cma_ab")
    n = 12
    row = {"size": 4 << 20, "algorithm": {"messages": "two_step", "cma": "direct_shm", "messages_again": "two_step"},
           "times_s": {"messages": [500e-6] * n, "cma": [400e-6] * n, "messages_again": [500e-6] * n}}
    meta = {"mpccs": "x", "iters": n, "block": 5, "host": "test"}
    text = "\n".join(ab.report_lines("reduce_scatter", [row], meta))
    assert "float32 reduce_scatter" in text
    assert table_rows(text)["4 MiB"] == ["500", "400", "1.25 [1.25, 1.25]", "0.00", "two_step / direct_shm"]


def test_testbed_targets_report_gives_ratios_to_the_sum_and_up_and_the_stolen_cpu():
    # testbed_targets imports mpccs.testbed (namespaces), which loads without root
    targets = load("testbed_targets")
    mib = 1 << 20

    def row(policy, times, steal=0.12):
        return {"collective": "all_gather", "size": 16 * mib, "policy": policy, "times_us": times,
                "busbw": 1.0, "up_share": 0.67 if policy == "adaptive" else None, "steal": steal}

    # adaptive at 2/3 of up's time: 1.5x up, and 1 / (1/30 + 1/60) = 20 = its time: 1.0x the sum
    data = {"rows": [row("up", [30.0] * 10), row("up#2", [30.0] * 10), row("out", [60.0] * 10),
                     row("adaptive", [20.0] * 10)],
            "meta": {"host_speed": {"python_loop_ns": 61.5, "copy_GBps": 8.25},
                     "settle": {"size": 16 * mib, "ops": 12, "adaptive_s": 0.6, "up_s": 0.75},
                     "code": {"path": "/tmp/old/mpccs", "sources": "0123456789ab"}}}
    (verdict,) = targets.verdicts(data)
    assert verdict["vs_up"][0] == pytest.approx(1.5) and verdict["vs_sum"][0] == pytest.approx(1.0)
    assert verdict["holds_up"] and verdict["holds_sum"] and verdict["steal"] == 0.12
    text = targets.render([verdict], {"up_rate": "2.4gbit", "out_rate": "1.2gbit", "iters": 10, "time": "now"})
    assert "all_gather: python loop 61.5 ns/iteration, 8 MiB copy 8.25 GB/s" in text
    assert "12 operations of 16 MiB" in text and "all_gather 0.80x (600 / 750 ms)" in text
    assert "imported (mpccs-perf's `# code:`): /tmp/old/mpccs (sources 0123456789ab): all_gather." in text
    cells = table_rows(text.replace("| all_gather | ", "| "))["16 MiB"]
    assert cells[4:] == ["1.00 [1.00, 1.00]", "1.50 [1.50, 1.50]", "0.000", "12%", "holds", "holds"]


def test_testbed_targets_judges_a_fixed_split_by_the_same_rule_and_reports_it_apart():
    targets = load("testbed_targets")
    mib = 1 << 20
    def row(policy, times):
        return {"collective": "all_reduce", "size": 64 * mib, "policy": policy, "times_us": list(times),
                "busbw": 1.0, "up_share": 0.66 if policy in ("adaptive", "0.667") else None}

    # up's A/A twin runs 6% slower: the floor (0.06) eats the margin of a fixed split at 0.95x the sum
    up = [30.0 + 0.5 * (i % 3) for i in range(12)]
    up2 = [1.06 * t for t in up]
    data = {"rows": [row("up", up), row("up#2", up2), row("out", [2 * t for t in up]),
                     row("adaptive", [t / 1.40 for t in up]), row("0.667", [t / 1.425 for t in up])], "meta": {}}
    (verdict,) = targets.verdicts(data, fixed="0.667")
    fixed = verdict["fixed"]
    assert fixed["vs_up"][0] == pytest.approx(1.425) and fixed["vs_sum"][0] == pytest.approx(1.425 / 1.5)
    assert verdict["floor"] == pytest.approx(0.06) and fixed["holds_up"]
    assert not fixed["holds_sum"] and not verdict["holds_sum"]  # 0.95 - 0.06 and 0.93 - 0.06 < 0.90
    text = targets.render([verdict], {"up_rate": "2.4gbit", "out_rate": "1.2gbit", "iters": 12, "time": "now"})
    assert "A fixed split (0.667 of every stage on `up`)" in text
    fixed_row = [line for line in text.splitlines() if line.startswith("| all_reduce") and line.count("|") == 10]
    assert len(fixed_row) == 1 and fixed_row[0].endswith("| NOT MET | holds |") and "| 1.02 |" in fixed_row[0]
    assert targets.fixed_fraction("ratio", "2.4gbit", "1.2gbit") == "0.667"  # the default: the rate ratio
    assert targets.fixed_fraction("0.80", "2.4gbit", "1.2gbit") == "0.8"
    assert targets.fixed_fraction("none", "2.4gbit", "1.2gbit") is None
    (plain,) = targets.verdicts(data)
    assert "fixed" not in plain and "A fixed split" not in targets.render([plain], {
        "up_rate": "2.4gbit", "out_rate": "1.2gbit", "iters": 12, "time": "now"})


def test_testbed_targets_report_only_rebuilds_the_report_and_plot_from_saved_verdicts(tmp_path, monkeypatch, capsys):
    import json

    targets = load("testbed_targets")
    mib = 1 << 20
    up = [30.0 + 0.5 * (i % 3) for i in range(12)]

    def row(policy, times, size):
        return {"collective": "all_to_all", "size": size, "policy": policy, "times_us": list(times),
                "busbw": 1.0, "up_share": 0.66 if policy in ("adaptive", "0.667") else None}

    rows = []
    for size, speedup in ((16 * mib, 1.45), (64 * mib, 1.30)):  # 64 MiB misses both (the sum is 1.5x up here)
        rows += [row("up", up, size), row("up#2", up, size), row("out", [2 * t for t in up], size),
                 row("adaptive", [t / speedup for t in up], size), row("0.667", [t / 1.44 for t in up], size)]
    results = targets.verdicts({"rows": rows, "meta": {}}, fixed="0.667")
    meta = {"up_rate": "2.4gbit", "out_rate": "1.2gbit", "iters": 12, "time": "now"}
    (tmp_path / "verdicts.json").write_text(json.dumps({"meta": meta, "results": results, "counters": {}}))
    monkeypatch.setattr(sys, "argv", ["testbed_targets.py", "--out", str(tmp_path), "--report-only"])
    assert targets.main() == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "report.md").read_text() == printed.rstrip("\n") + "\n" and targets.PLOT_TEXT in printed
    adaptive_table, fixed_table = printed.replace("| all_to_all | ", "| ").split("A fixed split")
    assert {k: v[-2:] for k, v in table_rows(adaptive_table).items()} == {
        "16 MiB": ["holds", "holds"], "64 MiB": ["NOT MET", "NOT MET"]}
    assert {k: v[-2:] for k, v in table_rows(fixed_table).items()} == {
        "16 MiB": ["holds", "holds"], "64 MiB": ["holds", "holds"]}
    png = (tmp_path / "targets.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="steal is read from Linux's /proc/stat")
def test_host_steal_reads_a_share_while_every_core_spins():
    host = load("host_steal")
    share = host.stolen_while_busy(0.3)
    assert share is not None and 0.0 <= share <= 1.0


def test_host_speed_measures_a_python_loop_and_a_copy():
    from mpccs.perf import host_speed, host_speed_line
    speed = host_speed()
    assert 0 < speed["python_loop_ns"] < 1e4 and 0 < speed["copy_GBps"] < 1e4
    assert host_speed_line(speed).startswith(f"# host: python loop {speed['python_loop_ns']:.1f} ns/iteration, ")
    assert host_speed_line(None) == "# host: not measured"


def test_code_text_groups_the_runs_by_the_code_their_ranks_imported():
    stats = load("stats")
    old, new = {"path": "/tmp/old/mpccs", "sources": "aaaaaaaaaaaa"}, {"path": "/w/mpccs", "sources": "bbbbbbbbbbbb"}
    text = stats.code_text({"all_reduce": new, "reduce_scatter": old, "all_gather": new, "all_to_all": None})
    assert text == ("Code the ranks imported (mpccs-perf's `# code:`): /w/mpccs (sources bbbbbbbbbbbb): all_reduce, "
                    "all_gather; /tmp/old/mpccs (sources aaaaaaaaaaaa): reduce_scatter.")
    assert stats.code_text({"mpccs": None}) == "Code: not recorded."


def test_group_lane_ab_reports_the_median_ratios_per_rank_count_and_size():
    ab = load("group_lane_ab")
    sizes = [str(n) for n in ab.SIZES]

    def run(scale, algorithm):
        return dict({k: scale * (i + 1) for i, k in enumerate(sizes)}, algorithm_8=algorithm)

    # old / new per round at every size: 2, 4, 3 (median 3); new / MPICH: 0.5, 1, 2 (median 1).
    rounds = [{3: {"old": run(old, "direct"), "new": run(new, "direct_lane"), "mpi": run(mpi, None)}}
              for old, new, mpi in ((20.0, 10.0, 20.0), (40.0, 10.0, 10.0), (60.0, 20.0, 10.0))]
    lines = ab.report(rounds, "/tmp/old", (3,))
    rows = [line for line in lines if line.startswith("| 3 |")]
    assert len(rows) == len(sizes)
    assert rows[0].split("|")[2].strip() == "8 B" and rows[0].rstrip(" |").endswith("3.00 | 1.00")
    assert "20 / 10 / 20" in rows[0] and "60 / 20 / 10" in rows[0]
    assert lines[-1].endswith("3 ranks direct -> direct_lane")


def test_mann_whitney_p_matches_scipys_asymptotic_method():
    stats = load("stats")
    # Values from scipy.stats.mannwhitneyu(a, b, method="asymptotic") (scipy 1.16):
    # no ties, then ties within and across the samples.
    assert stats.mann_whitney_p([1, 2, 3, 4, 5, 6, 7, 8, 9], [4.5, 6, 7, 8, 9, 10, 11, 12, 13, 14]) == \
        pytest.approx(0.009980956684238857, rel=1e-9)
    assert stats.mann_whitney_p([1, 1, 2, 2, 3, 3, 3, 4], [2, 3, 3, 4, 4, 5, 5, 5, 6]) == \
        pytest.approx(0.016098254978888133, rel=1e-9)
    assert stats.mann_whitney_p([1.0, 2.0], [1.0, 2.0]) == 1.0
    assert math.isnan(stats.mann_whitney_p([], [1.0]))


def test_shared_bottleneck_judges_adaptive_against_the_faster_single_plane_by_the_strict_rule():
    shared = load("shared_bottleneck")
    mib = 1 << 20

    def row(policy, size, times):
        return {"collective": "all_to_all", "size": size, "policy": policy, "times_us": times,
                "time_us": sorted(times)[len(times) // 2], "busbw": 1.0,
                "up_share": 1.0 if policy == "adaptive" else None, "steal": 0.02}

    noisy_up2 = [100.0, 110.0] * 10  # `up#2` apart from `up`: a floor that eats the margin
    data = {"rows": [row("up", 16 * mib, [100.0] * 20), row("up#2", 16 * mib, [100.0] * 20),
                     row("out", 16 * mib, [200.0] * 20), row("adaptive", 16 * mib, [101.0] * 20),
                     row("up", 64 * mib, [100.0] * 20), row("up#2", 64 * mib, noisy_up2),
                     row("out", 64 * mib, [80.0] * 20), row("adaptive", 64 * mib, [81.0] * 20)],
            "meta": {"code": {"path": "/x/mpccs", "sources": "0123456789ab"}}}
    small, large = shared.verdicts(data)
    assert small["best"] == "up" and small["ratio"][0] == pytest.approx(100 / 101) and small["holds"]
    assert large["best"] == "out" and large["ratio"][0] == pytest.approx(80 / 81)  # against the faster plane
    assert large["floor"] > 0.03 and not large["holds"]
    text = shared.render([small, large], {"up_rate": "1gbit", "out_rate": "500mbit", "shared_rate": "1gbit",
                                          "iters": 20, "settle": 12, "time": "now"})
    cells = table_rows(text.replace("| all_to_all | ", "| "))
    assert cells["16 MiB"][4:] == ["up", "0.990 [0.990, 0.990]", "0.000", "0.990", "yes", "2%"]
    assert cells["64 MiB"][4] == "out" and cells["64 MiB"][8] == "no"
    assert "1 of 2 points hold by the strict rule." in text


def test_adaptive_vs_up_reads_0_97_from_64_kib_and_not_below_under_it(tmp_path):
    avu = load("adaptive_vs_up")
    kib = 1 << 10

    def row(policy, size, times):
        return {"policy": policy, "size": size, "times_us": times, "time_us": sorted(times)[len(times) // 2],
                "algorithm": "direct_lane", "steal": 0.0}

    # 32 KiB: adaptive 2% slower than `up` with no noise: above 0.97, yet below `up` beyond the floor.
    # 64 KiB: the same 2% holds the 0.97 rule.  16 KiB: 1% slower, but `up#2` is 2% off `up`: within the floor.
    times = {16 * kib: (100.0, 102.0, 101.0), 32 * kib: (100.0, 100.0, 102.0), 64 * kib: (100.0, 100.0, 102.0)}
    rows = [row(p, s, [t] * 50) for s, ts in times.items() for p, t in zip(("up", "up#2", "adaptive"), ts)]
    meta = {"mpccs": "0.1.0", "ucx": "1.21.0", "kernel": "k", "time": "now",
            "code": {"path": "/x/mpccs", "sources": "0123456789ab"}}
    (tmp_path / "perf.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    cells = table_rows(avu.report(str(tmp_path)))
    assert cells["16 KiB"][4:7] == ["not below", "1.010", "yes"]
    assert cells["32 KiB"][4:7] == ["not below", "0.980", "no"]
    assert cells["64 KiB"][4:7] == [">= 0.97", "0.980", "yes"]
    assert "2 of 3 sizes hold by the strict rule." in avu.report(str(tmp_path))


def test_testbed_2x2_reads_the_best_fixed_split_against_the_best_single_plane():
    two_by_two = load("testbed_2x2")
    mib = 1 << 20

    def row(policy, times):
        return {"size": 16 * mib, "policy": policy, "times_us": list(times), "time_us": sorted(times)[len(times) // 2],
                "busbw": 1e6 / sorted(times)[len(times) // 2], "algorithm": "hierarchical", "channels": 4}

    up = [100.0 + (i % 3) for i in range(12)]
    data = {"rows": [row("up", up), row("up#2", up), row("out", [1.6 * t for t in up]),
                     row("0.8", [t / 1.20 for t in up]), row("0.75", [t / 1.25 for t in up]),
                     row("adaptive", [t / 1.10 for t in up])]}
    text, (verdict,) = two_by_two.report(data, "500mbit", "500mbit", 12, ["0.8", "0.75"], "up=500mbit,out=500mbit")
    assert verdict["ratio"][0] == pytest.approx(1.10) and not verdict["holds"]  # adaptive: 1.10 < 1.15
    assert verdict["oracle"]["fraction_on_up"] == "0.75"  # the faster of the two fixed splits
    assert verdict["oracle"]["ratio"][0] == pytest.approx(1.25) and verdict["oracle"]["holds"]  # floor 0
    assert verdict["ceiling"] == pytest.approx(1.33, abs=0.01)  # 1:1 rates (mpccs.sim.bounds)
    assert "| 16 MiB | 0.75 |" in text and "(MPCCS_PLANE_RATES): up=500mbit,out=500mbit." in text
    assert "Plan rates: not recorded." in text
    assert "start-up ran inside the 16 MiB point (no --settle)" in text
    settled = {"size": 16 * mib, "ops": 40, "adaptive_s": 5.2, "up_s": 5.4, "epoch": 3}
    text_settled, _ = two_by_two.report(dict(data, meta={"settle": settled}), "1gbit", "1gbit", 12, [], None)
    assert ("start-up ran before the sweep: 40 operations of 16 MiB under `adaptive` against as many under `up`, "
            "adaptive / up time 0.96x (5200 / 5400 ms)") in text_settled
    measured = {"source": "measured", "up": 61.7e6, "out": 57.5e6}
    plain, (alone,) = two_by_two.report({"rows": data["rows"][:3] + [dict(data["rows"][5], plan_rates=measured)]},
                                        "1gbit", "500mbit", 12, [], None)
    assert "oracle" not in alone and "best fixed split" not in plain and "none (the priors" in plain
    assert "16 MiB: measured (up 61.7 MB/s, out 57.5 MB/s)" in plain
    assert alone["ceiling"] == pytest.approx(1.0)  # 2:1: no split can beat an overlapped 'up'
    # another hierarchical collective: the same ratios, without the all_reduce bound's columns
    other = {"rows": [dict(r, collective="reduce_scatter") for r in data["rows"]]}
    text, (scatter,) = two_by_two.report(other, "500mbit", "500mbit", 12, ["0.8", "0.75"], None)
    assert "reduce_scatter" in text.splitlines()[0] and "ceiling" not in scatter
    assert scatter["ratio"][0] == pytest.approx(1.10) and "| - | - | NOT MET |" in text


def test_adaptive_overhead_clock_sums_time_and_calls_per_operation():
    clock_mod = load("adaptive_overhead")

    class Owner:
        def work(self, x, *, twice=False):
            if x < 0:
                raise ValueError(x)
            return 2 * x if twice else x

    clock = clock_mod.Clock()
    clock.wrap(Owner, "work")
    owner = Owner()
    assert owner.work(3) == 3 and owner.work(4, twice=True) == 8  # arguments and results pass through
    with pytest.raises(ValueError):
        owner.work(-1)  # an exception still counts its call and time
    per_op = clock.per_op(2)
    assert set(per_op) == {"work"}
    assert per_op["work"]["calls"] == 1.5  # three calls over two operations
    assert per_op["work"]["us"] > 0
    clock.reset()
    assert clock.per_op(1) == {}


def test_size_sweep_rows_and_their_report_lines(capsys):
    stats = load("stats")

    class Rank0:
        rank = 0

    seen = []

    def measure_one(nbytes, in_place):
        seen.append((nbytes, in_place))
        return {"size": nbytes, "in_place": in_place, "algorithm": {"before": "ring"},
                "times_s": {"a": [2.0, 2.0, 2.0], "b": [1.0, 1.0, 1.0], "a2": [2.0, 2.0, 2.0]}}

    rows = stats.size_sweep(Rank0(), (False, True), [1 << 20, 4 << 20], measure_one)
    assert seen == [(1 << 20, False), (4 << 20, False), (1 << 20, True), (4 << 20, True)]  # in place outermost
    assert capsys.readouterr().out.splitlines() == [
        "# progress: out of place 1 MiB", "# progress: out of place 4 MiB",
        "# progress: in place 1 MiB", "# progress: in place 4 MiB"]
    line = stats.ab_size_row(rows[2], "a", "b", "a2", rows[2]["algorithm"]["before"])
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:3] == ["1 MiB", "yes", "ring"]
    assert cells[3:5] == ["2000000", "1000000"]  # each way's median, in microseconds
    assert cells[5].startswith("2.00 [2.00, 2.00]") and cells[6] == "0.00"  # a / b, and the A/A floor
    assert stats.ab_size_row(rows[0], "a", "b", "a2").startswith("| 1 MiB | no | 2000000 |")
