"""Checkpointing: the sparse schedule (Algorithm 1), popularity, profiling, per-policy capture
planners, and the snapshot engine, store and replication that execute the plans."""

from lightning_moe_ckpt.checkpoint.planner_base import (
    BasePlanner,
    CapturePlan,
    NonePlanner,
    Planner,
)
from lightning_moe_ckpt.checkpoint.planners import (
    PLANNER_NAMES,
    MoEvementPlanner,
    make_planner,
    planner_options,
)
from lightning_moe_ckpt.checkpoint.planners_dense import (
    CheckFreqPlanner,
    GeminiPlanner,
    checkfreq_interval,
    oracle_interval,
)
from lightning_moe_ckpt.checkpoint.planners_partial import MoCPlanner, MoEtionPlanner
from lightning_moe_ckpt.checkpoint.popularity import SCHEMES, PopularityTracker, should_reorder
from lightning_moe_ckpt.checkpoint.profiler import IterationProfiler, Profile, measure_bandwidth
from lightning_moe_ckpt.checkpoint.schedule import (
    OperatorSpec,
    WindowSchedule,
    order_operators,
    plan_window,
    specs_from_registry,
)

__all__ = [
    "PLANNER_NAMES",
    "SCHEMES",
    "BasePlanner",
    "CapturePlan",
    "CheckFreqPlanner",
    "GeminiPlanner",
    "IterationProfiler",
    "MoCPlanner",
    "MoEtionPlanner",
    "MoEvementPlanner",
    "NonePlanner",
    "OperatorSpec",
    "Planner",
    "PopularityTracker",
    "Profile",
    "WindowSchedule",
    "checkfreq_interval",
    "make_planner",
    "measure_bandwidth",
    "oracle_interval",
    "order_operators",
    "plan_window",
    "planner_options",
    "should_reorder",
    "specs_from_registry",
]
