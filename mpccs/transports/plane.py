"""A Plane: one UCX context + worker with its own transport list.

Two planes live side by side in each process (``up``: scale-up, ``out``:
scale-out). Each owns the endpoints to the peers it reaches and offers
non-blocking tag send / receive / probe / progress returning UCX requests.
Nothing here knows about collectives; the engine drives the planes.
"""
from __future__ import annotations

import os
import re
import time
from typing import Optional

import numpy as np

from ..config import GPU_DIRECT_OUT_TLS, GPU_DIRECT_UP_TLS
from ..errors import TransportError
from .ucx import Array, ucx_api

# Shared-memory transports cannot report a dead peer ("no peer failure
# handler") and refuse endpoints that ask for error handling.
_SHM_ONLY = {"posix", "sysv", "cma", "mm", "sm", "shm", "knem", "xpmem", "self", "cuda_ipc", "cuda_copy"}


# What GPU-direct adds to a plane: transports that copy device memory to and from
# the network's buffers; they do not change how host memory goes.
_DEVICE_COPY_TLS = frozenset(GPU_DIRECT_UP_TLS + GPU_DIRECT_OUT_TLS)


def _transport_names(tls: str) -> set[str]:
    """The transports a UCX_TLS list names, without '^' or a ':' suffix."""
    return {t.lstrip("^").split(":")[0] for t in tls.split(",")}


def default_rndv_thresh(tls: str) -> str:
    """Eager for every size on socket-only planes, UCX's choice elsewhere.

    Over tcp, UCX's rendezvous costs a request/reply round trip per message
    through the same queues the data fills; when both directions are busy (any
    all_reduce) those replies wait behind data and a shaped link delivered
    ~60% of its rate. Eager messages went at 91-97% (docs/design.md). Zero-copy
    transports (shared memory, RDMA) keep UCX's rendezvous.
    """
    names = _transport_names(tls) - _DEVICE_COPY_TLS
    return "inf" if names <= {"tcp", "self"} else "ucx"


# UCX's tcp transport cuts a message into segments of UCX_TCP_TX_SEG_SIZE (8 KiB by
# default), one send call each. On loopback (bench/results/tcp_segments_s47/) a 2-rank
# all_reduce on a tcp plane went 0.51-0.55 GB/s busbw from 1 MiB with 8 KiB segments and
# 0.95-1.09 with 64 KiB; 4 ranks as 2 domains of 2 (`out` tcp) spent 28% less CPU per
# 16 MiB all_reduce (docs/design.md, "Protocol choice per plane").
TCP_TX_SEG_SIZE = "64K"


def tcp_config(tls: str) -> dict[str, str]:
    """UCX settings for the tcp transport of a plane that has one.

    A user's own UCX_TCP_TX_SEG_SIZE wins (the context's settings would
    otherwise override the environment).
    """
    names = _transport_names(tls)
    # "^a,b" is every transport but a and b (UCX_TLS's syntax); "all" includes tcp
    uses_tcp = "tcp" not in names if tls.startswith("^") else bool(names & {"tcp", "all"})
    if not uses_tcp or "UCX_TCP_TX_SEG_SIZE" in os.environ:
        return {}
    return {"TCP_TX_SEG_SIZE": TCP_TX_SEG_SIZE}


class Plane:
    def __init__(self, name: str, tls: str, devices: Optional[str] = None, rank: int = -1,
                 rndv_thresh: Optional[str] = None):
        self.name = name
        self.tls = tls
        self.devices = devices
        self.rank = rank
        config = {"TLS": tls, **tcp_config(tls)}
        if devices:
            config["NET_DEVICES"] = devices
        self.rndv_thresh = rndv_thresh or default_rndv_thresh(tls)
        if self.rndv_thresh != "ucx":
            config["RNDV_THRESH"] = self.rndv_thresh
        # Under an eager protocol a send completes when the socket took the
        # bytes, not when the peer has them: such completions cannot pace
        # tail stealing (the engine then keeps the planned split).
        self.completion_means_delivery = self.rndv_thresh != "inf"
        try:
            # WAKEUP lets an idle rank sleep on the worker's event fd instead of
            # spinning: on small machines the spinning steals the cores that the
            # kernel's tcp stack (and the peer) need.
            self._context = ucx_api.UCXContext(config, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
            self._worker = ucx_api.UCXWorker(self._context)
            self._worker.init_blocking_progress_mode()
        except Exception as exc:  # UCX raises its own types; name the plane
            raise TransportError(
                f"cannot open plane {name!r} with UCX_TLS={tls!r} NET_DEVICES={devices!r}: {exc}",
                rank=rank, plane=name,
            ) from exc
        self._endpoints: dict[int, object] = {}
        self._addresses: dict[int, bytes] = {}  # kept so a failed plane can reconnect
        self._severed: set[int] = set()  # fault injection: see sever()
        self.error_handling = not _transport_names(tls) <= _SHM_ONLY
        self.closed = False

    # -- wiring ---------------------------------------------------------
    @property
    def address(self) -> bytes:
        return bytes(self._worker.address)

    def connect(self, peer: int, address: bytes) -> None:
        self._addresses[peer] = address
        addr = ucx_api.UCXAddress.create_from_buffer(address)
        try:
            self._endpoints[peer] = ucx_api.UCXEndpoint.create_from_worker_address(
                self._worker, addr, endpoint_error_handling=self.error_handling
            )
        except Exception as exc:
            raise TransportError(f"cannot connect: {exc}", rank=self.rank, plane=self.name, peer=peer) from exc

    def reaches(self, peer: int) -> bool:
        return peer in self._endpoints or peer in self._severed

    def knows(self, peer: int) -> bool:
        """The peer was wired on this plane, even if its endpoint is closed now
        (a receiver still looks there: a peer that rejoined may send on it)."""
        return peer in self._addresses

    @property
    def known_peers(self) -> list[int]:
        return sorted(self._addresses)

    @property
    def failable(self) -> bool:
        """A network plane: it can fail while both processes live, and another plane may take over."""
        return self.error_handling

    @property
    def peers(self) -> list[int]:
        return sorted(self._endpoints)

    # -- data path --------------------------------------------------------
    @staticmethod
    def descriptor(view: np.ndarray):
        """UCX's descriptor of a buffer (~1 us to build): pass it to send/recv
        as ``desc`` for a buffer that is sent or received many times."""
        return Array(view)

    def send(self, peer: int, view: np.ndarray, tag: int, desc=None):
        try:
            ep = self._endpoints[peer]
        except KeyError:
            what = "endpoint was closed under the operation" if peer in self._severed else "plane does not reach this peer"
            raise TransportError(what, rank=self.rank, plane=self.name, peer=peer) from None
        return ep.tag_send(desc or Array(view), ucx_api.UCXXTag(tag))

    def probe(self, tag: int, mask: int):
        """A matched probe result (message removed from the queue) or None."""
        result = self._worker.tag_probe(ucx_api.UCXXTag(tag), ucx_api.UCXXTagMask(mask), remove=True)
        return result if result.matched else None

    def recv_probed(self, view: np.ndarray, probe):
        return self._worker.tag_recv_with_handle(Array(view), probe)

    def take(self, probe, timeout_s: float = 5.0) -> bytes:
        """Receive a probed (small, eager) message at once: its bytes (what arrived by timeout_s)."""
        n = int(probe.length)
        buf = np.zeros(max(1, n), dtype=np.uint8)
        req = self.recv_probed(buf[:n], probe)
        deadline = time.perf_counter() + timeout_s
        while not req.completed and time.perf_counter() < deadline:
            self.progress()
        return bytes(buf[:n])

    def recv(self, view: np.ndarray, tag: int, mask: int = (1 << 64) - 1, desc=None):
        return self._worker.tag_recv(desc or Array(view), ucx_api.UCXXTag(tag), ucx_api.UCXXTagMask(mask))

    def progress(self) -> None:
        self._worker.progress()

    def arm(self) -> bool:
        """Arm the worker's event fd; False when events are pending (progress first)."""
        return bool(self._worker.arm())

    def fileno(self) -> int:
        return self._worker.epoll_file_descriptor

    def cancel_all(self) -> None:
        """Cancel every request still posted on this plane (failure path)."""
        try:
            self._worker.cancel_inflight_requests()
        except Exception:  # a failed plane may refuse; nothing more to reclaim
            pass

    def fail(self) -> None:
        """Take the plane down: cancel its requests, then close its endpoints.

        Cancelling first matters: UCX (through ucxx) crashes when an endpoint
        closes under requests still posted on it. The worker stays open, so
        messages that already arrived can still be probed and discarded, and
        reconnect() can bring the plane back.
        """
        self.cancel_all()
        for _ in range(64):
            self._worker.progress()
        self._close_endpoints()
        self._severed.clear()
        for _ in range(16):
            self._worker.progress()

    def sever(self) -> None:
        """Fault injection (tests, soak): close every endpoint under the engine's feet.

        The engine still believes the plane reaches its peers; its next send
        there fails as a dead link's would once UCX reports it, and peers see
        the connection drop. What a test without root can do in place of
        pulling a cable (the testbed's link failure needs network namespaces).
        """
        peers = set(self._endpoints)
        self.fail()
        self._severed = peers

    def reconnect(self, peer: int) -> None:
        """A fresh endpoint to a peer whose endpoint fail() closed."""
        if peer not in self._endpoints and peer in self._addresses:
            self.connect(peer, self._addresses[peer])
            self._severed.discard(peer)

    # -- introspection ----------------------------------------------------
    def resources(self) -> list[str]:
        """Transport/device pairs UCX opened for this plane, e.g. ['tcp/lo']."""
        return re.findall(r"resource \d+\s*:.*?flags \S+\s+(\S+)", self._context.info)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._close_endpoints()

    def _close_endpoints(self) -> None:
        for ep in self._endpoints.values():
            try:
                ep.close()
            except Exception:  # an endpoint already broken by its peer
                pass
        self._endpoints.clear()
