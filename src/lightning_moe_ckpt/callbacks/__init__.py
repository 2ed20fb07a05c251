"""Lightning callbacks: sparse per-iteration checkpointing, failure injection with
recovery, and expert popularity."""

from lightning_moe_ckpt.callbacks.failure_injector import FailureInjector
from lightning_moe_ckpt.callbacks.popularity import PopularityTracker
from lightning_moe_ckpt.callbacks.sparse_checkpointing import SparseCheckpointing

__all__ = ["FailureInjector", "PopularityTracker", "SparseCheckpointing"]
