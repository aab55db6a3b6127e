"""The one place that imports ucxx.

ucxx sets UCX_RNDV_THRESH and UCX_MEMTYPE_CACHE on import; we only silence
UCX's unused-variable warning (each plane passes its settings through its own
context configuration, never through process-wide UCX_* variables). ucxx must
be imported before mpi4py (pip mpich ships a different UCX): importing it
here, first, from mpccs.transports keeps that order for every entry point.
"""
import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

UCXError = ucx_api.UCXError
UCXCanceledError = ucx_api.UCXCanceledError


def ucx_version() -> str:
    return ".".join(str(x) for x in ucx_api.get_ucx_version())


def ucxx_version() -> str:
    import ucxx

    return getattr(ucxx, "__version__", "unknown")
