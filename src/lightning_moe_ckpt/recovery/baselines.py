"""Recovery of the baseline checkpoint policies: the contrast users must see.

* ``gemini`` and ``checkfreq`` (dense planners, windows of one snapshot) roll **every**
  rank back to their last dense checkpoint and recompute up to the failed iteration:
  exact, like MoEvement, but the rollback reaches back up to a whole checkpoint interval
  instead of about 1.5 sparse windows, and they never roll back only the failed stage.
  Gemini's checkpoint is in its peers' host memory (global rollback over the replicas);
  CheckFreq's is on each rank's own disk (``checkpoint.replicas`` plays no part), so a
  failed rank reads its own persisted file back (:func:`disk_rollback`), checksums
  verified.
* ``moc`` and ``moetion`` (partial planners) restore their partial state, stale experts
  included, and go on: see :mod:`~lightning_moe_ckpt.recovery.partial_restore`. They
  lose tokens, which the report says.

A single process keeps its host memory through a device failure, so a dense baseline
there recovers from its own store (:func:`~lightning_moe_ckpt.recovery.sparse_to_dense.
recover_from_store`). Failures that cascade into a running recovery are not modelled
for the baselines.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from lightning_moe_ckpt.core.collectives import all_gather_values
from lightning_moe_ckpt.planning.planner import BasePlanner
from lightning_moe_ckpt.recovery.global_rollback import global_rollback
from lightning_moe_ckpt.recovery.partial_restore import partial_restore
from lightning_moe_ckpt.recovery.side import CheckpointSide
from lightning_moe_ckpt.recovery.sparse_to_dense import (
    RecoveryReport,
    SnapshotView,
    recover_from_store,
    snapshot_view,
    sparse_to_dense,
)
from lightning_moe_ckpt.snapshots.codec import CorruptCheckpointError, decode_snapshot


def is_baseline(planner: BasePlanner) -> bool:
    """Whether ``planner`` is a baseline policy with its own recovery."""
    return planner.restore_rule != "sparse_to_dense"


def recover_baseline(coordinator: CheckpointSide, failed_step: int,
                     failed_ranks: Iterable[int], world_size: int) -> RecoveryReport:
    """Recover a baseline policy's run (collective when ``world_size > 1``)."""
    planner = coordinator.planner
    if planner.restore_rule == "partial_restore":
        return partial_restore(coordinator, failed_step, failed_ranks)
    if world_size == 1:
        return recover_from_store(coordinator, failed_step)
    if coordinator.disk is not None:
        return disk_rollback(coordinator, failed_step, failed_ranks)
    return global_rollback(coordinator, failed_step, failed_ranks)


def disk_rollback(side: CheckpointSide, failed_step: int,
                  failed_ranks: Iterable[int]) -> RecoveryReport:
    """CheckFreq: every rank rolls back to the newest dense snapshot all of them persisted
    to disk; survivors use their host copy, failed ranks read their own file (collective)."""
    started = time.perf_counter()
    failed = tuple(sorted(set(failed_ranks)))
    rank = dist.get_rank()
    disk = side.disk
    assert disk is not None  # recover_baseline routes only disk-persisting runs here
    side.drain()  # what was taken before the failure is on disk
    if rank in failed:  # host memory gone; the disk survives
        side.lose_host_state()
        steps = disk.persisted_steps()
    else:
        steps = side.persisted_window_starts()
    everyone: list[Any] = all_gather_values(steps)
    common = set(everyone[0]).intersection(*everyone[1:])
    if not common:
        raise CorruptCheckpointError(
            "no dense checkpoint persisted by every rank: "
            + ", ".join(f"rank {r} has {s}" for r, s in enumerate(everyone)))
    step = max(common)
    views: list[SnapshotView] = []
    error = None
    if rank in failed:
        try:
            views = [decode_snapshot(disk.read(step))]
        except (OSError, CorruptCheckpointError) as exc:
            error = f"rank {rank}: {exc}"
    else:
        try:
            views = [snapshot_view(s) for s in side.own_window(step) or ()]
        except CorruptCheckpointError as exc:  # reported by every rank alike, below
            error = f"rank {rank}: {exc}"
    errors: list[Any] = all_gather_values(error)
    if any(errors):
        raise CorruptCheckpointError("; ".join(e for e in errors if e))
    fetched_at = time.perf_counter()
    report = sparse_to_dense(side.target, views, failed_step)
    side.restart(failed_step)
    report.phases_s["fetch"] = fetched_at - started
    return report
