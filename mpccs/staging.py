"""Device (cupy) arrays: GPU-direct calls, pinned host mirrors, reductions on the device.

Where cupy sees a GPU on every rank, the planes open UCX's cuda transports
(GPU-direct, comm.plane_settings) and a large enough call hands its device
arrays to the DAG engine as they are (DirectCall: nothing to stage). Otherwise
the planes read host memory (shared memory and tcp here, RDMA verbs without
GPUDirect) and a device array reaches them through a pinned (page-locked) host
mirror: the copy engines move it at PCIe rate without a bounce through a
driver buffer, and cupy's pinned pool caches the blocks, so a mirror is a pool
lookup after the first call of a size.

Collectives that only move data (all_gather, all_to_all(v), broadcast,
send/recv) run on the mirrors as they are: inputs copied device -> host before
any byte moves, outputs host -> device when the operation completes.

Reductions (all_reduce, reduce_scatter, reduce) are reduced on the device, so
the host CPU, which the planes need, does no arithmetic: a reduce-scatter as
an all-to-all of blocks (on the mirrors, or GPU-direct on the arrays), the p blocks each rank receives
copied to the device and combined there in rank order, then an all-gather
(all_reduce) or a gather to the root (reduce) of the reduced blocks. Both host
steps are ordinary multipath collectives; the bytes per rank are the ring's,
2 (p - 1) / p of the buffer. Combining in rank order makes the result the same
on every rank and under every path policy; float16 is combined in float32
and rounded once per hop, as on the host (mpccs.reduce).

A mirror goes back to the pool only after the copy into the device has
finished (the stream is synchronised), so a later call never overwrites bytes
a copy is still reading. The copies are outside the planes' windows and the
same whichever plane carries a byte, so they do not bear on the split; their
bytes and seconds are in the operation's stats (``staging``).

The algorithm takes its array module as a backend: cupy on a GPU, numpy in
the CPU tests, which run the same steps in real processes. Nothing imports
cupy where it is not installed; where it is, init asks it whether a GPU is
there (gpu_direct 'auto'), and device arrays bring it in.
"""
from __future__ import annotations

import contextlib
import importlib.util
import time
from typing import Callable, Iterable, Optional

import numpy as np

from .errors import ConfigError
from .reduce import SUPPORTED_DTYPE_NAMES, finish_avg, is_supported_dtype

_UFUNC = {"sum": "add", "avg": "add", "prod": "multiply", "min": "minimum", "max": "maximum"}


def is_device_array(arr) -> bool:
    """A cupy array (checked by type, so numpy-only processes never import cupy)."""
    return type(arr).__module__.startswith("cupy")


def any_on_device(*arrays) -> bool:
    """On every public call: numpy arrays answer with one type check (the 8-byte
    all_reduce is ~20 us, and a generator over the arguments cost 1.5 of them)."""
    for a in arrays:
        if a is not None and type(a) is not np.ndarray and type(a).__module__.startswith("cupy"):
            return True
    return False


# ---------------------------------------------------------------------------
# GPU-direct planes
# ---------------------------------------------------------------------------
def gpu_visible() -> bool:
    """cupy is installed and sees a GPU (cupy is not imported where it is not installed)."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device, a broken install: all mean "no GPU here"
        return False


def offers_gpu_direct(mode: str) -> bool:
    """This rank's offer of planes that read device memory (config.GPU_DIRECT_MODES).
    Offering creates the current device's CUDA context, which UCX's cuda transports
    look for when the planes open; under 'auto' a GPU that cannot give one (held
    by another process in exclusive mode, say) means no offer."""
    if mode == "off":
        return False
    problem = None if gpu_visible() else "cupy sees no GPU here"
    if problem is None:
        try:
            _make_cuda_context()
        except Exception as exc:  # a CUDA error: the device is there but unusable
            problem = f"no CUDA context on the current device ({type(exc).__name__}: {exc})"
    if problem is not None and mode == "on":
        raise ConfigError(f"gpu_direct='on' (MPCCS_GPU_DIRECT=1) but {problem}; "
                          "use 'auto' or 'off', or install cupy on a GPU machine")
    return problem is None


def _make_cuda_context() -> None:
    import cupy

    cupy.zeros(1, cupy.uint8)
    sync_current_stream()


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------
def check_device_arrays(arrays: dict, *, any_dtype: bool = False) -> int:
    """Validate a call's arrays when one of them is on the device; return the device id.

    All of them must be cupy arrays on one device: a host array beside a device
    one, or two devices, would need a copy the caller did not ask for.
    """
    named = {name: a for name, a in arrays.items() if a is not None}
    device_names = [n for n, a in named.items() if is_device_array(a)]
    host_names = [n for n in named if n not in device_names]
    if host_names:
        raise TypeError(f"{host_names[0]} is a {type(named[host_names[0]]).__name__} but "
                        f"{device_names[0]} is a device array: pass both on the same device")
    devices = {n: int(a.device.id) for n, a in named.items()}
    first = device_names[0]
    for name, dev in devices.items():
        if dev != devices[first]:
            raise ValueError(f"{name} is on GPU {dev} but {first} is on GPU {devices[first]}: "
                             f"pass every array of a call on one device")
    for name, a in named.items():
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (use cupy.ascontiguousarray)")
        if not any_dtype and not is_supported_dtype(a.dtype):  # point-to-point moves bytes of any dtype
            names = ", ".join(SUPPORTED_DTYPE_NAMES)
            raise TypeError(f"{name}: dtype {a.dtype} is not supported; supported: {names}")
    return devices[first]


# ---------------------------------------------------------------------------
# array backends: where "device" arrays live and how mirrors are made
# ---------------------------------------------------------------------------
class CupyBackend:
    """Device arrays in GPU memory, mirrors in pinned host memory."""

    name = "cupy"

    def __init__(self, device_id: int):
        import cupy

        self.xp = cupy
        self.device_id = device_id

    def scope(self):
        return self.xp.cuda.Device(self.device_id)

    def mirror(self, dtype, count: int) -> np.ndarray:
        if count == 0:
            return np.empty(0, dtype)
        mem = self.xp.cuda.alloc_pinned_memory(count * np.dtype(dtype).itemsize)
        return np.frombuffer(mem, dtype, count)

    def to_host(self, dev, mirror: np.ndarray) -> None:
        dev.get(out=mirror)  # blocking, ordered after the caller's kernels on this stream

    def to_device(self, mirror: np.ndarray, dev) -> None:
        dev.set(mirror)

    def empty(self, dtype, count: int):
        return self.xp.empty(count, dtype)

    def sync(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()


class NumpyBackend:
    """The same steps on host arrays: what the CPU tests run."""

    name = "numpy"
    xp = np
    device_id = -1

    def scope(self):
        return contextlib.nullcontext()

    def mirror(self, dtype, count: int) -> np.ndarray:
        return np.empty(count, dtype)

    def to_host(self, dev, mirror: np.ndarray) -> None:
        np.copyto(mirror, dev)

    def to_device(self, mirror: np.ndarray, dev) -> None:
        np.copyto(dev, mirror)

    def empty(self, dtype, count: int):
        return np.empty(count, dtype)

    def sync(self) -> None:
        pass


def backend_for(arrays: dict, *, any_dtype: bool = False):
    return CupyBackend(check_device_arrays(arrays, any_dtype=any_dtype))


def sync_current_stream() -> None:
    """Let the kernels queued on the current stream finish: the planes' copies
    of device memory run on UCX's own streams, so a buffer a kernel is still
    writing must be done before its bytes are handed to them."""
    import cupy

    cupy.cuda.get_current_stream().synchronize()


class Copies:
    """Bytes and seconds of the copies between device and mirrors (the ``staging`` stats)."""

    def __init__(self, backend, reduced_on: str, direct: bool = False):
        self.backend = backend
        self.reduced_on = reduced_on
        self.direct = direct  # GPU-direct planes: no mirrors, nothing copied
        self.d2h_bytes = self.h2d_bytes = 0
        self.d2h_s = self.h2d_s = 0.0

    def to_host(self, dev, mirror) -> None:
        if mirror.size:
            t0 = time.perf_counter()
            self.backend.to_host(dev, mirror)
            self.d2h_s += time.perf_counter() - t0
            self.d2h_bytes += mirror.nbytes

    def to_device(self, mirror, dev) -> None:
        if mirror.size:
            t0 = time.perf_counter()
            self.backend.to_device(mirror, dev)
            self.h2d_s += time.perf_counter() - t0
            self.h2d_bytes += mirror.nbytes

    def settle(self) -> None:
        """Wait for the copies into the device: then the mirrors may go back to the pool."""
        t0 = time.perf_counter()
        self.backend.sync()
        self.h2d_s += time.perf_counter() - t0

    def report(self) -> dict:
        memory = "device" if self.direct else "pinned host" if self.backend.name == "cupy" else "host"
        return {"memory": memory,
                "device": self.backend.device_id, "reduced_on": self.reduced_on,
                "d2h_bytes": self.d2h_bytes, "d2h_s": self.d2h_s,
                "h2d_bytes": self.h2d_bytes, "h2d_s": self.h2d_s}


# ---------------------------------------------------------------------------
# data-movement collectives: the call itself on mirrors
# ---------------------------------------------------------------------------
class StagedCall:
    """One call's device arrays and their mirrors: inputs loaded now, outputs written back at finish()."""

    def __init__(self, arrays: dict, *, loads: Iterable[str], outputs: Iterable[str], any_dtype: bool = False):
        backend = backend_for(arrays, any_dtype=any_dtype)
        self.copies = Copies(backend, reduced_on="-")
        xp = backend.xp
        # point-to-point moves bytes: a uint8 view travels whatever the dtype
        self._device = {n: a.reshape(-1).view(xp.uint8) if any_dtype else a.reshape(-1)
                        for n, a in arrays.items() if a is not None}
        self.outputs = [n for n in outputs if n in self._device]
        self.host: dict[str, Optional[np.ndarray]] = {n: None for n in arrays}
        with backend.scope():
            self._mirror_all(backend)
            loaded = set()
            for name in loads:
                if name in self._device and id(self.host[name]) not in loaded:
                    loaded.add(id(self.host[name]))
                    self.copies.to_host(self._device[name], self.host[name])

    def _mirror_all(self, backend) -> None:
        """One mirror per distinct device buffer: an in-place call (recv is send) shares one."""
        by_span: dict = {}
        for name, a in self._device.items():
            span = (a.data.ptr, a.nbytes, a.dtype.str)
            if span not in by_span:
                by_span[span] = backend.mirror(a.dtype, a.size)
            self.host[name] = by_span[span]

    def finish(self) -> None:
        """Copy the outputs back to the device, then let the mirrors go (DeviceWork calls it once)."""
        with self.copies.backend.scope():
            for name in self.outputs:
                self.copies.to_device(self.host[name], self._device[name])
            self.copies.settle()
        self.host = {}

    def report(self) -> dict:
        return self.copies.report()


class DirectCall:
    """A data-movement call whose device arrays the planes read and write
    themselves (GPU-direct): nothing to stage, only the stats note."""

    def __init__(self, backend):
        self.copies = Copies(backend, reduced_on="-", direct=True)

    def finish(self) -> None:
        pass

    def report(self) -> dict:
        return self.copies.report()


# ---------------------------------------------------------------------------
# reductions on the device
# ---------------------------------------------------------------------------
def combine(xp, acc, x, op: str) -> None:
    """acc = op(acc, x) on the device; float16 in float32, rounded once (as mpccs.reduce)."""
    ufunc = getattr(xp, _UFUNC[op])
    if acc.dtype == np.float16:
        acc[...] = ufunc(acc.astype(np.float32), x.astype(np.float32)).astype(np.float16)
    else:
        ufunc(acc, x, out=acc)


def reduce_blocks(xp, blocks, op: str, out) -> None:
    """out = blocks[0] op blocks[1] op ... in rank order: the same bits on every rank."""
    out[...] = blocks[0]
    for r in range(1, blocks.shape[0]):
        combine(xp, out, blocks[r], op)


def device_avg(xp, buf, world: int) -> None:
    """sum / world as mpccs.reduce.finish_avg: float32 (or wider), rounded once."""
    if xp is np:
        finish_avg(buf, world)
    elif buf.dtype.itemsize < 4:
        buf[...] = (buf.astype(np.float32) / world).astype(buf.dtype)
    else:
        xp.divide(buf, world, out=buf)


class DeviceReduction:
    """all_reduce / reduce_scatter / reduce with the arithmetic on the device.

    ``run_host(name, *args)`` starts a host collective on the communicator and
    returns its Work; the first step (all_to_all) is waited for here, the
    second (all_gather / gather) is returned in flight: every rank issues the
    two steps back to back, in the order of its calls, so sequence numbers
    agree without any bookkeeping across operations.
    """

    def __init__(self, backend, kind: str, send, out, op: str, rank: int, size: int, root: Optional[int],
                 run_host: Callable, direct: bool = False):
        self.backend, self.kind, self.op = backend, kind, op
        self.rank, self.size, self.root = rank, size, root
        # direct: the planes read device memory (GPU-direct), so both steps run on
        # device buffers and nothing crosses PCIe (start_direct)
        self.direct = direct
        self.copies = Copies(backend, reduced_on=backend.name, direct=direct)
        self._run_host = run_host
        self._out = out  # device array written at finish (None: a non-root rank of reduce)
        self._send = send
        n = send.size if kind != "reduce_scatter" else send.size // size
        self.block = n if kind == "reduce_scatter" else -(-n // size)  # ceil: the last block is padded
        self.count = send.size
        self._tail: Optional[np.ndarray] = None

    def start(self):
        """Run the reduce-scatter, start the second step; returns the host Work last started."""
        if self.direct:
            with self.backend.scope():
                return self._start_direct()
        be, p, b = self.backend, self.size, self.block
        with be.scope():
            h_send = be.mirror(self._send.dtype, p * b)
            self.copies.to_host(self._send, h_send[:self.count])
            h_send[self.count:] = 0  # the padding of the last block: never reaches an output
            h_blocks = be.mirror(self._send.dtype, p * b)
            first = self._run_host("all_to_all", h_send, h_blocks)
            first.wait()
            d_blocks = be.empty(self._send.dtype, p * b)
            self.copies.to_device(h_blocks, d_blocks)
            part = self._reduced_part(d_blocks)
            if self.kind == "reduce_scatter":
                be.sync()  # the result is in place on the device: nothing follows
                return first
            h_part = be.mirror(self._send.dtype, b)
            self.copies.to_host(part, h_part)
            self._tail = be.mirror(self._send.dtype, self._tail_count())
            return self._second_step(h_part)

    def _reduced_part(self, blocks):
        """This rank's block: the p blocks it received combined in rank order (avg divided once)."""
        part = self._out if self.kind == "reduce_scatter" else self.backend.empty(self._send.dtype, self.block)
        reduce_blocks(self.backend.xp, blocks.reshape(self.size, self.block), self.op, part)
        if self.op == "avg":
            device_avg(self.backend.xp, part, self.size)
        return part

    def _tail_count(self) -> int:
        """Elements the second step gathers here: every block (all_reduce, the root of reduce) or none."""
        return self.size * self.block if self.kind == "all_reduce" or self.rank == self.root else 0

    def _second_step(self, part):
        """All-gather (all_reduce) or gather to the root (reduce) of ``part`` into self._tail."""
        if self.kind == "all_reduce":
            return self._run_host("all_gather", part, self._tail)
        b, p = self.block, self.size
        counts_out = [b if j == self.root else 0 for j in range(p)]
        counts_in = [b] * p if self.rank == self.root else [0] * p
        return self._run_host("all_to_allv", part, counts_out, self._tail, counts_in)

    def _start_direct(self):
        """The same two steps on device buffers: the planes read and write them.
        Where the count fills the p blocks exactly, the input is the first step's
        send buffer and the output the second step's receive buffer (no copy)."""
        be, p, b = self.backend, self.size, self.block
        dtype = self._send.dtype
        if self.kind == "reduce_scatter" or self.count == p * b:
            d_send = self._send
        else:
            d_send = be.empty(dtype, p * b)
            d_send[:self.count] = self._send
            d_send[self.count:] = 0  # the padding of the last block: never reaches an output
        d_blocks = be.empty(dtype, p * b)
        be.sync()  # the caller's kernels (and the padding) are done before the planes read
        first = self._run_host("all_to_all", d_send, d_blocks)
        first.wait()
        part = self._reduced_part(d_blocks)
        be.sync()  # the reduced block is written before it is sent (or returned)
        if self.kind == "reduce_scatter":
            return first
        whole = self._out is not None and self.count == p * b
        self._tail = self._out if whole else be.empty(dtype, self._tail_count())
        return self._second_step(part)

    def finish(self) -> None:
        """Write the gathered blocks into the output (DeviceWork calls it once)."""
        if self.direct:
            if self._tail is not None and self._out is not None and self._tail is not self._out:
                with self.backend.scope():
                    self._out[...] = self._tail[:self.count]  # device to device
                    self.backend.sync()
            self._tail = None
            return
        if self._tail is not None and self._out is not None:
            with self.backend.scope():
                self.copies.to_device(self._tail[:self.count], self._out)
                self.copies.settle()
        self._tail = None

    def report(self) -> dict:
        return dict(self.copies.report(), algorithm="device reduce-scatter (all_to_all) + "
                    + {"all_reduce": "all_gather", "reduce": "gather", "reduce_scatter": "-"}[self.kind])


class DeviceWork:
    """A device-array operation in flight: the host operation on the mirrors,
    then ``staged.finish()`` (done by whichever of wait / is_completed sees it end)."""

    def __init__(self, comm, host_work, staged, result):
        self._comm = comm
        self._host_work = host_work
        self._staged = staged
        self._result = result
        self._finished = False

    def wait(self, timeout: Optional[float] = None):
        self._host_work.wait(timeout)
        self._finish()
        return self._result

    def is_completed(self) -> bool:
        if not self._host_work.is_completed():
            return False
        if self._host_work.exception() is None:
            self._finish()
        return True

    @property
    def _op(self):
        """The last host operation (a device reduction's second step): its stats record is the call's."""
        return self._host_work._op

    def stats(self) -> dict:
        return dict(self._host_work.stats(), staging=self._staged.report())

    def exception(self) -> Optional[BaseException]:
        return self._host_work.exception()

    def _finish(self) -> None:
        """The copies back and the stats note, once, whichever of wait / is_completed comes first."""
        if self._finished:
            return
        self._finished = True
        self._staged.finish()
        self._comm._annotate_last_stats(self._host_work, staging=self._staged.report())
