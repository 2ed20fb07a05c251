"""A rank's training engine: its model part, optimizer, LR schedule, operators and executor.

The Trainer's LightningModule and the Fabric loop both drive a :class:`TrainingEngine`;
:meth:`TrainingEngine.local` builds the single-process engine, and the parallel strategy
builds one per rank over the same class, so every front end and every layout runs the
same iteration function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

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


class StepHooks(Protocol):
    """Observers of the optimizer step (the snapshot engine is one)."""

    def before_optimizer_step(self, step: int) -> None:
        """Called right before optimizer step ``step`` mutates any state."""

    def after_optimizer_step(self, step: int, result: IterationResult) -> None:
        """Called right after optimizer step ``step`` (and the LR-scheduler step)."""


@dataclass
class TrainingEngine:
    """Everything one rank needs to run training iterations.

    ``step`` counts completed optimizer steps; iteration ``step`` reads data batch
    ``step`` and performs optimizer step ``step`` (0-based).
    """

    settings: RunSettings
    model: MoETransformer
    optimizer: MasterWeightAdamW
    scheduler: LambdaLR
    executor: Executor
    step: int = 0
    hooks: list[StepHooks] = field(default_factory=list)

    @classmethod
    def local(cls, settings: RunSettings,
              device: torch.device | str = "cpu") -> TrainingEngine:
        """The single-process engine (the reference for every parallel layout)."""
        model = build_model(settings.model, settings.precision, settings.seed).to(device)
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
        for hook in list(self.hooks):  # e.g. failure injection, which may recover first
            before_iteration = getattr(hook, "before_iteration", None)
            if before_iteration is not None:
                before_iteration(self.step)
        optimizer_step = step if step is not None else self.optimizer.step
        index = self.step

        def hooked_step() -> None:
            for hook in self.hooks:
                hook.before_optimizer_step(index)
            optimizer_step()

        result = train_iteration(
            self.executor, self.optimizer, self.scheduler, inputs, targets,
            backward if backward is not None else _plain_backward, hooked_step,
            self.settings.optim.max_grad_norm, clip_coef)
        self.step += 1
        for hook in self.hooks:
            hook.after_optimizer_step(index, result)
        return result


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()
