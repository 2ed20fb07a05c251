"""Several failures at once, failures during a recovery, and recovery without upstream
logging (gloo, 4 processes, pp=4): the result is bitwise the fault-free run's every time.

* two failures in non-adjacent stages recover as two scopes, concurrently, each fed by
  its healthy neighbours' logs; two in adjacent stages recover jointly (boundary tensors
  between them flow by P2P, the outer ones come from the logs);
* a failure during an ongoing recovery (phase ``recovery``) in a stage adjacent to the
  scope stops it, widens it and restarts it from the window; one in a distant stage
  opens a second scope while the first finishes;
* with ``checkpoint.upstream_logging=false`` every rank rolls back and replays, also
  through a cascade.

Ranks outside every scope run no forward/backward during recovery (counted); with logging
off all of them do.

A real failure seen late can leave a survivor one iteration *ahead* of the others: it
rolls back with its stage, but from its own host memory, so a window the failed rank's
replica on it holds stays usable. A survivor can also lag: its replica peers had not filed
its newest window yet, so the newest window every rank persisted is one the holders of
the others dropped; the ranks then agree on the newer window.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import run_distributed
from tests.distributed.recovery_workloads import (
    ahead_scenarios,
    lagging_scenario,
    scenario_matrix,
)
from tests.distributed.workloads import make_settings

pytestmark = pytest.mark.distributed

WINDOW, STEPS, PP = 3, 11, 4

SCENARIOS: dict[str, dict[str, Any]] = {
    "non_adjacent": {"events": [{"step": 7, "rank": 0}, {"step": 7, "rank": 2}],
                     "scope": [0, 2], "rounds": 1},
    "adjacent": {"events": [{"step": 7, "rank": 1}, {"step": 7, "rank": 2}],
                 "scope": [1, 2], "rounds": 1},
    "cascade_widens_scope": {
        "events": [{"step": 8, "rank": 1}, {"step": 8, "rank": 2, "phase": "recovery"}],
        "scope": [1, 2], "rounds": 2},
    "cascade_opens_scope": {
        "events": [{"step": 8, "rank": 0}, {"step": 8, "rank": 3, "phase": "recovery"}],
        "scope": [0, 3], "rounds": 1},
    "global": {"events": [{"step": 7, "rank": 2}], "upstream_logging": False,
               "scope": [0, 1, 2, 3], "rounds": 1},
    "global_cascade": {
        "events": [{"step": 8, "rank": 1}, {"step": 8, "rank": 3, "phase": "recovery"}],
        "upstream_logging": False, "scope": [0, 1, 2, 3], "rounds": 2},
}


def test_multiple_and_cascading_failures_are_bitwise() -> None:
    settings = make_settings(PP, 1, 1, steps=STEPS)
    results = run_distributed(PP, scenario_matrix, settings, WINDOW, SCENARIOS)
    for name, scenario in SCENARIOS.items():
        result = results[name]
        failed = {event["rank"] for event in scenario["events"]}
        cascading = sorted(e["rank"] for e in scenario["events"] if e.get("phase") == "recovery")
        for rank, facts in enumerate(result["ranks"]):
            assert facts["failures"] == len(scenario["events"]), (name, rank)
            assert facts["destroyed"] == ([True] if rank in failed else []), (name, rank)
            (recovery,) = facts["recoveries"]
            assert recovery["ranks_rolled_back"] == scenario["scope"], (name, rank)
            assert recovery["cascading_ranks"] == cascading, (name, rank)
            assert recovery["window_start"] == 3, (name, rank)
            replayed = facts["calls"] - STEPS  # forward/backward beyond the training steps
            if rank in scenario["scope"]:
                assert replayed > 0, (name, rank)
            else:  # paused: not a single forward or backward during the recovery
                assert replayed == 0 and facts["paused_calls"] == 0, (name, rank)
        rounds = {facts["recoveries"][0]["recovery_rounds"] for facts in result["ranks"]}
        assert rounds == {scenario["rounds"]}, name
        assert result["state_mismatches"] == [], name
        assert result["losses_after"] == result["golden_after"], name


@pytest.mark.parametrize("layout", [(2, 2, 1), (4, 1, 1)], ids=["2x2x1", "4x1x1"])
def test_a_survivor_ahead_rolls_back_from_its_own_host_memory(
        layout: tuple[int, int, int]) -> None:
    """Rank 3 fails at step 7 while stage 0's ranks already finished it. With one replica
    (ring order: rank r's window lives on rank r + 1 mod 4 alone), treating rank 0 as
    failed too drops the copy of rank 3's window it holds (and, with rank 1 ahead as well,
    rank 0's own): nothing would recover, which is checked too."""
    settings = make_settings(*layout, steps=STEPS)
    ahead = (0, 1) if layout[0] == 2 else (0,)
    result = run_distributed(4, ahead_scenarios, settings, WINDOW, 7, (3,), ahead)
    assert "no usable checkpoint window" in result["folded"], result["folded"]
    assert result["state_mismatches"] == []
    assert result["losses_after"] == result["golden_after"]
    scope = [0, 1, 2, 3] if layout[0] == 2 else [0, 3]  # pp=4: two scopes, stages 0 and 3
    for rank, facts in enumerate(result["ranks"]):
        assert facts["rolled_back"] == scope, rank
        assert facts["paused"] == (rank not in scope), rank
        if rank not in scope:
            assert facts["calls"] == 0, rank


def test_a_rank_whose_replicas_lag_does_not_hold_the_recovery_back() -> None:
    """Rank 3 fails at step 7 while rank 0's newest window (3) is not persisted yet (its
    replica peer had not filed it): the newest window every rank persisted is window 0,
    whose copy of rank 3 rank 0 dropped when it filed rank 3's window 6. The ranks agree on
    window 3 instead, which rank 0 holds complete in its own host memory, and the run
    ends bitwise equal to the fault-free one."""
    settings = make_settings(PP, 1, 1, steps=STEPS)
    result = run_distributed(4, lagging_scenario, settings, WINDOW, 7, (3,), (0,))
    assert result["state_mismatches"] == []
    assert result["losses_after"] == result["golden_after"]
    recovered = result["ranks"][3]
    assert recovered["rolled_back"] == [3] and recovered["window_start"] == 3, recovered
    assert [facts["paused"] for facts in result["ranks"]] == [True, True, True, False]
