"""What recovery needs from one rank's checkpoint side: :class:`CheckpointSide`.

Recovery functions take this protocol, never a concrete coordinator, and ask it for
verbs: settle what was taken before the failure (:meth:`~CheckpointSide.drain`), forget
a dead worker's host memory, read this rank's windows and fetch a peer's from its replica
holders, start the windows anew after the recovery. They read nothing else of it but the
training target and the planner. The
:class:`~lightning_moe_ckpt.checkpointing.coordinator.CheckpointCoordinator` implements it.

The baselines' own stores are reached through typed collaborators, each its policy's
alone: CheckFreq's :class:`~lightning_moe_ckpt.snapshots.disk.DiskWriter`
(:attr:`~CheckpointSide.disk`) and the partial baselines' retained saves
(:meth:`~CheckpointSide.retained_saves`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lightning_moe_ckpt.core.target import TrainingTarget
    from lightning_moe_ckpt.planning.planner import BasePlanner
    from lightning_moe_ckpt.replication.retention import RetainedSaves
    from lightning_moe_ckpt.snapshots.disk import DiskWriter
    from lightning_moe_ckpt.snapshots.snapshot import Snapshot


class CheckpointSide(Protocol):
    """One rank's snapshots, replicas and planner, as recovery sees them."""

    @property
    def target(self) -> TrainingTarget:
        """The rank's model, optimizer and training step."""

    @property
    def planner(self) -> BasePlanner:
        """The policy's planner (its restore rule, lost tokens, capacity factors)."""

    @property
    def rank(self) -> int:
        """This rank."""

    @property
    def world_size(self) -> int:
        """Ranks of the job."""

    paused_forward_backward: int  # forward/backward a paused rank ran (must be zero)

    # -- before the recovery: settle what was taken ------------------------------------

    def wait_copies(self) -> None:
        """Every issued snapshot copy finished: nothing reads the live state any more."""

    def drain(self) -> None:
        """Everything taken before the failure is copied, checksummed and replicated (or
        written to disk), and what was confirmed is filed."""

    def drain_acks(self) -> None:
        """File what replication (or the disk) confirmed since the last call."""

    def lose_host_state(self) -> None:
        """A dead worker's host memory is gone: its snapshots, the saves it retained and
        the replicas it held for its peers."""

    # -- windows: this rank's own, and its peers' replicas ------------------------------

    @property
    def persisted_start(self) -> int | None:
        """The start of this rank's newest persisted window (None: none persisted)."""

    def persisted_window(self) -> tuple[int, list[Snapshot]] | None:
        """This rank's newest persisted window: its start and its snapshots."""

    def persisted_window_starts(self) -> list[int]:
        """Starts of the windows this rank's store holds persisted, ascending."""

    def own_window(self, start: int) -> list[Snapshot] | None:
        """This rank's snapshots of window ``start`` when its store holds it complete."""

    def keep_only(self, start: int) -> None:
        """Free every window of this rank's store but ``start``."""

    def held_window_starts(self) -> set[int]:
        """Windows this rank holds anything of: its own and its peers' replicas."""

    @property
    def keeps_replicas(self) -> bool:
        """Whether this rank's snapshots have replica peers (``checkpoint.replicas > 0``)."""

    def fetch_window(self, source: int, start: int,
                     exclude: Iterable[int]) -> dict[int, dict[str, Any]]:
        """Rank ``source``'s window ``start`` from its first live replica peer not in
        ``exclude`` whose copy is intact, decoded and verified (collective)."""

    # -- the baselines' own stores ------------------------------------------------------

    @property
    def disk(self) -> DiskWriter | None:
        """CheckFreq's snapshots on this rank's disk (None for every other policy)."""

    def retained_saves(self) -> RetainedSaves:
        """Each operator's newest save, here and on the replica peers (the partial
        baselines' stores; raises for any other policy)."""

    # -- after the recovery --------------------------------------------------------------

    def restart(self, failed_step: int) -> None:
        """Supersede the old windows and start anew at ``failed_step``."""

    def apply_capacity_factors(self) -> None:
        """Hand the planner's expert capacity factors to the target."""
