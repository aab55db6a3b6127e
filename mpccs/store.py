"""A small authenticated TCP key-value store for rendezvous.

Rank 0 hosts it; every rank publishes its worker addresses and domain and
reads everybody else's. Every request carries the job token, compared in
constant time; a wrong token is refused. Frames are length-prefixed and
bounded, waits are bounded, so a rogue or broken client can neither exhaust
memory nor hold a server thread forever.

Frame (request):  b"MPCS" | u32 body_len | body
  body: u8 op | u16 token_len | token | u16 key_len | key | u32 wait_ms | u32 value_len | value
Frame (response): u8 status | u32 value_len | value
"""
from __future__ import annotations

import hmac
import socket
import socketserver
import struct
import threading
import time
from typing import Optional

from .errors import RendezvousError

MAGIC = b"MPCS"
MAX_BODY = 1 << 20  # worker addresses are ~100 B; 1 MiB is generous
MAX_WAIT_MS = 600_000

OP_SET, OP_GET, OP_ADD = 1, 2, 3
OK, NOT_FOUND, AUTH_FAILED, BAD_REQUEST = 0, 1, 2, 3
_STATUS_TEXT = {NOT_FOUND: "timed out waiting for key", AUTH_FAILED: "job token refused", BAD_REQUEST: "malformed request"}


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = sock.recv(min(n - got, 1 << 16))
        if not part:
            raise ConnectionError("connection closed")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


class _Data:
    def __init__(self):
        self.values: dict[bytes, bytes] = {}
        self.cond = threading.Condition()


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.settimeout(MAX_WAIT_MS / 1000 + 30)
        while True:
            try:
                header = _recv_exact(self.request, 8)
            except (ConnectionError, OSError):
                return
            if header[:4] != MAGIC:
                return self._reply(BAD_REQUEST, b"", close=True)
            (length,) = struct.unpack("!I", header[4:])
            if length > MAX_BODY:
                return self._reply(BAD_REQUEST, b"request too large", close=True)
            try:
                body = _recv_exact(self.request, length)
                op, token, key, wait_ms, value = _parse_body(body)
            except (ConnectionError, OSError):
                return
            except (ValueError, struct.error, IndexError):
                return self._reply(BAD_REQUEST, b"malformed request", close=True)
            if not hmac.compare_digest(token, self.server.token):
                return self._reply(AUTH_FAILED, b"", close=True)
            status, payload = self._execute(op, key, wait_ms, value)
            self._reply(status, payload)

    def _execute(self, op, key, wait_ms, value):
        data: _Data = self.server.data
        with data.cond:
            if op == OP_SET:
                data.values[key] = value
                data.cond.notify_all()
                return OK, b""
            if op == OP_ADD:
                try:
                    current = int(data.values.get(key, b"0")) + int(value)
                except ValueError:
                    return BAD_REQUEST, b"ADD needs an integer value and key"
                data.values[key] = str(current).encode()
                data.cond.notify_all()
                return OK, data.values[key]
            if op == OP_GET:
                deadline = time.monotonic() + min(wait_ms, MAX_WAIT_MS) / 1000
                while key not in data.values:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return NOT_FOUND, b""
                    data.cond.wait(left)
                return OK, data.values[key]
        return BAD_REQUEST, b"unknown op"

    def _reply(self, status, payload, close=False):
        try:
            self.request.sendall(struct.pack("!BI", status, len(payload)) + payload)
        except OSError:
            pass
        if close:
            self._close_after_reply()

    def _close_after_reply(self, drain_bytes: int = 1 << 16, drain_s: float = 1.0) -> None:
        """FIN after the reply, then read what the peer sent before closing: closing with
        unread bytes makes the kernel send a reset, which can destroy the reply before the
        peer reads it (a rejected HTTP request lost its error reply that way). Bounded, so a
        peer that never stops sending cannot hold the handler."""
        try:
            self.request.shutdown(socket.SHUT_WR)
            self.request.settimeout(drain_s)
            deadline = time.monotonic() + drain_s
            while drain_bytes > 0 and time.monotonic() < deadline:
                part = self.request.recv(min(drain_bytes, 4096))
                if not part:
                    break
                drain_bytes -= len(part)
        except OSError:
            pass


def _parse_body(body: bytes):
    if not body:
        raise ValueError("empty body")
    op = body[0]
    pos = 1
    (tlen,) = struct.unpack_from("!H", body, pos)
    pos += 2
    token = body[pos : pos + tlen]
    pos += tlen
    (klen,) = struct.unpack_from("!H", body, pos)
    pos += 2
    key = body[pos : pos + klen]
    pos += klen
    wait_ms, vlen = struct.unpack_from("!II", body, pos)
    pos += 8
    value = body[pos : pos + vlen]
    if len(value) != vlen or pos + vlen != len(body) or op not in (OP_SET, OP_GET, OP_ADD):
        raise ValueError("malformed body")
    return op, token, key, wait_ms, value


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class StoreServer:
    """Runs in a daemon thread of rank 0, bound to one address only."""

    def __init__(self, host: str, port: int, token: str):
        self._server = _Server((host, port), _Handler)
        self._server.token = token.encode()
        self._server.data = _Data()
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="mpccs-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class StoreClient:
    def __init__(self, host: str, port: int, token: str, timeout_s: float = 60.0):
        self.host, self.port = host, port
        self._token = token.encode()
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock = self._connect_with_retries()

    def _connect_with_retries(self) -> socket.socket:
        deadline = time.monotonic() + self._timeout_s
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=5)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise RendezvousError(
                        f"cannot reach the rendezvous store at {self.host}:{self.port} "
                        f"within {self._timeout_s:.0f} s ({exc}); is rank 0 running and "
                        f"MASTER_ADDR/MASTER_PORT right?"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _request(self, op: int, key: str, value: bytes = b"", wait_s: float = 0.0) -> bytes:
        kbytes = key.encode()
        wait_ms = int(min(wait_s * 1000, MAX_WAIT_MS))
        body = (
            struct.pack("!BH", op, len(self._token)) + self._token
            + struct.pack("!H", len(kbytes)) + kbytes
            + struct.pack("!II", wait_ms, len(value)) + value
        )
        with self._lock:
            self._sock.settimeout(wait_s + 30)
            try:
                self._sock.sendall(MAGIC + struct.pack("!I", len(body)) + body)
                status, length = struct.unpack("!BI", _recv_exact(self._sock, 5))
                payload = _recv_exact(self._sock, length)
            except (OSError, ConnectionError) as exc:
                raise RendezvousError(f"rendezvous store at {self.host}:{self.port} failed: {exc}") from None
        if status == AUTH_FAILED:
            raise RendezvousError(
                f"the rendezvous store at {self.host}:{self.port} refused the job token "
                f"(MPCCS_JOB_TOKEN differs between ranks?)"
            )
        if status != OK:
            raise KeyError(_STATUS_TEXT.get(status, f"status {status}"))
        return payload

    def set(self, key: str, value: bytes) -> None:
        self._request(OP_SET, key, value)

    def get(self, key: str, timeout_s: Optional[float] = None) -> bytes:
        return self._request(OP_GET, key, wait_s=self._timeout_s if timeout_s is None else timeout_s)

    def add(self, key: str, amount: int = 1) -> int:
        return int(self._request(OP_ADD, key, str(amount).encode()))

    def gather(self, prefix: str, size: int, timeout_s: Optional[float] = None) -> list[bytes]:
        """Values of prefix/0 .. prefix/size-1; a timeout names the missing ranks."""
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        values: list[Optional[bytes]] = [None] * size
        for r in range(size):
            try:
                values[r] = self.get(f"{prefix}/{r}", timeout_s=max(0.0, deadline - time.monotonic()))
            except KeyError:
                pass
        missing = [r for r, v in enumerate(values) if v is None]
        if missing:
            raise RendezvousError(f"rendezvous timed out: rank(s) {missing} never published {prefix!r}")
        return values  # type: ignore[return-value]

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
