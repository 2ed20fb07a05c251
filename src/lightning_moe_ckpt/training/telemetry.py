"""Logged values: per-step training scalars, expert-load statistics, validation metrics.

The same functions feed the Trainer's ``self.log_dict`` and Fabric's ``fabric.log_dict``,
so both front ends write identical CSV columns. Validation loss and perplexity use
torchmetrics so they aggregate correctly over batches (and later over ranks).
"""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity

from lightning_moe_ckpt.training.core import IterationResult, language_model_loss


def step_log_values(result: IterationResult, layer_ids: list[int]) -> dict[str, torch.Tensor]:
    """Scalars to log after one iteration (device tensors; loggers sync when they flush)."""
    values = {
        "train/loss": result.loss,
        "train/perplexity": result.loss.exp(),
        "train/aux_loss": result.aux_loss,
        "train/grad_norm": result.grad_norm,
        "train/clip_coef": result.clip_coef,
        "train/lr": torch.tensor(result.lr),
        "train/dropped_assignments": result.dropped,
    }
    load = result.expert_load.float()
    mean = load.mean(dim=1)
    cv = load.std(dim=1, correction=0) / mean.clamp(min=1e-9)
    max_share = load.max(dim=1).values / load.sum(dim=1).clamp(min=1e-9)
    for row, layer in enumerate(layer_ids):
        values[f"load/layer{layer}_cv"] = cv[row]
        values[f"load/layer{layer}_max_share"] = max_share[row]
    return values


class ValidationMetrics:
    """Token-weighted validation loss and perplexity over a fixed set of batches."""

    def __init__(self) -> None:
        self.loss = MeanMetric()
        self.perplexity = Perplexity()

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Accumulate one batch."""
        self.loss.update(language_model_loss(logits, targets), weight=targets.numel())
        self.perplexity.update(logits.float(), targets)

    def compute_and_reset(self) -> tuple[float, float]:
        """``(loss, perplexity)`` over everything seen since the last reset."""
        loss, perplexity = float(self.loss.compute()), float(self.perplexity.compute())
        self.loss.reset()
        self.perplexity.reset()
        return loss, perplexity


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
             metrics: ValidationMetrics) -> tuple[float, float]:
    """Validation ``(loss, perplexity)`` of ``model`` on ``batches``."""
    was_training = model.training
    model.eval()
    for inputs, targets in batches:
        metrics.update(model(inputs), targets)
    model.train(was_training)
    return metrics.compute_and_reset()
