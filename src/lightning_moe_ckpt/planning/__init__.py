"""What to capture when: the sparse schedule (paper Algorithm 1), expert popularity, the
profile it is planned from, the planner interface every checkpoint policy implements, and
the checkpoint-interval rules the runtime and the simulator share."""

from lightning_moe_ckpt.planning.planner import BasePlanner, CapturePlan, NonePlanner, Planner
from lightning_moe_ckpt.planning.popularity import SCHEMES, PopularityTracker
from lightning_moe_ckpt.planning.profiler import IterationProfiler, Profile, measure_bandwidth
from lightning_moe_ckpt.planning.schedule import (
    OperatorSpec,
    WindowSchedule,
    order_operators,
    plan_window,
    specs_from_registry,
)

__all__ = ["SCHEMES", "BasePlanner", "CapturePlan", "IterationProfiler", "NonePlanner",
           "OperatorSpec", "Planner", "PopularityTracker", "Profile", "WindowSchedule",
           "measure_bandwidth", "order_operators", "plan_window", "specs_from_registry"]
