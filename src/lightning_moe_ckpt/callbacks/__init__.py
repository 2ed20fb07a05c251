"""Lightning callbacks: sparse per-iteration checkpointing, its durable tier, and expert
popularity over training."""

from lightning_moe_ckpt.callbacks.durable_checkpoints import DurableCheckpoints
from lightning_moe_ckpt.callbacks.popularity_monitor import PopularityMonitor
from lightning_moe_ckpt.callbacks.sparse_checkpointing import SparseCheckpointing

__all__ = ["DurableCheckpoints", "PopularityMonitor", "SparseCheckpointing"]
