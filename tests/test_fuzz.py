"""Fuzzing from a rogue peer and a rogue store client: no crash, no write out of bounds, clear errors.

Chunks: ``mpccs-run -n 2`` runs this file as the job's program; every case gets a fresh communicator
(own planes, own comm id). Rank 0 (the victim) starts a collective with ``async_op=True`` (or posts a
receive) into a destination that is a slice in the middle of a larger array filled with a seeded random
sentinel. Rank 1 (the rogue) never calls the operation: it sends, through its raw plane objects,
messages whose tags (built with mpccs.wire as the engine builds them) claim to belong to rank 0's
operation but do not fit it: a chunk index out of range, a duplicate, a length too long or too short,
seeded random tags and lengths, a malformed fingerprint, abort or failover notice, a point-to-point
header or chunk that does not fit. Rank 0 must raise a clear mpccs error naming the peer, write no byte
outside the flow's destination range, abort the communicator, and exit normally (the launcher reports
every rank's exit code).

Store: a rogue client sends seeded garbage, truncated frames, oversized length prefixes, wrong tokens
and valid-token requests with malformed bodies to a StoreServer; each gets an error reply or a closed
connection within a bounded time, and a legitimate client is still served correctly afterwards.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.abspath(__file__)
BIN = os.path.dirname(sys.executable)
COUNT = 1 << 18  # float32 elements per rank: 1 MiB in, 2 MiB gathered
GUARD = 1 << 18  # float32 elements of sentinel on each side of the destination (1 MiB)
WAIT_S = 8.0  # the victim's no-progress timeout: detection must come long before it
SEED = 20260117


# ---------------------------------------------------------------------------
# the job (this file as mpccs-run's program): rank 0 victim, rank 1 rogue
# ---------------------------------------------------------------------------
CASES = {
    # name: (what the victim runs, the plane the rogue sends the bad message on; "both": drawn per message)
    "out_of_range": ("all_gather", "out"),
    "huge_index": ("all_gather", "up"),
    "duplicate": ("all_gather", "up"),
    "too_long": ("all_gather", "out"),
    "too_short": ("all_gather", "up"),
    "too_long_last": ("all_reduce", "out"),
    "random_gather": ("all_gather", "both"),
    "random_reduce": ("all_reduce", "both"),
    "fingerprint_garbage": ("all_gather", "up"),
    "fingerprint_short": ("all_gather", "up"),
    "fingerprint_long": ("all_gather", "up"),
    "abort_garbage": ("all_gather", "up"),
    "failover_garbage": ("all_gather", "out"),
    "p2p_bad_chunk": ("recv", "out"),
    "p2p_header_long": ("recv", "up"),
}


def _geometry(collective):
    """(destination elements, bytes the tuner sizes the call by) of the victim's call."""
    if collective == "all_gather":
        return 2 * COUNT, 2 * COUNT * 4
    return COUNT, COUNT * 4


def _victim(comm, store, case):
    import mpccs

    collective, _ = CASES[case]
    x = np.arange(COUNT, dtype=np.float32) + 1
    n, _ = _geometry(collective)
    rng = np.random.default_rng(SEED)
    whole = np.empty(GUARD + n + GUARD, dtype=np.float32)
    sentinel = rng.integers(0, 256, whole.nbytes, dtype=np.uint8)
    whole.view(np.uint8)[:] = sentinel
    dest = whole[GUARD : GUARD + n]
    if collective == "all_gather":
        work = comm.all_gather(x, dest, async_op=True, algorithm="ring")  # the DAG path, as all_reduce below
    elif collective == "all_reduce":
        # An algorithm named: the DAG path, whose chunks these cases forge (1 MiB
        # would otherwise go direct; ring is what the tuner picks at this size).
        work = comm.all_reduce(x, dest, async_op=True, algorithm="ring")
    else:
        work = comm.irecv(dest, 1)
    store.set("fuzz/started", b"1")
    start = time.monotonic()
    result = {"case": case, "collective": collective}
    try:
        work.wait(timeout=WAIT_S)
        result["error"] = None
    except mpccs.MpccsError as exc:
        result.update(error=type(exc).__name__, message=str(exc)[:2000], message_len=len(str(exc)),
                      peer=getattr(exc, "peer", None), rank=getattr(exc, "rank", None))
    except BaseException as exc:  # noqa: BLE001 - exactly what this test must not see
        result.update(error=f"unexpected {type(exc).__module__}.{type(exc).__name__}", message=str(exc)[:2000])
    result["elapsed_s"] = round(time.monotonic() - start, 3)
    raw = whole.view(np.uint8)
    lo, hi = GUARD * 4, (GUARD + n) * 4
    result["guard_before_intact"] = bool((raw[:lo] == sentinel[:lo]).all())
    result["guard_after_intact"] = bool((raw[hi:] == sentinel[hi:]).all())
    if collective == "all_gather":
        # Rank 0's own block is the prologue's copy of its input; the rogue's flow lands only in block 1.
        result["own_block_intact"] = bool((dest[:COUNT] == x).all())
    try:
        comm.all_reduce(np.ones(4, np.float32), async_op=True).wait(timeout=1.0)
        result["after"] = "usable"
    except mpccs.CommunicatorAborted:
        result["after"] = "aborted"
    except mpccs.MpccsError as exc:
        result["after"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print("RESULT " + json.dumps(result), flush=True)
    store.set("fuzz/victim_done", b"1")
    store.get("fuzz/rogue_done", timeout_s=30)  # rank 0 hosts the store: the rogue still needs it
    comm.close()


def _rogue_messages(comm, case):
    """(plane name, tag, payload) of everything the rogue sends for rank 0's first operation."""
    from mpccs import fingerprint, wire
    from mpccs.comm import DEFAULT_CHUNK_BYTES
    from mpccs.flows import MIN_CHUNK_BYTES
    from mpccs.windows import chunk_count, chunk_range, flow_chunk_elems

    call, plane = CASES[case]
    cid = comm._engine.comm_id  # each case runs on its own communicator
    seq = wire.attempt_seq(1, 0)  # the victim's first collective (or first receive from rank 1)
    n, nbytes = _geometry(call)

    def payload(size, fill=0x5A):
        return np.full(size, fill, dtype=np.uint8)

    if call == "recv":  # point-to-point: a header, then the data chunks (tags carry the source rank)
        chunk_bytes = comm.options.chunk_bytes or DEFAULT_CHUNK_BYTES
        ce = flow_chunk_elems(n * 4, chunk_bytes, MIN_CHUNK_BYTES)
        nchunks = chunk_count(n * 4, ce)
        header = np.array([n * 4], dtype=np.uint64).view(np.uint8)
        header_tag = wire.make_tag(wire.KIND_CTRL, cid, 1, 1, wire.CTRL_P2P_HEADER)
        if case == "p2p_header_long":
            header = np.concatenate([header, payload(4096)])
        messages = [("up", header_tag, header.copy())]
        messages.append((plane, wire.make_tag(wire.KIND_P2P, cid, 1, 1, nchunks), payload(ce)))
        return messages, {"flow": 0, "nchunks": nchunks}

    plan = comm._schedule(call, COUNT, nbytes, algorithm="ring")  # as the victim
    schedule = plan.schedule
    protected = comm._protected(nbytes, plan.single_plane)  # what the victim runs under (fingerprinted)
    fp = fingerprint.make(call, "sum", np.float32, schedule.algorithm, schedule.root, plan.chunk_bytes,
                          schedule.count, protected)
    fp_tag = wire.make_tag(wire.KIND_CTRL, cid, seq, 1, wire.CTRL_FINGERPRINT)
    first = {s.id for s in schedule.stages if not s.deps}
    flows = [f for s in schedule.stages if s.id in first for f in s.flows if f.src == 1 and f.dst == 0]
    assert flows, "the victim receives nothing from rank 1 in its first stage"
    flow = flows[0]
    ce = flow_chunk_elems(flow.count, max(1, plan.chunk_bytes // 4), max(1, MIN_CHUNK_BYTES // 4))
    nchunks = chunk_count(flow.count, ce)
    assert nchunks >= 2

    def chunk_tag(flow_id, index):
        return wire.make_tag(wire.KIND_COLL, cid, seq, flow_id, index)

    def expected(index):
        return chunk_range(index, flow.count, ce)[1] * 4

    info = {"flow": flow.id, "nchunks": nchunks, "first": expected(0), "second": expected(1),
            "last": expected(nchunks - 1)}  # the geometry, for the test's expected messages

    words = fp.encode().view(np.uint8).copy()
    if case == "abort_garbage":  # no fingerprint: an abort for the operation, of random bytes, 64 KiB
        body = np.random.default_rng(SEED).integers(0, 256, 64 << 10, dtype=np.uint8)
        return [(plane, wire.make_tag(wire.KIND_CTRL, cid, seq, 1, wire.CTRL_ABORT), body)], info
    if case == "failover_garbage":  # a failover notice for the operation naming no plane that exists
        body = np.frombuffer(b"\xff\xfenot-a-plane\0" + bytes(range(256)), dtype=np.uint8).copy()
        return [("up", fp_tag, words),
                (plane, wire.make_tag(wire.KIND_CTRL, cid, seq, 1, wire.CTRL_FAILOVER), body)], info
    if case.startswith("fingerprint_"):
        if case == "fingerprint_garbage":
            body = np.random.default_rng(SEED).integers(0, 256, 16, dtype=np.uint8)
        elif case == "fingerprint_short":
            body = words[:8].copy()
        else:
            # Fingerprint messages legitimately carry up to 4 KiB after the
            # fingerprint (piggybacked estimates, a direct all_reduce's data):
            # longer than any legitimate one, it must be refused.
            body = np.concatenate([words, payload(8192)])
        return [("up", fp_tag, body), (plane, chunk_tag(flow.id, 0), payload(expected(0)))], info

    messages = [("up", fp_tag, words)]
    if case == "out_of_range":
        messages.append((plane, chunk_tag(flow.id, nchunks), payload(expected(0))))
    elif case == "huge_index":
        messages.append((plane, chunk_tag(flow.id, wire.MAX_CHUNKS - 1), payload(expected(0))))
    elif case == "duplicate":
        messages.append((plane, chunk_tag(flow.id, 0), payload(expected(0))))
        messages.append((plane, chunk_tag(flow.id, 0), payload(expected(0), 0xA7)))
    elif case == "too_long":
        messages.append((plane, chunk_tag(flow.id, 0), payload(expected(0) + 4096)))
    elif case == "too_short":
        messages.append((plane, chunk_tag(flow.id, 1), payload(expected(1) - 4)))
    elif case == "too_long_last":
        # The last chunk sits at the end of the destination: one byte more would run past it.
        messages.append((plane, chunk_tag(flow.id, nchunks - 1), payload(expected(nchunks - 1) + 1)))
    elif case.startswith("random_"):
        rng = np.random.default_rng(SEED + len(case))
        flow_ids = sorted({f.id for f in schedule.flows()})
        for i in range(48):
            which = str(rng.choice(["up", "out"]))
            if i % 4 == 3:  # any tag at all, short messages (nothing of this operation should notice)
                tag = int(rng.integers(0, 1 << 63, dtype=np.int64)) << 1 | int(rng.integers(0, 2))
                size = int(rng.integers(0, 512))
            else:  # one of the operation's flow ids, or near them, with any index and length
                fid = int(rng.choice(flow_ids + [max(flow_ids) + 1, int(rng.integers(0, wire.MAX_FLOWS))]))
                index = int(rng.choice([rng.integers(0, nchunks + 2), rng.integers(0, wire.MAX_CHUNKS)]))
                size = int(rng.integers(0, 2 * expected(0) + 1))
                if size == expected(min(index, nchunks - 1)):
                    size += 1
                tag = chunk_tag(fid, index)
            messages.append((which, tag, payload(size, int(rng.integers(0, 256)))))
    else:
        raise SystemExit(f"unknown case {case!r}")
    return messages, info


def _rogue(comm, store, case):
    messages, info = _rogue_messages(comm, case)
    store.get("fuzz/started", timeout_s=30)
    planes = comm._planes
    requests = []
    for name, tag, body in messages:
        requests.append((planes[name].send(0, body, tag), body))
    # Sends the victim never receives (it stopped at the first bad one) stay pending: progress a
    # while, then wait for the victim's verdict, then cancel what is left before closing.
    deadline, next_look = time.monotonic() + 30, 0.0
    while time.monotonic() < deadline and not all(r.completed for r, _ in requests):
        for plane in planes.values():
            plane.progress()
        time.sleep(0.001)  # two cores: leave the victim room
        if time.monotonic() >= next_look:
            next_look = time.monotonic() + 0.05
            try:
                store.get("fuzz/victim_done", timeout_s=0)
                break
            except KeyError:
                pass
    print("SENT " + json.dumps({"case": case, "messages": len(messages), **info,
                                "completed": sum(r.completed for r, _ in requests)}), flush=True)
    store.get("fuzz/victim_done", timeout_s=60)
    for plane in planes.values():
        plane.cancel_all()
        for _ in range(64):
            plane.progress()
    store.set("fuzz/rogue_done", b"1")
    comm._aborted = "rogue rank: it never ran the operation"  # no closing barrier
    comm.close()


class _CaseStore:
    """The job's store under a per-case prefix, so every case wires a fresh communicator."""

    def __init__(self, store, prefix):
        self._store, self._prefix = store, prefix

    def set(self, key, value):
        self._store.set(self._prefix + key, value)

    def get(self, key, timeout_s=None):
        return self._store.get(self._prefix + key, timeout_s=timeout_s)

    def add(self, key, amount=1):
        return self._store.add(self._prefix + key, amount)

    def gather(self, prefix, size, timeout_s=None):
        return self._store.gather(self._prefix + prefix, size, timeout_s)

    def close(self):
        pass  # the job's store outlives every case


def _job(cases):
    """Every case on its own communicator (own planes, own comm id), one after the other."""
    import dataclasses

    from mpccs.bootstrap import rendezvous
    from mpccs.comm import Communicator
    from mpccs.config import load_options

    options = load_options(timeout_s=WAIT_S, path_policy="adaptive")
    boot = rendezvous(timeout_s=30)
    try:
        for comm_id, case in enumerate(cases, 1):
            print(f"CASE {case}", flush=True)
            store = _CaseStore(boot.store, f"{case}/")
            comm = Communicator(dataclasses.replace(boot, store=store, server=None, job_file=None), options, comm_id)
            if comm.rank == 0:
                _victim(comm, store, case)
            else:
                _rogue(comm, store, case)
    finally:
        boot.close()


# ---------------------------------------------------------------------------
# pytest: rogue chunks (one mpccs-run job for every case)
# ---------------------------------------------------------------------------
JOB_TIMEOUT_S = 90
PROTOCOL = r"chunk \d+ of flow \d+ (is out of range|is a duplicate|has \d+ bytes, expected \d+)"
EXPECT = {  # case: (error the victim must raise, its message; {...}: the geometry the rogue reported)
    "out_of_range": ("ProtocolError", r"chunk {nchunks} of flow {flow} is out of range"),
    "huge_index": ("ProtocolError", r"chunk 1048575 of flow {flow} is out of range"),
    "duplicate": ("ProtocolError", r"chunk 0 of flow {flow} is a duplicate"),
    "too_long": ("ProtocolError", r"chunk 0 of flow {flow} has {first_plus_4096} bytes, expected {first}"),
    "too_short": ("ProtocolError", r"chunk 1 of flow {flow} has {second_minus_4} bytes, expected {second}"),
    "too_long_last": ("ProtocolError", r"chunk {last_index} of flow {flow} has {last_plus_1} bytes, expected {last}"),
    "random_gather": ("ProtocolError", PROTOCOL),
    "random_reduce": ("ProtocolError", PROTOCOL),
    "fingerprint_garbage": ("MismatchError", r"rank 0 called all_gather\(count={count}.* but rank 1 called <unknown"),
    "fingerprint_short": ("MismatchError", r"but rank 1 called all_gather\(count=0,.*\(count {count} vs 0\)"),
    "fingerprint_long": (("ProtocolError", "MismatchError"), r"rank 1|peer=1"),
    "abort_garbage": ("TransportError", r"^rank 1 aborted operation #1: "),
    "failover_garbage": (("ProtocolError", "TransportError"), r"rank 1|peer=1"),
    "p2p_bad_chunk": ("ProtocolError", r"chunk {nchunks} of flow 0 is out of range"),
    "p2p_header_long": (("ProtocolError", "MismatchError"), r"rank 1|peer=1"),
}



def _expected_message(case, sent):
    geometry = dict(sent, count=COUNT)
    if "first" in sent:
        geometry.update(first_plus_4096=sent["first"] + 4096, second_minus_4=sent["second"] - 4,
                        last_index=sent["nchunks"] - 1, last_plus_1=sent["last"] + 1)
    return EXPECT[case][1].format(**geometry)


def _clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "PMI_", "OMPI_", "SLURM_", "MPCCS_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _children(pid):
    """Direct children of a process (from /proc), to clean up after a launcher that had to be killed."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def job():
    """All cases in one mpccs-run job (each on a fresh communicator), stopped if it overruns."""
    cmd = [os.path.join(BIN, "mpccs-run"), "-n", "2", "--grace", "5", "--timeout", str(JOB_TIMEOUT_S - 20), HERE,
           *CASES]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        ranks = _children(proc.pid)
        proc.terminate()  # mpccs-run stops its ranks on SIGTERM
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        for pid in ranks:  # whatever the launcher could not stop (each rank leads its own group)
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        err += f"\n(job killed after {JOB_TIMEOUT_S} s)"
    return {"rc": proc.returncode, "out": out, "err": err, "wall_s": time.monotonic() - start}


def _lines(out, rank, label):
    prefix = f"[rank {rank}] {label} "
    return [line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)]


def _where(job):
    started = _lines(job["out"], 0, "CASE")
    return (f"(job exit code {job['rc']}, last case started: {started[-1] if started else None})"
            f"\n--- stdout ---\n{job['out'][-3000:]}\n--- stderr ---\n{job['err'][-3000:]}")


def test_rogue_job_ranks_exit_cleanly(job):
    # The launcher reports every rank's non-zero exit (a crash shows as a signal's negative code).
    assert "exited with code" not in job["err"], _where(job)
    assert job["rc"] == 0, _where(job)
    assert [json.loads(r)["case"] for r in _lines(job["out"], 0, "RESULT")] == list(CASES), _where(job)
    assert job["wall_s"] < 40, f"the job took {job['wall_s']:.1f} s"


@pytest.mark.parametrize("case", CASES)
def test_rogue_chunks_get_a_clear_error_and_nothing_is_written_out_of_bounds(job, case):
    results = {r["case"]: r for r in map(json.loads, _lines(job["out"], 0, "RESULT"))}
    sent = {r["case"]: r for r in map(json.loads, _lines(job["out"], 1, "SENT"))}
    assert case in results and case in sent, f"case {case} did not finish {_where(job)}"
    assert sent[case]["messages"] >= 1
    got = results[case]
    # Nothing outside the destination was written (nor, for all_gather, rank 0's own block).
    assert got["guard_before_intact"] and got["guard_after_intact"], got
    assert got.get("own_block_intact", True), got
    # A clear mpccs error of the expected kind, naming the peer, found at once (not by the timeout) ...
    kinds, pattern = EXPECT[case][0], _expected_message(case, sent[case])
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    assert got["error"] in kinds, f"{case}: rank 0 raised {got['error']}: {got.get('message', '')[:300]}"
    assert re.search(pattern, got["message"]), got["message"][:300]
    if got["error"] == "ProtocolError":
        assert (got["rank"], got["peer"]) == (0, 1), got
        assert "rank=0" in got["message"] and "peer=1" in got["message"]
    assert got["elapsed_s"] < WAIT_S / 2, got
    # ... after which the communicator refuses further use instead of running on a half-run schedule.
    assert got["after"] == "aborted", got


# ---------------------------------------------------------------------------
# pytest: a rogue store client
# ---------------------------------------------------------------------------
TOKEN = "fuzz-job-token-5f0c"
REPLY_S = 5.0  # every rogue request is answered or its connection closed within this


def _body(op, token, key, value=b"", wait_ms=0):
    return (struct.pack("!BH", op, len(token)) + token + struct.pack("!H", len(key)) + key
            + struct.pack("!II", wait_ms, len(value)) + value)


def _frame(body):
    from mpccs.store import MAGIC

    return MAGIC + struct.pack("!I", len(body)) + body


def _exchange(port, payload, what):
    """Send one rogue request (then half-close) and read until the server closes.

    Returns the reply's status, or None when the server closed (or reset) the
    connection without one. A server that does neither within REPLY_S fails.
    """
    start = time.monotonic()
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=REPLY_S) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server refused the frame and closed before reading all of it
        try:
            while True:
                part = sock.recv(1 << 16)
                if not part:
                    break
                data += part
        except ConnectionResetError:
            pass  # closed with our unread bytes still queued: a reset, as good as a close
        except socket.timeout:
            raise AssertionError(f"{what}: no reply and no close within {REPLY_S:g} s") from None
    elapsed = time.monotonic() - start
    assert elapsed < REPLY_S, f"{what}: took {elapsed:.1f} s"
    if not data:
        return None
    assert len(data) >= 5, f"{what}: truncated reply {data!r}"
    status, length = struct.unpack("!BI", data[:5])
    assert len(data) == 5 + length, f"{what}: reply of {len(data)} bytes announces {length} of payload"
    return status


def _rogue_store_requests(rng, token):
    """(category, payload, statuses allowed besides a closed connection) of seeded rogue requests."""
    from mpccs.store import AUTH_FAILED, BAD_REQUEST, MAGIC, MAX_BODY, OP_ADD, OP_GET, OP_SET

    ops = (OP_SET, OP_GET, OP_ADD)

    def valid_body(i, key_prefix="rogue"):
        op = rng.choice(ops)
        value = b"1" if op == OP_ADD else rng.randbytes(rng.randint(0, 64)) if op == OP_SET else b""
        return _body(op, token, f"{key_prefix}/{i}".encode(), value, wait_ms=rng.randint(0, 50))

    requests = []
    for i in range(60):  # garbage: anything but the magic
        payload = rng.randbytes(rng.randint(0, 300))
        if payload[:4] == MAGIC[: len(payload[:4])]:
            payload = b"X" + payload
        requests.append(("garbage", payload, {BAD_REQUEST}))
    for i in range(50):  # a valid request cut anywhere: never executed, never answered OK
        frame = _frame(valid_body(i, "trunc"))
        requests.append(("truncated", frame[: rng.randint(0, len(frame) - 1)], set()))
    for i in range(30):  # length prefixes beyond the bound, with some body after them
        length = MAX_BODY + 1 if i == 0 else rng.randint(MAX_BODY + 1, (1 << 32) - 1)
        requests.append(("oversized", MAGIC + struct.pack("!I", length) + rng.randbytes(rng.randint(0, 4096)),
                         {BAD_REQUEST}))
    wrong_tokens = [b"", token[:-1], token + b"x", token[:-1] + bytes([token[-1] ^ 1]), token.upper()]
    for i in range(50):  # well-formed requests with a wrong token (sets of keys that must not appear)
        bad = wrong_tokens[i] if i < len(wrong_tokens) else rng.randbytes(rng.randint(0, 80))
        if bad == token:
            bad += b"!"
        value = b"1" if i % 3 == 2 else b"stolen"
        requests.append(("wrong_token", _frame(_body((OP_SET, OP_GET, OP_ADD)[i % 3], bad, f"victim/{i}".encode(),
                                                     value)), {AUTH_FAILED}))
    for i in range(60):  # the right token, a malformed body
        body = bytearray(valid_body(i, "malformed"))
        kind = i % 5
        if kind == 0:  # an op that does not exist
            body[0] = rng.choice([0] + list(range(4, 256)))
        elif kind == 1:  # trailing bytes after the value
            body += rng.randbytes(rng.randint(1, 64))
        elif kind == 2:  # the body cut short (the frame's length says so)
            body = body[: rng.randint(1, len(body) - 1)]
        elif kind == 3:  # value length field wrong either way
            vlen_at = 1 + 2 + len(token) + 2 + len(f"malformed/{i}") + 4
            (vlen,) = struct.unpack_from("!I", body, vlen_at)
            delta = rng.choice([-1, 1]) * rng.randint(1, 1000)
            struct.pack_into("!I", body, vlen_at, vlen + delta if vlen + delta >= 0 else vlen - delta)
        else:  # token length pointing past the end of the body
            struct.pack_into("!H", body, 1, rng.randint(len(body), 0xFFFF))
        requests.append(("malformed", _frame(bytes(body)), {BAD_REQUEST}))
    rng.shuffle(requests)
    return requests


def test_rogue_store_requests_are_refused_and_the_store_keeps_serving():
    import random

    from mpccs.store import AUTH_FAILED, BAD_REQUEST, StoreClient, StoreServer

    server = StoreServer("127.0.0.1", 0, TOKEN)
    try:
        early = StoreClient("127.0.0.1", server.port, TOKEN, timeout_s=5)  # connected before the fuzz
        early.set("legit/before", b"kept")
        requests = _rogue_store_requests(random.Random(SEED), TOKEN.encode())
        outcomes: dict = {}
        start = time.monotonic()
        for n, (category, payload, allowed) in enumerate(requests):
            status = _exchange(server.port, payload, f"rogue request #{n} ({category}, {len(payload)} bytes)")
            assert status is None or status in allowed, (
                f"rogue request #{n} ({category}) got status {status}: {payload[:80]!r}")
            outcomes.setdefault(category, []).append(status)
            if n % 25 == 0:  # the legitimate client is served in between
                assert early.add("legit/counter") == n // 25 + 1
        fuzz_s = time.monotonic() - start
        assert server._thread.is_alive(), "the store's server thread died"
        late = StoreClient("127.0.0.1", server.port, TOKEN, timeout_s=5)
        for client in (early, late):
            assert client.get("legit/before", timeout_s=1) == b"kept"
        late.set("legit/after", b"\x00" * 1000)
        assert early.get("legit/after", timeout_s=1) == b"\x00" * 1000
        assert late.add("legit/counter", 0) == len(range(0, len(requests), 25))
        # Nothing a rogue sent was executed: no wrong-token or truncated request wrote a key.
        for key in ("victim/0", "victim/3", "victim/49", "trunc/0", "trunc/7", "trunc/49"):
            with pytest.raises(KeyError):
                late.get(key, timeout_s=0)
        # Refusals are explicit where the server read a whole header: most garbage, every oversized
        # prefix and wrong token get their status (a reset may swallow a few replies).
        for category, status in (("garbage", BAD_REQUEST), ("oversized", BAD_REQUEST), ("wrong_token", AUTH_FAILED),
                                 ("malformed", BAD_REQUEST)):
            answered = outcomes[category].count(status)
            assert answered >= len(outcomes[category]) // 2, (category, outcomes[category])
        assert all(s is None for s in outcomes["truncated"]), outcomes["truncated"]
        assert fuzz_s < 20, f"{len(requests)} rogue requests took {fuzz_s:.1f} s"
        early.close()
        late.close()
    finally:
        server.close()


def test_stalled_rogue_connections_do_not_block_the_store():
    """Clients that send part of a frame and go silent hold their own connection only."""
    from mpccs.store import MAGIC, StoreClient, StoreServer

    server = StoreServer("127.0.0.1", 0, TOKEN)
    stalled = []
    try:
        partials = [MAGIC[:2], MAGIC, MAGIC + struct.pack("!I", 100),
                    _frame(_body(1, TOKEN.encode(), b"half", b"v" * 100))[:40]]
        for i in range(16):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=REPLY_S)
            sock.sendall(partials[i % len(partials)])
            stalled.append(sock)
        client = StoreClient("127.0.0.1", server.port, TOKEN, timeout_s=5)
        start = time.monotonic()
        client.set("k", b"v")
        assert client.get("k", timeout_s=1) == b"v"
        assert client.add("n", 5) == 5
        assert time.monotonic() - start < 2
        with pytest.raises(KeyError):
            client.get("half", timeout_s=0)
        client.close()
        assert server._thread.is_alive()
    finally:
        for sock in stalled:
            sock.close()
        server.close()


def test_store_answers_every_malformed_body_with_bad_request():
    from mpccs.store import BAD_REQUEST, OK, OP_ADD, OP_SET, StoreServer

    server = StoreServer("127.0.0.1", 0, TOKEN)
    token = TOKEN.encode()
    try:
        assert _exchange(server.port, _frame(_body(OP_SET, token, b"text", b"abc")), "set") == OK
        statuses = [
            _exchange(server.port, _frame(b""), "empty body"),
            _exchange(server.port, _frame(_body(OP_ADD, token, b"n", b"one")), "add of a non-integer"),
            _exchange(server.port, _frame(_body(OP_ADD, token, b"text", b"1")), "add to a non-integer"),
        ]
        assert statuses == [BAD_REQUEST] * 3, statuses
    finally:
        server.close()


if __name__ == "__main__":
    _job(sys.argv[1:])
    sys.exit(0)
