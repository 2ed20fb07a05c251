"""Run one training job from a composed recipe config, through the Trainer or Fabric.

:func:`run_training` is what ``recipes/train.py`` calls: it validates the config, builds
the corpus and the seekable sampler, trains with ``api=trainer`` (a LightningModule on
``lightning.Trainer``) or ``api=fabric`` (an explicit loop on ``lightning.Fabric``), and
writes the recipe contract's ``final_state.pt`` and ``metrics.json`` plus the training
plot into ``out_dir``. Both paths call the same iteration function and produce
bitwise-identical final states.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from lightning_moe_ckpt.data import (
    BatchLayout,
    SeekableSampler,
    TokenCorpus,
    stdlib_corpus,
    textfile_corpus,
    validation_batches,
)
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models.transformer import MoETransformer
from lightning_moe_ckpt.precision import MasterWeightAdamW
from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.history import TrainingHistory, ValidationRecord
from lightning_moe_ckpt.training.lightning_module import MoELanguageModule
from lightning_moe_ckpt.training.outputs import (
    FINAL_STATE,
    METRICS,
    PLOT,
    consolidated_state,
    plot_training,
    write_metrics,
)
from lightning_moe_ckpt.training.settings import DataSettings, RunSettings, settings_from_config
from lightning_moe_ckpt.training.telemetry import ValidationMetrics, evaluate, step_log_values

Batch = tuple[torch.Tensor, torch.Tensor]


class IterationDataset(Dataset[dict[str, Any]]):
    """Item ``t`` is iteration ``t``'s micro-batches: the data position is the step."""

    def __init__(self, sampler: SeekableSampler, stop: int, start: int = 0) -> None:
        self.sampler, self.start, self.stop = sampler, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> dict[str, Any]:
        iteration = self.start + index
        inputs, targets = self.sampler.iteration(iteration)
        return {"iteration": iteration, "inputs": inputs, "targets": targets}


class ListDataset(Dataset[Batch]):
    """A fixed list of validation batches as a map-style dataset."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Batch:
        return self.batches[index]


@dataclass
class TrainedState:
    """What a finished run hands to the output writers."""

    model: MoETransformer
    optimizer: MasterWeightAdamW
    step: int


def build_corpus(data: DataSettings) -> TokenCorpus:
    """The corpus named by ``data.name``."""
    if data.name == "textfile":
        return textfile_corpus(data.path, data.val_fraction)
    return stdlib_corpus(data.val_percent)


def build_data(settings: RunSettings) -> tuple[TokenCorpus, SeekableSampler, list[Batch]]:
    """The corpus, the training sampler and the fixed validation batches of a run."""
    corpus = build_corpus(settings.data)
    layout = BatchLayout(settings.global_batch, settings.layout.microbatches,
                         settings.layout.data_shards)
    sampler = SeekableSampler(corpus.train, settings.data.seq_len, layout, settings.seed)
    val = validation_batches(corpus.val, settings.data.seq_len,
                             settings.global_batch // settings.layout.microbatches,
                             settings.val_batches, settings.seed)
    return corpus, sampler, val


def build_dataloaders(settings: RunSettings, start_step: int = 0
                      ) -> tuple[DataLoader[dict[str, Any]], DataLoader[Batch]]:
    """``(train, validation)`` loaders; train item ``t`` is iteration ``start_step + t``."""
    _, sampler, val = build_data(settings)
    return _loaders(sampler, val, settings.max_steps, start_step)


def _loaders(sampler: SeekableSampler, val: list[Batch], stop: int, start: int = 0
             ) -> tuple[DataLoader[dict[str, Any]], DataLoader[Batch]]:
    train = DataLoader(IterationDataset(sampler, stop, start), batch_size=None)
    return train, DataLoader(ListDataset(val), batch_size=None)


def _csv_logger(settings: RunSettings) -> CSVLogger:
    return CSVLogger(save_dir=settings.out_dir, name="csv", version=0)


def _train_with_trainer(settings: RunSettings, sampler: SeekableSampler, val: list[Batch],
                        history: TrainingHistory) -> TrainedState:
    module = MoELanguageModule(settings, history)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_steps=settings.max_steps,
        logger=_csv_logger(settings), enable_checkpointing=False,
        enable_progress_bar=settings.progress_bar, enable_model_summary=False,
        num_sanity_val_steps=0, val_check_interval=settings.val_every,
        check_val_every_n_epoch=None, log_every_n_steps=settings.log_every,
        default_root_dir=settings.out_dir,
    )
    train_loader, val_loader = _loaders(sampler, val, settings.max_steps)
    trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader)
    if settings.max_steps % settings.val_every:
        trainer.validate(module, dataloaders=val_loader, verbose=False)
    engine = module._engine()
    return TrainedState(engine.model, engine.optimizer, trainer.global_step)


def _train_with_fabric(settings: RunSettings, sampler: SeekableSampler, val: list[Batch],
                       history: TrainingHistory) -> TrainedState:
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true",
                      loggers=_csv_logger(settings))
    fabric.launch()
    engine = TrainingEngine.local(settings)
    model, optimizer = engine.model, engine.optimizer
    _, wrapped_optimizer = fabric.setup(model, optimizer)
    layer_ids = list(range(settings.model.n_layers))
    metrics = ValidationMetrics()
    dataset = IterationDataset(sampler, settings.max_steps)
    steps = tqdm(range(settings.max_steps), desc="train", disable=not settings.progress_bar)
    for step in steps:
        batch = dataset[step]
        history.start_iteration()
        result = engine.train_iteration(batch["inputs"], batch["targets"], fabric.backward,
                                        wrapped_optimizer.step)
        history.record(result)
        done = step + 1
        if done % settings.log_every == 0:
            fabric.log_dict(step_log_values(result, layer_ids), step=done - 1)
            steps.set_postfix(loss=f"{float(result.loss):.3f}")
        if done % settings.val_every == 0 or done == settings.max_steps:
            loss, perplexity = evaluate(model, val, metrics)
            history.validation.append(ValidationRecord(done, loss, perplexity))
            fabric.log_dict({"val/loss": loss, "val/perplexity": perplexity}, step=done - 1)
    for logger in fabric.loggers:
        logger.finalize("success")
    return TrainedState(model, optimizer, settings.max_steps)


def run_training(cfg: DictConfig) -> dict[str, Any]:
    """Train as the recipe config says and write the run's artifacts; returns the metrics."""
    settings = settings_from_config(cfg)
    if settings.layout.world_size != 1:
        layout = settings.layout
        raise ConfigError(
            f"parallel.pp={layout.pp} x parallel.dp={layout.dp} x parallel.ep={layout.ep} "
            f"needs {layout.world_size} processes; this version trains single-process "
            "layouts only (pp=dp=ep=1)")
    corpus, sampler, val = build_data(settings)
    out_dir = Path(settings.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    history = TrainingHistory()
    train = _train_with_trainer if settings.api == "trainer" else _train_with_fabric
    trained = train(settings, sampler, val, history)
    torch.save(consolidated_state(trained.model, trained.optimizer, trained.step),
               out_dir / FINAL_STATE)
    metrics = write_metrics(out_dir / METRICS, settings, history,
                            {"data": corpus.name, "data_fingerprint": corpus.fingerprint})
    plot_training(out_dir / PLOT, history, f"{settings.model.name}, {settings.api}")
    return metrics
