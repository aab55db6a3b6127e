"""Point-to-point over both planes: every byte checked under every policy."""
import numpy as np
import pytest

import mpccs
from rankpool import RankPool

POLICIES = ["up", "out", 0.5, 0.8, "adaptive"]
SIZES = [0, 1, 4097, 1_000_003, 64 << 20]


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2)
    yield p
    p.close()


def pattern(n: int, salt: int = 0) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + salt) % 251).astype(np.uint8)


def exchange(comm, policy, n):
    comm.set_path_policy(policy)
    if comm.rank == 0:
        comm.send(pattern(n), 1)
        return comm.last_stats()["bytes_per_plane"]
    buf = np.full(n, 7, np.uint8)
    comm.recv(buf, 0)
    assert np.array_equal(buf, pattern(n)), f"payload differs (policy {policy}, {n} bytes)"
    return comm.last_stats()["bytes_per_plane"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n", SIZES)
def test_every_byte_arrives(pool, policy, n):
    sent, received = pool.run(exchange, policy, n)
    assert sum(sent.values()) == n and received == sent
    if policy == "up":
        assert sent["out"] == 0
    if policy == "out":
        assert sent["up"] == 0


@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_fixed_fraction_uses_both_planes(pool, fraction):
    n = 64 << 20
    sent, _ = pool.run(exchange, fraction, n)
    assert sent["up"] > 0 and sent["out"] > 0
    assert abs(sent["up"] / n - fraction) < 0.05


def typed_roundtrip(comm):
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    if comm.rank == 0:
        comm.send(x, 1)
        return None
    y = np.zeros((3, 4))
    comm.recv(y, 0)
    return y.tolist()


def test_typed_and_shaped_buffers(pool):
    _, got = pool.run(typed_roundtrip)
    assert got == np.arange(12, dtype=np.float64).reshape(3, 4).tolist()


def mismatched_sizes(comm, sent=10, posted=11):
    try:
        if comm.rank == 0:
            comm.send(np.zeros(sent, np.uint8), 1)
        else:
            buf = np.full(posted, 3, np.uint8)
            try:
                comm.recv(buf, 0)
            finally:
                assert (buf == 3).all(), "a mismatched receive wrote into the buffer"
    except mpccs.MismatchError as exc:
        return str(exc)
    return None


def test_size_mismatch_fails_on_both_sides(pool):
    sender, receiver = pool.run(mismatched_sizes)
    assert sender and "refused" in sender
    assert receiver and "does not match" in receiver


def many_in_flight(comm, count=8):
    peer = 1 - comm.rank
    sends = [comm.isend(pattern(100_000 + i, salt=i + comm.rank), peer) for i in range(count)]
    bufs = [np.zeros(100_000 + i, np.uint8) for i in range(count)]
    recvs = [comm.irecv(b, peer) for b in bufs]
    for w in reversed(recvs):  # complete in an order different from posting
        w.wait()
    for w in sends:
        w.wait()
    return all(np.array_equal(b, pattern(100_000 + i, salt=i + peer)) for i, b in enumerate(bufs))


def test_async_messages_complete_in_any_order(pool):
    assert pool.run(many_in_flight) == [True, True]


def small_in_flight(comm, count=8):
    """Messages that ride inside their header (P2P_INLINE_MAX_BYTES), many at once, waited on out of order."""
    peer = 1 - comm.rank
    sizes = [0, 1, 7, 4096, 65535, 65536, 3, 100][:count]
    sends = [comm.isend(pattern(n, salt=i + comm.rank), peer) for i, n in enumerate(sizes)]
    bufs = [np.zeros(n, np.uint8) for n in sizes]
    recvs = [comm.irecv(b, peer) for b in bufs]
    for w in reversed(recvs):
        w.wait()
    for w in sends:
        w.wait()
    return all(np.array_equal(b, pattern(n, salt=i + peer)) for i, (b, n) in enumerate(zip(bufs, sizes)))


def test_small_messages_in_flight_complete_in_any_order(pool):
    assert pool.run(small_in_flight) == [True, True]


def inline_boundary(comm):
    """Exactly P2P_INLINE_MAX_BYTES rides inline, one byte more goes by rendezvous; both exact."""
    from mpccs.p2p_ops import P2P_INLINE_MAX_BYTES

    out = []
    for n in (P2P_INLINE_MAX_BYTES, P2P_INLINE_MAX_BYTES + 1):
        if comm.rank == 0:
            comm.send(pattern(n, salt=n), 1)
            out.append(comm.last_stats()["bytes_per_plane"])
        else:
            buf = np.zeros(n, np.uint8)
            comm.recv(buf, 0)
            out.append(bool(np.array_equal(buf, pattern(n, salt=n))))
    return out


def test_the_inline_bound_both_ways(pool):
    sent, received = pool.run(inline_boundary)
    assert received == [True, True] and [sum(b.values()) for b in sent] == [65536, 65537]


@pytest.mark.parametrize("sent,posted", [(1000, 100_000), (100_000, 1000)])
def test_size_mismatch_across_the_inline_bound_fails_on_both_sides(pool, sent, posted):
    """One side under the inline bound (P2P_INLINE_MAX_BYTES), the other over it."""
    sender, receiver = pool.run(mismatched_sizes, sent, posted)
    assert sender and "refused" in sender
    assert receiver and "does not match" in receiver
    pool.run(exchange, "up", 1000)  # and the pair still talks


def bad_arguments(comm):
    errors = []
    for call in (
        lambda: comm.send(np.zeros(4), 5),
        lambda: comm.send(np.zeros(4), comm.rank),
        lambda: comm.recv(np.zeros(4)[::2], 1 - comm.rank),
        lambda: comm.recv(np.zeros(4).setflags(write=False) or np.frombuffer(b"abcd", np.uint8), 1 - comm.rank),
        lambda: comm.send([1, 2, 3], 1 - comm.rank),
        lambda: comm.set_path_policy("both"),
        lambda: comm.set_path_policy(1.5),
    ):
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append("TypeError" if isinstance(exc, TypeError) else "ValueError")
    return errors


def test_bad_arguments_fail_before_any_byte_moves(pool):
    for errors in pool.run(bad_arguments):
        assert errors == ["ValueError", "ValueError", "ValueError", "ValueError", "TypeError", "ValueError", "ValueError"]
    # and the communicator is still usable afterwards
    pool.run(exchange, "up", 1000)
