"""Checkpoint policies in the training recipe: every policy runs on a parallel layout, and
taking snapshots never changes the training result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_moe_ckpt.recovery.manifest import verify
from lightning_moe_ckpt.replication.replicator import decode_snapshot
from lightning_moe_ckpt.snapshots.checksum import default_threads
from lightning_moe_ckpt.snapshots.helper_threads import DEFAULT_HELPER_NICE
from moe_recipes.command_line import EXIT_USAGE
from tests.recipes.test_train_recipe import assert_states_equal, run_recipe

pytestmark = pytest.mark.slow

# moevement on pp=2 x ep=2 runs in every failure recipe test (test_failure_recipe.py).
POLICIES = ["gemini", "checkfreq", "moc", "moetion", "none"]


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_runs_on_pp2_ep2(tmp_path: Path, policy: str) -> None:
    result = run_recipe(tmp_path, "parallel.pp=2", "parallel.ep=2", "parallel.microbatches=4",
                        f"checkpoint={policy}", "trainer.max_steps=8", "trainer.val_every=8",
                        "api=fabric")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["checkpoint_policy"] == policy
    if policy != "none":
        assert metrics["snapshot_bytes_per_iter"] > 0
        assert metrics["persisted_window_start"] is not None
        # Rank 0's checkpoint threads report their CPU time; CheckFreq writes to disk and
        # has no replication thread.
        threads = metrics["checkpoint_thread_cpu_ms_per_iter"]
        assert threads["copy"] > 0
        # The behind-compute copies were timed: a bandwidth, not a division by zero.
        assert metrics["snapshot_copy_ms_per_iter"] > 0 and metrics["snapshot_copy_gbps"] > 0
        assert (threads["replication"] > 0) == (policy != "checkfreq")
        # ... and the training thread's CPU time in the checkpoint's step hooks.
        assert threads["training_hooks"] > 0
        # One node, every peer mapping: gemini's snapshots go straight into the shared
        # slots; the partial baselines' stores keep pieces of released snapshots, and
        # CheckFreq has no peers, so they use host buffers of their own.
        placed = policy == "gemini"
        assert (metrics["host_snapshot_own_bytes_peak"] == 0) == placed, metrics
        assert (metrics["host_buffer_bytes"] == 0) == placed
        assert metrics["host_snapshot_bytes_peak"] > 0
    if policy == "checkfreq":  # dense snapshots persisted to disk, checksums intact
        files = metrics["persisted_files"]
        assert files and all(Path(f).is_file() for f in files)
        decoded = decode_snapshot(torch.frombuffer(bytearray(Path(files[-1]).read_bytes()),
                                                   dtype=torch.uint8))
        assert decoded["rank"] == 0 and len(decoded["pieces"]) > 0


def test_snapshots_do_not_change_training(tmp_path: Path) -> None:
    for policy in ("none", "moevement"):
        result = run_recipe(tmp_path / policy, f"checkpoint={policy}", "trainer.max_steps=8",
                            "checkpoint.window=3" if policy == "moevement" else "api=trainer")
        assert result.returncode == 0, result.stderr[-4000:]
    assert_states_equal(tmp_path / "none" / "final_state.pt",
                        tmp_path / "moevement" / "final_state.pt")
    metrics = json.loads((tmp_path / "moevement" / "metrics.json").read_text())
    assert metrics["window"] == 3 and metrics["windows_taken"] >= 3


@pytest.mark.parametrize(("precision", "layout"), [
    ("32", ()), ("bf16-master", ()),
    ("32", ("parallel.pp=2", "parallel.ep=2", "parallel.microbatches=4")),
], ids=["fp32", "bf16", "fp32-pp2-ep2"])
def test_durable_checkpoint_resumes_bitwise_with_plain_ckpt_path(
        tmp_path: Path, precision: str, layout: tuple[str, ...]) -> None:
    """Resumed at step 7 of 16 (more steps to go than done: the epoch Lightning restores
    must not end early), and a failure at step 11 after the resume recovers from the
    resumed run's own windows; the one scheduled at step 3, before the resume, is counted
    and named instead of silently not firing."""
    common = ("trainer.max_steps=16", "checkpoint.window=3", f"trainer.precision={precision}",
              *layout)
    full = run_recipe(tmp_path / "full", *common, "checkpoint.durable_every=7")
    assert full.returncode == 0, full.stderr[-4000:]
    saved = json.loads((tmp_path / "full" / "metrics.json").read_text())["durable_checkpoints"]
    assert [Path(p).name for p in saved] == ["step=7.ckpt", "step=14.ckpt"]
    resumed = run_recipe(tmp_path / "resumed", *common, f"ckpt_path='{saved[0]}'",
                         "faults=at", "faults.events=[{step: 3, rank: 0}, {step: 11, rank: 0}]")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    metrics = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert metrics["failures_injected"] == 1 and metrics["failures_before_resume"] == 1
    assert "1 scheduled failure(s) before it (the first at step 3)" in resumed.stderr
    (recovery,) = metrics["recoveries"]
    # a window of the resumed run (or its initial snapshot, step 6), never one before it
    assert recovery["failed_step"] == 11 and 6 <= recovery["window_start"] < 11
    assert_states_equal(tmp_path / "full" / "final_state.pt",
                        tmp_path / "resumed" / "final_state.pt")
    losses_full = json.loads((tmp_path / "full" / "metrics.json").read_text())["loss"]
    losses_resumed = json.loads((tmp_path / "resumed" / "metrics.json").read_text())["loss"]
    assert losses_resumed == losses_full[7:]
    if layout:  # one process cannot resume a pp2 x ep2 checkpoint: one line, before training
        other = run_recipe(tmp_path / "other", *common[:3], f"ckpt_path='{saved[0]}'",
                           full_error=False)
        assert other.returncode == EXIT_USAGE, other.stderr[-2000:]
        assert ("was written by the layout pp=2 x dp=1 x ep=2 (4 ranks); this run's is 1 "
                "rank(s)") in other.stderr
        assert "Traceback" not in other.stderr


def test_durable_retention_keeps_only_the_newest_committed_checkpoints(tmp_path: Path) -> None:
    """A durable checkpoint every 3 steps, each committed by its manifest; only the newest
    ``durable_keep`` remain, and nothing a write leaves on the way (temporary files,
    parts)."""
    result = run_recipe(tmp_path, "trainer.max_steps=12", "checkpoint.window=2",
                        "checkpoint.durable_every=3", "checkpoint.durable_keep=2")
    assert result.returncode == 0, result.stderr[-4000:]
    saved = json.loads((tmp_path / "metrics.json").read_text())["durable_checkpoints"]
    assert [Path(p).name for p in saved] == ["step=9.ckpt", "step=12.ckpt"]
    assert sorted(p.name for p in (tmp_path / "durable").iterdir()) == [
        "step=12.ckpt", "step=12.manifest.json", "step=9.ckpt", "step=9.manifest.json"]
    for path in saved:
        verify(path)  # every byte as its manifest says


def test_checksum_threads_setting_reaches_the_snapshot_engine(tmp_path: Path) -> None:
    """``checkpoint.checksum_threads`` sets the threads each rank checksums with; left
    null, a rank takes its share of the cores (at most 8). ``checkpoint.helper_nice``
    reaches the coordinator the same way (19 unless set)."""
    result = run_recipe(tmp_path / "set", "checkpoint.checksum_threads=3",
                        "checkpoint.helper_nice=7",
                        "trainer.max_steps=4", "trainer.val_every=4")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((tmp_path / "set" / "metrics.json").read_text())
    assert metrics["checksum_threads"] == 3
    assert metrics["helper_nice"] == 7
    assert metrics["pieces_checksummed"] == metrics["pieces_issued"] > 0
    result = run_recipe(tmp_path / "auto", "trainer.max_steps=4", "trainer.val_every=4")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((tmp_path / "auto" / "metrics.json").read_text())
    assert metrics["checksum_threads"] == default_threads(1)
    assert metrics["helper_nice"] == DEFAULT_HELPER_NICE
