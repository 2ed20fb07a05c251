"""The training recipe on one GPU, through both APIs: it trains, takes snapshots into pinned
memory on the side stream, and replays an injected failure to the fault-free state bit for
bit. Skipped without CUDA (``recipes/gpu_check.sh`` runs it on a GPU machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.recipes.test_train_recipe import assert_states_equal, run_recipe

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

COMMON = ("hardware=h100", "trainer.max_steps=12", "trainer.val_every=12",
          "checkpoint.window=3")


@pytest.mark.parametrize("api", ["fabric", "trainer"])
def test_recipe_replays_a_failure_on_the_gpu_bitwise(tmp_path: Path, api: str) -> None:
    golden, failed = tmp_path / "golden", tmp_path / "failed"
    result = run_recipe(golden, f"api={api}", *COMMON)
    assert result.returncode == 0, result.stderr[-4000:]
    result = run_recipe(failed, f"api={api}", *COMMON, "faults=at",
                        "faults.events=[{step: 8, rank: 0}]")
    assert result.returncode == 0, result.stderr[-4000:]
    reference = json.loads((golden / "metrics.json").read_text())
    metrics = json.loads((failed / "metrics.json").read_text())
    assert metrics["accelerator"] == "cuda" and metrics["precision"] == "bf16-master"
    assert metrics["failures_injected"] == 1
    recovery = metrics["recoveries"][0]
    assert recovery["failed_step"] == 8 and recovery["lost_tokens"] == 0
    assert recovery["iterations_replayed"] == 8 - recovery["window_start"] - 1 > 0
    # The copies ran on the side stream, timed by its events.
    assert metrics["snapshot_copy_gbps"] > 0
    assert metrics["pieces_checksummed"] == metrics["pieces_issued"] > 0
    assert metrics["loss"] == reference["loss"]
    assert_states_equal(golden / "final_state.pt", failed / "final_state.pt")
