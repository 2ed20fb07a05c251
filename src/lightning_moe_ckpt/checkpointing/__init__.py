"""One rank's checkpoint side: the coordinator that drives planner, capture, store and
replication around every optimizer step, and answers recovery's requests."""

from lightning_moe_ckpt.checkpointing.coordinator import CheckpointCoordinator

__all__ = ["CheckpointCoordinator"]
