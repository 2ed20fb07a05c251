"""A rank's training engine: its model part, optimizer, LR schedule, operators and executor.

The Trainer's LightningModule and the Fabric loop both drive a :class:`TrainingEngine`;
:meth:`TrainingEngine.local` builds the single-process engine, and the parallel strategy
builds one per rank over the same class, so every front end and every layout runs the
same iteration function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

from lightning_moe_ckpt.models.transformer import MoETransformer
from lightning_moe_ckpt.operators import OperatorRegistry
from lightning_moe_ckpt.precision import MasterWeightAdamW
from lightning_moe_ckpt.training.core import (
    IterationResult,
    build_model,
    build_optimizer,
    build_scheduler,
    train_iteration,
)
from lightning_moe_ckpt.training.executor import Backward, Executor, LocalExecutor
from lightning_moe_ckpt.training.settings import RunSettings


@dataclass
class TrainingEngine:
    """Everything one rank needs to run training iterations."""

    settings: RunSettings
    model: MoETransformer
    optimizer: MasterWeightAdamW
    scheduler: LambdaLR
    executor: Executor

    @classmethod
    def local(cls, settings: RunSettings) -> TrainingEngine:
        """The single-process engine (the reference for every parallel layout)."""
        model = build_model(settings.model, settings.precision, settings.seed)
        return cls.around(settings, model, LocalExecutor(model))

    @classmethod
    def around(cls, settings: RunSettings, model: MoETransformer,
               executor: Executor) -> TrainingEngine:
        """An engine over an already built (possibly partial) model and its executor."""
        optimizer = build_optimizer(model, settings.precision, settings.optim)
        scheduler = build_scheduler(optimizer, settings.optim, settings.max_steps)
        return cls(settings, model, optimizer, scheduler, executor)

    @property
    def registry(self) -> OperatorRegistry:
        """The operators this rank holds (freeze/activate them by name)."""
        return OperatorRegistry(self.model)

    def train_iteration(self, inputs: torch.Tensor, targets: torch.Tensor,
                        backward: Backward | None = None,
                        step: Callable[[], object] | None = None,
                        clip_coef: torch.Tensor | None = None) -> IterationResult:
        """One optimizer step. ``backward``/``step`` let Lightning wrap them (defaults:
        ``loss.backward()`` and the raw optimizer step)."""
        return train_iteration(
            self.executor, self.optimizer, self.scheduler, inputs, targets,
            backward if backward is not None else _plain_backward,
            step if step is not None else self.optimizer.step,
            self.settings.optim.max_grad_norm, clip_coef)


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()
