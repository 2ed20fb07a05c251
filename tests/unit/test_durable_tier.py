"""The durable tier's files: atomic writes, the commit by manifest, verification, retention
and the clean-up when a run starts."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from lightning_moe_ckpt.callbacks.durable_checkpoints import DurableCheckpoints
from lightning_moe_ckpt.core.files import (
    add_write_fault,
    remove_write_fault,
    write_atomically,
)
from lightning_moe_ckpt.errors import ConfigError, CorruptCheckpointError, NoUsableCheckpointError
from lightning_moe_ckpt.recovery.durable import newest_committed_durable
from lightning_moe_ckpt.recovery.manifest import (
    checkpoint_path,
    clean_directory,
    committed_steps,
    manifest_path,
    retain,
    try_commit,
    verify,
    write_part,
)

PP2 = {"pp": 2, "dp": 1, "dp_shard": 1, "ep": 1, "world_size": 2}


def _write_rank_files(root: Path, step: int, ranks: range, commit: bool = True,
                      payload: bytes = b"weights") -> Path:
    """``step=N.ckpt/rank<r>.ckpt`` for ``ranks`` of a pp=2 job, each with its part; the
    checkpoint committed by the last part when ``commit``."""
    checkpoint = checkpoint_path(root, step)
    for rank in ranks:
        name = f"rank{rank:05d}.ckpt"
        data = payload + bytes([rank, step % 256])
        record = write_atomically(checkpoint / name, lambda f, data=data: f.write(data))
        write_part(checkpoint, rank, 2, PP2, {f"{checkpoint.name}/{name}": record})
        if commit:
            try_commit(checkpoint, 2)
    return checkpoint


def test_a_failed_write_leaves_the_file_as_it_was_and_names_it(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "state.pt"
    record = write_atomically(target, lambda f: f.write(b"first"))
    assert record.size == 5 and target.read_bytes() == b"first"

    def full(path: Path, written: int) -> None:
        if written > 2:
            raise OSError(errno.ENOSPC, "No space left on device")

    add_write_fault(full)
    try:
        with pytest.raises(OSError) as caught:
            write_atomically(target, lambda f: (f.write(b"sec"), f.write(b"ond")))
    finally:
        remove_write_fault(full)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(target)
    assert target.read_bytes() == b"first"
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.pt"]  # no temporary


def test_a_checkpoint_is_committed_only_once_every_rank_wrote_its_part(tmp_path: Path) -> None:
    checkpoint = _write_rank_files(tmp_path, 6, range(1), commit=False)
    assert try_commit(checkpoint, 2) is None  # rank 1 has not written
    assert committed_steps(tmp_path) == [] and not manifest_path(checkpoint).exists()
    _write_rank_files(tmp_path, 6, range(1, 2))
    assert committed_steps(tmp_path) == [6]
    manifest = verify(checkpoint)
    assert manifest.step == 6 and manifest.layout == PP2
    assert sorted(manifest.files) == ["step=6.ckpt/rank00000.ckpt", "step=6.ckpt/rank00001.ckpt"]
    assert not (tmp_path / "step=6.ckpt.parts").exists()


def test_a_part_that_names_an_error_removes_the_checkpoint(tmp_path: Path) -> None:
    checkpoint = _write_rank_files(tmp_path, 6, range(1), commit=False)
    write_part(checkpoint, 1, 2, PP2, {}, error="OSError: [Errno 28] No space left on device")
    assert try_commit(checkpoint, 2) == "rank 1: OSError: [Errno 28] No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_verification_names_the_damaged_file_and_what_failed(tmp_path: Path) -> None:
    checkpoint = _write_rank_files(tmp_path, 6, range(2))
    file = checkpoint / "rank00001.ckpt"
    data = bytearray(file.read_bytes())
    data[3] ^= 0x01  # one flipped bit
    file.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError,
                       match=r"step=6\.ckpt is damaged: rank00001\.ckpt has CRC32C 0x"):
        verify(checkpoint)
    file.write_bytes(bytes(data[:-1]))
    with pytest.raises(CorruptCheckpointError, match=r"rank00001\.ckpt has 8 bytes where its "
                                                     r"manifest says 9"):
        verify(checkpoint)
    file.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"rank00001\.ckpt is missing"):
        verify(checkpoint)
    manifest = manifest_path(checkpoint)
    manifest.write_text(manifest.read_text().replace('"step": 6', '"step": 7'))
    with pytest.raises(CorruptCheckpointError, match=r"step=6\.manifest\.json is damaged \(its "
                                                     r"content does not match its CRC32C\)"):
        verify(checkpoint)


def test_a_start_removes_what_writes_cut_short_and_sets_a_newer_run_aside(
        tmp_path: Path) -> None:
    _write_rank_files(tmp_path, 3, range(2))
    _write_rank_files(tmp_path, 9, range(2))  # an abandoned run's newer checkpoint
    torn = _write_rank_files(tmp_path, 6, range(1), commit=False)  # rank 1 died writing
    (torn / ".rank00001.ckpt.tmp-123").write_bytes(b"half")
    clean_directory(tmp_path, start_step=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step=3.ckpt", "step=3.manifest.json", "superseded"]
    assert committed_steps(tmp_path) == [3]
    assert committed_steps(tmp_path / "superseded") == [9]
    verify(checkpoint_path(tmp_path / "superseded", 9))


def test_retention_removes_older_checkpoints_only_up_to_the_newest(tmp_path: Path) -> None:
    for step in (3, 6, 9):
        _write_rank_files(tmp_path, step, range(2))
    _write_rank_files(tmp_path, 4, range(1), commit=False)  # a write that failed
    assert retain(tmp_path, 9, keep=2) == [3, 4]
    assert committed_steps(tmp_path) == [6, 9]
    assert retain(tmp_path, 9, keep=1) == [6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=9.ckpt", "step=9.manifest.json"]


def test_the_newest_that_verifies_is_resumed_and_a_damaged_one_skipped_with_its_reason(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for step in (3, 6):
        _write_rank_files(tmp_path, step, range(2))
    newest = checkpoint_path(tmp_path, 6) / "rank00000.ckpt"
    newest.write_bytes(b"X" + newest.read_bytes()[1:])
    with caplog.at_level(logging.WARNING, "lightning_moe_ckpt"):
        found = newest_committed_durable(tmp_path, layout=PP2)
    assert found == str(checkpoint_path(tmp_path, 3))
    assert "skipping step=6.ckpt: durable checkpoint" in caplog.text
    assert "rank00000.ckpt has CRC32C" in caplog.text
    assert newest_committed_durable(tmp_path / "none") is None


def test_every_committed_checkpoint_damaged_stops_instead_of_starting_afresh(
        tmp_path: Path) -> None:
    checkpoint = _write_rank_files(tmp_path, 3, range(2))
    (checkpoint / "rank00001.ckpt").unlink()
    with pytest.raises(NoUsableCheckpointError,
                       match=r"holds 1 committed durable checkpoint\(s\) and none verifies .*"
                             r"rank00001\.ckpt is missing.*refusing to start afresh"):
        newest_committed_durable(tmp_path)


def test_a_checkpoint_of_another_layout_is_refused_naming_both(tmp_path: Path) -> None:
    _write_rank_files(tmp_path, 3, range(2))
    with pytest.raises(ConfigError, match=r"written by the layout pp=2 x dp=1 x ep=1 \(2 ranks\); "
                                          r"this run's is 1 rank\(s\)"):
        newest_committed_durable(tmp_path, layout={"world_size": 1})


def test_the_durable_cadence_is_a_function_of_the_step_alone() -> None:
    """Every 4th step, whoever asks and however often: a replacement that started at step
    13, a rank that replayed, a resumed job all take the same steps; step 0 never."""
    durable = DurableCheckpoints(4, "d", 2)
    assert [s for s in range(0, 30) if durable.due(s)] == [4, 8, 12, 16, 20, 24, 28]
    replacement = DurableCheckpoints(4, "d", 2)
    replacement.start(rank=3, start_step=13, fresh=False)
    assert [s for s in (13, 14, 16, 16, 20) if replacement.due(s)] == [16, 16, 20]
    assert not any(DurableCheckpoints(None, None, 2).due(s) for s in range(10))


@pytest.mark.parametrize(("every", "keep", "key"), [
    (0, 2, "checkpoint.durable_every=0"), (True, 2, "checkpoint.durable_every=True"),
    (2, 0, "checkpoint.durable_keep=0")])
def test_bad_durable_settings_are_refused_naming_the_key(every: object, keep: object,
                                                         key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        DurableCheckpoints(every, "d", keep)  # type: ignore[arg-type]


def test_a_fresh_start_at_step_0_over_committed_checkpoints_is_refused(tmp_path: Path) -> None:
    """Started again without its ckpt_path, a run would train from scratch over the
    checkpoints of the one it follows: refused, naming the directory and the newest; a
    resume (start step > 0) or a replacement joining the job goes on."""
    _write_rank_files(tmp_path, 6, range(2))
    with pytest.raises(ConfigError, match=r"checkpoint\.durable_dir=.* holds committed durable "
                                          r"checkpoints \(the newest: step=6\) and this run "
                                          r"starts afresh at step 0"):
        DurableCheckpoints(3, str(tmp_path), 2).start(rank=1, start_step=0, fresh=True)
    DurableCheckpoints(3, str(tmp_path), 2).start(rank=1, start_step=0, fresh=False)
    DurableCheckpoints(3, str(tmp_path), 2).start(rank=0, start_step=6, fresh=True)
    assert committed_steps(tmp_path) == [6]
