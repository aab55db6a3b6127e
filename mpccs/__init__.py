"""mpccs: one collective over the scale-up fabric and the scale-out network at once.

    import mpccs, numpy as np
    comm = mpccs.init()                 # env://, mpirun/mpiexec, Slurm or a single rank
    x = np.ones(1 << 20, np.float32)
    comm.all_reduce(x)                  # in place, over both planes
    print(comm.last_stats()["bytes_per_plane"])
"""
from .transports import ucx as _ucx  # noqa: F401  (ucxx before mpi4py, always)

from .comm import Communicator, Work, init
from .errors import (
    CommunicatorAborted,
    ConfigError,
    MismatchError,
    MpccsError,
    OperationTimeout,
    ProtocolError,
    RendezvousError,
    TransportError,
)
from .hostmem import empty
from .reduce import OPS

__version__ = "0.1.0"
ReduceOp = OPS

__all__ = [
    "Communicator", "Work", "init", "empty", "OPS", "ReduceOp", "__version__",
    "MpccsError", "ConfigError", "RendezvousError", "TransportError", "OperationTimeout",
    "MismatchError", "ProtocolError", "CommunicatorAborted",
]
