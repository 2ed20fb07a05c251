"""Localized rollback: only the failed stages' ranks roll back; everyone else pauses.

With upstream logging, a failed rank's recovery scope is its pipeline stage (all dp x ep
ranks of it; contiguous failed stages recover jointly, see :mod:`.scope`). Every rank
calls :func:`localized_rollback` at the failed iteration (a collective):

1. copies and replication are drained; the failed ranks' host state is gone;
2. all ranks agree on the newest window persisted on every surviving rank (or, where
   that one is no longer whole, a newer or an older one:
   :func:`~lightning_moe_ckpt.recovery.global_rollback.agree_on_window`); scope ranks
   that no longer hold it fetch it from replicas (checksums verified);
3. the neighbours of a scope (the stages just outside it) hand over the activations and
   gradients they logged for the iterations to replay, and a surviving rank the logged
   clip coefficients;
4. scope ranks run sparse-to-dense conversion and replay through their own pipeline
   stages, with the logged tensors standing in for the paused neighbours (no P2P leaves
   the scope) and the logged clip coefficients (the global norm needs every stage);
   ranks outside the scope run no forward or backward at all;
5. everyone resumes at the failed iteration.

A failure during the recovery (a cascade) stops the scopes it touches, widens them and
restarts them from the window; untouched scopes finish, and a new scope recovers next.

Interleaved schedules (several stages per pipeline rank) recover by global rollback.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from lightning_moe_ckpt.core.collectives import all_gather_values
from lightning_moe_ckpt.core.layout import Coordinates, ParallelPlan
from lightning_moe_ckpt.recovery.global_rollback import agree_on_window
from lightning_moe_ckpt.recovery.scope import RecoveryScope, recovery_scopes
from lightning_moe_ckpt.recovery.side import CheckpointSide
from lightning_moe_ckpt.recovery.sparse_to_dense import (
    Cascade,
    RecoveryInterrupted,
    RecoveryReport,
    sparse_to_dense,
)
from lightning_moe_ckpt.recovery.upstream_log import UpstreamLog


def _neighbour_logs(log: UpstreamLog, plan: ParallelPlan, coords: Coordinates,
                    scope_pp: set[int], iterations: range) -> dict[str, Any]:
    """What this rank hands to the scope: its logged sends toward it, and scalars."""
    handed: dict[str, Any] = {"activation": {}, "gradient": {}, "clip": {}}
    p = coords.pp
    if p not in scope_pp:
        for t in iterations:
            if p + 1 in scope_pp:
                handed["activation"][t] = log.activations(t, stage=p)
            if p - 1 in scope_pp:
                handed["gradient"][t] = log.gradients(t, stage=p)
            scalars = log.scalars(t)
            if scalars is not None:
                handed["clip"][t] = torch.as_tensor(scalars.clip_coef).detach().to(
                    "cpu", copy=True)
    return handed


def localized_rollback(coordinator: CheckpointSide, log: UpstreamLog, plan: ParallelPlan,
                       coords: Coordinates, failed_step: int,
                       failed_ranks: Iterable[int],
                       cascade: Cascade | None = None,
                       ahead_ranks: Iterable[int] = ()) -> RecoveryReport | None:
    """Recover the failed ranks' stages from logs; returns the report on scope ranks and
    ``None`` on ranks that only paused.

    ``ahead_ranks`` (survivors already past ``failed_step``) roll back with their stages
    too, from their own host snapshots: only the failed ranks lost their host memory.

    With a ``cascade``, its ranks fail while the recovery is under way: scopes the new
    failures touch (adjacent stages, or inside the scope) stop, widen and restart from the
    window; scopes they do not touch finish, and new scopes recover in a second round.
    """
    if plan.stages_per_rank != 1:
        raise ValueError("localized rollback needs one stage per pipeline rank; "
                         "interleaved schedules recover by global rollback")
    failed = tuple(sorted(set(failed_ranks)))
    scopes = recovery_scopes(plan, set(failed) | set(ahead_ranks), upstream_logging=True)
    target = coordinator.target
    calls_before = target.forward_backward_calls
    again: list[RecoveryScope] = []
    if cascade is not None:
        widened = recovery_scopes(plan, cascade.ranks, upstream_logging=True, ongoing=scopes)
        again = [scope for scope in widened
                 if scope not in scopes or set(scope.ranks) & set(cascade.ranks)]
    restarting = {p for scope in again for p in scope.stages}
    stop_after = cascade.after_replayed if cascade is not None and coords.pp in restarting \
        else None
    report = _recover_scopes(coordinator, log, plan, coords, failed_step, failed,
                             {p for scope in scopes for p in scope.stages}, stop_after)
    if cascade is not None:
        cascade.fail()
        lost = set(failed) | set(cascade.ranks)
        again_ranks = {r for scope in again for r in scope.ranks}
        second = _recover_scopes(coordinator, log, plan, coords, failed_step,
                                 tuple(sorted(lost & again_ranks)), restarting, None)
        if second is not None:
            if report is not None:
                second.merge_restart(report)
            report = second
    resuming = time.perf_counter()
    coordinator.restart(failed_step)
    calls = target.forward_backward_calls - calls_before
    if report is not None:
        report.phases_s["resume"] = time.perf_counter() - resuming
        report.forward_backward_calls = calls
    coordinator.paused_forward_backward = 0 if report is not None else calls
    return report


def _recover_scopes(coordinator: CheckpointSide, log: UpstreamLog, plan: ParallelPlan,
                    coords: Coordinates, failed_step: int,
                    failed: tuple[int, ...], scope_pp: set[int],
                    stop_after: int | None) -> RecoveryReport | None:
    """One round: the scope ranks (pipeline positions ``scope_pp``) convert the agreed
    window and replay from the neighbours' logs; the rest only take part in the
    collectives. A replay cut short by ``stop_after`` returns its partial report."""
    started = time.perf_counter()
    in_scope = coords.pp in scope_pp
    target = coordinator.target
    executor = target.pipeline
    if executor is None or executor.runner is None:
        raise TypeError("localized rollback replays through a pipeline schedule; "
                        f"{type(target).__name__} runs none and recovers by global rollback")
    common, views = agree_on_window(coordinator, failed, in_scope)
    iterations = range(common + 1, failed_step)
    handed: list[Any] = all_gather_values(_neighbour_logs(log, plan, coords, scope_pp,
                                                          iterations))
    fetched_at = time.perf_counter()
    report = None
    if in_scope:
        assert views is not None
        clip = {t: c for part in handed for t, c in part["clip"].items()}
        previous = plan.rank_of(replace(coords, pp=coords.pp - 1)) \
            if coords.pp > 0 and coords.pp - 1 not in scope_pp else None
        following = plan.rank_of(replace(coords, pp=coords.pp + 1)) \
            if coords.pp + 1 < plan.pp and coords.pp + 1 not in scope_pp else None
        runner = executor.runner
        runner.replay = {t: {coords.pp: (
            None if previous is None else handed[previous]["activation"][t],
            None if following is None else handed[following]["gradient"][t])}
            for t in iterations}
        executor.replaying = True
        try:
            report = sparse_to_dense(coordinator.target, views, failed_step, clip,
                                     stop_after)
        except RecoveryInterrupted as interrupted:
            report = interrupted.report
        finally:
            executor.replaying = False
            runner.replay = {}
        report.phases_s["fetch"] = fetched_at - started
    else:  # paused: keep the live state, run nothing
        coordinator.target.resume_at(failed_step)
    dist.barrier()
    return report
