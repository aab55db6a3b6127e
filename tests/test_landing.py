"""The landing flush choice (control/landing.py), driven with synthetic landing
times, and the flush itself (transports/cacheflush.py)."""
import numpy as np
import pytest

from mpccs.config import load_options
from mpccs.control.landing import LandingChoice, LandingChoices, LandingConfig, size_class_of
from mpccs.errors import ConfigError
from mpccs.transports import cacheflush

REF = 1e-10  # seconds per byte of the first step's reads
FAST, SLOW = 0.85 * REF, 5.0 * REF  # a plain landing's time per byte in the two kinds of launch


def land(choice: LandingChoice, plain: float, flushed: float, calls: int) -> list[bool]:
    """``calls`` landings at these times per byte (a flushed one's with its flush); whether each flushed."""
    seen = []
    for _ in range(calls):
        flushes = choice.flush_next()
        choice.record(flushes, flushed if flushes else plain, REF)
        seen.append(flushes)
    return seen


def test_a_fast_launch_never_flushes():
    choice = LandingChoice("auto")
    assert not any(land(choice, FAST, 0.5 * FAST, 500))
    assert (choice.flushing, choice.switches) == (False, 0)


def test_slow_landings_start_a_trial_that_the_flush_wins():
    config = LandingConfig()
    choice = LandingChoice("auto", config=config)
    seen = land(choice, SLOW, 1.5 * REF, config.slow_after + config.slow_after + 10)
    k = config.slow_after
    assert seen[:k] == [False] * k, "plain until slow_after slow landings in a row"
    assert all(seen[k:]), "then the trial, and the flush from then on"
    assert choice.flushing and choice.switches == 1


def test_while_flushing_one_landing_in_recheck_every_goes_plain():
    config = LandingConfig(recheck_every=8)
    choice = LandingChoice("auto", config=config)
    land(choice, SLOW, 1.5 * REF, 2 * config.slow_after)  # slow, then the trial the flush wins
    seen = land(choice, SLOW, 1.5 * REF, 3 * (config.recheck_every + 1))
    plain_at = [i for i, flushed in enumerate(seen) if not flushed]
    assert plain_at == [8, 17, 26], seen
    assert choice.flushing and choice.switches == 1


def test_a_recheck_that_beats_the_flush_lands_plain_again():
    config = LandingConfig(recheck_every=8)
    choice = LandingChoice("auto", config=config)
    land(choice, SLOW, 1.5 * REF, 2 * config.slow_after)
    assert choice.flushing
    seen = land(choice, FAST, 1.5 * REF, 30)  # the launch turned fast: the recheck finds it
    assert seen[:8] == [True] * 8 and not any(seen[8:])
    assert not choice.flushing and choice.switches == 2


def test_a_trial_the_flush_loses_waits_recheck_every_slow_landings_for_the_next():
    config = LandingConfig(recheck_every=10)
    choice = LandingChoice("auto", config=config)
    k = config.slow_after
    seen = land(choice, 2.5 * REF, 4 * REF, k + k + config.recheck_every + k)
    assert seen[:k] == [False] * k and seen[k:2 * k] == [True] * k
    assert seen[2 * k:2 * k + config.recheck_every] == [False] * config.recheck_every
    assert seen[-k:] == [True] * k, "the next trial"
    assert not choice.flushing and choice.switches == 0


def test_slow_landings_must_come_in_a_row():
    choice = LandingChoice("auto")
    flushes = []
    for i in range(300):  # every third landing fast: never slow_after in a row
        flushes.append(choice.flush_next())
        choice.record(flushes[-1], FAST if i % 3 == 2 else SLOW, REF)
    assert not any(flushes)


@pytest.mark.parametrize("mode,can_flush,expected", [("never", True, False), ("always", True, True),
                                                     ("auto", False, False)])
def test_fixed_modes_and_a_rank_that_cannot_flush(mode, can_flush, expected):
    choice = LandingChoice(mode, can_flush=can_flush)
    assert set(land(choice, SLOW, 1.5 * REF, 50)) == {expected}
    assert choice.switches == 0


def test_a_flush_that_cannot_be_made_ready_turns_the_flushing_off():
    """ready() is asked only where a flush is due; False from it lands plain from then on."""
    asked = []

    def not_ready():
        asked.append(True)
        return False

    idle = LandingChoice("auto")
    assert not idle.flush_next(not_ready) and asked == []  # nothing due: not asked
    broken = LandingChoice("always")
    assert not broken.flush_next(not_ready) and asked == [True]
    assert not broken.can_flush and not broken.flush_next() and asked == [True]


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown landing flush mode 'sometimes'"):
        LandingChoice("sometimes")
    with pytest.raises(ValueError, match="unknown landing flush mode 'sometimes'"):
        LandingChoices("sometimes")


def test_each_size_class_of_landing_chooses_alone():
    """Slow 2 MiB landings make their class flush; 8 MiB ones, plain at twice the
    reference (a landing that does not fit the caches pays little for the lines'
    return), keep theirs plain."""
    choices = LandingChoices("auto")
    for _ in range(20):
        for nbytes, plain in ((2 << 20, SLOW), (8 << 20, 1.5 * REF), ((2 << 20) + 4, SLOW)):
            choice = choices.for_bytes(nbytes)
            flushes = choice.flush_next()
            choice.record(flushes, 1.5 * REF if flushes else plain, REF)
    assert choices.flushing_classes == [2 << 20]
    assert choices.switches == 1
    assert choices.for_bytes(3 << 20) is choices.for_bytes(2 << 20) is not choices.for_bytes(4 << 20)


def test_size_classes_are_powers_of_two_at_or_below():
    assert [size_class_of(n) for n in (0, 1, 2, 3, 4096, 4097, (8 << 20) - 1)] == [1, 1, 2, 2, 4096, 4096, 4 << 20]


def test_the_option_reads_its_aliases_and_refuses_the_rest():
    read = [load_options({"MPCCS_LANDING_FLUSH": v}).landing_flush for v in ("1", "0", "Auto", "never")]
    assert read == ["always", "never", "auto", "never"]
    assert load_options({}).landing_flush == "auto"
    with pytest.raises(ConfigError, match="MPCCS_LANDING_FLUSH"):
        load_options({"MPCCS_LANDING_FLUSH": "sometimes"})


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as fh:
            return set(next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), []))
    except OSError:
        return set()


def test_available_follows_the_cpu():
    assert cacheflush.available() == ("clflushopt" in _cpu_flags() and __import__("platform").machine() == "x86_64")


@pytest.mark.skipif(not cacheflush.available(), reason="needs an x86-64 CPU with CLFLUSHOPT")
@pytest.mark.parametrize("start,stop", [(0, 1 << 20), (3, 1000), (17, 18), (5, 5)])
def test_a_flush_keeps_every_byte(start, stop):
    """Flushed lines are written back, not lost: dirty ones, unaligned ends, one byte, none."""
    data = np.arange(1 << 20, dtype=np.uint8) * 7
    data += 1  # dirty in this core's cache
    expected = data.copy()
    assert cacheflush.prepare() and cacheflush.failure is None
    cacheflush.flush(data[start:stop])
    assert data.tobytes() == expected.tobytes()
