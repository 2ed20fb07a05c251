"""``faults=at`` in the training recipe: trains through an injected failure (global
rollback with replay) and ends bitwise equal to the fault-free run, through both APIs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_moe_ckpt.failures.protocol import EXIT_UNRECOVERABLE
from tests.recipes.test_train_recipe import assert_states_equal, run_recipe

pytestmark = pytest.mark.slow

COMMON = ("parallel.pp=2", "parallel.ep=2", "parallel.microbatches=4", "trainer.max_steps=16",
          "checkpoint.window=3")


@pytest.fixture(scope="module")
def golden_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The fault-free run of each API, run once for the module (on first use)."""
    runs: dict[str, Path] = {}

    def golden(api: str) -> Path:
        if api not in runs:
            out = tmp_path_factory.mktemp(f"golden_{api}")
            result = run_recipe(out, f"api={api}", *COMMON)
            assert result.returncode == 0, result.stderr[-4000:]
            runs[api] = out
        return runs[api]
    return golden


@pytest.mark.parametrize(("api", "logging"), [("trainer", True), ("fabric", True),
                                              ("fabric", False)],
                         ids=["trainer-localized", "fabric-localized", "fabric-global"])
def test_training_through_an_injected_failure_is_bitwise(
        tmp_path: Path, golden_runs: Callable[[str], Path], api: str, logging: bool) -> None:
    golden = golden_runs(api)
    failed = run_recipe(tmp_path / "failed", f"api={api}", *COMMON, "faults=at",
                        "faults.events=[{step: 13, rank: 3}]",
                        f"checkpoint.upstream_logging={str(logging).lower()}")
    assert failed.returncode == 0, failed.stderr[-4000:]
    assert "failures injected: 1" in failed.stdout
    metrics = json.loads((tmp_path / "failed" / "metrics.json").read_text())
    assert metrics["failures_injected"] == 1
    recovery = metrics["recoveries"][0]
    assert recovery["failed_step"] == 13 and recovery["failed_ranks"] == [3]
    assert recovery["lost_tokens"] == 0 and recovery["window"] == 3
    # With logging only the failed rank's stage (ranks 2 and 3) rolls back.
    assert recovery["ranks_rolled_back"] == ([2, 3] if logging else [0, 1, 2, 3])
    assert 0 < 13 - recovery["window_start"] <= 2 * 3 + 1
    assert recovery["iterations_replayed"] == 13 - recovery["window_start"] - 1
    # Rank 0 (stage 0) logs the activations it sends: 4 micro-batches of 2 x 64 x 64 fp32
    # per iteration, kept from the previous persisted window's start (the fallback point):
    # at most ~three windows (+2) are held.
    per_iteration = 4 * 2 * 64 * 64 * 4
    if logging:
        assert 0 < metrics["upstream_log_bytes_peak"] <= (3 * 3 + 2) * per_iteration + 4096
    else:
        assert metrics["upstream_log_bytes_peak"] == 0
    golden_losses = json.loads((golden / "metrics.json").read_text())["loss"]
    assert metrics["loss"] == golden_losses
    assert_states_equal(golden / "final_state.pt", tmp_path / "failed" / "final_state.pt")


def test_failure_of_every_rank_falls_back_to_the_durable_checkpoint(tmp_path: Path) -> None:
    """Every rank fails at once: no host memory survives, so no window is usable. With a
    durable checkpoint the run recovers from it bitwise; without one it stops and says
    what was missing."""
    common = ("api=trainer", "parallel.pp=2", "trainer.max_steps=12", "checkpoint.window=3")
    everyone = ("faults=at", "faults.events=[{step: 11, rank: 0}, {step: 11, rank: 1}]")
    golden = run_recipe(tmp_path / "golden", *common)
    assert golden.returncode == 0, golden.stderr[-4000:]
    durable = run_recipe(tmp_path / "durable", *common, *everyone, "checkpoint.durable_every=4",
                         f"checkpoint.durable_dir={tmp_path / 'durable' / 'ckpt'}")
    assert durable.returncode == 0, durable.stderr[-4000:]
    metrics = json.loads((tmp_path / "durable" / "metrics.json").read_text())
    assert metrics["failures_injected"] == 2
    recovery = metrics["recoveries"][0]
    assert recovery["ranks_rolled_back"] == [0, 1]
    resumed_at = recovery["window_start"]  # the durable checkpoint's step
    assert f"step={resumed_at}.ckpt" in {Path(p).name for p in metrics["durable_checkpoints"]}
    assert recovery["iterations_replayed"] == 11 - resumed_at > 0
    assert metrics["loss"] == json.loads((tmp_path / "golden" / "metrics.json").read_text())["loss"]
    assert_states_equal(tmp_path / "golden" / "final_state.pt",
                        tmp_path / "durable" / "final_state.pt")
    stopped = run_recipe(tmp_path / "stopped", *common, *everyone)
    assert stopped.returncode == EXIT_UNRECOVERABLE  # one line, no traceback
    assert "Traceback" not in stopped.stderr
    assert "no surviving rank holds a persisted checkpoint" in stopped.stderr
    assert "no committed durable checkpoint to fall back to" in stopped.stderr
    assert "checkpoint.durable_every" in stopped.stderr


def test_faults_without_checkpointing_is_refused(tmp_path: Path) -> None:
    result = run_recipe(tmp_path, "faults=at", "faults.events=[{step: 2, rank: 0}]",
                        "checkpoint=none")
    assert result.returncode != 0
    assert "faults=at needs a checkpoint policy" in result.stderr
    result = run_recipe(tmp_path, "faults=at", "faults.events=[{step: 2, rank: 5}]")
    assert result.returncode != 0 and "faults.events[0].rank=5" in result.stderr


def test_hugging_face_model_recipe_recovers_bitwise(tmp_path: Path) -> None:
    """``model=hf_qwen3_moe``: a Hugging Face Qwen3-MoE in a plain LightningModule (torch
    AdamW, automatic optimization, gradient clipping) recovers bitwise in the recipe."""
    common = ("model=hf_qwen3_moe", "trainer.max_steps=10", "checkpoint.window=3")
    golden = run_recipe(tmp_path / "golden", *common)
    assert golden.returncode == 0, golden.stderr[-4000:]
    failed = run_recipe(tmp_path / "failed", *common, "faults=at",
                        "faults.events=[{step: 7, rank: 0}]")
    assert failed.returncode == 0, failed.stderr[-4000:]
    metrics = json.loads((tmp_path / "failed" / "metrics.json").read_text())
    assert metrics["failures_injected"] == 1
    assert metrics["recoveries"][0]["iterations_replayed"] == 3
    assert metrics["routing_telemetry"] == "router hooks"
    golden_losses = json.loads((tmp_path / "golden" / "metrics.json").read_text())["loss"]
    assert metrics["loss"] == golden_losses
    assert_states_equal(tmp_path / "golden" / "final_state.pt",
                        tmp_path / "failed" / "final_state.pt")


def test_hugging_face_model_refuses_a_layout_it_cannot_take(tmp_path: Path) -> None:
    result = run_recipe(tmp_path, "model=hf_qwen3_moe", "parallel.ep=3")
    assert result.returncode != 0
    assert "parallel.ep=3" in result.stderr and "n_experts=8" in result.stderr
    assert not (tmp_path / "metrics.json").exists()  # refused before any training
