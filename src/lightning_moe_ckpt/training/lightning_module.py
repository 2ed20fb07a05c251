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

from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.history import TrainingHistory, ValidationRecord
from lightning_moe_ckpt.training.settings import RunSettings
from lightning_moe_ckpt.training.telemetry import ValidationMetrics, step_log_values


class MoELanguageModule(L.LightningModule):
    """Trains a :class:`~lightning_moe_ckpt.models.MoETransformer` on next-byte prediction."""

    def __init__(self, settings: RunSettings, history: TrainingHistory | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.settings = settings
        self.engine: TrainingEngine | None = None
        self.history = history if history is not None else TrainingHistory()
        self.val_metrics = ValidationMetrics()

    @override
    def configure_model(self) -> None:
        if self.engine is not None:
            return
        self.engine = TrainingEngine.local(self.settings)
        self.model = self.engine.model
        self._layer_ids = list(range(self.settings.model.n_layers))

    @override
    def configure_optimizers(self) -> Any:
        engine = self._engine()
        return {"optimizer": engine.optimizer,
                "lr_scheduler": {"scheduler": engine.scheduler, "interval": "step"}}

    def _engine(self) -> TrainingEngine:
        if self.engine is None:
            raise RuntimeError("configure_model() has not run: attach the module to a Trainer")
        return self.engine

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        if batch["iteration"] != self.global_step:
            raise RuntimeError(f"data position {batch['iteration']} does not match "
                               f"optimizer step {self.global_step}")
        wrapped = self.optimizers()
        assert not isinstance(wrapped, list)
        self.history.start_iteration()
        result = self._engine().train_iteration(batch["inputs"], batch["targets"],
                                                self.manual_backward, wrapped.step)
        self.history.record(result)
        values = step_log_values(result, self._layer_ids)
        self.log("train/loss", values.pop("train/loss"), prog_bar=True)
        self.log_dict(values)

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.val_metrics.update(self._engine().model(inputs), targets)

    @override
    def on_validation_epoch_end(self) -> None:
        loss, perplexity = self.val_metrics.compute_and_reset()
        self.history.validation.append(ValidationRecord(self.global_step, loss, perplexity))
        self.log_dict({"val/loss": loss, "val/perplexity": perplexity}, prog_bar=True)
