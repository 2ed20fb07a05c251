"""Golden-run equivalence of recovery (gloo, multi-process, CPU): every layout (bf16 on two),
a failure inside the first window, mid-window, right after a window persists and during a
snapshot copy; the final state and every loss from the failure on are bitwise equal
(``torch.equal`` / ``==``) to the run without the failure, and the failure fired.

Each (layout, precision) spawns one world that runs the fault-free reference and then the
four failure scenarios through :class:`FailureInjector`, with moevement windows of W=3
(windows start at steps 0, 3, 6, 9; the initial state is window -1). Upstream logging is
on, so pipelined layouts recover by localized rollback and the others globally.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import run_distributed
from tests.distributed.recovery_workloads import recovery_error, scenario_matrix
from tests.distributed.workloads import make_settings

pytestmark = pytest.mark.distributed

WINDOW, STEPS = 3, 11

LAYOUTS = [(1, 1, 2), (2, 1, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]


def timing_scenarios(layout: tuple[int, int, int]) -> dict[str, dict[str, Any]]:
    """The four failure timings, on different ranks, with the window each must recover
    from. During the copy of SS_8, the last snapshot of window 6, the failed rank's window
    6 becomes unusable and the ranks fall back to window 3, whose copies the replica peers
    still hold. With two ranks rolling back globally, the survivor's only replica peer is
    the failed rank, so nothing would hold its window 3 (a test below covers that error):
    there the copy of SS_7 dies, in the middle of window 6."""
    world = layout[0] * layout[1] * layout[2]
    last = world - 1
    copy_step = 8 if world == 2 and layout[0] == 1 else 9
    return {
        "first_window": {"events": [{"step": 2, "rank": 0}], "window_start": -1},
        "mid_window": {"events": [{"step": 7, "rank": last}], "window_start": 3},
        "after_persist": {"events": [{"step": 9, "rank": 1 % world}], "window_start": 6},
        "during_copy": {"events": [{"step": copy_step, "rank": last,
                                    "phase": "snapshot_copy"}], "window_start": 3},
    }


def check_scenario(name: str, result: dict[str, Any], scenario: dict[str, Any],
                   layout: tuple[int, int, int]) -> None:
    """Bitwise equality with the golden run, the failure fired, the expected window, and
    with localized rollback no forward/backward outside the scope."""
    failed = {event["rank"] for event in scenario["events"]}
    group = layout[1] * layout[2]  # ranks per pipeline stage
    for rank, facts in enumerate(result["ranks"]):
        assert facts["failures"] == len(scenario["events"]), (name, rank)
        assert facts["destroyed"] == ([True] if rank in failed else []), (name, rank)
        (recovery,) = facts["recoveries"]
        assert recovery["window_start"] == scenario["window_start"], (name, rank)
        if layout[0] > 1:  # localized: only the failed stages' ranks rolled back
            scope = sorted(r for r in range(layout[0] * group)
                           if r // group in {f // group for f in failed})
            assert recovery["ranks_rolled_back"] == scope, (name, rank)
            if rank not in scope:
                assert facts["paused_calls"] == 0, (name, rank)
    assert result["state_mismatches"] == [], name
    assert result["losses_after"] == result["golden_after"], name


# bf16 with fp32 master weights on the layouts that combine pipeline with data or expert
# parallelism (localized rollback, sharded experts' masters); fp32 on every layout.
CASES = [(layout, "32") for layout in LAYOUTS] + [((2, 1, 2), "bf16-master"),
                                                  ((2, 2, 1), "bf16-master")]


@pytest.mark.parametrize(("layout", "precision"), CASES,
                         ids=[f"{'x'.join(map(str, layout))}-{precision}"
                              for layout, precision in CASES])
def test_recovery_is_bitwise_for_every_failure_timing(layout: tuple[int, int, int],
                                                      precision: str) -> None:
    settings = make_settings(*layout, precision=precision, steps=STEPS)
    world = settings.layout.world_size
    scenarios = timing_scenarios(layout)
    results = run_distributed(world, scenario_matrix, settings, WINDOW, scenarios)
    assert set(results) == set(scenarios)
    for name, scenario in scenarios.items():
        check_scenario(name, results[name], scenario, layout)


def test_a_survivor_copy_corrupted_in_host_memory_is_fetched_from_a_replica() -> None:
    """Global rollback on pp=2 x dp=2: before step 10, rank 2 flips a bit in its own host
    copy of every snapshot its peers confirmed; rank 0 then fails. Rank 2's window fails
    verification and comes from its other replica peer (rank 3), and the recovery is
    bitwise (restoring the flipped bit would not be). The same when the first replica
    peer's copies have a flipped header byte."""
    settings = make_settings(2, 2, 1, steps=STEPS)
    scenario = {"events": [{"step": 10, "rank": 0}], "window_start": 6,
                "upstream_logging": False, "corrupt_local": (2, 10)}
    # Rank 1, rank 0's first replica peer, flips a header byte of every replica it holds:
    # rank 0's window comes from rank 2 instead.
    headers = {"events": [{"step": 10, "rank": 0}], "window_start": 6,
               "upstream_logging": False, "damage_replicas": (1, 10)}
    results = run_distributed(4, scenario_matrix, settings, WINDOW,
                              {"corrupt": scenario, "headers": headers})
    assert results["corrupt"]["ranks"][2]["corrupted"] >= WINDOW  # the corruption fired
    assert results["headers"]["ranks"][1]["corrupted"] >= WINDOW  # the damage was done
    for result in results.values():
        for rank, facts in enumerate(result["ranks"]):
            (recovery,) = facts["recoveries"]
            assert recovery["window_start"] == 6, rank
            assert recovery["ranks_rolled_back"] == [0, 1, 2, 3], rank
        assert result["state_mismatches"] == []
        assert result["losses_after"] == result["golden_after"]


def test_no_usable_window_stops_naming_what_is_missing() -> None:
    """Two ranks, global rollback: the copy of SS_8 (completing window 6) dies on rank 1,
    and the survivor's window 3 was only replicated to rank 1. Nothing usable remains and
    no durable checkpoint exists: the run stops, naming each window and piece."""
    settings = make_settings(1, 1, 2, steps=STEPS)
    events = [{"step": 9, "rank": 1, "phase": "snapshot_copy"}]
    message = run_distributed(2, recovery_error, settings, WINDOW, events)
    assert "no usable checkpoint window" in message
    assert "window starting at 6" in message and "rank 1, operator" in message
    assert "iteration 8 fails its checksum" in message
    assert "window starting at 3" in message and "no live replica peer" in message
    assert "checkpoint.durable_every" in message
