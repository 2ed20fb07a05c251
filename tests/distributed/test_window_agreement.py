"""Ranks agreeing on the moevement window W in the background (gloo, 2 processes): the
largest proposal wins, every boundary lines up across ranks, and a W that grows on one
rank takes effect on both at the second agreement after it (agreements at least
``agreement_every`` iterations apart; one window later when that is 1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from lightning_moe_ckpt.planning.agreement import LargestAcrossRanks
from lightning_moe_ckpt.planning.schedule import OperatorSpec
from lightning_moe_ckpt.policies.moevement import MoEvementPlanner
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

_OPERATORS, _MASTER_BYTES, _COMPUTE_BYTES = 6, 100, 10
_DENSE = _OPERATORS * _MASTER_BYTES


def _specs() -> tuple[OperatorSpec, ...]:
    return tuple(OperatorSpec(f"op{i}", _COMPUTE_BYTES, _MASTER_BYTES, 1.0)
                 for i in range(_OPERATORS))


def _plans_on_two_ranks(agreement_every: int = 1, change_at: int = 5) -> dict[str, Any]:
    """Rank 0 fits the whole state in one iteration (W = 1), rank 1 needs W = 2; from
    iteration ``change_at`` on (a new profile on both, as the profiling hook hands it)
    rank 0 needs W = 3."""
    rank = dist.get_rank()
    # Per iteration, a budget of 600 bytes fits W = 1, 400 W = 2 and 300 W = 3.
    rank_1_budget = 2 * _DENSE / 3
    planner = MoEvementPlanner(_specs(), iteration_time_s=1.0,
                               bandwidth_bytes_per_s=_DENSE if rank == 0 else rank_1_budget,
                               window_agreement=LargestAcrossRanks(),
                               agreement_every=agreement_every)
    plans = []
    for iteration in range(1, 16):
        if iteration == change_at:
            planner.set_profile(1.0, _DENSE / 2 if rank == 0 else rank_1_budget)
        plan = planner.plan(iteration)
        assert plan is not None
        plans.append((plan.iteration, plan.window_start, plan.window))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, plans)
    both = LargestAcrossRanks()
    return {"plans": gathered, "call": both(10 * (rank + 1)),
            "started": _started_then_result(rank)}


def _started_then_result(rank: int) -> int:
    agreement = LargestAcrossRanks()
    agreement.start(rank + 7)
    return agreement.result()


def test_ranks_agree_on_the_largest_w_one_boundary_ahead() -> None:
    result = run_distributed(2, _plans_on_two_ranks)
    rank0, rank1 = result["plans"]
    assert rank0 == rank1  # every boundary and every W line up
    windows = {start: window for _, start, window in rank0}
    # Both use rank 1's W = 2 from the first boundary on (that one waits for its
    # agreement); rank 0's W = 3, proposed at the first boundary after its new profile
    # (iteration 5), is used from the boundary after that (7).
    assert windows == {1: 2, 3: 2, 5: 2, 7: 3, 10: 3, 13: 3}
    assert result["call"] == 20 and result["started"] == 8
    with pytest.raises(RuntimeError, match="before any start"):
        LargestAcrossRanks().result()


def test_boundaries_between_agreements_keep_the_agreed_w() -> None:
    """Agreements at least 4 iterations apart (boundaries 1, 5, 9, 13): rank 0's new
    need (its profile changes at iteration 6) rebuilds its schedule at boundary 7, which
    agrees nothing and keeps the W agreed (2); it is proposed at 9 and used from 13."""
    result = run_distributed(2, _plans_on_two_ranks, 4, 6)
    rank0, rank1 = result["plans"]
    assert rank0 == rank1
    windows = {start: window for _, start, window in rank0}
    assert windows == {1: 2, 3: 2, 5: 2, 7: 2, 9: 2, 11: 2, 13: 3}
