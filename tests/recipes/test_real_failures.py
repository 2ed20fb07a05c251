"""Real failures in the training recipe: the failing worker really dies (SIGKILL, exit,
an exception) or hangs; the supervisor replaces it with a new process, the survivors keep
their processes and state, and training ends bitwise equal to the fault-free run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.recipes.test_train_recipe import assert_states_equal, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PP2 = ("api=fabric", "parallel.pp=2", "parallel.microbatches=2", "trainer.max_steps=10",
       "checkpoint.window=3", "recovery.timeout_s=30")


@pytest.fixture(scope="module")
def golden_pp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("golden")
    result = run_recipe(out, *PP2)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _assert_replaced(out: Path, dead_rank: int, cause: str, world: int) -> dict[str, Any]:
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    (replacement,) = metrics["replacements"]
    assert replacement["rank"] == dead_rank and replacement["cause"] == cause
    assert replacement["new_pid"] != replacement["dead_pid"]
    pids = metrics["worker_pids"]
    assert pids[str(dead_rank)] == [replacement["dead_pid"], replacement["new_pid"]]
    for rank in range(world):  # survivors kept their processes
        if rank != dead_rank:
            assert len(pids[str(rank)]) == 1, pids
    return metrics


@pytest.mark.parametrize(("kind", "rank", "cause"), [
    ("kill", 1, "exit -9"),  # the last stage, SIGKILL
    ("exception", 0, "exit 1"),  # rank 0 (the first stage) raises in its training step
])
def test_dead_worker_is_replaced_and_training_ends_bitwise(
        tmp_path: Path, golden_pp2: Path, kind: str, rank: int, cause: str) -> None:
    result = run_recipe(tmp_path, *PP2, "faults=at", f"faults.kind={kind}",
                        f"faults.events=[{{step: 7, rank: {rank}}}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _assert_replaced(tmp_path, rank, cause, world=2)
    golden = json.loads((golden_pp2 / "metrics.json").read_text())
    if rank != 0:  # rank 0's own history restarts with its replacement
        assert metrics["loss"] == golden["loss"]
    assert_states_equal(golden_pp2 / "final_state.pt", tmp_path / "final_state.pt")


def test_hung_worker_is_killed_within_the_timeout_and_replaced(
        tmp_path: Path, golden_pp2: Path) -> None:
    result = run_recipe(tmp_path, *PP2, "faults=at", "faults.kind=hang",
                        "faults.events=[{step: 7, rank: 1}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _assert_replaced(tmp_path, 1, "hang", world=2)
    assert metrics["loss"] == json.loads((golden_pp2 / "metrics.json").read_text())["loss"]
    assert_states_equal(golden_pp2 / "final_state.pt", tmp_path / "final_state.pt")


def test_no_replacement_left_stops_with_a_clear_error(tmp_path: Path) -> None:
    result = run_recipe(tmp_path, *PP2, "faults=at", "faults.kind=kill",
                        "faults.events=[{step: 5, rank: 1}]", "recovery.max_restarts=0")
    assert result.returncode != 0
    assert "rank 1 (exit -9)" in result.stderr
    assert "recovery.max_restarts=0" in result.stderr


def test_real_kill_in_pp2_ep2_recovers_localized_and_bitwise(tmp_path: Path) -> None:
    """The issue's own command: kill rank 3 at step 13 under pp=2 x ep=2."""
    common = ("api=fabric", "parallel.pp=2", "parallel.ep=2", "parallel.microbatches=4",
              "trainer.max_steps=16", "checkpoint.window=3", "recovery.timeout_s=60")
    golden = run_recipe(tmp_path / "golden", *common)
    assert golden.returncode == 0, golden.stderr[-4000:]
    failed = run_recipe(tmp_path / "failed", *common, "faults=at", "faults.kind=kill",
                        "faults.events=[{step: 13, rank: 3}]")
    assert failed.returncode == 0, failed.stderr[-4000:]
    metrics = _assert_replaced(tmp_path / "failed", 3, "exit -9", world=4)
    golden_metrics = json.loads((tmp_path / "golden" / "metrics.json").read_text())
    assert metrics["loss"] == golden_metrics["loss"]
    assert_states_equal(tmp_path / "golden" / "final_state.pt",
                        tmp_path / "failed" / "final_state.pt")
