"""Recovery scope (paper Appendix A): stage groups, joint and concurrent recoveries,
cascading failures, global rollback without upstream logging."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_moe_ckpt.core.layout import ParallelPlan
from lightning_moe_ckpt.failures.survivor import agree_on_failure
from lightning_moe_ckpt.models import MoEModelConfig
from lightning_moe_ckpt.recovery import (
    RecoveryScope,
    adjacent,
    paused_ranks,
    recovery_scopes,
    restarted,
)
from lightning_moe_ckpt.recovery.api import RecoveryRequest
from lightning_moe_ckpt.recovery.durable import NoUsableCheckpointError


def _plan(pp: int, dp: int = 1, ep: int = 1, schedule: str = "1f1b") -> ParallelPlan:
    model = MoEModelConfig(n_layers=2 * pp, n_experts=8)
    return ParallelPlan.validate(pp=pp, dp=dp, ep=ep, microbatches=2 * pp, schedule=schedule,
                                 model=model)


def test_single_failure_rolls_back_its_stage_group() -> None:
    plan = _plan(4, dp=2, ep=2)  # 4 ranks per stage; rank 6 is in stage 1
    scopes = recovery_scopes(plan, [6])
    assert scopes == [RecoveryScope((1,), (4, 5, 6, 7))]
    assert paused_ranks(scopes, plan.world_size) == (0, 1, 2, 3, *range(8, 16))


def test_two_failures_in_one_stage_share_a_scope() -> None:
    plan = _plan(3, dp=2, ep=1)
    assert recovery_scopes(plan, [2, 3]) == [RecoveryScope((1,), (2, 3))]


def test_adjacent_stages_recover_jointly() -> None:
    plan = _plan(4, ep=2)
    assert recovery_scopes(plan, [3, 4]) == [RecoveryScope((1, 2), (2, 3, 4, 5))]


def test_non_adjacent_stages_recover_separately() -> None:
    plan = _plan(4, ep=2)
    scopes = recovery_scopes(plan, [7, 1])
    assert scopes == [RecoveryScope((0,), (0, 1)), RecoveryScope((3,), (6, 7))]
    assert paused_ranks(scopes, plan.world_size) == (2, 3, 4, 5)


def test_cascading_failure_widens_an_adjacent_or_containing_scope() -> None:
    plan = _plan(6)
    ongoing = recovery_scopes(plan, [1, 4])
    assert ongoing == [RecoveryScope((1,), (1,)), RecoveryScope((4,), (4,))]
    widened = recovery_scopes(plan, [2], ongoing=ongoing)
    assert widened == [RecoveryScope((1, 2), (1, 2)), RecoveryScope((4,), (4,))]
    assert restarted(ongoing, widened) == [RecoveryScope((1, 2), (1, 2))]  # (4,) proceeds
    # A second failure inside a recovering stage group widens nothing but restarts it.
    plan_dp = _plan(3, dp=2)
    ongoing_dp = recovery_scopes(plan_dp, [2])
    assert recovery_scopes(plan_dp, [3], ongoing=ongoing_dp) == ongoing_dp
    # Bridging two ongoing scopes merges all three positions.
    bridged = recovery_scopes(plan, [3], ongoing=widened)
    assert bridged == [RecoveryScope((1, 2, 3, 4), (1, 2, 3, 4))]


def test_cascading_failure_disjoint_from_ongoing_adds_a_scope() -> None:
    plan = _plan(6)
    ongoing = recovery_scopes(plan, [1])
    scopes = recovery_scopes(plan, [4], ongoing=ongoing)
    assert scopes == [RecoveryScope((1,), (1,)), RecoveryScope((4,), (4,))]
    assert restarted(ongoing, scopes) == [RecoveryScope((4,), (4,))]


def test_without_upstream_logging_everyone_rolls_back() -> None:
    plan = _plan(4, dp=2)
    scopes = recovery_scopes(plan, [3], upstream_logging=False)
    assert scopes == [RecoveryScope((0, 1, 2, 3), tuple(range(8)))]
    assert paused_ranks(scopes, plan.world_size) == ()
    assert recovery_scopes(plan, [], upstream_logging=False) == []


def test_no_failures_no_scopes_and_bad_ranks_rejected() -> None:
    plan = _plan(2)
    assert recovery_scopes(plan, []) == []
    assert paused_ranks([], 2) == (0, 1)
    with pytest.raises(ValueError, match="outside world"):
        recovery_scopes(plan, [2])


def test_interleaved_schedule_joins_the_wrapping_pipeline_ranks() -> None:
    # pp=4 interleaved: rank 0 holds stages 0 and 4, rank 3 holds 3 and 7; stage 3 feeds
    # stage 4, so ranks 3 and 0 exchange boundary tensors and must recover jointly.
    plan = _plan(4, schedule="interleaved_1f1b")
    assert adjacent(plan, 3, 0) and not adjacent(plan, 0, 2)
    assert not adjacent(_plan(4), 3, 0)
    scopes = recovery_scopes(plan, [0, 3])
    assert scopes == [RecoveryScope((0, 3), (0, 3))]
    assert scopes[0].model_stages(plan) == (0, 3, 4, 7)
    assert recovery_scopes(plan, [0, 2]) == [RecoveryScope((0,), (0,)),
                                             RecoveryScope((2,), (2,))]


def _connected(plan: ParallelPlan, stages: tuple[int, ...]) -> bool:
    reached, frontier = {stages[0]}, [stages[0]]
    while frontier:
        current = frontier.pop()
        for other in stages:
            if other not in reached and adjacent(plan, current, other):
                reached.add(other)
                frontier.append(other)
    return reached == set(stages)


LAYOUTS = st.tuples(st.integers(1, 6), st.integers(1, 2), st.sampled_from([1, 2]),
                    st.sampled_from(["1f1b", "interleaved_1f1b"]))


@settings(max_examples=150, deadline=None)
@given(layout=LAYOUTS, data=st.data())
def test_scopes_are_disjoint_cover_failures_and_are_closed(
        layout: tuple[int, int, int, str], data: st.DataObject) -> None:
    plan = _plan(*layout)
    world = plan.world_size
    waves = data.draw(st.lists(st.sets(st.integers(0, world - 1), max_size=4), min_size=1,
                               max_size=3))
    scopes: list[RecoveryScope] = []
    failed: set[int] = set()
    for wave in waves:  # later waves fail during the recovery of the earlier ones
        before = scopes
        scopes = recovery_scopes(plan, wave, ongoing=before)
        failed |= wave
        # Cascades only ever grow the rolled-back set; ongoing scopes survive or are absorbed.
        for old in before:
            assert any(set(old.ranks) <= set(new.ranks) for new in scopes)
    covered = [r for scope in scopes for r in scope.ranks]
    assert len(covered) == len(set(covered))  # disjoint
    assert failed <= set(covered)  # every failed rank rolls back
    for scope in scopes:  # each scope is whole stage groups, and nothing more
        assert set(scope.ranks) == {r for pp in scope.stages for r in plan.stage_group_ranks(pp)}
        assert any(plan.coordinates(r).pp in scope.stages for r in failed)
        assert _connected(plan, scope.stages)  # a joint recovery is one pipeline segment
    for a in scopes:  # separate scopes never exchange boundary tensors
        for b in scopes:
            if a != b:
                assert not any(adjacent(plan, x, y) for x in a.stages for y in b.stages)
    assert set(paused_ranks(scopes, world)) == set(range(world)) - set(covered)
    assert recovery_scopes(plan, failed, upstream_logging=False) == (
        [RecoveryScope(tuple(range(plan.pp)), tuple(range(world)))] if failed else [])


def test_a_survivor_past_the_oldest_step_is_ahead_not_failed() -> None:
    # rank 1 finished step 5 before it saw the failure; rank 3 is the empty replacement
    views = [(5, [], []), (6, [], []), (5, [], []), (None, [], [])]
    assert agree_on_failure(views) == (5, {3}, {1})
    # a retry: everyone now says 5; what the first try knew is kept, and a rank the
    # supervisor reports failed since then is failed, not ahead
    retry = [(5, [3], [1]), (5, [3], [1]), (5, [3], [1]), (None, [], [])]
    assert agree_on_failure(retry) == (5, {3}, {1})
    assert agree_on_failure(retry, known_failed=[1]) == (5, {1, 3}, set())
    with pytest.raises(NoUsableCheckpointError, match="every rank of the job failed"):
        agree_on_failure([(None, [], []), (None, [], [])])


def test_a_rank_cannot_be_failed_and_ahead() -> None:
    with pytest.raises(ValueError, match=r"ranks \[1\] are both failed and ahead"):
        RecoveryRequest(5, (1, 3), ahead_ranks=(1,))
