"""control.plan_rates: what each rank measures, when the ranks agree, and when the plan is rebuilt
(pure: no planes, no clocks)."""
import pytest

from mpccs.algorithms.schedule import Topology
from mpccs.control import ControlConfig
from mpccs.control.plan_rates import AgreementClock, PlaneRateMeter, PlanRateConfig, agree, replan_rates
from mpccs.control.split import PathModel
from mpccs.control.tuner import choose

MiB = 1 << 20
PRIORS = {"up": 5e9, "out": 700e6}


def test_the_meter_answers_the_median_of_its_last_samples_and_skips_small_parts():
    meter = PlaneRateMeter(PlanRateConfig(samples_kept=3))
    assert meter.rates() == {"up": 0.0, "out": 0.0}
    meter.add("out", MiB // 2, 0.001)  # below min_plane_bytes: mostly fixed costs
    meter.add("out", 0, 0.0)
    assert meter.rates()["out"] == 0.0
    for rate in (10e6, 60e6, 62e6, 64e6):  # the first falls out of the last three
        meter.add("out", 4 * MiB, 4 * MiB / rate)
    assert meter.rates() == {"up": 0.0, "out": pytest.approx(62e6)}


def test_the_clock_counts_large_calls_only_and_agrees_at_the_same_call_on_every_rank():
    clock = AgreementClock(PlanRateConfig(min_call_bytes=4 * MiB, first_agreement=4, agreement_every=32))
    assert not clock.measured("all_reduce", 4 * MiB - 1)
    assert not clock.measured("all_to_allv", 64 * MiB)  # its size differs per rank
    assert clock.measured("reduce_scatter", 4 * MiB)
    due = []
    for _ in range(80):
        if clock.tick():
            due.append(clock.calls)
            # some rank had no 'out' sample at the first two: they ask again first_agreement later
            clock.agreed({"up": 60e6, "out": 0.0 if len(due) < 3 else 58e6})
    assert due == [4, 8, 12, 44, 76]


def test_the_ranks_agree_on_the_lower_median_so_one_low_reading_does_not_set_the_plan():
    # testbed_2x2_s44: one rank of four read 'out' at 47.8 MB/s, the others ~60 on 62.5 MB/s links
    four = [{"up": 60e6, "out": 47.8e6}, {"up": 61e6, "out": 60e6}, {"up": 59e6, "out": 61e6},
            {"up": 62e6, "out": 59e6}]
    agreed, highest = agree(four)
    assert agreed == {"up": 60e6, "out": 59e6}  # the lower of the middle two: a rate some rank measured
    assert highest == {"up": 62e6, "out": 61e6}
    assert agree(four[:2])[0] == {"up": 60e6, "out": 47.8e6}  # 2 ranks: the lower of the two
    assert agree(four[:3])[0] == {"up": 60e6, "out": 60e6}


def test_a_plane_some_rank_has_not_measured_is_agreed_as_0():
    agreed, highest = agree([{"up": 60e6, "out": 0.0}, {"up": 61e6, "out": 60e6}, {"up": 59e6, "out": 61e6}])
    assert agreed == {"up": 60e6, "out": 0.0}
    assert highest == {"up": 61e6, "out": 61e6}
    assert replan_rates(agreed, PRIORS) is None


def test_the_plan_is_rebuilt_only_from_complete_agreements_far_enough_off():
    measured_1_to_1 = {"up": 62e6, "out": 58e6}
    assert replan_rates(measured_1_to_1, PRIORS) == measured_1_to_1
    assert replan_rates({"up": 62e6, "out": 0.0}, PRIORS) is None  # one plane unmeasured somewhere
    assert replan_rates({"up": 4e9, "out": 600e6}, PRIORS) is None  # within 1.5x of each
    assert replan_rates({"up": 3.2e9, "out": 700e6}, PRIORS) == {"up": 3.2e9, "out": 700e6}
    assert replan_rates({"up": 62e6, "out": 60e6}, measured_1_to_1) is None  # hysteresis: same regime


@pytest.mark.parametrize("nbytes", [16 * MiB, 64 * MiB])
def test_agreed_1_to_1_rates_turn_the_2x2_hierarchical_plan_multipath(nbytes):
    # Why the agreement exists: on the priors (7:1) the tuner keeps 4 ranks in 2 domains of 2 on one
    # plane; at the rates the 1:1 testbed measures it splits the in-domain steps.
    delay = ControlConfig().prior_delay_s
    topo = Topology((0, 0, 1, 1))

    def plan(rates):
        costs = {p: PathModel(rates[p], delay[p]) for p in ("up", "out")}
        return choose("all_reduce", 4, nbytes, topo, costs, reduce_Bps=2e9)

    assert plan(PRIORS).split_policy == "single"
    measured = replan_rates({"up": 61.7e6, "out": 57.5e6}, PRIORS)
    assert plan(measured).algorithm == "hierarchical" and plan(measured).split_policy == "multipath"
