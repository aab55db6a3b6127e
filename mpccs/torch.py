"""mpccs as a ``torch.distributed`` backend, and a DDP communication hook.

    import torch.distributed as dist
    import mpccs.torch                      # registers the "mpccs" backend
    dist.init_process_group("mpccs")        # torchrun / mpccs-run variables
    dist.all_reduce(t)                      # CPU tensors: zero-copy numpy views

    # or keep gloo for DDP's bookkeeping and all-reduce the gradients with mpccs:
    ddp.register_comm_hook(mpccs.torch.hook_state(), mpccs.torch.allreduce_hook)

Rendezvous: torch already runs a store on MASTER_ADDR:MASTER_PORT (its
TCPStore), which is the port mpccs' own store would want. The backend therefore
does not start a second store: it publishes the planes' addresses through the
store torch hands to the backend creator (``rendezvous="store"``, default). With
``MPCCS_TORCH_RENDEZVOUS=port`` rank 0 instead starts mpccs' token-authenticated
store on a kernel-chosen free port of MASTER_ADDR and only that port and a fresh
token travel through torch's store. docs/torch.md explains the choice.

Tensors: contiguous CPU tensors are passed to the Communicator as numpy views of
their own memory (no copy). Non-contiguous tensors, lists of separate tensors
(list all_gather / reduce_scatter / alltoall, unless the list is consecutive views
of one buffer) and CUDA tensors are staged through a contiguous host copy (pinned
for CUDA tensors) and copied back when the Work completes. On GPU-direct planes
(``Communicator.gpu_direct``) contiguous CUDA tensors of the dtypes cupy has go
to the planes as cupy views of their own memory (no copy) in allreduce,
broadcast, reduce, the single-tensor all_gather / reduce_scatter / all_to_all,
and the DDP hook.

Progress: mpccs has no progress thread. ``Work.wait()``, ``Work.is_completed()``
and ``Work.get_future()`` drive the communicator; ``get_future()`` returns an
already completed future (it waits first).
"""
from __future__ import annotations

import datetime
import itertools
import json
import os
import secrets
import socket
import threading
import weakref
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from .bootstrap import Bootstrap
from .comm import Communicator
from .config import load_options
from .errors import ConfigError, MpccsError, RendezvousError
from .reduce import bfloat16_dtype, is_supported_dtype
from .store import StoreClient, StoreServer

__all__ = [
    "BACKEND_NAME", "ProcessGroupMpccs", "MpccsWork", "HookState", "allreduce_hook", "register",
    "new_communicator", "get_communicator", "hook_state", "to_numpy",
]

BACKEND_NAME = "mpccs"
RENDEZVOUS_MODES = ("store", "port")

ReduceOp = dist.ReduceOp
_REDUCE_OPS = {
    ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MIN: "min", ReduceOp.MAX: "max", ReduceOp.AVG: "avg",
}

# ---------------------------------------------------------------------------
# tensors <-> numpy
# ---------------------------------------------------------------------------
_TORCH_REDUCIBLE = {
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
}
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor's memory; never a copy.

    bfloat16 comes back as ml_dtypes.bfloat16; dtypes numpy lacks (bool is
    kept, float8, ...) come back as unsigned/signed integers of their size.
    """
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16_dtype())
    try:
        return t.numpy()
    except (TypeError, RuntimeError):
        if t.element_size() not in _SAME_SIZE_INT:
            raise TypeError(f"mpccs: dtype {t.dtype} has no numpy view") from None
        return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


def _movable(arr: np.ndarray) -> np.ndarray:
    """Copy-only collectives move any dtype: unsupported ones (bool, complex) travel as bytes."""
    if is_supported_dtype(arr.dtype):
        return arr
    return arr.reshape(-1).view(np.uint8)


class _Staged:
    """One tensor handed to the Communicator: a zero-copy view, or a host copy written back later."""

    __slots__ = ("tensor", "host", "array", "copied")

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor, copied: bool):
        self.tensor = tensor
        self.host = host
        self.copied = copied
        if not host.is_contiguous():  # a reshape below would copy silently and lose the result
            raise AssertionError("mpccs: staged tensor is not contiguous")
        self.array = to_numpy(host).reshape(-1)

    def write_back(self) -> None:
        if self.copied:
            with torch.no_grad():
                self.tensor.copy_(self.host.view(self.tensor.shape))


# CUDA tensors of these dtypes go to GPU-direct planes as cupy views of their
# memory (no copy); others (bfloat16, which cupy lacks, bool, complex) are staged.
_CUPY_DTYPES = {torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.uint8}


class _OnDevice:
    """A contiguous CUDA tensor handed to GPU-direct planes as a cupy view of its
    memory: the planes read and write the tensor itself (zero-copy)."""

    __slots__ = ("tensor", "host", "array", "copied")

    def __init__(self, tensor: torch.Tensor):
        import cupy

        self.tensor = tensor
        self.host = tensor  # what the dtype checks read
        self.array = cupy.asarray(tensor.detach()).reshape(-1)
        self.copied = False

    def write_back(self) -> None:
        pass


def _direct_ok(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and t.dtype in _CUPY_DTYPES)


def _stage(t: torch.Tensor, *, load: bool = True, direct: bool = False):
    """Contiguous CPU tensors as themselves; with ``direct`` (GPU-direct planes),
    contiguous CUDA tensors of a cupy dtype as themselves too; everything else as
    a contiguous host copy."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if direct and _direct_ok(t):
        return _OnDevice(t)
    if t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return _Staged(t, t.detach(), False)
    if t.is_sparse:
        raise TypeError("mpccs: sparse tensors are not supported")
    # CUDA tensors stage through page-locked memory: the copy engines move it
    # at PCIe rate without a bounce buffer (torch caches the pinned blocks).
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    if load:
        host.copy_(t.detach())  # resolves conj/neg views and strides; blocking for CUDA sources
    return _Staged(t, host, True)


def _stage_pair(output: torch.Tensor, input: torch.Tensor, direct: bool):
    """(output, input) staged alike: both on the device or both through the host
    (one call's arrays must be in one kind of memory)."""
    both = direct and _direct_ok(output) and _direct_ok(input)
    return _stage(output, load=False, direct=both), _stage(input, direct=both)


def _span(tensors: list) -> Optional[torch.Tensor]:
    """One flat view over tensors that lie back to back in one CPU buffer, or None."""
    if not tensors:
        return None
    first = tensors[0]
    if first.device.type != "cpu" or first.is_conj() or first.is_neg():
        return None
    size = first.element_size()
    ptr = first.data_ptr()
    try:
        storage = first.untyped_storage().data_ptr()
    except RuntimeError:
        return None
    for t in tensors:
        if (t.device.type != "cpu" or t.dtype != first.dtype or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage or t.data_ptr() != ptr):
            return None
        ptr += t.numel() * size
    total = sum(t.numel() for t in tensors)
    return first.detach().as_strided((total,), (1,), first.storage_offset())


class _StagedList:
    """A list of same-dtype tensors as one flat array: a span of their buffer or a concatenated copy."""

    def __init__(self, tensors: list, *, load: bool):
        self.tensors = list(tensors)
        dtypes = {t.dtype for t in self.tensors}
        if len(dtypes) > 1:
            raise TypeError(f"mpccs: tensors of one list must share a dtype, got {sorted(map(str, dtypes))}")
        span = _span(self.tensors)
        self.copied = span is None
        if span is None:
            if load:
                flat = torch.cat([t.detach().reshape(-1).to("cpu") for t in self.tensors]) if self.tensors else torch.empty(0)
            else:
                n = sum(t.numel() for t in self.tensors)
                flat = torch.empty(n, dtype=self.tensors[0].dtype if self.tensors else torch.float32)
            span = flat
        self.host = span
        self.array = to_numpy(span).reshape(-1)
        self.counts = [t.numel() for t in self.tensors]

    def write_back(self) -> None:
        if not self.copied:
            return
        offset = 0
        with torch.no_grad():
            for t, n in zip(self.tensors, self.counts):
                t.copy_(self.host[offset:offset + n].view(t.shape))
                offset += n


def _reduce_op(reduce_op) -> str:
    key = getattr(reduce_op, "op", reduce_op)
    try:
        return _REDUCE_OPS[key]
    except (KeyError, TypeError):
        raise ValueError(
            f"mpccs: reduce op {key} is not supported; supported: SUM, PRODUCT, MIN, MAX, AVG"
        ) from None


def _reducible(staged, what: str) -> np.ndarray:
    """The staged array of a reduction; refuses dtypes mpccs cannot reduce (bool, complex, float8, ...)."""
    if staged.host.dtype not in _TORCH_REDUCIBLE:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in _TORCH_REDUCIBLE))
        raise TypeError(f"mpccs: {what}: cannot reduce dtype {staged.host.dtype}; reducible dtypes: {names}")
    return staged.array


def _seconds(timeout) -> Optional[float]:
    """torch passes timeouts as timedelta (0 or negative: unset) or milliseconds."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout) / 1000.0
    return seconds if seconds > 0 else None


# ---------------------------------------------------------------------------
# locks: the engine is single-threaded; whoever submits or drives holds the lock
# ---------------------------------------------------------------------------
_LOCKS: "weakref.WeakKeyDictionary[Communicator, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _lock_for(comm: Communicator) -> threading.RLock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(comm)
        if lock is None:
            lock = _LOCKS[comm] = threading.RLock()
        return lock


# ---------------------------------------------------------------------------
# Work
# ---------------------------------------------------------------------------
class MpccsWork(dist.Work):
    """A torch Work over one or more mpccs Works.

    ``wait()`` drives the communicator until every part is done, then writes
    staged copies back; ``get_future()`` waits and returns a completed future
    whose value is ``result()``.
    """

    def __init__(self, comm: Communicator, name: str, works: list, result: list,
                 finalizers: list[Callable[[], None]], keep: list, timeout_s: Optional[float] = None):
        super().__init__()
        self._comm = comm
        self._lock = _lock_for(comm)
        self._name = name
        self._works = works
        self._result = result
        self._finalizers = finalizers
        self._keep = keep  # staged buffers stay alive while the operation runs
        self._timeout_s = timeout_s
        self._done = not works and not finalizers
        self._error: Optional[BaseException] = None

    def _finish(self, timeout_s: Optional[float]) -> None:
        if self._done:
            if self._error is not None:
                raise self._error
            return
        with self._lock:
            if not self._done:
                try:
                    for work in self._works:
                        work.wait(timeout_s if timeout_s is not None else self._timeout_s)
                    for fin in self._finalizers:
                        fin()
                except BaseException as exc:
                    self._error = exc
                    raise
                finally:
                    self._done = True
                    self._keep = []
        if self._error is not None:
            raise self._error

    def wait(self, timeout=None) -> bool:
        self._finish(_seconds(timeout))
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        with self._lock:
            if all(w.is_completed() for w in self._works):
                try:
                    self._finish(None)
                except BaseException:
                    pass  # is_completed reports, wait() raises
                return True
        return False

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def result(self) -> list:
        self._finish(None)
        return self._result

    def get_future(self) -> torch.futures.Future:
        fut = torch.futures.Future()
        try:
            self._finish(None)
        except BaseException as exc:  # noqa: BLE001 - the future carries it
            fut.set_exception(exc)
        else:
            fut.set_result(self._result)
        return fut

    def stats(self) -> list[dict]:
        """The per-operation statistics of the mpccs Works (bytes per plane, split, time)."""
        return [w.stats() for w in self._works]


# ---------------------------------------------------------------------------
# rendezvous over a torch Store
# ---------------------------------------------------------------------------
class _TorchStoreClient:
    """The part of mpccs' StoreClient a Communicator uses, over a torch ``Store``."""

    def __init__(self, store, prefix: str, timeout_s: float):
        self._store = store
        self._prefix = prefix
        self._timeout_s = timeout_s

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _wait(self, keys: list[str], timeout_s: float) -> bool:
        try:
            self._store.wait([self._key(k) for k in keys], datetime.timedelta(seconds=max(timeout_s, 0.001)))
            return True
        except RuntimeError:  # DistStoreError on timeout
            return False

    def set(self, key: str, value) -> None:
        self._store.set(self._key(key), value)

    def get(self, key: str, timeout_s: Optional[float] = None) -> bytes:
        if not self._wait([key], self._timeout_s if timeout_s is None else timeout_s):
            raise KeyError("timed out waiting for key")
        return bytes(self._store.get(self._key(key)))

    def add(self, key: str, amount: int = 1) -> int:
        return int(self._store.add(self._key(key), amount))

    def gather(self, prefix: str, size: int, timeout_s: Optional[float] = None) -> list[bytes]:
        keys = [f"{prefix}/{r}" for r in range(size)]
        if not self._wait(keys, self._timeout_s if timeout_s is None else timeout_s):
            missing = [r for r, k in enumerate(keys) if not self._store.check([self._key(k)])]
            raise RendezvousError(
                f"rendezvous through the torch store timed out: rank(s) {missing} never published {prefix!r}"
            )
        return [bytes(self._store.get(self._key(k))) for k in keys]

    def close(self) -> None:
        pass  # torch owns the store


def _store_host() -> str:
    addr = os.environ.get("MASTER_ADDR")
    try:
        return socket.gethostbyname(addr) if addr else socket.gethostbyname(socket.gethostname())
    except OSError:
        raise RendezvousError(f"MASTER_ADDR={addr!r} does not resolve") from None


def _boot_through_store(store, rank: int, size: int, mode: str, timeout_s: float, prefix: str) -> Bootstrap:
    if mode not in RENDEZVOUS_MODES:
        raise ConfigError(f"unknown rendezvous mode {mode!r}; valid: {', '.join(RENDEZVOUS_MODES)}")
    client = _TorchStoreClient(store, prefix, timeout_s)
    if mode == "store":
        return Bootstrap(rank, size, None, "torch", client, None, "")
    # mode "port": mpccs' own authenticated store on a free port; its address travels through torch's store
    server = None
    if rank == 0:
        token = secrets.token_hex(16)
        try:
            server = StoreServer(_store_host(), 0, token)
        except OSError as exc:
            client.set("store", json.dumps({"error": str(exc)}).encode())
            raise RendezvousError(f"rank 0 cannot start the mpccs store: {exc}") from None
        client.set("store", json.dumps({"host": server.host, "port": server.port, "token": token}).encode())
    info = json.loads(client.get("store", timeout_s))
    if "error" in info:
        raise RendezvousError(f"rank 0 could not start the mpccs store: {info['error']}")
    try:
        own = StoreClient(info["host"], int(info["port"]), info["token"], timeout_s)
    except BaseException:
        if server is not None:
            server.close()
        raise
    return Bootstrap(rank, size, None, "torch", own, server, info["token"])


def _communicator_over(store, rank: int, size: int, prefix: str, rendezvous: Optional[str] = None,
                       **options) -> Communicator:
    mode = rendezvous or os.environ.get("MPCCS_TORCH_RENDEZVOUS") or "store"
    opts = load_options(**options)
    boot = _boot_through_store(store, rank, size, mode, opts.rendezvous_timeout_s, prefix)
    try:
        return Communicator(boot, opts)
    except BaseException:
        boot.close()
        raise


_COMM_COUNTER = itertools.count()


def new_communicator(group=None, *, rendezvous: Optional[str] = None, **options) -> Communicator:
    """An mpccs Communicator over the ranks of a torch process group (collective call).

    It rendezvouses through that group's torch store (no second port), so it
    works under torchrun and after ``init_process_group`` of any backend; every
    rank of the group must call it, in the same order. Keyword options are
    ``mpccs.init``'s.
    """
    if not dist.is_initialized():
        raise RuntimeError("mpccs.torch.new_communicator needs torch.distributed.init_process_group first")
    group = group if group is not None else dist.group.WORLD
    from torch.distributed import distributed_c10d as c10d

    store = c10d._world.pg_map[group][1]
    index = next(_COMM_COUNTER)
    return _communicator_over(store, dist.get_rank(group), dist.get_world_size(group),
                              f"mpccs/comm{index}/", rendezvous, **options)


def get_communicator(group=None) -> Communicator:
    """The Communicator behind an mpccs process group (the default group when None)."""
    group = group if group is not None else dist.group.WORLD
    pg = group
    if not isinstance(pg, ProcessGroupMpccs):
        raise TypeError(f"process group {group!r} is not an mpccs group (backend {dist.get_backend(group)!r})")
    return pg.comm


# ---------------------------------------------------------------------------
# the process group
# ---------------------------------------------------------------------------
class ProcessGroupMpccs(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on an mpccs Communicator.

    torch 2.13 gives Python no constructor for ``c10d.Backend``; a Python
    backend subclasses ``ProcessGroup`` (whose pybind trampoline forwards the
    C++ virtual calls, e.g. from DDP's reducer, to these methods) and the
    creator's return value replaces the ProcessGroup torch would have built.
    """

    def __init__(self, comm: Communicator, rank: int, size: int, timeout_s: Optional[float] = None):
        super().__init__(rank, size)
        if comm.rank != rank or comm.size != size:
            raise ValueError(f"communicator is rank {comm.rank} of {comm.size}, the group rank {rank} of {size}")
        self.comm = comm
        self._direct = comm.gpu_direct  # CUDA tensors to the planes as they are (_stage)
        self._lock = _lock_for(comm)
        self._timeout_s = timeout_s
        self._closed = False
        self._group_name = ""
        self._group_desc = "undefined"

    # -- identity --------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    # ProcessGroup keeps its name in the backends registered with it; a Python
    # group that stands in for them keeps its own (torch sets it after creation).
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupMpccs(rank={self.comm.rank}, size={self.comm.size}, policy={self.comm.path_policy!r})"

    # -- helpers ----------------------------------------------------------------
    def _work(self, name, works, result, finalizers=(), keep=()) -> MpccsWork:
        return MpccsWork(self.comm, name, works, list(result), list(finalizers), list(keep), self._timeout_s)

    def _check_open(self) -> None:
        if self._closed:
            raise MpccsError("mpccs process group is shut down")

    @staticmethod
    def _one(tensors, what: str):
        if len(tensors) != 1:
            raise ValueError(f"mpccs: {what} takes exactly one tensor per rank, got {len(tensors)}")
        return tensors[0]

    # -- collectives -------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        self._check_open()
        op = _reduce_op(opts.reduceOp if opts is not None else ReduceOp.SUM)
        staged = [_stage(t, direct=self._direct) for t in tensors]
        with self._lock:
            works = [self.comm.all_reduce(_reducible(s, "allreduce"), op=op, async_op=True) for s in staged]
        return self._work("allreduce", works, tensors, [s.write_back for s in staged if s.copied], staged)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        self._check_open()
        root = opts.rootRank if opts is not None else 0
        if opts is not None and opts.rootTensor != 0:
            raise ValueError("mpccs: broadcast supports rootTensor 0 only")
        staged = [_stage(t, direct=self._direct) for t in tensors]
        with self._lock:
            works = [self.comm.broadcast(_movable(s.array), root=root, async_op=True) for s in staged]
        return self._work("broadcast", works, tensors, [s.write_back for s in staged if s.copied], staged)

    def reduce(self, tensors, opts=None):
        self._check_open()
        root = opts.rootRank if opts is not None else 0
        op = _reduce_op(opts.reduceOp if opts is not None else ReduceOp.SUM)
        staged = [_stage(t, direct=self._direct) for t in tensors]
        with self._lock:
            works = [self.comm.reduce(_reducible(s, "reduce"), op=op, root=root, async_op=True)
                     for s in staged]
        fins = [s.write_back for s in staged if s.copied] if self.comm.rank == root else []
        return self._work("reduce", works, tensors, fins, staged)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[i][j]`` receives rank j's ``input_tensors[i]``."""
        self._check_open()
        if len(output_tensors) != len(input_tensors):
            raise ValueError("mpccs: allgather needs one output list per input tensor")
        works, fins, keep = [], [], []
        for outs, inp in zip(output_tensors, input_tensors):
            if len(outs) != self.comm.size:
                raise ValueError(f"mpccs: allgather needs {self.comm.size} output tensors, got {len(outs)}")
            if any(o.numel() != inp.numel() for o in outs):
                raise ValueError("mpccs: allgather outputs must have the input's number of elements")
            src = _stage(inp)
            dst = _StagedList(outs, load=False)
            keep += [src, dst]
            with self._lock:
                works.append(self.comm.all_gather(_movable(src.array), _movable(dst.array), async_op=True))
            if dst.copied:
                fins.append(dst.write_back)
        return self._work("allgather", works, output_tensors, fins, keep)

    def all_gather_single(self, output, input, opts=None):
        """``output`` is every rank's ``input`` back to back (all_gather_into_tensor)."""
        self._check_open()
        dst, src = _stage_pair(output, input, self._direct)
        with self._lock:
            work = self.comm.all_gather(_movable(src.array), _movable(dst.array), async_op=True)
        return self._work("all_gather_single", [work], [output], [dst.write_back] if dst.copied else [], [src, dst])

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[i]`` receives the reduction of every rank's ``input_tensors[i][rank]``."""
        self._check_open()
        op = _reduce_op(opts.reduceOp if opts is not None else ReduceOp.SUM)
        if len(output_tensors) != len(input_tensors):
            raise ValueError("mpccs: reduce_scatter needs one input list per output tensor")
        works, fins, keep = [], [], []
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != self.comm.size:
                raise ValueError(f"mpccs: reduce_scatter needs {self.comm.size} input tensors, got {len(ins)}")
            src = _StagedList(ins, load=True)
            dst = _stage(out, load=False)
            keep += [src, dst]
            with self._lock:
                works.append(self.comm.reduce_scatter(_reducible(src, "reduce_scatter"), dst.array, op=op,
                                                      async_op=True))
            if dst.copied:
                fins.append(dst.write_back)
        return self._work("reduce_scatter", works, output_tensors, fins, keep)

    def reduce_scatter_single(self, output, input, opts=None):
        """``output`` receives block ``rank`` of the reduction of every rank's ``input`` (reduce_scatter_tensor)."""
        self._check_open()
        op = _reduce_op(opts.reduceOp if opts is not None else ReduceOp.SUM)
        dst, src = _stage_pair(output, input, self._direct)
        with self._lock:
            work = self.comm.reduce_scatter(_reducible(src, "reduce_scatter"), dst.array, op=op, async_op=True)
        return self._work("reduce_scatter_single", [work], [output], [dst.write_back] if dst.copied else [],
                          [src, dst])

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        """all_to_all_single: even splits (empty lists) or row splits along dim 0 (all_to_allv)."""
        self._check_open()
        size = self.comm.size
        dst, src = _stage_pair(output, input, self._direct)
        s_arr, d_arr = _movable(src.array), _movable(dst.array)
        with self._lock:
            if not output_split_sizes and not input_split_sizes:
                work = self.comm.all_to_all(s_arr, d_arr, async_op=True)
            else:
                scale = src.array.itemsize // s_arr.itemsize  # elements -> bytes when moved as bytes
                send_counts = [c * scale for c in _row_counts(input, input_split_sizes, size, "input")]
                recv_counts = [c * scale for c in _row_counts(output, output_split_sizes, size, "output")]
                work = self.comm.all_to_allv(s_arr, send_counts, d_arr, recv_counts, async_op=True)
        return self._work("all_to_all_single", [work], [output], [dst.write_back] if dst.copied else [], [src, dst])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """``input_tensors[j]`` goes to rank j; ``output_tensors[i]`` comes from rank i (any sizes)."""
        self._check_open()
        size = self.comm.size
        if len(output_tensors) != size or len(input_tensors) != size:
            raise ValueError(f"mpccs: alltoall needs {size} input and {size} output tensors")
        src = _StagedList(input_tensors, load=True)
        dst = _StagedList(output_tensors, load=False)
        s_arr, d_arr = _movable(src.array), _movable(dst.array)
        scale = src.array.itemsize // s_arr.itemsize  # elements -> bytes when moved as bytes
        with self._lock:
            work = self.comm.all_to_allv(s_arr, [c * scale for c in src.counts], d_arr,
                                         [c * scale for c in dst.counts], async_op=True)
        return self._work("alltoall", [work], output_tensors, [dst.write_back] if dst.copied else [], [src, dst])

    def barrier(self, opts=None):
        self._check_open()
        with self._lock:
            self.comm.barrier()
        return self._work("barrier", [], [])

    # -- point to point (tags are not used: messages between two ranks match in order) --
    def send(self, tensors, dst_rank, tag=0):
        self._check_open()
        staged = [_stage(t) for t in tensors]
        with self._lock:
            works = [self.comm.isend(s.array, dst_rank) for s in staged]
        return self._work("send", works, tensors, [], staged)

    def recv(self, tensors, src_rank, tag=0):
        self._check_open()
        staged = [_stage(t, load=False) for t in tensors]
        with self._lock:
            works = [self.comm.irecv(s.array, src_rank) for s in staged]
        return self._work("recv", works, tensors, [s.write_back for s in staged if s.copied], staged)

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError("mpccs: receiving from any source is not supported")

    def gather(self, output_tensors, input_tensors, opts=None):
        """Point-to-point gather: the root receives from every rank in rank order."""
        self._check_open()
        root = opts.rootRank if opts is not None else 0
        inp = self._one(input_tensors, "gather")
        works, fins, keep = [], [], []
        with self._lock:
            if self.comm.rank == root:
                outs = self._one(output_tensors, "gather")
                for r, out in enumerate(outs):
                    if r == root:
                        out.copy_(inp.view(out.shape) if out.numel() == inp.numel() else inp)
                        continue
                    dst = _stage(out, load=False)
                    keep.append(dst)
                    works.append(self.comm.irecv(dst.array, r))
                    if dst.copied:
                        fins.append(dst.write_back)
            else:
                src = _stage(inp)
                keep.append(src)
                works.append(self.comm.isend(src.array, root))
        return self._work("gather", works, output_tensors, fins, keep)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """Point-to-point scatter: the root sends block r to rank r."""
        self._check_open()
        root = opts.rootRank if opts is not None else 0
        out = self._one(output_tensors, "scatter")
        works, fins, keep = [], [], []
        with self._lock:
            if self.comm.rank == root:
                ins = self._one(input_tensors, "scatter")
                for r, inp in enumerate(ins):
                    if r == root:
                        out.copy_(inp.view(out.shape) if out.numel() == inp.numel() else inp)
                        continue
                    src = _stage(inp)
                    keep.append(src)
                    works.append(self.comm.isend(src.array, r))
            else:
                dst = _stage(out, load=False)
                keep.append(dst)
                works.append(self.comm.irecv(dst.array, root))
                if dst.copied:
                    fins.append(dst.write_back)
        return self._work("scatter", works, output_tensors, fins, keep)

    # -- coalesced forms used by torch's _coalescing_manager and FSDP ---------------
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Combined(self.comm, works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Combined(self.comm, works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- lifecycle ------------------------------------------------------------------
    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            with self._lock:
                self.comm.close()

    def abort(self) -> None:
        self.shutdown()


class _Combined(MpccsWork):
    """Several MpccsWorks as one."""

    def __init__(self, comm, parts: list, result: list):
        super().__init__(comm, "coalesced", [], list(result), [lambda: [p.wait() for p in parts]], [])
        self._parts = parts


def _row_counts(t: torch.Tensor, splits, size: int, what: str) -> list[int]:
    """Element counts per rank from row splits along dim 0 (empty: equal rows)."""
    rows = t.shape[0] if t.dim() else 1
    per_row = t.numel() // rows if rows else 0
    if not splits:
        if rows % size:
            raise ValueError(f"mpccs: all_to_all_single {what} has {rows} rows, not divisible by {size} ranks")
        splits = [rows // size] * size
    splits = [int(s) for s in splits]
    if len(splits) != size or sum(splits) != rows or any(s < 0 for s in splits):
        raise ValueError(f"mpccs: all_to_all_single {what} splits {splits} do not cover {rows} rows over {size} ranks")
    return [s * per_row for s in splits]


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------
_DEFAULT_OPTIONS: dict = {}


def _create(store, rank: int, size: int, timeout) -> ProcessGroupMpccs:
    """Backend creator: torch passes the group's (prefix) store, group rank and size, and its timeout."""
    options = dict(_DEFAULT_OPTIONS)
    rendezvous = options.pop("rendezvous", None)
    timeout_s = _seconds(timeout)
    from torch.distributed.constants import default_pg_timeout

    if ("timeout_s" not in options and not os.environ.get("MPCCS_TIMEOUT") and timeout_s
            and timeout != default_pg_timeout):
        options["timeout_s"] = timeout_s  # an explicit init_process_group(timeout=...) bounds each operation
    comm = _communicator_over(store, rank, size, "mpccs/", rendezvous, **options)
    return ProcessGroupMpccs(comm, rank, size)


def register(name: str = BACKEND_NAME, **options) -> None:
    """Register the backend (done on import); keyword options go to every Communicator it creates.

    ``rendezvous="store"`` (default) or ``"port"`` chooses how ranks find each
    other (see the module docstring); the rest are ``mpccs.init`` options.
    """
    rendezvous = options.get("rendezvous")
    if rendezvous is not None and rendezvous not in RENDEZVOUS_MODES:
        raise ConfigError(f"unknown rendezvous mode {rendezvous!r}; valid: {', '.join(RENDEZVOUS_MODES)}")
    _DEFAULT_OPTIONS.clear()
    _DEFAULT_OPTIONS.update(options)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    dist.Backend.register_backend(name, _create, devices=devices)


# ---------------------------------------------------------------------------
# DDP communication hook
# ---------------------------------------------------------------------------
class HookState:
    """State of :func:`allreduce_hook`: the Communicator and the buckets in flight.

    ``overlap=True``: a bucket's all_reduce starts when DDP hands it over and
    runs while backward computes the next buckets (progress is driven at every
    later hook call); the last bucket's call finishes them all, in order, before
    DDP waits on the futures. ``overlap=False``: each bucket completes inside
    its own hook call.
    """

    def __init__(self, comm: Communicator, overlap: bool = True, op: str = "avg"):
        if op not in ("avg", "sum"):
            raise ValueError("op must be 'avg' or 'sum'")
        self.comm = comm
        self.overlap = overlap
        self.op = op
        self.lock = _lock_for(comm)
        self.pending: list = []  # (mpccs Work, future, bucket tensor, staged)
        self.buckets = 0  # buckets all-reduced so far
        self.bytes = 0
        self.max_in_flight = 0  # most buckets in flight at once (1 without overlap)

    def _settle(self, drain: bool) -> None:
        """Complete finished (drain: all) pending buckets, oldest first, in order."""
        while self.pending:
            work, fut, tensor, staged = self.pending[0]
            if not drain and not work.is_completed():
                return
            self.pending.pop(0)
            try:
                work.wait()
                staged.write_back()
            except BaseException as exc:  # noqa: BLE001 - DDP sees it at fut.wait()
                fut.set_exception(exc)
                for _, other, _, _ in self.pending:
                    other.set_exception(exc)
                self.pending.clear()
                return
            fut.set_result(tensor)

    def flush(self) -> None:
        """Finish every bucket in flight."""
        with self.lock:
            self._settle(drain=True)


_STATES: "weakref.WeakKeyDictionary[Communicator, HookState]" = weakref.WeakKeyDictionary()


def _state_of(state) -> HookState:
    if isinstance(state, HookState):
        return state
    comm = state.comm if isinstance(state, ProcessGroupMpccs) else state
    if not isinstance(comm, Communicator):
        comm = getattr(state, "comm", None)
    if not isinstance(comm, Communicator):
        raise TypeError(
            "allreduce_hook state must be a mpccs.torch.HookState, a Communicator, an mpccs process group "
            f"or carry one in .comm; got {type(state).__name__}"
        )
    found = _STATES.get(comm)
    if found is None:
        found = _STATES[comm] = HookState(comm)
    return found


def allreduce_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the gradient bucket over the ranks with mpccs.

    ``ddp.register_comm_hook(state, mpccs.torch.allreduce_hook)`` where state is
    a :class:`HookState`, a Communicator, or an mpccs process group; the DDP
    process group may be any backend (gloo for bookkeeping, say). The
    Communicator's ranks must be the DDP group's, in the same order.
    """
    st = _state_of(state)
    tensor = bucket.buffer()
    fut = torch.futures.Future()
    staged = _stage(tensor, direct=st.comm.gpu_direct)
    with st.lock:
        try:
            work = st.comm.all_reduce(_reducible(staged, "allreduce_hook"), op=st.op, async_op=True)
        except BaseException as exc:  # noqa: BLE001
            fut.set_exception(exc)
            return fut
        st.pending.append((work, fut, tensor, staged))
        st.buckets += 1
        st.bytes += staged.array.nbytes
        st.max_in_flight = max(st.max_in_flight, len(st.pending))
        st._settle(drain=not st.overlap or bucket.is_last())
    return fut


# DDP compares the return annotation with the object itself (not a string, as
# `from __future__ import annotations` would leave it).
allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def hook_state(group=None, *, overlap: bool = True, comm: Optional[Communicator] = None, **options) -> HookState:
    """A HookState over ``comm``, or over a new Communicator for ``group`` (collective call)."""
    if comm is None:
        if dist.is_initialized():
            pg = group if group is not None else dist.group.WORLD
            comm = pg.comm if isinstance(pg, ProcessGroupMpccs) else new_communicator(group, **options)
        else:
            raise RuntimeError("mpccs.torch.hook_state: call init_process_group first, or pass comm=")
    return HookState(comm, overlap=overlap)


register()
