"""What ``MoEParallelStrategy`` needs from a user's LightningModule to run it under pp x ep.

A pipeline schedule owns forward and backward, and only the last stage sees the loss, so
the strategy cannot call a ``training_step`` that does ``loss = f(model(x), y)``. A module
that subclasses :class:`PipelineTrainable` declares the three things the schedule needs
instead, and keeps everything else its own (``configure_optimizers``, LR schedulers,
hooks, logging, data loaders)::

    class MyModule(PipelineTrainable, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Qwen3MoeForCausalLM(config)

        def parallel_model(self):            # the MoE model the plan splits
            return self.model

        def split_batch(self, batch):        # -> token ids [B, S], targets [B, S]
            return batch["input_ids"], batch["labels"]

        def microbatch_loss(self, logits, targets):   # mean loss of one micro-batch
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

        def training_step(self, batch, batch_idx):    # still runs on one device (pp=ep=1
            inputs, targets = self.split_batch(batch)  # without the strategy)
            return self.microbatch_loss(self.model(input_ids=inputs).logits, targets)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=3e-4)

Under the strategy each batch is split into ``parallel.microbatches`` micro-batches; the
loss the Trainer sees is their mean over the global batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


class PipelineTrainable(ABC):
    """Mixin for a LightningModule whose model ``MoEParallelStrategy`` parallelizes."""

    @abstractmethod
    def parallel_model(self) -> nn.Module:
        """The MoE model to split into stages and expert shards (pruned in place)."""

    @abstractmethod
    def split_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's token ids ``[B, S]`` and targets ``[B, S]``."""

    @abstractmethod
    def microbatch_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of one micro-batch from the last stage's output (logits)."""
