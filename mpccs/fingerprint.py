"""Operation fingerprints: what a rank believes the current operation is.

Before a rank accepts data from a peer for operation #seq it checks the
peer's fingerprint for #seq: ranks that call different collectives, counts,
dtypes, ops or roots get a MismatchError that says exactly what differs,
instead of a hang or silently wrong data (same bytes, different dtype or op).

Wire form: two little-endian uint64 words.
  word 0: collective (4 bits) | op (4) | dtype (6) | algorithm (4) | root (20) | sender's chunk log2 (6)
          | protected (1: runs under the failover protocol, which ranks must agree on)
          | whole flows (1: the sender does not cut flows finer than its chunk; not compared)
  word 1: count (elements, or 2**64-1 when ranks may legitimately differ: all_to_allv)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .reduce import SUPPORTED_DTYPE_NAMES

_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_allv", "broadcast", "reduce", "barrier",
                "plan_rates")  # 4 bits; plan_rates: the ranks agreeing on plan rates (comm._agree_plan_rates)
_OPS = ("sum", "prod", "min", "max", "avg")
_ALGORITHMS = ("ring", "rhd", "rd", "tree", "hierarchical", "pairwise", "pipeline", "direct", "direct_blocks", "direct_shm",
               "direct_lane", "group_reads", "direct_pipe")  # 4 bits: at most 16
ANY_COUNT = (1 << 64) - 1


@dataclass(frozen=True)
class Fingerprint:
    collective: str
    op: str
    dtype: str
    algorithm: str
    root: int
    chunk_log2: int
    count: int
    protected: bool = False
    whole_flows: bool = False

    def encode(self) -> np.ndarray:
        return self._words

    @functools.cached_property
    def signed_words(self) -> tuple[int, int]:
        """The two words as int64 values (what an int64 memoryview stores and loads: lane_ops.Lane)."""
        word0, word1 = self._words.view(np.int64)
        return int(word0), int(word1)

    @functools.cached_property
    def raw(self) -> bytes:
        """The encoded words as bytes, to compare a received fingerprint without decoding it."""
        return self._words.tobytes()

    def with_declaration(self, declared: int) -> np.ndarray:
        """The fingerprint message with one declaration byte after the words
        (collective_op.DECLARES_*), built once per byte value: sends only read it."""
        payload = self._with_declarations.get(declared)
        if payload is None:
            payload = np.frombuffer(bytearray(self.raw + bytes((declared,))), dtype=np.uint8)
            self._with_declarations[declared] = payload
        return payload

    @functools.cached_property
    def _with_declarations(self) -> dict:
        return {}

    @functools.cached_property
    def _words(self) -> np.ndarray:
        word0 = (
            _COLLECTIVES.index(self.collective)
            | (_OPS.index(self.op) << 4)
            | (_dtype_code(self.dtype) << 8)
            | (_ALGORITHMS.index(self.algorithm) << 14)
            | ((self.root & 0xFFFFF) << 18)
            | ((self.chunk_log2 & 0x3F) << 38)
            | (int(self.protected) << 44)
            | (int(self.whole_flows) << 45)
        )
        return np.array([word0, self.count], dtype=np.uint64)

    @classmethod
    def decode(cls, words: np.ndarray) -> "Fingerprint":
        w0, count = int(words[0]), int(words[1])
        return cls(
            collective=_safe(_COLLECTIVES, w0 & 0xF),
            op=_safe(_OPS, (w0 >> 4) & 0xF),
            dtype=_safe(_DTYPE_NAMES, (w0 >> 8) & 0x3F),
            algorithm=_safe(_ALGORITHMS, (w0 >> 14) & 0xF),
            root=(w0 >> 18) & 0xFFFFF,
            chunk_log2=(w0 >> 38) & 0x3F,
            count=count,
            protected=bool((w0 >> 44) & 1),
            whole_flows=bool((w0 >> 45) & 1),
        )

    def describe(self) -> str:
        count = "any" if self.count == ANY_COUNT else str(self.count)
        return (f"{self.collective}(count={count}, dtype={self.dtype}, op={self.op}, root={self.root}, "
                f"algorithm={self.algorithm}, chunk=2**{self.chunk_log2})")

    def differences(self, other: "Fingerprint") -> list[str]:
        """What makes the two calls different operations. Not the chunking: each
        sender picks its own (whole flows of up to 1 MiB when it sends on one plane
        only) and its receivers cut its flows the sender's way (collective_op.CollectiveOp)."""
        out = []
        for name in ("collective", "count", "dtype", "op", "root", "algorithm"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b and not (name == "count" and ANY_COUNT in (a, b)):
                out.append(f"{name} {a} vs {b}")
                if name == "algorithm" and (a.startswith("direct") or b.startswith("direct")) \
                        and self.count == other.count:
                    # same call, different path: the direct path follows the path policy
                    out[-1] += (" (a medium collective goes direct under 'up' and 'adaptive' only: "
                                "set the same path policy on every rank)")
        if self.protected != other.protected:
            # the DONE round would wait forever on the rank that skips it
            out.append(f"failover protection {'on' if self.protected else 'off'} vs "
                       f"{'on' if other.protected else 'off'} (set the same path policy and MPCCS_FAILOVER on every rank)")
        return out


_DTYPE_NAMES = SUPPORTED_DTYPE_NAMES
_DTYPE_CODE = {name: code for code, name in enumerate(_DTYPE_NAMES)}


def _dtype_code(name: str) -> int:
    return _DTYPE_CODE[name]


def _safe(values, index: int) -> str:
    return values[index] if index < len(values) else f"<unknown {index}>"


@functools.lru_cache(maxsize=1024)
def make(collective: str, op: str, dtype, algorithm: str, root, chunk_bytes: int, count,
         protected: bool = False, whole_flows: bool = False) -> Fingerprint:
    """Cached: the same call shape on every step of a training loop costs a dict lookup."""
    return Fingerprint(
        collective=collective, op=op, dtype=str(np.dtype(dtype)), algorithm=algorithm,
        root=root or 0, chunk_log2=max(0, int(chunk_bytes).bit_length() - 1),
        count=ANY_COUNT if count is None else int(count), protected=bool(protected),
        whole_flows=bool(whole_flows),
    )
