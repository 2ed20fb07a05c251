"""How one iteration's forward/backward, gradient sync and statistics run: locally or spread.

:func:`~lightning_moe_ckpt.training.iteration.train_iteration` is written once against the
:class:`Executor` protocol. :class:`LocalExecutor` is the single-process reference; the
distributed executor (``parallel/engine.py``) runs a pipeline schedule, expert-parallel
dispatch and collective gradient sync behind the same methods.

The global gradient norm is always computed the same way: per-parameter norms are placed
into one vector indexed by the parameter's position in the *full* model (zeros for
parameters without a gradient or held elsewhere) and the norm of that vector is taken.
A distributed run only adds an exact all-reduce of that vector (every entry comes from
exactly one rank, the rest are zeros), so when its per-parameter gradients equal the
single-process ones, its clip coefficient is bitwise identical too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

import torch

from lightning_moe_ckpt.models.transformer import MoETransformer
from lightning_moe_ckpt.parallel.pipeline import PipelineRunner

Backward = Callable[[torch.Tensor], None]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class IterationStats(NamedTuple):
    """Global per-iteration scalars and routing telemetry."""

    loss: torch.Tensor
    aux_loss: torch.Tensor
    expert_load: torch.Tensor  # [layers of the full model, experts] tokens routed (hard)
    dropped: torch.Tensor
    soft_load: torch.Tensor  # [layers, experts] summed gate probabilities


def norm_vector(grads: Mapping[str, torch.Tensor], index: Mapping[str, int],
                size: int, device: torch.device) -> torch.Tensor:
    """Per-parameter L2 norms of ``grads`` scattered into a full-model-indexed vector."""
    vector = torch.zeros(size, dtype=torch.float32, device=device)
    names = list(grads)
    if names:
        norms = torch._foreach_norm([grads[name] for name in names])
        vector[slot_tensor([index[name] for name in names], device)] = torch.stack(norms).float()
    return vector


def accumulate_microbatches(model: MoETransformer, inputs: torch.Tensor,
                            targets: torch.Tensor, loss_fn: LossFn,
                            backward: Backward) -> torch.Tensor:
    """Forward and backward of each micro-batch of ``inputs`` (``[M, B, S]``) in turn, the
    gradients accumulating; returns the sum of the micro-batches' losses (detached)."""
    total = torch.zeros((), dtype=torch.float32, device=inputs.device)
    for index in range(inputs.shape[0]):
        loss = loss_fn(model(inputs[index]), targets[index])
        backward(loss)
        total = total + loss.detach()
    return total


def slot_tensor(slots: list[int], device: torch.device) -> torch.Tensor:
    """``slots`` as an index tensor on ``device``. The set of parameters with a gradient
    changes between iterations (an expert without tokens has none), so it is built each
    time; on a GPU through pinned memory and a non-blocking copy, because
    ``torch.tensor(..., device="cuda")`` from pageable memory waits for the device (the
    whole backward) on every iteration."""
    positions = torch.tensor(slots, dtype=torch.int64)
    if device.type == "cuda":
        return positions.pin_memory().to(device, non_blocking=True)
    return positions.to(device)


class Executor(Protocol):
    """Where and how the parts of an iteration run."""

    iteration: int  # the iteration the next forward_backward runs (tags boundary logs)
    forward_backward_calls: int  # counted: paused ranks run none during a recovery
    runner: PipelineRunner | None  # the pipeline schedule (None: no pipeline)
    replaying: bool  # a localized replay: no collective spans the world

    def reset_stats(self) -> None:
        """Zero per-iteration routing telemetry."""

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                         loss_fn: LossFn, backward: Backward) -> torch.Tensor:
        """Run every micro-batch; return this rank's summed micro-batch loss (or zero)."""

    def reduce_gradients(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Make ``grads`` (fp32 master gradients by FQN) the global average, in place."""

    def grad_norm(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of all gradients (see module docstring for the exact order)."""

    def iteration_stats(self, loss_sum: torch.Tensor, microbatches: int) -> IterationStats:
        """Global loss (mean over micro-batches and data shards) and routing telemetry."""

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 loss_fn: LossFn) -> tuple[torch.Tensor, int]:
        """Forward-only ``(mean micro-batch loss, tokens)``; ``tokens`` is 0 on ranks that
        hold no loss (so a token-weighted mean over ranks is the global mean)."""


class LocalExecutor:
    """Single process: the reference every parallel layout is compared against."""

    def __init__(self, model: MoETransformer) -> None:
        self.model = model
        self.index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        self.iteration = 0
        self.forward_backward_calls = 0
        self.runner: PipelineRunner | None = None
        self.replaying = False

    def reset_stats(self) -> None:
        self.model.reset_stats()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                         loss_fn: LossFn, backward: Backward) -> torch.Tensor:
        self.iteration += 1
        self.forward_backward_calls += 1
        return accumulate_microbatches(self.model, inputs, targets, loss_fn, backward)

    def reduce_gradients(self, grads: Mapping[str, torch.Tensor]) -> None:
        return None

    def grad_norm(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        device = next(iter(grads.values())).device if grads else torch.device("cpu")
        return torch.linalg.vector_norm(norm_vector(grads, self.index, len(self.index), device))

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 loss_fn: LossFn) -> tuple[torch.Tensor, int]:
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        for index in range(inputs.shape[0]):
            total = total + loss_fn(self.model(inputs[index]), targets[index])
        return total / inputs.shape[0], targets.numel()

    def iteration_stats(self, loss_sum: torch.Tensor, microbatches: int) -> IterationStats:
        moe_layers = self.model.moe_layers().values()
        return IterationStats(
            loss=loss_sum / microbatches,
            aux_loss=torch.stack([m.aux_loss_sum for m in moe_layers]).sum() / microbatches,
            expert_load=self.model.expert_load().clone(),
            dropped=torch.stack([m.dropped_assignments for m in moe_layers]).sum(),
            soft_load=torch.stack([m.gate.soft_counts for m in moe_layers]).clone(),
        )
