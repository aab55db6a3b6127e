"""Flow-level simulator of collectives over two planes (SIMULATED results only).

``simulate(schedule, Cluster(preset, domains), policy)`` runs one coflow DAG
from :mod:`mpccs.algorithms`; policies are fixed splits or the real
:mod:`mpccs.control` controller. See docs/simulator.md and ``mpccs-sim``.
"""
from .fabric import Cluster
from .presets import PRESETS, Preset, get_preset, load_toml
from .run import Background, FixedShare, NominalSplit, PlaneDown, SimResult, controller_factory, simulate

__all__ = [
    "PRESETS",
    "Background",
    "Cluster",
    "FixedShare",
    "NominalSplit",
    "PlaneDown",
    "Preset",
    "SimResult",
    "controller_factory",
    "get_preset",
    "load_toml",
    "simulate",
]
