"""The wire format: what a UCX tag carries.

Every chunk identifies itself in its 64-bit tag, so a receiver can accept it
from either plane and place it by its offset:

    bits 62-63  kind     0 collective data, 1 point-to-point data, 2 control
    bits 54-61  comm     communicator id (8 bits)
    bits 40-53  seq      operation sequence number, modulo 2**14
    bits 20-39  mid      collective: flow id; p2p and control: source rank
    bits  0-19  low      data: chunk index; control: message type

Probing with MASK_STREAM matches every chunk of one flow (or one p2p message)
whatever its chunk index; the index is read back from the sender's tag.
"""
from __future__ import annotations

KIND_COLL, KIND_P2P, KIND_CTRL = 0, 1, 2
SEQ_BITS, MID_BITS, LOW_BITS = 14, 20, 20
SEQ_MOD = 1 << SEQ_BITS
MAX_CHUNKS = 1 << LOW_BITS
MAX_FLOWS = 1 << MID_BITS
MAX_RANKS = 1 << MID_BITS
LOW_MASK = (1 << LOW_BITS) - 1
FULL_MASK = (1 << 64) - 1
MASK_STREAM = FULL_MASK ^ LOW_MASK

# control message types (low field of a control tag)
CTRL_P2P_HEADER = 1
CTRL_P2P_REPLY = 2
CTRL_FINGERPRINT = 3
CTRL_BARRIER = 4
CTRL_ABORT = 5
# plane failover (docs/reliability.md)
CTRL_FAILOVER = 6  # "plane P failed during attempt seq": every rank quiesces that attempt
CTRL_QUIESCED = 7  # "I have stopped posting for attempt seq and my requests are done"
CTRL_DONE = 8  # "every flow I receive in attempt seq has arrived" (completion agreement)
CTRL_PING = 9  # a plane heartbeat; seq carries a nonce
CTRL_PONG = 10
CTRL_WIREUP = 11  # one byte per plane and peer at init: connections exist before the first operation
CTRL_DIRECT_DATA = 12  # a direct operation's payload in its own message, after its fingerprint message
CTRL_DIRECT_PART = 13  # direct blocks: the block of a rank's input the receiver owns
CTRL_DIRECT_REDUCED = 14  # direct blocks: the block the sender owns, reduced
CTRL_DOORBELL = 15  # through the segments: "I am here", to a peer that sleeps on its planes' events (FLAG_WAITING)

# Flow ids no schedule reaches, for the two-step executor's messages (two_step.py):
# collective-data tags, so a failed attempt's strays are drained like chunks.
TWO_STEP_RS_FLOW = MAX_FLOWS - 2  # a rank's input half that its peer owns
TWO_STEP_AG_FLOW = MAX_FLOWS - 1  # the half a rank owns, reduced

# A collective's wire sequence number: the low 13 bits of its operation
# number, and the top bit set on its retry, so no chunk of a failed attempt
# can ever be taken for one of the retry.
RETRY_BIT = 1 << (SEQ_BITS - 1)


def attempt_seq(seq: int, attempt: int) -> int:
    return (seq % RETRY_BIT) | (RETRY_BIT if attempt else 0)


def mid_bits(mid: int) -> int:
    """The middle field of a tag alone: make_tag(k, c, s, 0, l) | mid_bits(m) == make_tag(k, c, s, m, l)."""
    return (mid & (MAX_FLOWS - 1)) << 20


def seq_bits(seq: int) -> int:
    """The sequence field of a tag alone: make_tag(k, c, 0, m, l) | seq_bits(s) == make_tag(k, c, s, m, l)."""
    return (seq % SEQ_MOD) << 40


def make_tag(kind: int, comm: int, seq: int, mid: int, low: int = 0) -> int:
    return (kind << 62) | ((comm & 0xFF) << 54) | ((seq % SEQ_MOD) << 40) | mid_bits(mid) | (low & LOW_MASK)


def split_tag(tag: int) -> tuple[int, int, int, int, int]:
    return (tag >> 62, (tag >> 54) & 0xFF, (tag >> 40) & (SEQ_MOD - 1), (tag >> 20) & (MAX_FLOWS - 1), tag & LOW_MASK)


def chunk_index(tag: int) -> int:
    return tag & LOW_MASK


def ctrl_any_sender_mask() -> int:
    """Match one control type of one sequence number from any sender."""
    return FULL_MASK ^ ((MAX_FLOWS - 1) << 20)


def ctrl_any_seq_mask() -> int:
    """Match one control type from any sender with any sequence number."""
    return FULL_MASK ^ (((SEQ_MOD - 1) << 40) | ((MAX_FLOWS - 1) << 20))


def stream_any_chunk_mask() -> int:
    """Match every data message of one sequence number (any flow, any chunk)."""
    return FULL_MASK ^ ((MAX_FLOWS - 1) << 20) ^ LOW_MASK
