"""Collective algorithms as coflow DAGs (pure functions, no I/O).

``build_schedule(collective, world, count, algorithm=...)`` returns a
:class:`Schedule`; ``ALGORITHMS`` lists the algorithm names per collective;
``default_algorithm`` is the fallback choice; ``describe``/``to_dot`` render
a plan; ``execute`` is the numpy reference executor and ``check_schedule``
the static checker the engine and simulator are validated against;
``resumable_in_place`` says when an in-place retry needs no input copy.
"""
from .interpret import (
    buffer_counts,
    check_hazards,
    check_schedule,
    check_structure,
    execute,
    execute_async,
    merge_local_schedules,
    reference,
)
from .plan import describe, to_dot
from .registry import ALGORITHMS, build_schedule, default_algorithm
from .resume import resumable_in_place
from .schedule import BUFFERS, COLLECTIVES, Flow, LocalCopy, Schedule, Stage, Topology
from ._builder import MAX_FLOW_ID, REMOTE_OFFSET

__all__ = [
    "ALGORITHMS",
    "BUFFERS",
    "COLLECTIVES",
    "Flow",
    "LocalCopy",
    "MAX_FLOW_ID",
    "REMOTE_OFFSET",
    "Schedule",
    "Stage",
    "Topology",
    "buffer_counts",
    "build_schedule",
    "check_hazards",
    "check_schedule",
    "check_structure",
    "default_algorithm",
    "describe",
    "execute",
    "execute_async",
    "merge_local_schedules",
    "reference",
    "resumable_in_place",
    "to_dot",
]
