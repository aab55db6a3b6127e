"""Tag fields: the partial builders the direct path caches tags with agree with make_tag."""
import itertools

from mpccs import wire

KINDS = (wire.KIND_COLL, wire.KIND_P2P, wire.KIND_CTRL)
SEQS = (0, 1, wire.RETRY_BIT - 1, wire.RETRY_BIT, wire.SEQ_MOD - 1, wire.SEQ_MOD, 3 * wire.SEQ_MOD + 5)
MIDS = (0, 1, 7, wire.MAX_FLOWS - 1)
LOWS = (0, wire.CTRL_FINGERPRINT, wire.CTRL_DIRECT_PART, wire.CTRL_DIRECT_REDUCED, wire.LOW_MASK)


def test_seq_and_mid_bits_complete_a_tag_built_without_them():
    for kind, comm, seq, mid, low in itertools.product(KINDS, (0, 3, 255), SEQS, MIDS, LOWS):
        whole = wire.make_tag(kind, comm, seq, mid, low)
        assert wire.make_tag(kind, comm, 0, mid, low) | wire.seq_bits(seq) == whole
        assert wire.make_tag(kind, comm, seq, 0, low) | wire.mid_bits(mid) == whole
        assert wire.make_tag(kind, comm, 0, 0, low) | wire.seq_bits(seq) | wire.mid_bits(mid) == whole
        assert wire.split_tag(whole) == (kind, comm, seq % wire.SEQ_MOD, mid, low)


def test_direct_control_types_are_distinct():
    types = [getattr(wire, name) for name in dir(wire) if name.startswith("CTRL_")]
    assert len(types) == len(set(types)) and max(types) <= wire.LOW_MASK
