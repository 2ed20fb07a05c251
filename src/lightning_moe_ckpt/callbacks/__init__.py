"""Lightning callbacks: sparse per-iteration checkpointing and expert popularity."""

from lightning_moe_ckpt.callbacks.popularity import PopularityTracker
from lightning_moe_ckpt.callbacks.sparse_checkpointing import SparseCheckpointing

__all__ = ["PopularityTracker", "SparseCheckpointing"]
