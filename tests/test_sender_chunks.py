"""A sender on one plane cuts its flows by larger chunks than a rank that splits,
and its receivers follow the chunk its fingerprint names (collective_op.CollectiveOp.
_follow_senders_chunking): ranks need not agree on chunking, results stay exact."""
from __future__ import annotations

import pytest

from rankpool import RankPool

import chunk_cases

COUNT = (2 << 20) // 8 + 3  # 2 MiB of int64 per block, not a multiple of any chunk


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def pool(request):
    # An 'adaptive' all_reduce of these sizes would take the direct path, not the DAG whose
    # chunking this checks: on 2 ranks through the segments' outboxes (MPCCS_SHM=0 closes
    # them), on 3 by the group's reads across processes (MPCCS_CMA=0).
    pool = RankPool(request.param, env={"MPCCS_SHM": "0"} if request.param == 2 else {"MPCCS_CMA": "0"})
    yield pool
    pool.close()


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"])
def test_ranks_cutting_by_different_chunks_exchange_exact_results(pool, collective):
    # 'out' sends on one plane, 0.5 splits; both run under failover protection, as ranks must agree
    policies = ["out", 0.5, "out"][: pool.size]
    results = pool.run(chunk_cases.mixed_policies, policies, collective, COUNT, timeout=120)
    assert all(ok for ok, _ in results)
    chunks = [chunk for _, chunk in results]
    assert chunks[0] == (1 << 20, True)  # one plane: whole flows in chunks of up to 1 MiB
    assert chunks[1][0] < chunks[0][0] and not chunks[1][1]  # 0.5 splits: the tuner's finer chunks


def test_every_rank_on_one_plane_uses_the_large_chunk(pool):
    results = pool.run(chunk_cases.mixed_policies, ["up"] * pool.size, "all_reduce", COUNT, timeout=120)
    assert all(ok for ok, _ in results) and {chunk for _, chunk in results} == {(1 << 20, True)}
