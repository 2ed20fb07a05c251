"""The durable tier through the recipe: a damaged newest checkpoint is skipped by the
automatic resume and refused as ``ckpt_path``, every one damaged stops the run; a full disk
names its first failing write and leaves a committed checkpoint that resumes bitwise
(durable tier and CheckFreq's disk snapshots alike)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_moe_ckpt.failures.protocol import EXIT_UNRECOVERABLE
from lightning_moe_ckpt.recovery.manifest import committed_steps
from tests.recipes.test_train_recipe import assert_states_equal, run_recipe

pytestmark = pytest.mark.slow

COMMON = ("trainer.max_steps=10", "checkpoint.window=3", "trainer.val_every=10")
DURABLE = (*COMMON, "checkpoint.durable_every=4")


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ten steps with a durable checkpoint every 4: steps 4 and 8 committed."""
    out = tmp_path_factory.mktemp("golden")
    result = run_recipe(out, *DURABLE)
    assert result.returncode == 0, result.stderr[-4000:]
    assert committed_steps(out / "durable") == [4, 8]
    return out


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x04
    path.write_bytes(bytes(data))


def _error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if "ERROR" in line]


def test_a_damaged_checkpoint_is_skipped_refused_as_ckpt_path_and_none_usable_stops(
        tmp_path: Path, golden: Path) -> None:
    job = tmp_path / "job"
    shutil.copytree(golden / "durable", job / "durable")
    _flip_a_byte(job / "durable" / "step=8.ckpt")
    refused = run_recipe(tmp_path / "refused", *COMMON,
                         f"ckpt_path='{job / 'durable' / 'step=8.ckpt'}'")
    assert refused.returncode == EXIT_UNRECOVERABLE
    (line,) = _error_lines(refused)
    assert "step=8.ckpt is damaged: step=8.ckpt has CRC32C" in line
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "refused" / "metrics.json").exists()

    resumed = run_recipe(job, *DURABLE)  # the same command again: resumes by itself
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "skipping step=8.ckpt: durable checkpoint" in resumed.stderr
    assert "has CRC32C" in resumed.stderr
    assert "resuming from the newest committed durable checkpoint" in resumed.stderr
    assert f"{job / 'durable' / 'step=4.ckpt'}" in resumed.stderr
    assert json.loads((job / "metrics.json").read_text())["steps"] == 6  # steps 4 to 9
    assert_states_equal(golden / "final_state.pt", job / "final_state.pt")

    for step in committed_steps(job / "durable"):
        _flip_a_byte(job / "durable" / f"step={step}.ckpt")
    (job / "metrics.json").unlink()
    stopped = run_recipe(job, *DURABLE)
    assert stopped.returncode == EXIT_UNRECOVERABLE
    (line,) = _error_lines(stopped)
    assert "holds 2 committed durable checkpoint(s) and none verifies" in line
    assert "refusing to start afresh" in line
    assert not (job / "metrics.json").exists()  # no training from step 0


@contextlib.contextmanager
def _small_disk(path: Path, size: int) -> Iterator[bool]:
    """A tmpfs of ``size`` bytes at ``path`` where this machine lets one be mounted
    (True), else a plain directory (False: the test injects the full disk; also with
    ``MOE_TEST_NO_MOUNT`` set, to run that path)."""
    path.mkdir(parents=True)
    mounted = "MOE_TEST_NO_MOUNT" not in os.environ and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=False)


def test_a_full_disk_names_the_failing_write_trains_on_and_the_committed_one_resumes(
        tmp_path: Path, golden: Path) -> None:
    """The durable directory on a disk that holds one checkpoint and a half: the one of
    step 4 is committed, the one of step 8 runs out of space (named with its step and
    errno), training ends as it would have, and started again the job resumes from step
    4 and ends bitwise."""
    size = (golden / "durable" / "step=8.ckpt").stat().st_size
    with _small_disk(tmp_path / "disk", size * 3 // 2) as mounted:
        durable = tmp_path / "disk" / "durable"
        command = (*DURABLE, f"checkpoint.durable_dir={durable}")
        if not mounted:  # the disk fills at step 5, after step 4's checkpoint
            command = (*command, "faults=at",
                       "faults.events=[{step: 5, rank: 0, kind: disk_full}]")
        full = run_recipe(tmp_path / "job", *command)
        assert full.returncode == 0, full.stderr[-4000:]
        assert "could not write the checkpoint of step 8 (OSError: [Errno 28]" in full.stderr
        assert committed_steps(durable) == [4]
        assert sorted(p.name for p in durable.iterdir()) == ["step=4.ckpt",
                                                             "step=4.manifest.json"]
        assert_states_equal(golden / "final_state.pt", tmp_path / "job" / "final_state.pt")
        again = run_recipe(tmp_path / "job", *DURABLE, f"checkpoint.durable_dir={durable}")
        assert again.returncode == 0, again.stderr[-4000:]
        assert f"{durable / 'step=4.ckpt'}" in again.stderr
        assert_states_equal(golden / "final_state.pt", tmp_path / "job" / "final_state.pt")


def test_checkfreq_on_a_full_disk_names_the_failing_write_and_recovers_bitwise(
        tmp_path: Path, golden: Path) -> None:
    """CheckFreq's disk snapshots fail from step 5 on (the first named, once); a failure at
    step 8 recovers from the newest snapshot written before, without waiting on the writes
    that failed, and ends bitwise."""
    result = run_recipe(tmp_path, "trainer.max_steps=10", "trainer.val_every=10",
                        "checkpoint=checkfreq", "checkpoint.initial_interval=1",
                        "faults=at", "faults.events=[{step: 5, rank: 0, kind: disk_full}, "
                        "{step: 8, rank: 0}]")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.count("disk snapshot of step 5 not written (OSError: [Errno 28]") == 1
    (recovery,) = json.loads((tmp_path / "metrics.json").read_text())["recoveries"]
    assert recovery["failed_step"] == 8 and recovery["window_start"] < 5
    assert_states_equal(golden / "final_state.pt", tmp_path / "final_state.pt")
