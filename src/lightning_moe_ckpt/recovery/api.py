"""``recover(...)``: the one entry point every failure detector calls.

A detector (the :class:`~lightning_moe_ckpt.callbacks.FailureInjector` for tests and
benchmarks; a real detector in production) decides *that* ranks failed at an iteration,
destroys or replaces what they lost, and calls :func:`recover` on every rank with the
same :class:`RecoveryRequest`. Recovery never reads a failure schedule: it chooses the
path from the checkpoint policy and the layout alone.

* baseline policies recover their own way (dense rollback, disk rollback, partial
  restore; :mod:`~lightning_moe_ckpt.recovery.baselines`);
* one process converts its own persisted window;
* with upstream logging and one pipeline stage per rank, only the failed stages roll
  back (:mod:`~lightning_moe_ckpt.recovery.localized`);
* otherwise every rank rolls back to the common window
  (:mod:`~lightning_moe_ckpt.recovery.global_rollback`).

When no window is usable anywhere, the newest durable checkpoint every rank wrote is
loaded and replayed from (:mod:`~lightning_moe_ckpt.recovery.durable`); without one the
recovery fails with :class:`~lightning_moe_ckpt.recovery.durable.NoUsableCheckpointError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lightning_moe_ckpt.recovery.baselines import is_baseline, recover_baseline
from lightning_moe_ckpt.recovery.durable import DurableSource, recover_from_durable
from lightning_moe_ckpt.recovery.global_rollback import global_rollback
from lightning_moe_ckpt.recovery.localized import localized_rollback
from lightning_moe_ckpt.recovery.scope import recovery_scopes
from lightning_moe_ckpt.recovery.side import CheckpointSide
from lightning_moe_ckpt.recovery.sparse_to_dense import Cascade, RecoveryReport, recover_from_store
from lightning_moe_ckpt.recovery.upstream_log import UpstreamLog
from lightning_moe_ckpt.snapshots.codec import CorruptCheckpointError


@dataclass(frozen=True)
class RecoveryRequest:
    """Ranks ``failed_ranks`` failed during iteration ``failed_step``; a ``cascade``
    strikes while the recovery runs.

    Args:
        failed_step: The iteration (0-based optimizer step) the ranks failed during.
        failed_ranks: The ranks that failed; they lost their live state and host memory.
        cascade: A failure that strikes while the recovery runs; ``None``: none.
        ahead_ranks: Survivors that already finished ``failed_step`` (a real failure seen
            late): their live state is newer than everyone else's, so they roll back with
            the failed ranks, but their host memory (own snapshots, replicas held for
            peers) is intact and serves the recovery like any survivor's.

    Raises:
        ValueError: A rank is both failed and ahead.
    """

    failed_step: int
    failed_ranks: tuple[int, ...]
    cascade: Cascade | None = None
    ahead_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        both = sorted(set(self.failed_ranks) & set(self.ahead_ranks))
        if both:
            raise ValueError(f"ranks {both} are both failed and ahead: a failed rank lost "
                             "its host memory, an ahead one kept it")


@dataclass
class RecoveryOutcome:
    """This rank's report (``None`` when it only paused) and the ranks rolled back.

    Attributes:
        report: What this rank's recovery did; ``None`` when it only paused.
        rolled_back: The global ranks that rolled back, ascending.
    """

    report: RecoveryReport | None
    rolled_back: list[int]


def recover(request: RecoveryRequest, coordinator: CheckpointSide,
            upstream_log: UpstreamLog | None = None,
            durable: DurableSource | None = None) -> RecoveryOutcome:
    """Bring this rank back to the state before ``request.failed_step`` (collective when
    the world has several ranks); the target then runs that iteration as if nothing
    happened.

    Args:
        request: Which ranks failed at which iteration; the same on every rank.
        coordinator: This rank's checkpoint side (its snapshots, replicas and planner).
        upstream_log: This rank's upstream log; with it (and one pipeline stage per rank)
            only the failed stages roll back. ``None``: every rank rolls back.
        durable: Where the durable checkpoints are, the fallback when no window is usable
            anywhere; ``None``: no durable tier.

    Returns:
        This rank's report and the ranks rolled back.

    Raises:
        NoUsableCheckpointError: No window is usable anywhere and there is no durable
            checkpoint to fall back to.
    """
    try:
        return _recover(request, coordinator, upstream_log)
    except CorruptCheckpointError as error:  # raised alike on every rank
        target = coordinator.target
        report = recover_from_durable(durable, target, request.failed_step, error)
        resuming = time.perf_counter()
        coordinator.restart(request.failed_step)
        report.phases_s["resume"] = time.perf_counter() - resuming
        return RecoveryOutcome(report, list(range(coordinator.world_size)))


def _recover(request: RecoveryRequest, coordinator: CheckpointSide,
             log: UpstreamLog | None) -> RecoveryOutcome:
    step, failed, cascade = request.failed_step, list(request.failed_ranks), request.cascade
    ahead = request.ahead_ranks
    world = coordinator.world_size
    plan = coordinator.target.layout
    everyone = list(range(world))
    if is_baseline(coordinator.planner):  # every rank rolls back, never localized
        return RecoveryOutcome(recover_baseline(coordinator, step, failed, world), everyone)
    if world == 1:  # one process: its host memory survives a device failure
        return RecoveryOutcome(recover_from_store(coordinator, step), everyone)
    if log is not None and plan.pp > 1 and plan.stages_per_rank == 1:
        scopes = recovery_scopes(plan, [*failed, *ahead], upstream_logging=True)
        if cascade is not None:
            scopes = recovery_scopes(plan, cascade.ranks, upstream_logging=True,
                                     ongoing=scopes)
        rolled_back = sorted(r for scope in scopes for r in scope.ranks)
        if len(rolled_back) == world:  # every stage failed: nobody pauses, nothing logged
            return RecoveryOutcome(global_rollback(coordinator, step, failed, cascade),
                                   everyone)
        report = localized_rollback(coordinator, log, plan,
                                    plan.coordinates(coordinator.rank), step, failed, cascade,
                                    ahead)
        return RecoveryOutcome(report, rolled_back)
    return RecoveryOutcome(global_rollback(coordinator, step, failed, cascade), everyone)
