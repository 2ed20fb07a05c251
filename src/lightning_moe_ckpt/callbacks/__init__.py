"""Lightning callbacks: sparse per-iteration checkpointing."""

from lightning_moe_ckpt.callbacks.sparse_checkpointing import SparseCheckpointing

__all__ = ["SparseCheckpointing"]
