"""What the steps tell a landing choice (control/landing.py), kept for the tests
of the in-place landing (test_cma.py) and of the outboxes (test_shm.py)."""
from mpccs.control.landing import LandingChoice


class RecordedLanding(LandingChoice):
    """A landing choice that keeps what each landing told it, and the sizes it was asked for."""

    def __init__(self, mode):
        super().__init__(mode)
        self.landings, self.asked = [], []

    def for_bytes(self, nbytes):  # (standing in for the LandingChoices of every size)
        self.asked.append(nbytes)
        return self

    def record(self, flushed, landing_s_per_byte, reference_s_per_byte):
        self.landings.append((flushed, landing_s_per_byte, reference_s_per_byte))
        super().record(flushed, landing_s_per_byte, reference_s_per_byte)


def recorded_flushes(monkeypatch, cacheflush) -> list:
    """cacheflush.flush, still flushing, made to note each region's (address, bytes) in the list returned."""
    flushed = []
    real_flush = cacheflush.flush
    monkeypatch.setattr(cacheflush, "flush", lambda region: (flushed.append((region.ctypes.data, region.nbytes)),
                                                            real_flush(region)))
    return flushed
