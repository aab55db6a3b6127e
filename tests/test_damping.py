"""Flap damping of a flow's whole-chunk boundary (mpccs.control.damping), alone
and inside the controller, with estimates that swing as they did next to a
paced competing flow (bench/results/series_s51_damping/)."""
import pytest

from mpccs.control import ControlConfig, FlowDemand, PathController
from mpccs.control.damping import BoundaryDamping

KiB = 1024
MiB = 1024 * KiB
KEY = (1, 0, 23)
LOW, HIGH = 1.5 * MiB, 2.0 * MiB   # two neighbouring boundaries: bytes on 'out'


def flap(d: BoundaryDamping, key=KEY) -> None:
    """LOW -> HIGH -> LOW -> HIGH -> LOW: damped from the second reversal."""
    assert d.choose(key, None, LOW) == LOW
    assert d.choose(key, LOW, HIGH) == HIGH
    assert d.choose(key, HIGH, LOW) == LOW        # one reversal: a load that came and went
    assert not d.damped(key)
    assert d.choose(key, LOW, HIGH) == HIGH       # the second: damped from here
    assert d.damped(key)
    assert d.choose(key, HIGH, LOW) == LOW        # fewer bytes on 'out': taken


def test_moves_in_one_direction_and_one_reversal_never_damp():
    d = BoundaryDamping(half_life=32, confirm=4)
    assert d.choose(KEY, None, HIGH) == HIGH                  # the first decision
    for n in (2.5, 3.0, 3.5, 4.0):                            # a ramp toward a new target
        assert d.choose(KEY, (n - 0.5) * MiB, n * MiB) == n * MiB
    assert d.choose(KEY, 4.0 * MiB, LOW) == LOW               # the load came back: one reversal
    assert not d.damped(KEY)
    assert d.choose(KEY, LOW, HIGH) == HIGH                   # a second one, a flap: damped now
    assert d.damped(KEY)


def test_a_flap_damps_moves_to_more_bytes_on_out_until_they_persist():
    d = BoundaryDamping(half_life=32, confirm=4)
    flap(d)
    # a swing of the estimate for 3 decisions: refused each time
    for _ in range(3):
        assert d.choose(KEY, LOW, HIGH) == LOW
    assert d.choose(KEY, LOW, LOW) == LOW        # the swing ends: the count starts again
    for _ in range(3):
        assert d.choose(KEY, LOW, HIGH) == LOW
    # picks that persist for `confirm` decisions (the load went) are taken, as far as all of them asked
    assert d.choose(KEY, LOW, 2.5 * MiB) == HIGH
    assert d.choose(KEY, HIGH, 2.5 * MiB) == HIGH    # and from there it waits again


def test_moves_to_fewer_bytes_on_out_are_taken_at_once():
    d = BoundaryDamping(half_life=32, confirm=4)
    flap(d)
    assert d.choose(KEY, LOW, 1.0 * MiB) == 1.0 * MiB   # a load that came: at once (target 5's 5 operations)
    assert d.damped(KEY)


def test_a_dip_climbs_back_at_once_and_one_that_stays_is_held():
    d = BoundaryDamping(half_life=32, confirm=4)
    flap(d)
    assert d.choose(KEY, LOW, 1.0 * MiB) == 1.0 * MiB   # a dip ...
    assert d.choose(KEY, 1.0 * MiB, LOW) == LOW          # ... back to the held boundary: at once
    assert d.choose(KEY, LOW, 1.0 * MiB) == 1.0 * MiB   # a dip that stays ...
    for _ in range(3):
        assert d.choose(KEY, 1.0 * MiB, 1.0 * MiB) == 1.0 * MiB
    assert d.choose(KEY, 1.0 * MiB, LOW) == 1.0 * MiB   # ... `confirm` decisions: now the one held
    assert d.damped(KEY)


def test_the_held_boundary_is_the_one_that_stayed_not_the_swing():
    d = BoundaryDamping(half_life=32, confirm=4)
    assert d.choose(KEY, None, HIGH) == HIGH
    for _ in range(5):
        d.choose(KEY, HIGH, HIGH)                    # HIGH stays: the settled boundary
    d.choose(KEY, HIGH, LOW)                         # two short dips: a flap
    d.choose(KEY, LOW, HIGH)
    d.choose(KEY, HIGH, LOW)
    assert d.damped(KEY)
    assert d.choose(KEY, LOW, HIGH) == HIGH          # back up to the settled one: at once
    assert d.choose(KEY, HIGH, 2.5 * MiB) == HIGH    # above it: waits


def test_a_swing_that_outlasted_the_wait_does_not_raise_the_held_boundary():
    d = BoundaryDamping(half_life=32, confirm=4)
    flap(d)
    for _ in range(3):
        assert d.choose(KEY, LOW, HIGH) == LOW
    assert d.choose(KEY, LOW, HIGH) == HIGH          # taken at the fourth
    assert d.choose(KEY, HIGH, LOW) == LOW           # back after one decision: a swing after all
    for _ in range(3):
        assert d.choose(KEY, LOW, HIGH) == LOW       # the next swing waits again
    assert d.choose(KEY, LOW, HIGH) == HIGH          # one that stays ...
    for _ in range(3):
        assert d.choose(KEY, HIGH, HIGH) == HIGH
    assert d.choose(KEY, HIGH, LOW) == LOW           # ... is the new level: a dip ...
    assert d.choose(KEY, LOW, HIGH) == HIGH          # ... climbs back to it at once


def test_damping_ends_when_the_flaps_are_old():
    d = BoundaryDamping(half_life=8, confirm=4)
    flap(d)
    # three reversals: a penalty of ~3 halves every 8 decisions, under reuse (0.5)
    # after log2(6) = 2.6 half-lives
    for _ in range(16):
        d.choose(KEY, LOW, LOW)
    assert d.damped(KEY)
    for _ in range(6):
        d.choose(KEY, LOW, LOW)
    assert not d.damped(KEY)
    assert d.choose(KEY, LOW, HIGH) == HIGH


def test_swings_that_keep_coming_keep_the_flow_damped():
    d = BoundaryDamping(half_life=8, confirm=4)
    flap(d)
    for _ in range(10):                           # 50 decisions, 6 half-lives
        for _ in range(2):
            assert d.choose(KEY, LOW, HIGH) == LOW  # refused: a flap each
        for _ in range(3):
            d.choose(KEY, LOW, LOW)
        assert d.damped(KEY)


def test_flows_are_damped_apart_and_memory_is_bounded():
    d = BoundaryDamping()
    other = (0, 1, 23)
    flap(d)
    d.choose(other, None, LOW)
    assert not d.damped(other)
    assert d.choose(other, LOW, HIGH) == HIGH
    for i in range(5000):
        d.choose((i, 0, 0), None, LOW)
    assert len(d) == 4096


@pytest.mark.parametrize("kwargs", [dict(half_life=0), dict(suppress=1, reuse=1), dict(confirm=0)])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        BoundaryDamping(**kwargs)


def test_controller_config_refuses_a_negative_half_life():
    with pytest.raises(ValueError, match="flap_half_life"):
        ControlConfig(flap_half_life=-1)


def boundaries_under_a_swinging_estimate(half_life: float) -> list[float]:
    """The bytes on 'out' a controller puts a 8 MiB flow's split on while the
    'out' estimate swings as it did next to a paced 250 Mbit/s flow: ~34 MB/s,
    every ninth decision up to 51 MB/s for three decisions ('up' at
    130 MB/s; 512 KiB chunks). The split targets 1.63 MiB at 34 MB/s and
    2.25 MiB at 51 MB/s: a boundary of 1.5 MiB or 2 MiB."""
    cfg = ControlConfig(prior_rate_Bps={"up": 130e6, "out": 34e6}, prior_delay_s={"up": 0.0, "out": 0.0},
                        flap_half_life=half_life)
    flow = FlowDemand(0, 0, 1, 8 * MiB, ("up", "out"), quantum_bytes=512 * KiB)
    ctl = PathController(cfg, rank=0)
    swing = [34e6] * 6 + [51e6, 45e6, 40e6]
    out = []
    for k in range(90):
        rate = swing[k % len(swing)]
        ctl.config.prior_rate_Bps["out"] = rate
        ctl.estimator.prior_rate_Bps["out"] = rate
        out.append(ctl.decide([flow], now=0.0, chunk_bytes=512 * KiB, align=4096).out_bytes(flow))
    return out


def moves(seq: list[float]) -> int:
    return sum(1 for a, b in zip(seq, seq[1:]) if a != b)


def test_the_controller_stops_flapping_with_a_swinging_estimate():
    undamped = boundaries_under_a_swinging_estimate(0)
    damped = boundaries_under_a_swinging_estimate(32)
    assert set(undamped) == {LOW, HIGH}
    assert moves(undamped) >= 18          # two moves every swing
    assert moves(damped) <= 4             # two excursions (two reversals), then held
    assert damped[-30:] == [LOW] * 30     # on the boundary with fewer bytes on 'out'


def test_the_controller_follows_a_load_that_goes_while_damped():
    cfg = ControlConfig(prior_rate_Bps={"up": 130e6, "out": 34e6}, prior_delay_s={"up": 0.0, "out": 0.0})
    flow = FlowDemand(0, 0, 1, 8 * MiB, ("up", "out"), quantum_bytes=512 * KiB)
    ctl = PathController(cfg, rank=0)

    notes = []

    def decide(rate):
        ctl.config.prior_rate_Bps["out"] = rate
        ctl.estimator.prior_rate_Bps["out"] = rate
        d = ctl.decide([flow], now=0.0, chunk_bytes=512 * KiB, align=4096)
        notes.append(d.reason["flows"]["0"].get("flap"))
        return d.out_bytes(flow)

    for rate in (34e6, 51e6, 34e6, 51e6, 34e6):  # a flap
        decide(rate)
    assert notes == [None, None, None, "damped", "damped"]   # the reason says so from the second reversal
    # the competing flow ends: 'out' reads 62.5 MB/s from now on (target 2.6 MiB)
    # taken once it outlasts a spike of the estimate: step_down_samples + 2 decisions
    confirm = cfg.step_down_samples + 2
    after = [decide(62.5e6) for _ in range(confirm + 2)]
    assert after[:confirm - 1] == [LOW] * (confirm - 1)
    assert after[confirm - 1:] == [2.5 * MiB] * 3
    assert notes[5:5 + confirm - 1] == ["held"] * (confirm - 1)
    assert notes[5 + confirm - 1] == "damped"
