"""Exception types. Every failure names what a user needs to find the fault:
the rank that saw it and, where known, the plane, peer, operation and stage."""
from __future__ import annotations


class MpccsError(RuntimeError):
    """Base class of every error mpccs raises at run time."""

    # The communicator's other ranks already know (the error came from a
    # peer's abort, or an abort was sent before raising it): when it aborts the
    # communicator, the communicator does not tell them again.
    peers_told = False
    lost_ranks: tuple = ()  # ranks found gone: nothing can be told to them


class ConfigError(MpccsError, ValueError):
    """A setting (plane name, transport list, policy, tuning string) is invalid."""


class RendezvousError(MpccsError):
    """Ranks could not find each other (missing variable, timeout, wrong token)."""


class TransportError(MpccsError):
    """A plane failed while an operation used it."""

    def __init__(self, message: str, *, rank=None, plane=None, peer=None, op=None, stage=None):
        self.rank, self.plane, self.peer, self.op, self.stage = rank, plane, peer, op, stage
        self.message = message
        where = ", ".join(
            f"{k}={v}"
            for k, v in (("rank", rank), ("plane", plane), ("peer", peer), ("op", op), ("stage", stage))
            if v is not None
        )
        super().__init__(f"{message} ({where})" if where else message)


class PlaneFailure(TransportError):
    """One plane stopped working under an operation; another may take over."""


class OperationTimeout(TransportError):
    """No progress on an operation for longer than its timeout."""


class MismatchError(MpccsError, ValueError):
    """Ranks called operations that do not match (size, dtype, op, root, collective)."""


class ProtocolError(TransportError):
    """A chunk or control message did not fit the operation it claimed."""


class CommunicatorAborted(MpccsError):
    """The communicator was aborted after an unrecoverable failure."""
