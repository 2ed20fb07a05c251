"""Run history: per-step scalars and routing telemetry, kept on the device until the end.

Recording a step appends device tensors and adds the expert load into a running
``[layers, experts]`` total, so the hot loop never waits on the host; everything is
converted to Python numbers once, when the metrics file and plots are written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lightning_moe_ckpt.training.core import IterationResult


@dataclass
class ValidationRecord:
    """Validation loss and perplexity after ``step`` optimizer steps."""

    step: int
    loss: float
    perplexity: float


@dataclass
class TrainingHistory:
    """Everything the end-of-run report needs."""

    losses: list[torch.Tensor] = field(default_factory=list)
    aux_losses: list[torch.Tensor] = field(default_factory=list)
    clip_coefs: list[torch.Tensor] = field(default_factory=list)
    dropped: list[torch.Tensor] = field(default_factory=list)
    iteration_seconds: list[float] = field(default_factory=list)
    validation: list[ValidationRecord] = field(default_factory=list)
    expert_load_total: torch.Tensor | None = None
    memory: list[dict[str, int]] = field(default_factory=list)  # host memory samples
    _started: float | None = None

    def start_iteration(self) -> None:
        """Mark the start of an iteration (host clock only)."""
        self._started = time.perf_counter()

    def record(self, result: IterationResult) -> None:
        """Append one iteration's results."""
        if self._started is not None:
            self.iteration_seconds.append(time.perf_counter() - self._started)
            self._started = None
        self.losses.append(result.loss)
        self.aux_losses.append(result.aux_loss)
        self.clip_coefs.append(result.clip_coef)
        self.dropped.append(result.dropped)
        load = result.expert_load
        self.expert_load_total = load.clone() if self.expert_load_total is None \
            else self.expert_load_total.add_(load)

    def record_loss(self, loss: torch.Tensor) -> None:
        """Append one iteration of a model without routing statistics (a user's model)."""
        if self._started is not None:
            self.iteration_seconds.append(time.perf_counter() - self._started)
            self._started = None
        self.losses.append(loss)

    def loss_values(self) -> list[float]:
        """Per-step training loss as Python floats (one host transfer)."""
        return torch.stack(self.losses).tolist() if self.losses else []
