"""Batch log: each iteration's batch and per-iteration state, kept in host memory for replay.

Replay reruns the user's own training step, so it needs exactly what that step saw: the
batch (a host copy, so the user's DataLoader need not be seekable), its index, the RNG
states (CPU and CUDA) and the LR-scheduler and optimizer hyper-parameters at the start of
the iteration. A record is taken when an iteration starts and is kept, like the upstream
log, from the start of the older window on (``SnapshotStore.release_listeners`` frees
older records), so every window a recovery may convert can be replayed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection


@dataclass(frozen=True)
class BatchRecord:
    """What iteration ``step`` started from."""

    step: int
    batch: Any  # host copy of the batch (tensors on the CPU, structure kept)
    batch_idx: int
    # Target-specific (RNG, LR schedulers, param groups); None for a batch read again from
    # the loader by a process that joined later (its state evolves through the replay).
    state: dict[str, Any] | None
    epoch: int = 0  # the loop's epoch (the Trainer's current_epoch); 0 where it has none

    @property
    def nbytes(self) -> int:
        """Host bytes of the batch's tensors."""
        sizes: list[int] = []
        apply_to_collection(self.batch, torch.Tensor,
                            lambda t: sizes.append(t.numel() * t.element_size()))
        return sum(sizes)


def host_copy(batch: Any) -> Any:
    """A host copy of every tensor in ``batch`` (pinned and asynchronous from CUDA)."""
    def copy(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor.detach().clone()
        target = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return target.copy_(tensor.detach(), non_blocking=True)
    return apply_to_collection(batch, torch.Tensor, copy)


class BatchLog:
    """Records of the iterations since the older window's start, by step."""

    def __init__(self) -> None:
        self.records: dict[int, BatchRecord] = {}
        self.peak_bytes = 0
        self._lock = threading.Lock()  # release_before may run on a replication thread

    def log(self, record: BatchRecord) -> None:
        """Keep ``record`` (a replayed iteration logs nothing new)."""
        with self._lock:
            self.records[record.step] = record
            self.peak_bytes = max(self.peak_bytes, self._nbytes())

    def find(self, step: int) -> BatchRecord | None:
        """The record of iteration ``step``, if held."""
        with self._lock:
            return self.records.get(step)

    def newest(self) -> BatchRecord | None:
        """The record of the latest iteration held."""
        with self._lock:
            return self.records[max(self.records)] if self.records else None

    def get(self, step: int) -> BatchRecord:
        """The record of iteration ``step``."""
        with self._lock:
            record = self.records.get(step)
            held = sorted(self.records)
        if record is None:
            span = f"{held[0]}..{held[-1]}" if held else "none"
            raise KeyError(f"the batch log holds no batch of iteration {step} (it holds "
                           f"{span}); replay needs every batch since the window's start")
        return record

    def release_before(self, step: int) -> None:
        """Free the records of iterations older than ``step``."""
        with self._lock:
            for old in [s for s in self.records if s < step]:
                del self.records[old]

    def drop_after(self, step: int) -> None:
        """Forget records of iterations after ``step`` (they will run again)."""
        with self._lock:
            for later in [s for s in self.records if s > step]:
                del self.records[later]

    def nbytes(self) -> int:
        """Host bytes held now."""
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        return sum(record.nbytes for record in self.records.values())
