"""What recovery needs from one rank's checkpoint side: :class:`CheckpointSide`.

Recovery functions take this protocol, never a concrete coordinator: the parts they read
(the store and replicas of snapshots, the planner, the training target) and the steps they
ask for (drain everything taken before the failure, forget a dead worker's host memory,
restart the windows after the recovery). The
:class:`~lightning_moe_ckpt.checkpointing.coordinator.CheckpointCoordinator` implements it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lightning_moe_ckpt.core.target import TrainingTarget
    from lightning_moe_ckpt.planning.planner import BasePlanner
    from lightning_moe_ckpt.replication.replicator import Replicator
    from lightning_moe_ckpt.snapshots.capture import SnapshotEngine
    from lightning_moe_ckpt.snapshots.disk import DiskPersister
    from lightning_moe_ckpt.snapshots.store import SnapshotStore


class CheckpointSide(Protocol):
    """One rank's snapshots, replicas and planner, as recovery sees them."""

    target: TrainingTarget
    planner: BasePlanner
    rank: int
    world_size: int
    store: SnapshotStore
    replicator: Replicator | None
    persister: DiskPersister | None
    snapshots: SnapshotEngine
    paused_forward_backward: int  # forward/backward a paused rank ran (must be zero)

    def drain(self) -> None:
        """Everything taken before the failure is copied, checksummed and replicated."""

    def drain_acks(self) -> None:
        """Mark what replication (or persistence) confirmed."""

    def lose_host_state(self) -> None:
        """A dead worker's host memory is gone: its snapshots and held replicas."""

    def restart(self, failed_step: int) -> None:
        """Supersede the old windows and start anew at ``failed_step``."""

    def apply_capacity_factors(self) -> None:
        """Hand the planner's expert capacity factors to the target."""
