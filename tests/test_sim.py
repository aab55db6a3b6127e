"""Flow-level simulator: closed forms, fair sharing, aggregation, scale, policies, CLI.

Every schedule comes from mpccs.algorithms (the same DAGs real runs execute)
except the small hand-made ones that isolate one simulator mechanism.
"""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from mpccs.algorithms import build_schedule
from mpccs.algorithms.schedule import Flow, Schedule, Stage, Topology
from mpccs.sim.cli import main as sim_main
from mpccs.sim.fabric import Cluster, max_min_rates
from mpccs.sim.fit import PlaneFit, fit_ring_all_reduce, preset_for_testbed
from mpccs.sim.presets import PRESETS, load_toml
from mpccs.sim.report import (
    Scenario,
    busbw_factor,
    count_for_size,
    evaluate,
    golden_min,
    published_comparison,
    step_speedup,
)
from mpccs.sim.run import Background, FixedShare, NominalSplit, PlaneDown, controller_factory, simulate
from mpccs.sim.study import closed_form_s, contention_free

MiB, GiB = 1 << 20, 1 << 30
H100 = PRESETS["h100"].with_(copy_GBps=math.inf)  # NCCL-like: no in->out copy charged


def per_rank_controllers(cluster, **config):
    make = controller_factory(**config)
    return lambda rank: make(cluster, rank)


# --- closed forms -----------------------------------------------------------------
@pytest.mark.parametrize("collective,algorithm", [
    ("all_reduce", "ring"), ("all_reduce", "rhd"), ("all_to_all", "pairwise"),
    ("reduce_scatter", "ring"), ("all_gather", "ring"),
])
@pytest.mark.parametrize("world", [4, 8, 16])
@pytest.mark.parametrize("n_bytes", [64 << 10, 64 * MiB])
def test_single_plane_matches_closed_form(collective, algorithm, world, n_bytes):
    rate_GBps, latency_us = 100.0, 5.0
    count = n_bytes // 4 if collective == "all_reduce" else n_bytes // 4 // world
    schedule = build_schedule(collective, world, count, algorithm=algorithm)
    result = simulate(schedule, Cluster(contention_free(world, rate_GBps, latency_us)))
    expected = closed_form_s(collective, algorithm, world, n_bytes, latency_us * 1e-6, 1 / (rate_GBps * 1e9))
    assert result.ok
    assert result.time_s == pytest.approx(expected, rel=0.02)


# --- fair sharing -----------------------------------------------------------------
def test_max_min_equal_share_and_capped_flow_releases_capacity():
    # Three flows on one 12 B/s link, one capped at 2: the others get 5 each.
    res = np.array([[0], [0], [0]])
    w = np.ones((3, 1))
    rates = max_min_rates(res, w, np.array([2.0, np.inf, np.inf]), np.array([12.0]))
    assert rates == pytest.approx([2.0, 5.0, 5.0])


def test_max_min_two_bottlenecks_and_weights():
    # Flow 0 crosses links A (10) and B (4); flow 1 only A; flow 2 only B.
    res = np.array([[0, 1], [0, 0], [1, 1]])
    w = np.array([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    rates = max_min_rates(res, w, np.full(3, np.inf), np.array([10.0, 4.0]))
    assert rates == pytest.approx([2.0, 8.0, 2.0])
    # A host-staged copy spends 2 bytes of memory per byte delivered.
    rates = max_min_rates(np.array([[0]]), np.array([[2.0]]), np.array([np.inf]), np.array([10.0]))
    assert rates == pytest.approx([5.0])


def test_shared_pcie_link_gives_no_gain_and_spec_split_loses():
    sc = Scenario(PRESETS["pcie-p2p"], 1, "all_reduce", 256 * MiB)
    single = sc.run("ring", FixedShare(0.0)).time_s
    spec = sc.run("ring", make_policy=NominalSplit).time_s
    _, tuned = golden_min(lambda x: sc.run("ring", FixedShare(x)).time_s, 0.0, 0.7)
    assert tuned == pytest.approx(single, rel=0.01)
    assert spec > 1.05 * single


# --- multipath on presets ----------------------------------------------------------
def test_h100_gain_is_bounded_by_nic_over_nvlink():
    row = evaluate(Scenario(PRESETS["h100"], 1, "all_reduce", GiB), ["ring"])
    bound = PRESETS["h100"].nic.usable_GBps / PRESETS["h100"].up_port.usable_GBps
    assert 0.8 * bound < row.gain_of(row.tuned) <= bound + 1e-9
    assert row.tuned.out_share == pytest.approx(bound / (1 + bound), abs=0.02)


def test_host_staged_pcie_server_gains_in_the_papers_range():
    row = evaluate(Scenario(PRESETS["pcie-shm"], 1, "all_reduce", GiB), ["ring"])
    assert 0.15 < row.gain_of(row.tuned) < 0.54


def test_predicted_busbw_vs_published_is_reported_not_fitted():
    rows = {r["preset"]: r for r in published_comparison([PRESETS["h100"], PRESETS["a100"]])}
    # The link model over-predicts (protocol overheads above the link layer are
    # not modelled); these bounds notice a preset change that hides or grows it.
    assert 0.10 < rows["h100"]["difference"] < 0.20
    assert 0.15 < rows["a100"]["difference"] < 0.30


# --- aggregation and scale ---------------------------------------------------------
@pytest.mark.parametrize("collective,algorithm,count,policy,channels", [
    ("all_reduce", "hierarchical", 256 * MiB // 4, "single", 1),
    ("all_reduce", "hierarchical", 256 * MiB // 4, "share", 1),
    ("all_reduce", "hierarchical", 256 * MiB // 4, "controller", 1),
    ("all_reduce", "hierarchical", 256 * MiB // 4, "share", 4),  # channels served in order
    ("all_reduce", "ring", 16 * MiB // 4, "share", 1),
    ("all_to_all", "pairwise", MiB // 4, "share", 1),
])
def test_aggregated_matches_full_simulation_at_64_ranks(collective, algorithm, count, policy, channels):
    schedule = build_schedule(collective, 64, count, algorithm=algorithm, topology=Topology.blocks(64, 8),
                              channels=channels)
    times = {}
    for aggregate in (False, True):
        cluster = Cluster(H100, 8)
        kw = {"single": dict(policy=FixedShare(0.0)), "share": dict(policy=FixedShare(0.1)),
              "controller": dict(policy_factory=per_rank_controllers(cluster))}[policy]
        result = simulate(schedule, cluster, aggregate=aggregate, **kw)
        assert result.ok
        assert result.aggregated == aggregate
        times[aggregate] = result.time_s
    assert times[True] == pytest.approx(times[False], rel=0.01)


def test_asymmetric_schedule_is_not_aggregated():
    schedule = build_schedule("broadcast", 16, MiB, algorithm="tree", topology=Topology.blocks(16, 8))
    result = simulate(schedule, Cluster(H100, 2), aggregate="auto")
    assert result.ok and not result.aggregated


def test_1024_rank_hierarchical_all_reduce_under_60s():
    t0 = time.perf_counter()
    schedule = build_schedule("all_reduce", 1024, GiB // 4, algorithm="hierarchical",
                              topology=Topology.blocks(1024, 8))
    result = simulate(schedule, Cluster(PRESETS["h100"], 128), FixedShare(0.1))
    elapsed = time.perf_counter() - t0
    assert result.ok and result.aggregated
    assert elapsed < 60
    busbw = 2 * 1023 / 1024 * GiB / result.time_s / 1e9
    # The inter-domain phase moves 1/8 of the buffer per NIC: 8 NICs bound it.
    assert 30 < busbw < 8 * PRESETS["h100"].nic.usable_GBps


# --- engine mechanics ----------------------------------------------------------------
def _one_flow(nbytes: int) -> Schedule:
    flow = Flow(0, 0, 1, "in", 0, "out", 0, nbytes // 4)
    return Schedule("all_to_all", "hand", 2, nbytes // 4, (Stage(0, (flow,)),))


def test_two_independent_planes_add_up_for_one_flow():
    preset = preset_for_testbed(PlaneFit(2.0, 10.0), PlaneFit(1.0, 10.0))
    n = 256 * MiB
    sched = _one_flow(n)
    alone = simulate(sched, Cluster(preset), FixedShare(0.0)).time_s
    split = simulate(sched, Cluster(preset), FixedShare(1 / 3)).time_s
    assert alone == pytest.approx(10e-6 + n / 2e9, rel=1e-6)
    assert split == pytest.approx(10e-6 + n / 3e9, rel=1e-3)


def test_steal_rescues_a_bad_split():
    preset = preset_for_testbed(PlaneFit(2.0, 10.0), PlaneFit(1.0, 10.0))
    sched = _one_flow(256 * MiB)
    bad = simulate(sched, Cluster(preset), FixedShare(0.8, window_bytes=4 * MiB)).time_s
    rescued = simulate(sched, Cluster(preset), FixedShare(0.8, window_bytes=4 * MiB, steal=True)).time_s
    ideal = 10e-6 + 256 * MiB / 3e9
    assert bad > 2 * ideal
    assert rescued < 1.05 * ideal


def test_window_caps_rate_at_window_over_latency():
    preset = preset_for_testbed(PlaneFit(100.0, 100.0), PlaneFit(1.0, 100.0))
    sched = _one_flow(64 * MiB)
    res = simulate(sched, Cluster(preset), FixedShare(0.0, window_bytes=MiB))
    assert res.time_s == pytest.approx(100e-6 + 64 * MiB / (MiB / 100e-6), rel=1e-3)


class RecordingPolicy(FixedShare):
    wants_feedback = True

    def __init__(self):
        super().__init__(0.25)
        self.chunks, self.stages = [], []

    def on_chunk(self, plane, peer, nbytes, t_post, t_done):
        self.chunks.append((plane, peer, nbytes, t_post, t_done))

    def on_stage(self, decision, t_start, t_end, bytes_by_plane):
        self.stages.append((t_start, t_end, dict(bytes_by_plane)))


def test_controller_feedback_sees_chunk_completions_at_link_rate():
    preset = preset_for_testbed(PlaneFit(2.0, 10.0), PlaneFit(1.0, 10.0))
    sched = build_schedule("all_reduce", 2, 64 * MiB // 4, algorithm="ring")
    policies = {}
    res = simulate(sched, Cluster(preset), policy_factory=lambda r: policies.setdefault(r, RecordingPolicy()),
                   chunk_bytes=MiB)
    assert res.ok
    p0 = policies[0]
    assert len(p0.stages) == 2 and p0.stages[0][2]["out"] == pytest.approx(0.25 * 32 * MiB, rel=1e-6)
    assert sum(c[2] for c in p0.chunks) == 64 * MiB  # every byte reported once
    for plane, rate in (("up", 2e9), ("out", 1e9)):
        done = sorted(c[4] for c in p0.chunks if c[0] == plane)
        gaps = np.diff(done)
        assert np.median(gaps) == pytest.approx(MiB / rate, rel=1e-3)
    assert all(c[4] > c[3] for c in p0.chunks)


def test_controller_converges_near_tuned_share_on_testbed():
    preset = preset_for_testbed(PlaneFit(0.29, 25.0), PlaneFit(0.15, 25.0))
    sc = Scenario(preset, 1, "all_reduce", 64 * MiB)
    runs = sc.series("ring", controller_factory(), 6)
    last = runs[-1]
    assert last.out_share == pytest.approx(0.15 / 0.44, abs=0.05)
    assert sc.busbw(last.time_s) > 0.4


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_controller_drops_out_where_both_planes_share_one_pcie_link(collective):
    # pcie-p2p: 'up' and 'out' both cross the GPU's x16 link, so a split is as
    # fast as 'up' alone and borrows the NICs for nothing. The controller kept
    # 16-43% on 'out': its check stage's solo record was capped at 1.2x the
    # 'up' rate measured while 'up' shared the link, and probes repeated forever
    # without the engine's operation clock (epoch).
    sc = Scenario(PRESETS["pcie-p2p"], 1, collective, 16 * MiB)
    runs = sc.series("rhd", controller_factory(), 13)
    single = sc.run("rhd").time_s
    assert max(r.out_share for r in runs[5:]) < 0.01
    assert runs[-1].time_s == pytest.approx(single, rel=0.01)


# --- timed events ----------------------------------------------------------------------
def test_background_load_on_nics_slows_fixed_split_and_controller_adapts():
    sc = Scenario(PRESETS["pcie-shm"], 1, "all_reduce", 64 * MiB)
    load = [Background("out", 0.6)]
    fixed_clean = sc.run("ring", FixedShare(0.44)).time_s
    fixed_loaded = sc.run("ring", FixedShare(0.44), events=load).time_s
    assert fixed_loaded > 1.3 * fixed_clean
    runs = sc.series("ring", controller_factory(), 8, events=load)
    assert runs[-1].time_s < 0.9 * fixed_loaded
    assert runs[-1].out_share < 0.3


def test_scale_up_failure_is_survived_on_the_nics():
    sc = Scenario(H100, 1, "all_reduce", 256 * MiB)
    base = sc.run("ring", FixedShare(0.1)).time_s
    # 0.45: inside a stage (at 0.5 the ring is between two stages, nothing in flight).
    res = simulate(sc.schedule("ring"), Cluster(H100), FixedShare(0.1), events=[PlaneDown("up", 0.45 * base)])
    assert res.ok
    assert any("resent on out" in what for _, what in res.events)
    # What is left after the failure moves at NIC speed instead of NVLink's.
    assert res.time_s > 0.45 * base + 1e-3 + 0.5 * 256 * MiB * 2 * 7 / 8 / (H100.nic.usable_GBps * 1e9)


def test_scale_out_failure_across_domains_fails_the_operation():
    schedule = build_schedule("all_reduce", 16, 64 * MiB // 4, algorithm="hierarchical",
                              topology=Topology.blocks(16, 8))
    res = simulate(schedule, Cluster(H100, 2), FixedShare(0.0), events=[PlaneDown("out", 1e-5)])
    assert not res.ok
    assert "only plane" in res.error or "no live plane" in res.error


# --- presets, fit, report, CLI -----------------------------------------------------------
def test_custom_cluster_from_toml(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('base = "h100"\nname = "h100-200g"\nnic = { nominal_GBps = 25.0, efficiency = 0.98 }\n')
    preset = load_toml(path)
    assert preset.name == "h100-200g" and preset.nic.usable_GBps == pytest.approx(24.5)
    assert preset.up_port == PRESETS["h100"].up_port
    path.write_text('base = "h100"\nnics = 2\n')
    with pytest.raises(ValueError, match="unknown preset keys"):
        load_toml(path)


def test_fit_recovers_alpha_beta():
    rate, alpha, world = 0.29e9, 25e-6, 2
    samples = [(s, 2 * (world - 1) * alpha + 2 * (world - 1) / world * s / rate) for s in (1 << 16, 1 << 20, 1 << 26)]
    fit = fit_ring_all_reduce(samples, world)
    assert fit.rate_GBps == pytest.approx(0.29, rel=1e-6)
    assert fit.latency_us == pytest.approx(25.0, rel=1e-6)


def test_busbw_factors_sizes_and_step_time():
    assert busbw_factor("all_reduce", 8) == pytest.approx(1.75)
    assert busbw_factor("all_to_all", 8) == pytest.approx(0.875)
    assert count_for_size("all_gather", 8 * MiB, 8) == MiB // 4
    assert step_speedup(0.43, 1.25) == pytest.approx(1.094, abs=1e-3)
    assert step_speedup(0.0, 2.0) == 1.0


def test_cli_run_and_fit_testbed(capsys, tmp_path):
    out = tmp_path / "rows.json"
    assert sim_main(["run", "--preset", "h100", "-c", "all_reduce", "-a", "ring", "-b", "256M", "-e", "256M",
                     "--policy", "share:0.1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text and "all_reduce" in text
    assert json.loads(out.read_text())[0]["label"] == "SIMULATED"
    measured = tmp_path / "planes.json"
    measured.write_text(json.dumps({"up": {"rate_GBps": 0.29, "latency_us": 25},
                                    "out": {"rate_GBps": 0.15, "latency_us": 25}}))
    assert sim_main(["--fit-testbed", "--measured", str(measured), "--sizes", "64M", "--iters", "2"]) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text and "ctrl" in text


def test_fit_testbed_from_perf_json_compares_with_measured_multipath(capsys, tmp_path):
    # mpccs-perf -J rows: each plane alone (fitted), and a measured multipath policy.
    def row(size, policy, rate):
        t = 2 * 25e-6 + size / rate
        return {"collective": "all_reduce", "size": size, "policy": policy, "time_us": t * 1e6,
                "busbw": size / t / 1e9, "nranks": 2}
    rows = [row(s, p, r) for s in (4 * MiB, 16 * MiB) for p, r in (("up", 0.29e9), ("out", 0.15e9), ("adaptive", 0.43e9))]
    perf = tmp_path / "perf.json"
    perf.write_text(json.dumps({"meta": {}, "rows": rows}))
    assert sim_main(["fit-testbed", "--measured", str(perf)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "adaptive" in x and "measured" in x]
    assert len(lines) == 2
    assert all(abs(float(x.split()[-1].rstrip("%"))) < 5 for x in lines)  # predicted within 5% of 0.43
