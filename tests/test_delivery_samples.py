"""flows.StageRun's delivery samples: one per (plane, peer) and stage, the
estimator's view of a link from what arrived over it."""
import pytest

from mpccs.algorithms.schedule import Stage
from mpccs.flows import StageRun

MB = 1 << 20


def stage_run(t_start, arrivals, last_empty_looks=None):
    run = StageRun(Stage(0, ()), [], [], None, t_start)
    for (plane, peer), t in (last_empty_looks or {}).items():
        run.note_first_chunk(plane, peer, t)
    for plane, peer, nbytes, t in arrivals:
        run.note_arrival(plane, peer, nbytes, t)
    return run


def test_a_peer_that_started_late_is_timed_from_its_first_chunk_less_one_spacing():
    # This rank started at 0 and kept looking (last in vain at 49 ms); the
    # peer's four 1 MB chunks land 10 ms apart from 50 ms on (it started the
    # stage at ~40 ms): 100 MB/s, not 4 MB / 80 ms.
    run = stage_run(0.0, [("out", 1, MB, t) for t in (0.05, 0.06, 0.07, 0.08)], {("out", 1): 0.049})
    (plane, peer, nbytes, start, end), = run.delivery_samples()
    assert (plane, peer, nbytes) == ("out", 1, 4 * MB)
    assert start == pytest.approx(0.04) and end == pytest.approx(0.08)


def test_chunks_that_waited_in_the_buffers_are_timed_from_the_stage_start():
    # A burst at the stage start (the flow sat in the socket buffers): the
    # spacing is tiny, the interval still starts at the stage start.
    run = stage_run(1.0, [("up", 0, MB, 1.0 + k * 1e-5) for k in range(1, 5)]
                    + [("out", 0, MB, 1.03)])
    samples = {(p, q): (start, end) for p, q, _, start, end in run.delivery_samples()}
    assert samples[("up", 0)] == (1.0, pytest.approx(1.00004))
    # one chunk: no spacing to go by, the stage start it is
    assert samples[("out", 0)] == (1.0, 1.03)
    assert run.received_by_plane() == {"up": 4 * MB, "out": MB}


def test_a_late_first_chunk_counts_only_from_this_ranks_last_look():
    # This rank looked at 1 ms, then spent 7 ms posting its own sends; the
    # peer's chunks had waited in the socket buffers and are found in a bunch
    # from 8 ms on. Timed from 8 ms less their spacing the link would read
    # 4 MB / 5 ms; the peer was late by at most 1 ms: 4 MB / 11 ms.
    arrivals = [("up", 1, MB, t) for t in (0.008, 0.008, 0.009, 0.012)]
    run = stage_run(0.0, arrivals, {("up", 1): 0.001})
    (_, _, _, start, end), = run.delivery_samples()
    assert (start, end) == (pytest.approx(0.001), pytest.approx(0.012))


def test_a_first_chunk_found_at_the_first_look_means_a_punctual_peer():
    # The first look of the stage found it (the last look was before the
    # stage began): the stage start, whatever the spacing says.
    run = stage_run(1.0, [("up", 1, MB, t) for t in (1.006, 1.007, 1.008)], {("up", 1): 0.9})
    (_, _, _, start, _), = run.delivery_samples()
    assert start == 1.0


def test_split_senders_are_the_peers_whose_chunks_came_on_both_planes():
    # Peer 1 split its flow; peer 2 sent its flow whole on 'up' (a check, a
    # dropped plane): its samples tell a rate, not how time grows with a split.
    run = stage_run(0.0, [("up", 1, MB, 0.01), ("out", 1, MB, 0.02), ("up", 2, MB, 0.01), ("up", 2, MB, 0.02)])
    assert run.split_senders() == {1}
    assert stage_run(0.0, []).split_senders() == set()


def test_busy_intervals_span_the_chunks_from_one_spacing_before_the_first():
    # four 1 MB chunks 10 ms apart from 50 ms: busy from 40 ms, whatever the stage start;
    # a one-chunk flow has no spacing and says nothing of when the link was busy
    run = stage_run(0.0, [("out", 1, MB, t) for t in (0.05, 0.06, 0.07, 0.08)] + [("up", 0, MB, 0.02)])
    (plane, peer, nbytes, start, end), = run.busy_intervals()
    assert (plane, peer, nbytes) == ("out", 1, 4 * MB)
    assert start == pytest.approx(0.04) and end == pytest.approx(0.08)


def test_a_pipelined_operation_teaches_each_plane_the_rate_of_the_link_its_stages_shared():
    # Overlapping stages share the link into this rank: every sender's path is taught all the
    # bytes over the union of the busy spans (2.5 s here), not each stage's share of the link.
    import types

    from mpccs.collective_op import CollectiveOp

    taught = []
    controller = types.SimpleNamespace(on_delivery=lambda *a, **kw: taught.append((a, kw)))
    op = types.SimpleNamespace(engine=types.SimpleNamespace(controller=controller), _port_intervals={
        "out": [(0.5, 1.5, 10 * MB, 2), (0.0, 1.0, 10 * MB, 1), (3.0, 4.0, 5 * MB, 1)],
        "up": [(0.0, 2.0, 8 * MB, 1)]})
    CollectiveOp._teach_port_rates(op)
    by_path = {(a[0], a[1]): a[2:] for a, _ in taught}
    assert by_path == {("out", 1): (25 * MB, pytest.approx(1.5), 4.0), ("out", 2): (25 * MB, pytest.approx(1.5), 4.0),
                       ("up", 1): (8 * MB, 0.0, 2.0)}
    # a rate: not how time grows with size, nor the path's delay
    assert all(kw == {"size_evidence": False, "rate_only": True} for _, kw in taught)
    assert op._port_intervals == {}
