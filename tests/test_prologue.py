"""Deferred prologue copies (mpccs.prologue): pure bookkeeping, no ranks."""
import numpy as np

from mpccs.algorithms.schedule import LocalCopy
from mpccs.prologue import DeferredCopies, merged_ranges


def buffers(n=16, inplace=False):
    src = np.arange(n, dtype=np.float32) + 1
    out = src if inplace else np.zeros(n, np.float32)
    return {"in": src, "out": out, "work": np.zeros(2 * n, np.float32)}


def whole(n=16, dst="out", dst_off=0, rank=0):
    return LocalCopy(rank, "in", 0, dst, dst_off, n)


def test_sends_read_the_source_while_the_copy_is_pending():
    b = buffers()
    d = DeferredCopies([whole()], 0, b)
    view = d.source_of("out", 4, 8)
    assert view is not None and np.shares_memory(view, b["in"])
    assert np.array_equal(view, b["in"][4:8])
    assert not b["out"].any()  # nothing copied yet
    d.flush()
    assert np.array_equal(b["out"], b["in"]) and not d


def test_overwritten_ranges_are_never_copied_and_the_rest_is_flushed():
    b = buffers()
    d = DeferredCopies([whole()], 0, b)
    d.discard("out", 0, 10)
    b["out"][0:10] = -1  # the flow that overwrote them
    d.flush()
    assert (b["out"][:10] == -1).all()
    assert np.array_equal(b["out"][10:], b["in"][10:])


def test_partial_overlap_materialises_only_the_overlap():
    b = buffers()
    d = DeferredCopies([whole(8, "out", 4)], 0, b)  # out[4:12] = in[0:8]
    assert d.source_of("out", 2, 6) is None  # straddles the pending range's start
    assert d.overlaps("out", 2, 6) and not d.overlaps("out", 12, 16)
    d.materialize("out", 2, 6)
    assert np.array_equal(b["out"][4:6], b["in"][0:2]) and not b["out"][6:].any()
    assert np.array_equal(d.source_of("out", 6, 12), b["in"][2:8])  # the remainder still maps right
    d.flush()
    assert np.array_equal(b["out"][4:12], b["in"][:8]) and not b["out"][:4].any()


def test_other_ranks_copies_and_in_place_no_ops_are_ignored():
    b = buffers(inplace=True)
    d = DeferredCopies([whole(rank=1), whole()], 0, b)
    assert not d  # rank 1's copy is not ours; ours is out = in in place


def test_in_place_input_is_copied_up_front_because_it_changes():
    b = buffers(inplace=True)
    d = DeferredCopies([whole(16, "work", 16)], 0, b)
    assert not d and np.array_equal(b["work"][16:], b["in"])
    b["out"][:] = 0  # the operation writes its output (= its input)
    assert b["work"][16:].sum() == np.arange(1, 17).sum()


def test_scratch_copies_nobody_reads_are_dropped_at_the_end():
    # A ring reduce_scatter copies its whole input into 'work' and only ever sends
    # some blocks from there: made at the end, that copy was 8-13 ms of a 2-rank
    # 64 MiB call for nobody. Only what the epilogue reads of 'work' is made.
    b = buffers()
    d = DeferredCopies([whole(16, "work", 0), whole(16, "out")], 0, b)
    d.flush(scratch_reads=[("work", 4, 8), ("out", 0, 2)])
    assert np.array_equal(b["work"][4:8], b["in"][4:8])
    assert not b["work"][:4].any() and not b["work"][8:].any()
    assert np.array_equal(b["out"], b["in"]) and not d  # a caller-visible buffer is made whole


def test_ranges_no_flow_writes_are_copied_early_in_slices():
    # An all_gather's own block: no flow writes it, so it is copied while the rank
    # waits on the network (made at the end it was 7 ms of a 2-rank 64 MiB call
    # after the last byte). Written ranges and scratch buffers wait for the end.
    b = buffers()
    written = merged_ranges([("out", 8, 12), ("work", 0, 32)])
    d = DeferredCopies([whole(), whole(16, "work", 0)], 0, b, written=written)
    slices = 0
    while d.copy_early(4 * b["out"].itemsize):  # 4 elements a slice
        slices += 1
    assert slices == 3  # out[0:8] in two, out[12:16] in one
    assert np.array_equal(b["out"][:8], b["in"][:8]) and np.array_equal(b["out"][12:], b["in"][12:])
    assert not b["out"][8:12].any() and not b["work"].any()
    assert d.source_of("out", 8, 12) is not None  # still pending: a flow may reduce into it from 'in'
