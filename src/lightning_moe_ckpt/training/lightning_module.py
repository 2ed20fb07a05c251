"""LightningModule for the Trainer path.

The module uses manual optimization: one ``training_step`` is one full iteration over all
micro-batches (forward/backward per micro-batch, gradient scaling, clipping, optimizer and
LR-scheduler step) run by :func:`~lightning_moe_ckpt.training.core.train_iteration`. That
is what lets a pipeline schedule own forward and backward later, and it keeps the Trainer
path bitwise identical to the Fabric loop, which calls the same function.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_moe_ckpt.precision import MasterWeightAdamW
from lightning_moe_ckpt.training.core import (
    build_model,
    build_optimizer,
    build_scheduler,
    train_iteration,
)
from lightning_moe_ckpt.training.history import TrainingHistory, ValidationRecord
from lightning_moe_ckpt.training.settings import RunSettings
from lightning_moe_ckpt.training.telemetry import ValidationMetrics, step_log_values


class MoELanguageModule(L.LightningModule):
    """Trains a :class:`~lightning_moe_ckpt.models.MoETransformer` on next-byte prediction."""

    def __init__(self, settings: RunSettings, history: TrainingHistory | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.settings = settings
        self.model = build_model(settings.model, settings.precision, settings.seed)
        self.history = history if history is not None else TrainingHistory()
        self.val_metrics = ValidationMetrics()
        self._layer_ids = sorted(self.model.moe_layers())

    @override
    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer(self.model, self.settings.precision, self.settings.optim)
        scheduler = build_scheduler(optimizer, self.settings.optim, self.settings.max_steps)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @property
    def master_optimizer(self) -> MasterWeightAdamW:
        """The unwrapped master-weight optimizer."""
        optimizer = self.optimizers(use_pl_optimizer=False)
        assert isinstance(optimizer, MasterWeightAdamW)
        return optimizer

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        if batch["iteration"] != self.global_step:
            raise RuntimeError(f"data position {batch['iteration']} does not match "
                               f"optimizer step {self.global_step}")
        wrapped = self.optimizers()
        assert not isinstance(wrapped, list)
        scheduler = self.lr_schedulers()
        assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
        self.history.start_iteration()
        result = train_iteration(self.model, self.master_optimizer, scheduler,
                                 batch["inputs"], batch["targets"], self.manual_backward,
                                 wrapped.step, self.settings.optim.max_grad_norm)
        self.history.record(result)
        values = step_log_values(result, self._layer_ids)
        self.log("train/loss", values.pop("train/loss"), prog_bar=True)
        self.log_dict(values)

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.val_metrics.update(self.model(inputs), targets)

    @override
    def on_validation_epoch_end(self) -> None:
        loss, perplexity = self.val_metrics.compute_and_reset()
        self.history.validation.append(ValidationRecord(self.global_step, loss, perplexity))
        self.log_dict({"val/loss": loss, "val/perplexity": perplexity}, prog_bar=True)
