"""Which algorithms exist, building a schedule by name, and the fallback choice.

:func:`build_schedule` validates its arguments and dispatches to a builder.
:func:`default_algorithm` is the *fallback rule* used when nothing better is
known; the tuner in ``mpccs.control`` refines it from measurements.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from ._builder import Spec, pow2_floor
from .alltoall import all_to_all_pairwise, all_to_allv_pairwise
from .hierarchical import all_gather_hierarchical, all_reduce_hierarchical, equal_domains, reduce_scatter_hierarchical
from .pipeline import broadcast_pipeline, reduce_pipeline
from .rhd import all_gather_rd, all_reduce_rhd, reduce_scatter_rhd
from .ring import all_gather_ring, all_reduce_ring, reduce_scatter_ring
from .schedule import COLLECTIVES, Schedule, Topology
from .tree import all_reduce_rd, all_reduce_tree, broadcast_tree, reduce_tree

_BUILDERS: dict[str, dict[str, Callable[[Spec], Schedule]]] = {
    "all_reduce": {
        "ring": all_reduce_ring,
        "rhd": all_reduce_rhd,
        "rd": all_reduce_rd,
        "tree": all_reduce_tree,
        "hierarchical": all_reduce_hierarchical,
    },
    "reduce_scatter": {"ring": reduce_scatter_ring, "rhd": reduce_scatter_rhd, "hierarchical": reduce_scatter_hierarchical},
    "all_gather": {"ring": all_gather_ring, "rd": all_gather_rd, "hierarchical": all_gather_hierarchical},
    "all_to_all": {"pairwise": all_to_all_pairwise},
    "all_to_allv": {"pairwise": all_to_allv_pairwise},
    "broadcast": {"pipeline": broadcast_pipeline, "tree": broadcast_tree},
    "reduce": {"pipeline": reduce_pipeline, "tree": reduce_tree},
}

ALGORITHMS: dict[str, tuple[str, ...]] = {coll: tuple(algos) for coll, algos in _BUILDERS.items()}
assert set(ALGORITHMS) == set(COLLECTIVES)


def build_schedule(
    collective: str,
    world: int,
    count: int,
    *,
    algorithm: str,
    topology: Optional[Topology] = None,
    channels: int = 1,
    root: int = 0,
    send_counts: Optional[Sequence[int]] = None,
    recv_counts: Optional[Sequence[int]] = None,
    rank: Optional[int] = None,
    segments: Optional[int] = None,
) -> Schedule:
    """The coflow DAG of one collective; see each builder module for the algorithm.

    ``count`` is per rank as the collective's API defines it (ignored for
    all_to_allv, which takes this ``rank``'s ``send_counts``/``recv_counts``
    and builds that rank's local view). ``segments`` applies to pipeline
    algorithms (per channel). Raises ValueError on any invalid argument.
    """
    if collective not in _BUILDERS:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    builders = _BUILDERS[collective]
    if algorithm not in builders:
        raise ValueError(f"unknown algorithm {algorithm!r} for {collective}; valid: {', '.join(builders)}")
    _check_int("world", world, 1)
    _check_int("channels", channels, 1)
    topology = Topology.flat(world) if topology is None else topology
    if topology.world != world:
        raise ValueError(f"topology has {topology.world} ranks, world is {world}")
    if collective in ("broadcast", "reduce") and not (isinstance(root, int) and 0 <= root < world):
        raise ValueError(f"root must be a rank in [0, {world}), got {root!r}")
    if segments is not None:
        _check_int("segments", segments, 1)
    if collective == "all_to_allv":
        sends, recvs = _check_v_args(world, send_counts, recv_counts, rank)
        spec = Spec(collective, algorithm, world, sum(sends), topology, channels, root, sends, recvs, rank, segments)
    else:
        _check_int("count", count, 0)
        spec = Spec(collective, algorithm, world, count, topology, channels, root, rank=rank, segments=segments)
    return builders[algorithm](spec)


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_v_args(world, send_counts, recv_counts, rank):
    if send_counts is None or recv_counts is None or rank is None:
        raise ValueError("all_to_allv needs send_counts, recv_counts and rank")
    sends, recvs = tuple(send_counts), tuple(recv_counts)
    for name, counts in (("send_counts", sends), ("recv_counts", recvs)):
        if len(counts) != world:
            raise ValueError(f"{name} must have {world} entries, got {len(counts)}")
        for c in counts:
            _check_int(f"each of {name}", c, 0)
    _check_int("rank", rank, 0)
    if rank >= world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if sends[rank] != recvs[rank]:
        raise ValueError(f"rank {rank} sends {sends[rank]} elements to itself but expects {recvs[rank]}")
    return sends, recvs


# -- fallback choice -----------------------------------------------------------
SMALL_BYTES = 64 * 1024  # below: latency-bound; few steps beat little traffic
MEDIUM_BYTES = 1024 * 1024  # below: rhd's lg p steps still pay off over ring's p


def default_algorithm(collective: str, world: int, nbytes: int, topology: Optional[Topology] = None) -> str:
    """The fallback rule (the tuner refines it from measurements).

    ``nbytes`` is the byte size of ``count`` elements, count as the API
    defines it. With T the bytes each rank contributes in total:

    * all_reduce: rd if T < 64 KiB; hierarchical if the topology has >= 2
      equal domains of >= 2 ranks; rhd for a power-of-two world below 1 MiB;
      ring otherwise.
    * reduce_scatter (T = world * nbytes): rhd below 64 KiB; hierarchical with
      equal domains; rhd for a power of two below 1 MiB; ring otherwise.
    * all_gather (T = world * nbytes): rd below 64 KiB; hierarchical with
      equal domains; ring otherwise.
    * broadcast, reduce: tree below 64 KiB, pipeline above.
    * all_to_all, all_to_allv: pairwise (the only one).
    """
    if collective not in _BUILDERS:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    if collective in ("all_to_all", "all_to_allv"):
        return "pairwise"
    if collective in ("broadcast", "reduce"):
        return "tree" if nbytes < SMALL_BYTES else "pipeline"
    total = nbytes if collective == "all_reduce" else nbytes * world
    domains = equal_domains(topology) if topology is not None and topology.world == world else None
    two_level = domains is not None and len(domains[0]) >= 2
    power_of_two = world == pow2_floor(max(world, 1))
    if collective == "all_reduce":
        if total < SMALL_BYTES:
            return "rd"
    elif collective == "reduce_scatter":
        if total < SMALL_BYTES:
            return "rhd"
    elif total < SMALL_BYTES:  # all_gather
        return "rd"
    if two_level:
        return "hierarchical"
    if collective != "all_gather" and power_of_two and total < MEDIUM_BYTES:
        return "rhd"
    return "ring"
