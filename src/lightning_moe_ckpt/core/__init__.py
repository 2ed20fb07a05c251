"""The ground floor: operators and their discovery, the training-target protocol, the
parallel layout, optimizer state, precision, the batch log and RNG states.

Everything else in the library builds on these; they import nothing of it but
:mod:`lightning_moe_ckpt.errors` and the built-in model's configuration.
"""

from lightning_moe_ckpt.core.discovery import discover_operators
from lightning_moe_ckpt.core.layout import Coordinates, ParallelPlan
from lightning_moe_ckpt.core.operators import Operator
from lightning_moe_ckpt.core.optimizer_state import OptimizerStateAccess
from lightning_moe_ckpt.core.precision import MasterWeightAdamW, parse_precision
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.core.target import StepHooks, StepResult, TrainingTarget

__all__ = ["Coordinates", "MasterWeightAdamW", "Operator", "OperatorRegistry",
           "OptimizerStateAccess", "ParallelPlan", "StepHooks", "StepResult", "TrainingTarget",
           "discover_operators", "parse_precision"]
