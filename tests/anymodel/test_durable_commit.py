"""A user's LightningModule under the durable tier: writes slower than the steps never leave
the directory without a committed checkpoint; a full disk names its first failing write,
keeps the committed one and does not stop training; a damaged checkpoint is refused."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import lightning_moe_ckpt.callbacks.durable_checkpoints as durable_module
from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.errors import CorruptCheckpointError
from lightning_moe_ckpt.recovery import newest_committed_durable
from lightning_moe_ckpt.recovery.manifest import checkpoint_path, committed_steps, verify
from lightning_moe_ckpt.testing import FailureInjector
from lightning_moe_ckpt.testing.faults import AtSchedule
from tests.anymodel.models import LMModule, modulelist_moe, random_token_loader

STEPS = 10


def _fit(steps: int, durable: Path, every: int = 2, keep: int = 2, ckpt: str | None = None,
         faults: list[dict[str, Any]] | None = None
         ) -> tuple[dict[str, torch.Tensor], SparseCheckpointing]:
    torch.manual_seed(0)
    module = LMModule(modulelist_moe(seed=0))
    checkpointing = SparseCheckpointing("moevement", replicas=0, window=3,
                                        durable_every=every, durable_dir=str(durable),
                                        durable_keep=keep)
    callbacks: list[L.Callback] = [checkpointing]
    if faults:
        callbacks.append(FailureInjector(AtSchedule(faults), checkpointing))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, random_token_loader(n_batches=STEPS), ckpt_path=ckpt)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, checkpointing


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    params, _ = _fit(STEPS, tmp_path_factory.mktemp("reference"), every=100)
    return params


def _assert_equal(reference: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    assert reference.keys() == params.keys()
    for name, value in reference.items():
        assert torch.equal(value, params[name]), name


def test_writes_slower_than_the_steps_always_leave_a_committed_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each file takes 0.3 s to write (much longer than a step), a checkpoint is due every
    step and only one is kept: a watcher that looks every millisecond sees a committed,
    verifying checkpoint at every moment once the first was committed; a due checkpoint
    waits for the previous one's write (at most one in flight) and says so."""
    slow_save = durable_module.save_atomically

    def delayed(content: Any, target: Path) -> Any:
        time.sleep(0.3)
        return slow_save(content, target)

    monkeypatch.setattr(durable_module, "save_atomically", delayed)
    seen: list[list[int]] = []
    gaps: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            steps = committed_steps(tmp_path)
            if seen and seen[-1] and not steps:
                gaps.append(f"no committed checkpoint after {seen[-1]}")
            if steps:
                try:
                    verify(checkpoint_path(tmp_path, steps[-1]))
                except CorruptCheckpointError as error:
                    if steps[-1] in committed_steps(tmp_path):  # not removed meanwhile
                        gaps.append(str(error))
            seen.append(steps)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with caplog.at_level(logging.WARNING, "lightning_moe_ckpt"):
            _, checkpointing = _fit(6, tmp_path, every=1, keep=1)
    finally:
        stop.set()
        watcher.join(5)
    assert not gaps, gaps[:3]
    assert committed_steps(tmp_path) == [6]
    assert {s[-1] for s in seen if s} == {1, 2, 3, 4, 5, 6}  # each was the newest a while
    assert checkpointing.durable.waits_s  # a due checkpoint waited for the previous write
    assert "waited" in caplog.text and "previous one to be written" in caplog.text


def test_a_full_disk_names_the_first_failing_write_and_the_committed_one_resumes_bitwise(
        tmp_path: Path, reference: dict[str, torch.Tensor],
        caplog: pytest.LogCaptureFixture) -> None:
    """The durable directory's disk is full from step 5 on: the checkpoints of steps 6 and
    8 fail (the first named with its path, step and errno, once), training goes on to the
    end, and the committed step 4 resumes to the same state as the run never stopped."""
    durable = tmp_path / "durable"
    with caplog.at_level(logging.ERROR, "lightning_moe_ckpt"):
        _, checkpointing = _fit(STEPS, durable, every=2,
                                faults=[{"step": 5, "rank": 0, "kind": "disk_full"}])
    assert committed_steps(durable) == [2, 4]
    failures = checkpointing.durable.failures
    assert [f["step"] for f in failures] == [6, 8, 10]
    assert failures[0]["path"] == str(durable / "step=6.ckpt")
    assert "[Errno 28] No space left on device" in failures[0]["error"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "the checkpoint of step 6" in errors[0]  # the first, once
    assert "step=6.ckpt" in errors[0] and "Errno 28" in errors[0]
    assert sorted(p.name for p in durable.iterdir()) == [
        "step=2.ckpt", "step=2.manifest.json", "step=4.ckpt", "step=4.manifest.json"]
    newest = newest_committed_durable(durable, layout={"world_size": 1})
    assert newest == str(durable / "step=4.ckpt")
    resumed, _ = _fit(STEPS, tmp_path / "resumed", every=100, ckpt=newest)
    _assert_equal(reference, resumed)


def test_ckpt_path_to_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    _fit(4, tmp_path, every=2)
    damaged = tmp_path / "step=4.ckpt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError,
                       match=r"durable checkpoint .*step=4\.ckpt is damaged: step=4\.ckpt has "
                             r"CRC32C"):
        _fit(STEPS, tmp_path / "resumed", every=100, ckpt=str(damaged))
