"""All_reduce bandwidth bounds (mpccs.sim.bounds): closed forms, and the fluid simulator never beats them."""
from __future__ import annotations

import pytest

from mpccs.algorithms import build_schedule
from mpccs.algorithms.schedule import Topology
from mpccs.sim.bounds import all_reduce_bounds
from mpccs.sim.fabric import Cluster
from mpccs.sim.fit import PlaneFit, preset_for_testbed
from mpccs.sim.run import FixedShare, simulate

MiB = 1 << 20
TWO_BY_TWO = [0, 0, 1, 1]


def test_two_to_one_rates_leave_no_room_over_the_overlapped_single_plane_policy():
    # The testbed's target-4 layout: up 1 Gbit/s, out 500 Mbit/s per rank.
    b = all_reduce_bounds(64 * MiB, TWO_BY_TWO, 125e6, 62.5e6)
    assert b.per_rank_s == pytest.approx(1.5 * 64 * MiB / 187.5e6)
    assert b.cross_domain_s == pytest.approx(64 * MiB / 125e6)
    assert b.single_plane_s == pytest.approx(64 * MiB / 125e6)
    assert b.ceiling == pytest.approx(1.0)


@pytest.mark.parametrize("up_over_out,ceiling", [(1.0, 4 / 3), (1.25, 1.2), (2.0, 1.0), (4.0, 1.0), (18.0, 1.0)])
def test_ceiling_over_rate_ratio(up_over_out, ceiling):
    # 2x2: (up + out) / (1.5 up) while up < 2 out, then the cross-domain limit binds both policies.
    assert all_reduce_bounds(16 * MiB, TWO_BY_TWO, up_over_out * 1e8, 1e8).ceiling == pytest.approx(ceiling)


def test_one_domain_ceiling_is_the_sum_of_the_planes():
    b = all_reduce_bounds(8 * MiB, [0, 0], 2e8, 1e8)
    assert b.cross_domain_s == 0.0
    assert b.ceiling == pytest.approx(1.5)  # target 1's 2:1 pair: 1.5x 'up' at most


def test_one_rank_per_domain_has_only_out():
    b = all_reduce_bounds(8 * MiB, [0, 1, 2, 3], 2e8, 1e8)
    assert b.per_rank_s == pytest.approx(1.5 * 8 * MiB / 1e8)
    assert b.ceiling == pytest.approx(1.0)


@pytest.mark.parametrize("domain_of,rates,match", [
    ([0], (1e8, 1e8), "at least 2 ranks"),
    ([0, 0, 0, 1], (1e8, 1e8), "unequal size"),
    ([0, 0, 1, 1], (0.0, 1e8), "positive"),
])
def test_bad_input_is_refused(domain_of, rates, match):
    with pytest.raises(ValueError, match=match):
        all_reduce_bounds(MiB, domain_of, *rates)


@pytest.mark.parametrize("up_GBps,out_GBps", [(0.125, 0.0625), (0.0625, 0.0625)])
def test_simulated_schedules_respect_the_bounds(up_GBps, out_GBps):
    """No split of a hierarchical schedule finishes below the multipath bound in the
    fluid simulator, and the single-plane policy none below its own; more
    channels bring the single-plane policy closer to its bound."""
    nbytes = 64 * MiB
    cluster = Cluster(preset_for_testbed(PlaneFit(up_GBps, 1.0), PlaneFit(out_GBps, 1.0), world=2), 2)
    b = all_reduce_bounds(nbytes, TWO_BY_TWO, up_GBps * 1e9, out_GBps * 1e9)
    single = {}
    for channels in (1, 4):
        schedule = build_schedule("all_reduce", 4, nbytes // 4, algorithm="hierarchical",
                                  topology=Topology.blocks(4, 2), channels=channels)
        single[channels] = simulate(schedule, cluster, FixedShare(0.0)).time_s
        assert single[channels] >= b.single_plane_s * 0.999
        for share in (0.1, 0.25, 0.4):
            assert simulate(schedule, cluster, FixedShare(share)).time_s >= b.multipath_s * 0.999
    assert single[4] < 0.7 * single[1]  # staggered channels (priority by channel)
