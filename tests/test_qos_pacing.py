"""The QoS rate cap (MPCCS_OUT_CAP_RATE): borrowed bytes on 'out' are paced by a
token bucket (windows.Pacer), so another tenant's flow on the scale-out link keeps
its share between this job's chunks, not only on average over a stage."""
from __future__ import annotations

import numpy as np
import pytest

from mpccs.config import ConfigError, load_options, parse_rate
from mpccs.windows import Pacer
from rankpool import RankPool

RATE = 40e6  # bytes/s: far below what loopback tcp carries here, so the pacer, not the link, sets the time


def test_pacer_starts_at_most_one_chunk_beyond_the_rate_over_any_interval():
    pacer = Pacer(1000.0, now=0.0)
    started, t = [], 0.0
    while t < 10.0:
        if pacer.ready(t):
            pacer.take(300, t)
            started.append(t)
        t += 0.01
    # 300-byte chunks at 1000 B/s: one every 0.3 s
    gaps = np.diff(started)
    assert np.all(gaps >= 0.3 - 1e-9) and np.all(gaps < 0.31 + 1e-9)
    for a in np.arange(0.0, 9.0, 0.37):  # any window: bytes started <= rate x window + one chunk
        n = sum(1 for s in started if a <= s < a + 1.0)
        assert n * 300 <= 1000 * 1.0 + 300


def test_pacer_burst_lets_an_idle_sender_start_that_much_at_once():
    pacer = Pacer(1000.0, burst_bytes=600, now=0.0)
    assert pacer.ready(5.0)
    pacer.take(300, 5.0)
    assert pacer.ready(5.0)  # 300 of the 600-byte burst left
    pacer.take(300, 5.0)
    assert pacer.ready(5.0)  # not in debt yet: a chunk may start at zero tokens
    pacer.take(300, 5.0)
    assert not pacer.ready(5.1) and pacer.ready(5.31)
    with pytest.raises(ValueError):
        Pacer(0.0)


@pytest.mark.parametrize("text, rate", [("250mbit", 31.25e6), ("1gbit", 125e6), ("30MB", 30e6),
                                        ("30MB/s", 30e6), ("31250000", 31.25e6), ("2.4gbit", 300e6)])
def test_rate_cap_reads_bits_and_bytes(text, rate):
    assert parse_rate(text) == pytest.approx(rate)
    assert load_options({"MPCCS_OUT_CAP_RATE": text}).out_cap_rate_Bps == pytest.approx(rate)


@pytest.mark.parametrize("text, message", [("fast", "MPCCS_OUT_CAP_RATE"), ("100mbps", "MPCCS_OUT_CAP_RATE"),
                                           ("1mbit", "below")])
def test_rate_cap_refuses_what_it_cannot_read_or_pace(text, message):
    with pytest.raises(ConfigError, match=message):
        load_options({"MPCCS_OUT_CAP_RATE": text})


def paced_split(comm, nbytes: int, policy):
    """A fixed split or 'out' alone under the rate cap: exact, and how long each rank's
    share of 'out' took against what the cap allows."""
    comm.set_path_policy(policy)
    x = (np.arange(nbytes // 8, dtype=np.int64) + comm.rank) % 977
    want = sum((np.arange(nbytes // 8, dtype=np.int64) + r) % 977 for r in range(comm.size))
    comm.barrier()
    work = comm.all_reduce(x, np.empty_like(x), async_op=True)
    out = work.wait()
    stats = work.stats()
    chunk = stats["chunk_bytes"]
    return bool(np.array_equal(out, want)), stats["bytes_per_plane"]["out"], stats["duration_s"], chunk


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(2, env={"MPCCS_OUT_CAP_RATE": str(RATE)})
    yield pool
    pool.close()


@pytest.mark.parametrize("policy", [0.5, "out"])
def test_borrowed_bytes_on_out_are_paced_to_the_cap(pool, policy):
    for exact, out_bytes, duration, chunk in pool.run(paced_split, 8 << 20, policy, timeout=120):
        assert exact
        assert out_bytes > 4 * chunk
        # Every chunk after the first waited for its bytes at the capped rate.
        assert duration >= (out_bytes - chunk) / RATE


def paced_send(comm, nbytes: int):
    comm.set_path_policy("out")
    buf = np.arange(nbytes, dtype=np.uint8) if comm.rank == 0 else np.zeros(nbytes, np.uint8)
    comm.barrier()
    if comm.rank == 0:
        work = comm.isend(buf, 1)
    else:
        work = comm.irecv(buf, 0)
    work.wait()
    ok = comm.rank == 0 or bool(np.array_equal(buf, np.arange(nbytes, dtype=np.uint8)))
    return ok, work.stats()["duration_s"]


def test_point_to_point_is_paced_too(pool):
    nbytes = 4 << 20
    (ok0, sent_s), (ok1, _) = pool.run(paced_send, nbytes, timeout=120)
    assert ok0 and ok1
    assert sent_s >= (nbytes - (1 << 20)) / RATE  # at most one chunk (<= 1 MiB) ahead of the cap
