"""Recovery scope: which ranks roll back after failures (paper §3.4 and Appendix A).

With upstream logging, a failed rank's scope is its pipeline position's whole stage group
(the ``dp x ep`` ranks that all-reduce gradients with it). A failed rank loses the logs it
held, so two failed pipeline positions that exchange boundary tensors cannot feed each
other's replay from logs: adjacent failed positions recover jointly in one scope, while
positions with a healthy one between them recover in separate scopes, concurrently, each
fed by its healthy neighbours' logs. A failure during an ongoing recovery widens a scope it
touches (adjacent or inside; that scope restarts) or opens a new one. Without logging there
is nothing to replay from, so every rank rolls back in one global scope. Scopes are defined
over pipeline ranks (``pp`` coordinates). With interleaved schedules a pipeline rank holds
several stages (:meth:`ParallelPlan.stages_of`); two pipeline ranks are adjacent when any
of their stages are consecutive, which also joins the last pipeline rank to the first
(stage ``pp - 1`` feeds stage ``pp``, held by pipeline rank 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_moe_ckpt.core.layout import ParallelPlan


@dataclass(frozen=True, order=True)
class RecoveryScope:
    """Ranks that roll back and replay together.

    Args:
        stages: Pipeline ranks (``pp`` coordinates), ascending.
        ranks: The global ranks of their stage groups, ascending.
    """

    stages: tuple[int, ...]
    ranks: tuple[int, ...]

    def model_stages(self, plan: ParallelPlan) -> tuple[int, ...]:
        """Every (virtual) pipeline stage the scope's pipeline ranks hold."""
        return tuple(sorted(s for pp in self.stages for s in plan.stages_of(pp)))


def adjacent(plan: ParallelPlan, a: int, b: int) -> bool:
    """Whether pipeline ranks ``a`` and ``b`` exchange boundary tensors.

    Args:
        plan: The parallel layout.
        a: A pipeline rank (``pp`` coordinate).
        b: Another pipeline rank.

    Returns:
        Whether any stage of ``a`` and any stage of ``b`` are consecutive (a rank is not
        adjacent to itself).
    """
    return a != b and any(abs(x - y) == 1 for x in plan.stages_of(a) for y in plan.stages_of(b))


def recovery_scopes(plan: ParallelPlan, failed_ranks: Iterable[int], *,
                    upstream_logging: bool = True,
                    ongoing: Sequence[RecoveryScope] = ()) -> list[RecoveryScope]:
    """The scopes after ``failed_ranks`` fail, given the scopes already recovering.

    Args:
        plan: The parallel layout.
        failed_ranks: Global ranks that fail now.
        upstream_logging: Whether boundary tensors are logged; ``False``: every rank rolls
            back, in one global scope.
        ongoing: The scopes already recovering (default: none).

    Returns:
        Every scope that must be recovering afterwards, sorted: ongoing scopes the new
        failures do not touch are returned unchanged (they proceed), touched ones merged
        with the new failures' positions (they restart, see :func:`restarted`).

    Raises:
        ValueError: A rank outside the world.
    """
    failed = sorted(set(failed_ranks))
    for rank in failed:
        plan.coordinates(rank)  # rejects ranks outside the world
    if not failed and not ongoing:
        return []
    if not upstream_logging:
        everything = tuple(range(plan.world_size))
        return [RecoveryScope(tuple(range(plan.pp)), everything)]
    positions = {plan.coordinates(rank).pp for rank in failed}
    groups = [set(scope.stages) for scope in ongoing] + [{pp} for pp in sorted(positions)]
    merged = _connected(plan, groups)
    return sorted(_scope(plan, stages) for stages in merged)


def _connected(plan: ParallelPlan, groups: list[set[int]]) -> list[set[int]]:
    """Merge groups of pipeline ranks that overlap or are adjacent, until none are."""
    merged: list[set[int]] = []
    for group in groups:
        current = set(group)
        keep = []
        for other in merged:
            touches = current & other or any(adjacent(plan, a, b)
                                             for a in current for b in other)
            if touches:
                current |= other
            else:
                keep.append(other)
        merged = [*keep, current]
    return merged


def _scope(plan: ParallelPlan, stages: set[int]) -> RecoveryScope:
    ranks = sorted(r for pp in stages for r in plan.stage_group_ranks(pp))
    return RecoveryScope(tuple(sorted(stages)), tuple(ranks))


def restarted(ongoing: Sequence[RecoveryScope],
              scopes: Sequence[RecoveryScope]) -> list[RecoveryScope]:
    """Scopes of ``scopes`` that must (re)start: new or widened, not merely continuing.

    Args:
        ongoing: The scopes that were recovering before.
        scopes: The scopes after the new failures (:func:`recovery_scopes`).

    Returns:
        The scopes of ``scopes`` not in ``ongoing``, in their order.
    """
    running = set(ongoing)
    return [scope for scope in scopes if scope not in running]


def paused_ranks(scopes: Sequence[RecoveryScope], world_size: int) -> tuple[int, ...]:
    """Ranks outside every scope: they pause with their live state during recovery.

    Args:
        scopes: The recovering scopes.
        world_size: Ranks in the job.

    Returns:
        The paused global ranks, ascending.
    """
    busy = {rank for scope in scopes for rank in scope.ranks}
    return tuple(rank for rank in range(world_size) if rank not in busy)
