"""Logged values: per-step training scalars, expert-load statistics, validation metrics.

The same functions feed the Trainer's ``self.log_dict`` and Fabric's ``fabric.log_dict``,
so both front ends write identical CSV columns. Validation loss and perplexity use
torchmetrics so they aggregate correctly over batches and ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torchmetrics import MeanMetric

from lightning_moe_ckpt.training.executor import Executor
from lightning_moe_ckpt.training.iteration import IterationResult, language_model_loss


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
    """Token-weighted validation loss (torchmetrics, synchronised over ranks) and its
    perplexity ``exp(loss)``. Ranks that hold no loss (non-last pipeline stages)
    contribute weight zero."""

    def __init__(self) -> None:
        self.loss = MeanMetric()

    def update(self, loss: torch.Tensor, tokens: int) -> None:
        """Accumulate one batch's mean loss over ``tokens`` tokens."""
        if self.loss.device != loss.device:  # the states live where the losses are (and
            self.loss.to(loss.device)  # are synchronised there: NCCL needs the GPU)
        self.loss.update(loss.detach().float(), weight=float(tokens))

    def compute_and_reset(self) -> tuple[float, float]:
        """``(loss, perplexity)`` over everything seen since the last reset."""
        loss = float(self.loss.compute())
        self.loss.reset()
        return loss, math.exp(loss)


def evaluate(executor: Executor, batches: Iterable[dict[str, Any]],
             metrics: ValidationMetrics, device: torch.device) -> tuple[float, float]:
    """Validation ``(loss, perplexity)`` over iteration-shaped host ``batches``, run on
    ``device``."""
    for batch in batches:
        metrics.update(*executor.evaluate(batch["inputs"].to(device, non_blocking=True),
                                          batch["targets"].to(device, non_blocking=True),
                                          language_model_loss))
    return metrics.compute_and_reset()
