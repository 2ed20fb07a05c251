"""LightningModule for the Trainer path.

The module uses manual optimization: one ``training_step`` is one full iteration over all
micro-batches (forward/backward, possibly through a pipeline schedule, gradient sync,
clipping, optimizer and LR-scheduler step) run by its
:class:`~lightning_moe_ckpt.training.engine.TrainingEngine`. ``configure_model`` asks the
Trainer's strategy for the engine when it is an
:class:`~lightning_moe_ckpt.training.engine.EngineProvider` (``MoEParallelStrategy``: a
rank's share of a pp x dp x ep layout) and builds the single-process engine otherwise. The data
loaders come from the seekable sampler, sharded by the strategy's data shard, so the module keeps
the data position equal to the optimizer step on every rank.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_moe_ckpt.core.target import IterationAborted, StepIndexedData
from lightning_moe_ckpt.targets.lightning import align_trainer_step
from lightning_moe_ckpt.training.data import IterationDataset, RunData, build_data
from lightning_moe_ckpt.training.engine import EngineProvider, TrainingEngine
from lightning_moe_ckpt.training.history import TrainingHistory, ValidationRecord
from lightning_moe_ckpt.training.iteration import language_model_loss
from lightning_moe_ckpt.training.settings import TrainingSettings
from lightning_moe_ckpt.training.step_log import ValidationMetrics, evaluate, step_log_values


class MoELanguageModule(StepIndexedData, L.LightningModule):
    """Trains a :class:`~lightning_moe_ckpt.models.MoETransformer` on next-byte prediction.

    Args:
        settings: The run's settings.
        history: Collects what the end-of-run report needs; ``None``: a new one.
        data: The run's corpus and samplers; ``None``: built from ``settings`` on first
            use.
    """

    def __init__(self, settings: TrainingSettings, history: TrainingHistory | None = None,
                 data: RunData | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.settings = settings
        self.history = history if history is not None else TrainingHistory()
        self.engine: TrainingEngine | None = None
        self.data_shard = 0
        self._data = data
        self.val_metrics = ValidationMetrics()
        self._layer_ids = list(range(settings.model.n_layers))

    @override
    def configure_model(self) -> None:
        if self.engine is not None:
            return
        strategy = self.trainer.strategy
        if isinstance(strategy, EngineProvider):  # e.g. MoEParallelStrategy
            self.engine = strategy.build_engine(self.settings)
            self.data_shard = strategy.data_shard
        else:
            # Built on the device: a MasterWeightAdamW makes its masters where it is built.
            self.engine = TrainingEngine.local(self.settings, device=strategy.root_device)
        self.model = self.engine.model
        # Replay reads this rank's batch of a step from the seekable sampler.
        self.engine.batch = lambda t: self.run_data().train.iteration(t, self.data_shard)

    def engine_or_raise(self) -> TrainingEngine:
        """The rank's engine (built by ``configure_model``)."""
        return self._engine()

    def _engine(self) -> TrainingEngine:
        if self.engine is None:
            raise RuntimeError("configure_model() has not run: attach the module to a Trainer")
        return self.engine

    def run_data(self) -> RunData:
        """The run's samplers (built on first use when not given)."""
        if self._data is None:
            self._data = build_data(self.settings)
        return self._data

    @override
    def configure_optimizers(self) -> Any:
        engine = self._engine()
        return {"optimizer": engine.optimizer,
                "lr_scheduler": {"scheduler": engine.scheduler, "interval": "step"}}

    @override
    def train_dataloader(self) -> DataLoader[dict[str, Any]]:
        # The data position is the optimizer step: a resumed run continues where the
        # checkpoint left off. max_steps items from there: Lightning restores its count of
        # the epoch's batches too, and a shorter epoch would end (and restart) early.
        start = self.trainer.global_step
        dataset = IterationDataset(self.run_data().train, start + self.settings.max_steps,
                                   start=start, shard=self.data_shard)
        return DataLoader(dataset, batch_size=None)

    @override
    def val_dataloader(self) -> DataLoader[dict[str, Any]]:
        dataset = IterationDataset(self.run_data().val, self.settings.val_batches,
                                   shard=self.data_shard)
        return DataLoader(dataset, batch_size=None)

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        if batch["iteration"] != self.global_step:
            raise RuntimeError(f"data position {batch['iteration']} does not match "
                               f"optimizer step {self.global_step}")
        wrapped = self.optimizers()
        assert not isinstance(wrapped, list)
        engine = self._engine()
        inputs, targets = batch["inputs"], batch["targets"]
        while True:
            self.history.start_iteration()
            try:
                result = engine.train_iteration(inputs, targets, self.manual_backward,
                                                wrapped.step)
                break
            except IterationAborted:  # a peer really failed and the job recovered
                align_trainer_step(self.trainer, engine.step, batches=False)
                assert engine.batch is not None  # configure_model set it
                inputs, targets = engine.batch(engine.step)
        self.history.record(result)
        values = step_log_values(result, self._layer_ids)
        self.log("train/loss", values.pop("train/loss"), prog_bar=True, rank_zero_only=True)
        self.log_dict(values, rank_zero_only=True)

    @override
    def on_train_start(self) -> None:
        # A resumed run continues the step count (data position, snapshot steps, log tags).
        self._engine().set_step(self.global_step)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.val_metrics.update(*self._engine().executor.evaluate(
            batch["inputs"], batch["targets"], language_model_loss))

    @override
    def on_validation_epoch_end(self) -> None:
        loss, perplexity = self.val_metrics.compute_and_reset()
        self.history.validation.append(ValidationRecord(self.global_step, loss, perplexity))
        self.log_dict({"val/loss": loss, "val/perplexity": perplexity}, prog_bar=True,
                      rank_zero_only=True)

    @override
    def on_train_end(self) -> None:
        # Validate the final state unless the last step was a validation step (all ranks
        # take part: validation runs through the same collectives as training).
        if not self.history.validation or self.history.validation[-1].step != self.global_step:
            dataset = IterationDataset(self.run_data().val, self.settings.val_batches,
                                       shard=self.data_shard)
            loss, perplexity = evaluate(self._engine().executor, dataset, self.val_metrics,
                                        self.device)
            self.history.validation.append(
                ValidationRecord(self.global_step, loss, perplexity))
