"""A user's LightningModule resumed from a durable checkpoint reads on where it was: its
own DataLoader (shuffled by a seeded generator, or in order) and a per-step LR scheduler,
checkpointed by the durable tier mid-epoch (or after an epoch's last batch), stopped and
resumed, ends bitwise equal to the run that was never interrupted."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.recovery import newest_committed_durable
from tests.anymodel.models import LMModule, qwen3_moe

STEPS = 20


class ScheduledLM(LMModule):
    """The Qwen3-MoE module with an LR scheduler stepped every optimizer step."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0 / (1.0 + t))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Batches(L.Callback):
    """The first token of every sequence of every step's batch."""

    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self.seen[trainer.global_step] = batch["input_ids"][:, 0].tolist()


def _loader(rows: int, generator: bool = True, shuffle: bool = True) -> DataLoader[Any]:
    tokens = torch.randint(0, 64, (rows, 9), generator=torch.Generator().manual_seed(1))
    return DataLoader([{"input_ids": row} for row in tokens], batch_size=2, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(0) if generator else None)


Fitted = tuple[dict[str, torch.Tensor], dict[str, Any], dict[int, list[int]]]


def _fit(steps: int, durable: Path, rows: int, ckpt: str | None = None,
         shuffle: bool = True, every: int = 1) -> Fitted:
    torch.manual_seed(0)
    module = ScheduledLM(qwen3_moe(seed=0))
    checkpointing = SparseCheckpointing("moevement", replicas=0, window=3,
                                        durable_every=every, durable_dir=str(durable))
    batches = Batches()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[checkpointing, batches])
    trainer.fit(module, _loader(rows, shuffle=shuffle), ckpt_path=ckpt)
    optimizer = trainer.optimizers[0]
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    state = {n: {k: v.clone() for k, v in optimizer.state[p].items()}
             for n, p in module.named_parameters() if p in optimizer.state}
    return params, state, batches.seen


@pytest.mark.parametrize(("rows", "stop_at", "resumed_at", "batches_trained"), [
    (16, 12, 10, 2),  # 8 batches an epoch: step 10 is the third batch of epoch 1
    (14, 8, 7, 7),  # 7 batches an epoch: step 7 follows epoch 0's last batch
], ids=["mid-epoch", "after-an-epoch"])  # a durable checkpoint every resumed_at steps
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
def test_a_resumed_run_reads_the_same_batches_and_ends_bitwise(
        tmp_path: Path, rows: int, stop_at: int, resumed_at: int,
        batches_trained: int, shuffle: bool) -> None:
    full, full_state, full_batches = _fit(STEPS, tmp_path / "full", rows, shuffle=shuffle)
    _fit(stop_at, tmp_path / "stopped", rows, shuffle=shuffle,
         every=resumed_at)  # its durable checkpoints remain
    newest = newest_committed_durable(tmp_path / "stopped", layout={"world_size": 1})
    assert newest is not None and Path(newest).name == f"step={resumed_at}.ckpt"
    position = torch.load(newest, weights_only=False)["lightning_moe_ckpt/data_position"]
    assert position["batches"] == batches_trained
    resumed, resumed_state, resumed_batches = _fit(STEPS, tmp_path / "resumed", rows, newest,
                                                   shuffle=shuffle)
    assert min(resumed_batches) == resumed_at
    assert resumed_batches == {s: b for s, b in full_batches.items() if s >= resumed_at}
    for name, tensor in full.items():
        assert torch.equal(resumed[name], tensor), name
    for name, state in full_state.items():
        for key, value in state.items():
            assert torch.equal(resumed_state[name][key], value), (name, key)


@pytest.mark.parametrize("durable_every", [1, None], ids=["durable", "no-checkpoint"])
def test_a_loader_it_cannot_position_is_named_when_a_checkpoint_is_taken(
        tmp_path: Path, durable_every: int | None) -> None:
    position_warning = r"shuffles without a generator of its own"
    module = ScheduledLM(qwen3_moe(seed=0))
    checkpointing = SparseCheckpointing("moevement", replicas=0, window=3,
                                        durable_every=durable_every,
                                        durable_dir=str(tmp_path))
    trainer = L.Trainer(max_steps=10, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[checkpointing])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, _loader(16, generator=False))
    named = [w for w in caught if re.search(position_warning, str(w.message))]
    assert (len(checkpointing.durable.committed()) > 1) == bool(durable_every)
    assert len(named) == (1 if durable_every else 0)  # once, however many checkpoints
