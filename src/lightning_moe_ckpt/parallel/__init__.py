"""Parallel execution: topology (pp x dp x ep), expert dispatch, pipeline stages."""

from lightning_moe_ckpt.parallel.topology import Coordinates, ParallelPlan

__all__ = ["Coordinates", "ParallelPlan"]
