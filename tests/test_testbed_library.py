"""The library on the emulated two-fabric cluster: what the kernel saw on each
interface matches what mpccs says it sent, and the controller finds the split.

Needs root (network namespaces); skipped with the reason otherwise. CI has root.
"""
import json
import os
import statistics
import sys

import pytest

from mpccs.testbed import Cluster, TestbedUnavailable, check_available

# Low enough that two ranks on 2 busy cores drive both planes at full rate at
# once (at 2.4/1.2 gbit the CPU, not the links, was the limit under load), so
# what the controller sees is the links.
UP_RATE, OUT_RATE = "1gbit", "500mbit"
JOB = os.path.join(os.path.dirname(__file__), "programs", "testbed_job.py")

try:
    check_available()
    SKIP = None
except TestbedUnavailable as exc:  # not root, or iproute2 missing
    SKIP = str(exc)
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def result_of(run) -> dict:
    for line in run.output[0]:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError("rank 0 printed no result:\n" + "\n".join(run.output[0] + run.output.get(1, [])))


def tx(counters_before, counters_after, rank, plane) -> int:
    return counters_after[rank][plane].get("tx_bytes", 0) - counters_before[rank][plane].get("tx_bytes", 0)


@pytest.fixture(scope="module")
def tcp_cluster():
    with Cluster(n=2, up="tcp", up_rate=UP_RATE, out_rate=OUT_RATE, log=lambda m: None) as cluster:
        yield cluster


@pytest.mark.parametrize("policy", ["up", "out", "0.5"])
def test_kernel_counters_match_bytes_per_plane(tcp_cluster, policy):
    nbytes = 16 << 20
    before = tcp_cluster.counters()
    run = tcp_cluster.run([sys.executable, JOB, "p2p", policy, str(nbytes)], timeout=120, stream=open(os.devnull, "w"))
    after = tcp_cluster.counters()
    assert run.exit_code == 0, "\n".join(run.output[0] + run.output[1])
    library = result_of(run)["bytes_per_plane"]
    kernel = {plane: tx(before, after, 0, plane) for plane in ("up", "out")}
    assert library["up"] + library["out"] == nbytes
    for plane in ("up", "out"):
        # the kernel counts headers and the rendezvous handshake too: a few percent over
        assert library[plane] <= kernel[plane] <= library[plane] * 1.08 + (256 << 10), (plane, library, kernel)
    if policy == "up":
        assert library["out"] == 0
    elif policy == "out":
        assert library["up"] == 0
    else:
        assert library["up"] > nbytes * 0.4 and library["out"] > nbytes * 0.4


def test_adaptive_finds_the_rate_ratio_and_beats_up(tcp_cluster):
    run = tcp_cluster.run([sys.executable, JOB, "adaptive", str(32 << 20), "20"], timeout=300,
                          stream=open(os.devnull, "w"))
    assert run.exit_code == 0, "\n".join(run.output[0] + run.output[1])
    res = result_of(run)
    # The controller re-probes, and on 2 busy cores a noisy stretch can make it
    # drop 'out' for an operation or two (a CI run saw 2 of the last 4 on 'up'),
    # or, judged on noisy joint stages, until its next probe: one CI run dropped
    # it at operation 5, two after the re-add, and the next probe (epoch 16)
    # came after 10 operations. 20 operations hold that recovery: the check is
    # that late operations split, and split at the link ratio.
    late = res["share"][-8:]
    split = [s for s in late if 0.05 < s < 0.95]
    expected = 2 / 3  # UP_RATE : OUT_RATE = 2 : 1
    assert len(split) >= 3, res
    assert abs(statistics.median(split) - expected) <= 0.10, res
    # Timing on a shared 2-core machine is noisy and adaptive keeps probing: the
    # check is that it can beat 'up' once settled, not a speed target (those are
    # measured by bench/testbed_targets.py with intervals).
    assert min(res["adaptive"]) < statistics.median(res["up"]), res


def test_shared_bottleneck_ends_on_one_plane():
    # The first probe (operation 4) may re-add 'out' on a noisy machine; the re-add's
    # check (operations 8 and 9, READD_CHECK_AFTER and READD_CHECK_OPS) drops it again,
    # and a rank whose own checks were slow follows its peer's drop an operation later.
    # The median of the last 4 of 12 operations is on one plane even when that takes
    # until operation 10; the next probe comes at 16.
    with Cluster(n=2, up="tcp", up_rate=UP_RATE, out_rate=OUT_RATE, shared_bottleneck=True,
                 log=lambda m: None) as cluster:
        run = cluster.run([sys.executable, JOB, "adaptive", str(32 << 20), "12"], timeout=300,
                          stream=open(os.devnull, "w"))
    assert run.exit_code == 0, "\n".join(run.output[0] + run.output[1])
    res = result_of(run)
    settled = statistics.median(res["share"][-4:])
    assert settled >= 0.9 or settled <= 0.1, res["share"]
