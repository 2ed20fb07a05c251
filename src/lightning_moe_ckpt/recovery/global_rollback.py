"""Global rollback: every rank converts the same persisted window and replays together.

This is the recovery without upstream logging (``checkpoint.upstream_logging=false``, the
comparison point for localized rollback). All ranks call :func:`global_rollback` at the
failed iteration:

1. outstanding copies and replication are drained, so every rank's store and its peers'
   replicas reflect every snapshot taken before the failure;
2. the ranks agree on the newest window persisted on every surviving rank (failed ranks
   lost their host memory: their own store and the replicas they held for others); if
   some rank's copy of it is gone or corrupt on every replica, they try the newer
   windows up to the newest some surviving rank persisted, then the older windows, and
   with no usable window the recovery stops with an error;
3. a rank whose store no longer holds that window complete (a failed rank, or one that
   already freed it after a newer window persisted) fetches it from its first live
   replica peer, checksums verified; the others use their own host copies;
4. every rank runs sparse-to-dense conversion and replays up to the failed iteration, in
   lockstep through the same pipeline schedule and collectives as training; the in-flight
   window is discarded and the planner starts a new window at the failed iteration.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from lightning_moe_ckpt.core.collectives import all_gather_values
from lightning_moe_ckpt.recovery.side import CheckpointSide
from lightning_moe_ckpt.recovery.sparse_to_dense import (
    Cascade,
    RecoveryInterrupted,
    RecoveryReport,
    SnapshotView,
    snapshot_view,
    sparse_to_dense,
)
from lightning_moe_ckpt.replication.replicator import CorruptCheckpointError


def agree_on_window(coordinator: CheckpointSide, failed: tuple[int, ...],
                    wants_window: bool) -> tuple[int, list[SnapshotView] | None]:
    """Collective prologue of every recovery: drain copies and replication, drop what the
    failed ranks lost, agree on the newest window persisted on every surviving rank and
    fetch it from replicas where a rank that ``wants_window`` no longer holds it.

    When some rank's copy of that window is missing or corrupt on every replica peer (or
    no rank has a persisted window yet), the ranks try the newer windows up to the newest
    some surviving rank persisted, then fall back to older windows (the replica peers keep
    two windows per source; the upstream logs are kept since the older one's start). When
    no window is usable, raises :class:`CorruptCheckpointError` naming every window tried
    and what was missing.
    Returns the window's start and, when ``wants_window``, this rank's snapshots of it.
    """
    rank = dist.get_rank()
    coordinator.drain()
    if rank in failed:  # a dead worker's host memory is gone: snapshots and held replicas
        coordinator.lose_host_state()
    starts: list[Any] = all_gather_values(coordinator.persisted_start)
    live = sorted({s for s in starts if s is not None})
    tried: list[str] = []
    for candidate in _candidate_windows(coordinator, live):
        try:
            return candidate, _window_views(coordinator, failed, wants_window, candidate)
        except CorruptCheckpointError as error:  # every rank raises alike (same bytes)
            tried.append(f"window starting at {candidate}: {error}")
    if not live:
        raise CorruptCheckpointError("no surviving rank holds a persisted checkpoint"
                                     + "".join(f" | {t}" for t in tried))
    raise CorruptCheckpointError("no usable checkpoint window: " + " | ".join(tried))


def _candidate_windows(coordinator: CheckpointSide, persisted: list[int]) -> list[int]:
    """Windows to try, in order (collective; the same list on every rank).

    First the newest window every surviving rank persisted (``persisted[0]``: the ranks'
    persisted window starts, ascending). Then the newer ones up to the newest any
    surviving rank persisted, oldest first: each rank persists at its own replica peers'
    pace, so a lagging rank's persisted window may be one whose copies of a faster rank
    its holders already dropped, while every rank still holds a newer window complete.
    Then the older windows anyone still holds, newest first. With no window persisted
    anywhere yet (a failure before the first window's replication was confirmed, the
    initial state's included), the windows held unconfirmed, newest first: the survivors'
    own are intact, and a failed rank's is used only if a holder has all of it intact."""
    everyone: list[Any] = all_gather_values(sorted(coordinator.held_window_starts()))
    anywhere = {start for starts in everyone for start in starts}
    if not persisted:
        return sorted(anywhere, reverse=True)
    lowest, highest = persisted[0], persisted[-1]
    newer = sorted({*persisted, *(s for s in anywhere if lowest < s < highest)})
    return newer + sorted((s for s in anywhere if s < lowest), reverse=True)


def _window_views(coordinator: CheckpointSide, failed: tuple[int, ...], wants_window: bool,
                  start: int) -> list[SnapshotView] | None:
    """This rank's snapshots of window ``start``: from its own store when it still holds
    the window persisted, else from a replica peer (collective)."""
    rank = dist.get_rank()
    own = coordinator.own_window(start) if wants_window else None
    local: list[SnapshotView] | None = None
    # A surviving rank's own complete window is intact whether or not its replica peers
    # filed all of it yet (checksums are verified below); a failed rank's store is empty.
    if own is not None:
        try:
            local = [snapshot_view(s) for s in own]
        except CorruptCheckpointError:
            local = None  # a replica peer's intact copy replaces this rank's own
    needs: list[Any] = all_gather_values(wants_window and local is None)
    views: list[SnapshotView] | None = local
    for source, needed in enumerate(needs):
        if needed:
            if not coordinator.keeps_replicas:
                raise CorruptCheckpointError(
                    f"rank {source} lost the checkpoint window starting at {start} (or "
                    "holds it corrupt) and checkpoint.replicas=0 keeps no copy elsewhere")
            fetched = coordinator.fetch_window(source, start, exclude=failed)
            if source == rank:
                views = list(fetched.values())
    return views


def global_rollback(coordinator: CheckpointSide, failed_step: int,
                    failed_ranks: Iterable[int],
                    cascade: Cascade | None = None) -> RecoveryReport:
    """Roll every rank back to the common persisted window and replay to ``failed_step``.

    ``coordinator`` is this rank's checkpoint coordinator; every rank calls this with the
    same ``failed_step`` and ``failed_ranks`` (a collective). A ``cascade`` (ranks failing
    during the recovery) stops the replay everywhere and restarts it with those ranks'
    state gone too.
    """
    failed = tuple(sorted(set(failed_ranks)))
    target = coordinator.target
    calls_before = target.forward_backward_calls
    report = _global_round(coordinator, failed_step, failed,
                           None if cascade is None else cascade.after_replayed)
    if cascade is not None:
        cascade.fail()
        dist.barrier()
        second = _global_round(coordinator, failed_step,
                               tuple(sorted(set(failed) | set(cascade.ranks))), None)
        second.merge_restart(report)
        report = second
    resuming = time.perf_counter()
    coordinator.restart(failed_step)
    report.phases_s["resume"] = time.perf_counter() - resuming
    report.forward_backward_calls = target.forward_backward_calls - calls_before
    return report


def _global_round(coordinator: CheckpointSide, failed_step: int,
                  failed: tuple[int, ...], stop_after: int | None) -> RecoveryReport:
    started = time.perf_counter()
    _, views = agree_on_window(coordinator, failed, True)
    assert views is not None
    fetched_at = time.perf_counter()
    try:
        report = sparse_to_dense(coordinator.target, views, failed_step,
                                 stop_after=stop_after)
    except RecoveryInterrupted as interrupted:
        report = interrupted.report
    report.phases_s["fetch"] = fetched_at - started
    return report
