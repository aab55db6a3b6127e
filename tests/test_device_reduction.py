"""The device-reduction steps (mpccs.staging.DeviceReduction) in real ranks,
with numpy standing in for the device array module: the same code cupy runs on
a GPU (tests/test_gpu.py runs it there), so the choreography (padding of the
last block, the gather to the root, the rank-order combination, async
completion) is checked on every CI run.
"""
from __future__ import annotations

import pytest

from pairwise import all_pairs
from rankpool import RankPool

import device_cases


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def pool(request):
    pool = RankPool(request.param)
    yield pool
    pool.close()


DIMENSIONS = {
    "kind": ["all_reduce", "reduce_scatter", "reduce"],
    "count": [0, 1, 1001, (4 << 20) // 4 + 5],
    "dtype": ["float32", "float16", "bfloat16", "int32", "uint8", "float64"],
    "op": ["sum", "max", "avg", "prod", "min"],
    "policy": ["up", "out", 0.5, "adaptive"],
    "in_place": [False, True],
    "direct": [False, True],  # staged through mirrors, or GPU-direct (the steps on the arrays themselves)
}


# avg needs a floating dtype (integers are refused before any byte moves)
CASES = all_pairs(DIMENSIONS, valid=lambda c: not (c.get("op") == "avg" and c.get("dtype") in ("int32", "uint8")))


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "-".join(str(v) for v in CASES[i].values()))
def test_device_steps_match_the_rank_order_reduction_bit_for_bit(pool, index):
    case = dict(CASES[index])
    count = case.pop("count")
    if case["kind"] == "reduce_scatter":
        count = max(count // pool.size, 0) * pool.size  # send.size == size * recv.size
    results = pool.run(device_cases.device_reduction, case["kind"], count, case["dtype"], case["op"],
                       case["policy"], index, case["in_place"], case["direct"], timeout=120)
    assert all(ok for _, ok in results), [ok for _, ok in results]
    if case["kind"] == "all_reduce":
        assert len({data for data, _ in results}) == 1  # the same bits on every rank


def test_results_are_bit_identical_under_every_policy(pool):
    seen = set()
    for policy in ("up", "out", 0.5, "adaptive"):
        results = pool.run(device_cases.device_reduction, "all_reduce", (2 << 20) + 3, "float32", "sum",
                           policy, 11, False, timeout=120)
        assert all(ok for _, ok in results)
        seen.add(results[0][0])
    assert len(seen) == 1


def test_two_device_reductions_in_flight_complete_in_either_order(pool):
    assert all(pool.run(device_cases.async_pair, timeout=120))


def test_auto_reduces_on_the_device_where_it_was_measured_to_pay(pool):
    # all_reduce stays on the mirrors; reduce_scatter and reduce go to the device from 16 MiB
    for auto, always, never in pool.run(device_cases.auto_choices):
        assert auto == [False, False, True, False, True, False]
        assert always is True and never is False
