"""A user's periodic checkpointing (the benchmark's peers) when a save fails: the job ends
with the save's own error, as Lightning's ``AsyncCheckpointIO`` and torchtitan's
checkpointer end it, instead of waiting for the save forever or restarting from it."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_moe_ckpt.training.engine import TrainingEngine
from moe_recipes.comparisons import ComparisonCheckpointing
from moe_recipes.settings import RunSettings
from tests.distributed.workloads import make_settings, whole_batch_sampler

FAILING_STEP = 3  # the save of the state after three optimizer steps fails
DISK_FULL = OSError(28, "No space left on device")


def _train(peer: ComparisonCheckpointing, engine: TrainingEngine, settings: RunSettings) -> None:
    """The run's iterations with a save after each (``k`` = 1), then wait for the saves."""
    sampler = whole_batch_sampler(settings)
    peer.begin()
    while engine.step < settings.max_steps:
        peer.before_iteration(engine.step)
        engine.train_iteration(*sampler.iteration(engine.step))
        peer.after_iteration(0.01)
    peer.close()


def _failing_save(original: Any) -> Any:
    def save(self: Any, checkpoint: dict[str, Any], path: Any, *args: Any) -> None:
        if Path(path).name == f"step-{FAILING_STEP}.ckpt":
            raise DISK_FULL
        original(self, checkpoint, path, *args)
    return save


def _failing_async_save(original: Any) -> Any:
    def async_save(state: Any, *, checkpoint_id: Any, **kwargs: Any) -> Future[Any]:
        if Path(checkpoint_id).name != f"step-{FAILING_STEP}":
            result: Future[Any] = original(state, checkpoint_id=checkpoint_id, **kwargs)
            return result
        failed: Future[Any] = Future()
        failed.set_exception(DISK_FULL)
        return failed
    return async_save


@pytest.mark.timeout(120)  # before the fix the Lightning case waited for the save forever
@pytest.mark.parametrize("policy,steps", [("lightning", 6), ("dcp", 6),
                                          # the failed save is the last: close() reports it
                                          ("lightning", FAILING_STEP), ("dcp", FAILING_STEP)])
def test_a_failed_save_ends_the_job_with_its_error(policy: str, steps: int, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if policy == "lightning":
        monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint",
                            _failing_save(TorchCheckpointIO.save_checkpoint))
    else:
        monkeypatch.setattr(dcp, "async_save", _failing_async_save(dcp.async_save))
    settings = make_settings(1, 1, 1, steps=steps)
    engine = TrainingEngine.local(settings)
    peer = ComparisonCheckpointing(policy, engine, tmp_path, 0, 1, set(), warmup=1, interval=1)
    with pytest.raises(OSError, match="No space left on device"):
        _train(peer, engine, settings)
    # The checkpoints before the failed one were kept: none was pruned for a failed save.
    names = {path.name for path in tmp_path.rglob("step-*")}
    assert f"step-{FAILING_STEP - 1}" + (".ckpt" if policy == "lightning" else "") in names
