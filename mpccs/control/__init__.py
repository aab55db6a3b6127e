"""Rate-and-delay control of the two planes: estimator, coflow split, fallback, QoS, tuner.

Pure logic (no I/O, no clock): every call takes the time it should believe,
so tests drive it with synthetic clocks and the simulator drives the same
objects the engine does. See docs/controller.md.
"""
from .controller import ControlConfig, PathController, StageDecision
from .estimator import PLANES, EstimateView, Estimator, PathEstimate, PathEstimator, window_bytes
from .split import (CoflowSplit, FlowDemand, PathModel, SplitFlow, equal_finish, finish_times,
                    greedy_per_flow, solve_coflow)
from .tuner import ALGORITHMS, Plan, TuneOverride, TuneRule, choose, parse_tune, tune_from_env

__all__ = [
    "PLANES", "FlowDemand", "StageDecision", "ControlConfig", "PathController",
    "Estimator", "EstimateView", "PathEstimator", "PathEstimate", "window_bytes",
    "PathModel", "SplitFlow", "CoflowSplit", "equal_finish", "solve_coflow", "finish_times", "greedy_per_flow",
    "ALGORITHMS", "Plan", "TuneOverride", "TuneRule", "choose", "parse_tune", "tune_from_env",
]
