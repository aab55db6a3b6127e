"""Rendezvous: who am I, how many are we, where is the store.

Launchers are recognised in this order:
  1. ``env://`` variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; set by
     ``mpccs-run``, ``mpccs-testbed`` and torchrun). The job token comes from
     MPCCS_JOB_TOKEN; without it the store runs unauthenticated, with a warning.
  2. Open MPI (OMPI_COMM_WORLD_*), MPICH hydra (PMI_RANK/PMI_SIZE), Slurm
     (SLURM_PROCID/SLURM_NTASKS): rank 0 starts the store and broadcasts its
     address and a random token through MPI (mpi4py), unless MASTER_ADDR and
     MASTER_PORT are set, in which case those are used as under env://.
  3. Nothing at all: a world of one rank (like an MPI singleton).
"""
from __future__ import annotations

import os
import secrets
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Optional

from .errors import RendezvousError
from .store import StoreClient, StoreServer

_MPI_RANK_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "openmpi"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "mpich"),
    ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "pmix"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "slurm"),
)


@dataclass
class Bootstrap:
    rank: int
    size: int
    local_rank: Optional[int]  # None when the launcher did not say; derived from host names later
    launcher: str
    store: Optional[StoreClient]
    server: Optional[StoreServer]
    token: str
    job_file: Optional[str] = None  # rank 0 removes the rendezvous file it wrote

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.server is not None:
            self.server.close()
        if self.job_file is not None:
            try:
                os.unlink(self.job_file)
            except FileNotFoundError:
                pass


def _int_var(environ, name: str) -> int:
    try:
        return int(environ[name])
    except KeyError:
        raise RendezvousError(f"environment variable {name} is not set") from None
    except ValueError:
        raise RendezvousError(f"environment variable {name}={environ[name]!r} is not an integer") from None


def _check_rank(rank: int, size: int) -> None:
    if size < 1:
        raise RendezvousError(f"world size {size} must be at least 1")
    if not 0 <= rank < size:
        raise RendezvousError(f"rank {rank} is out of range for world size {size}")


def _optional_int(environ, name: Optional[str]) -> Optional[int]:
    if name and name in environ:
        try:
            return int(environ[name])
        except ValueError:
            return None
    return None


def _store_host_for_binding(addr: str) -> str:
    """The store binds to the MASTER_ADDR interface only, never to all interfaces."""
    try:
        return socket.gethostbyname(addr)
    except OSError:
        raise RendezvousError(f"MASTER_ADDR={addr!r} does not resolve") from None


def _start_or_join(rank, size, addr, port, token, timeout_s):
    server = None
    if rank == 0:
        try:
            server = StoreServer(_store_host_for_binding(addr), port, token)
        except OSError as exc:
            raise RendezvousError(f"rank 0 cannot listen on {addr}:{port}: {exc}") from None
    client = StoreClient(addr, port, token, timeout_s)
    return client, server


def _from_env(environ, timeout_s: float, launcher: str = "env") -> Bootstrap:
    rank, size = _int_var(environ, "RANK"), _int_var(environ, "WORLD_SIZE")
    _check_rank(rank, size)
    local_rank = _optional_int(environ, "LOCAL_RANK")
    if size == 1 and "MASTER_ADDR" not in environ:
        return Bootstrap(rank, size, 0, launcher, None, None, "")
    addr = environ.get("MASTER_ADDR") or _raise_missing("MASTER_ADDR")
    port = _int_var(environ, "MASTER_PORT")
    token = environ.get("MPCCS_JOB_TOKEN", "")
    if not token and rank == 0:
        warnings.warn(
            "mpccs: MPCCS_JOB_TOKEN is not set; the rendezvous store runs unauthenticated",
            RuntimeWarning, stacklevel=3,
        )
    client, server = _start_or_join(rank, size, addr, port, token, timeout_s)
    return Bootstrap(rank, size, local_rank, launcher, client, server, token)


def _raise_missing(name: str):
    raise RendezvousError(f"environment variable {name} is not set")


def _from_mpi(environ, rank_var, size_var, local_var, launcher, timeout_s) -> Bootstrap:
    rank, size = _int_var(environ, rank_var), _int_var(environ, size_var)
    _check_rank(rank, size)
    local_rank = _optional_int(environ, local_var)
    if "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
        env = dict(environ, RANK=str(rank), WORLD_SIZE=str(size))
        if local_rank is not None:
            env["LOCAL_RANK"] = str(local_rank)
        return _from_env(env, timeout_s, launcher)
    if size == 1:
        return Bootstrap(rank, size, 0, launcher, None, None, "")
    if launcher in ("openmpi", "pmix") and not _mpi4py_matches("Open MPI"):
        return _from_job_file(environ, rank, size, local_rank, launcher, timeout_s)
    # Broadcast the store address through MPI. ucxx is imported first (pip
    # mpich ships its own UCX; the other order fails to load).
    from .transports import ucx  # noqa: F401

    try:
        from mpi4py import MPI
    except ImportError:
        raise RendezvousError(
            f"launched by {launcher} (found {rank_var}) but neither MASTER_ADDR/MASTER_PORT is set "
            f"nor mpi4py installed; install the 'mpi' extra (pip install 'mpccs[mpi]') or set MASTER_ADDR and MASTER_PORT"
        ) from None
    world = MPI.COMM_WORLD
    hosts = world.allgather(socket.gethostname())
    server = None
    info = None
    if rank == 0:
        token = secrets.token_hex(16)
        host = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(socket.gethostname())
        try:
            server = StoreServer(host, 0, token)
            info = (server.host, server.port, token)
        except OSError as exc:
            info = ("error", str(exc), "")
    info = world.bcast(info, root=0)
    if info[0] == "error":
        raise RendezvousError(f"rank 0 could not start the rendezvous store: {info[1]}")
    host, port, token = info
    client = StoreClient(host, port, token, timeout_s)
    return Bootstrap(rank, size, local_rank, launcher, client, server, token)


def _mpi4py_matches(library: str) -> bool:
    """Is an importable mpi4py built against this MPI library? (Checked without MPI_Init.)

    The 'mpi' extra brings mpi4py on pip's MPICH; under Open MPI's mpirun that
    MPICH aborts the process inside MPI_Init, so it must not be initialised.
    """
    from .transports import ucx  # noqa: F401  (ucxx before mpi4py)

    try:
        import mpi4py

        mpi4py.rc.initialize = False
        from mpi4py import MPI

        return library in MPI.Get_library_version()
    except Exception:  # no mpi4py, or one that cannot load
        return False


def _from_job_file(environ, rank, size, local_rank, launcher, timeout_s) -> Bootstrap:
    """Rendezvous through a file named after the launcher's job id, for one-host jobs.

    Used under Open MPI when no matching mpi4py is there to broadcast the store
    address: rank 0 starts the store on loopback and writes its address and a
    random token to a 0600 file; the others read it.
    """
    local_size = _optional_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
    if local_size != size:
        raise RendezvousError(
            f"launched by {launcher} across several hosts without MASTER_ADDR/MASTER_PORT and without an mpi4py "
            f"built for Open MPI: set MASTER_ADDR and MASTER_PORT (and MPCCS_JOB_TOKEN) for every rank"
        )
    job = environ.get("PMIX_NAMESPACE") or environ.get("OMPI_MCA_ess_base_jobid")
    if not job:
        raise RendezvousError(f"launched by {launcher} but no job id (PMIX_NAMESPACE) to rendezvous on")
    path = os.path.join(tempfile.gettempdir(), f"mpccs-job-{os.getuid()}-{job}.addr")
    server = None
    if rank == 0:
        token = secrets.token_hex(16)
        server = StoreServer("127.0.0.1", 0, token)
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{server.port} {token}")
        os.replace(path + ".tmp", path)  # atomic: readers never see half a file
    port, token = _read_job_file(path, timeout_s)
    client = StoreClient("127.0.0.1", port, token, timeout_s)
    return Bootstrap(rank, size, local_rank, launcher, client, server, token, path if rank == 0 else None)


def _read_job_file(path: str, timeout_s: float) -> tuple[int, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as fh:
                port, token = fh.read().split()
            return int(port), token
        except (FileNotFoundError, ValueError):
            if time.monotonic() > deadline:
                raise RendezvousError(f"rank 0 never published the rendezvous address in {path}") from None
            time.sleep(0.02)


def rendezvous(environ=None, timeout_s: float = 60.0) -> Bootstrap:
    environ = os.environ if environ is None else environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _from_env(environ, timeout_s, "mpccs-run" if environ.get("MPCCS_RUN") else "env")
    for rank_var, size_var, local_var, launcher in _MPI_RANK_VARS:
        if rank_var in environ and size_var in environ:
            return _from_mpi(environ, rank_var, size_var, local_var, launcher, timeout_s)
    return Bootstrap(0, 1, 0, "singleton", None, None, "")


def hostname() -> str:
    return os.environ.get("MPCCS_HOSTNAME") or socket.gethostname()


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (a launcher's binding,
    a container's cpuset), or the machine's count where there is none."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1
