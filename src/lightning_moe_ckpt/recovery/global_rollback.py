"""Global rollback: every rank converts the same persisted window and replays together.

This is the recovery without upstream logging (``checkpoint.upstream_logging=false``, the
comparison point for localized rollback). All ranks call :func:`global_rollback` at the
failed iteration:

1. outstanding copies and replication are drained, so every rank's store and its peers'
   replicas reflect every snapshot taken before the failure;
2. the ranks agree on the newest window persisted on every surviving rank (failed ranks
   lost their host memory: their own store and the replicas they held for others);
3. a rank whose store no longer holds that window (a failed rank, or one that already
   freed it after a newer window persisted) fetches it from its first live replica peer,
   checksums verified; the others use their own host copies;
4. every rank runs sparse-to-dense conversion and replays up to the failed iteration, in
   lockstep through the same pipeline schedule and collectives as training; the in-flight
   window is discarded and the planner starts a new window at the failed iteration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from lightning_moe_ckpt.checkpoint.replication import CorruptCheckpointError
from lightning_moe_ckpt.recovery.replay import (
    Batch,
    RecoveryReport,
    SnapshotView,
    snapshot_view,
    sparse_to_dense,
)


def _discard_all(coordinator: Any) -> None:
    for start in list(coordinator.store.windows):
        for snapshot in coordinator.store.windows.pop(start).snapshots.values():
            coordinator.pool.release(snapshot)
    coordinator.store.persisted_start = None


def agree_on_window(coordinator: Any, failed: tuple[int, ...],
                    wants_window: bool) -> tuple[int, list[SnapshotView] | None]:
    """Collective prologue of every recovery: drain copies and replication, drop what the
    failed ranks lost, agree on the newest window persisted on every surviving rank and
    fetch it from replicas where a rank that ``wants_window`` no longer holds it.

    Returns the window's start and, when ``wants_window``, this rank's snapshots of it.
    """
    rank = dist.get_rank()
    replicator = coordinator.replicator
    coordinator.snapshots.wait_copies()
    if replicator is not None:
        replicator.drain()
    coordinator._drain_acks()
    coordinator.store.refresh()
    if rank in failed:  # a dead worker's host memory is gone: snapshots and held replicas
        _discard_all(coordinator)
        if replicator is not None:
            replicator.replicas.windows.clear()
    starts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(starts, coordinator.store.persisted_start)
    live = [s for s in starts if s is not None]
    if not live:
        raise CorruptCheckpointError("no surviving rank holds a persisted checkpoint")
    common = min(live)
    record = coordinator.store.windows.get(common)
    needs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(needs, wants_window and not (record is not None
                                                        and record.persisted))
    views: list[SnapshotView] | None = None
    for source, needed in enumerate(needs):
        if needed:
            if replicator is None:
                raise CorruptCheckpointError(
                    f"rank {source} lost the checkpoint window starting at {common} and "
                    "checkpoint.replicas=0 keeps no copy elsewhere")
            fetched = replicator.fetch_window(source, common, exclude=failed)
            if source == rank:
                views = list(fetched.values())
    if wants_window and views is None:
        assert record is not None
        views = [snapshot_view(s) for s in record.snapshots.values()]
    return common, views


def restart_windows(coordinator: Any, failed_step: int) -> None:
    """After a recovery: old windows are superseded, the planner starts a new window at
    ``failed_step``, and a dense base snapshot is the recovery point until it persists."""
    _discard_all(coordinator)
    coordinator.planner.on_recovery(failed_step)
    coordinator.take_base_snapshot()


def global_rollback(coordinator: Any, batch: Callable[[int], Batch], failed_step: int,
                    failed_ranks: Iterable[int]) -> RecoveryReport:
    """Roll every rank back to the common persisted window and replay to ``failed_step``.

    ``coordinator`` is this rank's checkpoint coordinator; every rank calls this with the
    same ``failed_step`` and ``failed_ranks`` (a collective).
    """
    started = time.perf_counter()
    _, views = agree_on_window(coordinator, tuple(sorted(set(failed_ranks))), True)
    assert views is not None
    fetched_at = time.perf_counter()
    report = sparse_to_dense(coordinator.engine, views, batch, failed_step)
    restart_windows(coordinator, failed_step)
    report.phases_s["fetch"] = fetched_at - started
    return report
