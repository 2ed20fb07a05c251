"""The training iteration shared by the Trainer and the Fabric paths.

Both front ends call :func:`train_iteration` with their own ``backward`` and optimizer
``step`` callables, so they execute the very same tensor operations in the same order and
produce bitwise-identical states. One iteration is: forward/backward of every micro-batch
(backward on the unscaled micro-batch loss, as ``torch.distributed.pipelining`` does),
gradients moved to fp32 and divided by the micro-batch count, global grad-norm clipping
(the coefficient is returned so it can be logged and, during replay, supplied instead of
recomputed), the optimizer step, and the LR-scheduler step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from lightning_moe_ckpt.core.precision import MasterWeightAdamW, Precision, compute_dtype
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.models.transformer import MoETransformer
from lightning_moe_ckpt.training.executor import Backward, Executor
from lightning_moe_ckpt.training.settings import OptimSettings

_CLIP_EPS = 1e-6


@dataclass(frozen=True)
class IterationResult:
    """Per-iteration scalars and routing telemetry, all still on the device (no sync).

    Attributes:
        loss: Mean language-model cross-entropy over micro-batches.
        aux_loss: Load-balancing loss, summed over layers, mean over micro-batches.
        grad_norm: Global gradient norm before clipping.
        clip_coef: The clipping coefficient applied (one when clipping is off).
        lr: The learning rate of this optimizer step.
        expert_load: ``[layers, experts]`` tokens routed this iteration.
        dropped: Assignments dropped by capacity this iteration.
        soft_load: ``[layers, experts]`` summed gate probabilities this iteration.
    """

    loss: torch.Tensor
    aux_loss: torch.Tensor
    grad_norm: torch.Tensor
    clip_coef: torch.Tensor
    lr: float
    expert_load: torch.Tensor
    dropped: torch.Tensor
    soft_load: torch.Tensor


def build_model(cfg: MoEModelConfig, precision: Precision, seed: int) -> MoETransformer:
    """The model with compute weights in the precision's dtype."""
    return MoETransformer(cfg, seed=seed).to(compute_dtype(precision))


def build_optimizer(model: torch.nn.Module, precision: Precision,
                    optim: OptimSettings) -> MasterWeightAdamW:
    """Master-weight AdamW over the model's parameters, keyed by FQN."""
    return MasterWeightAdamW(model.named_parameters(), precision, lr=optim.lr,
                             betas=optim.betas, eps=optim.eps,
                             weight_decay=optim.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimSettings,
                    max_steps: int) -> LambdaLR:
    """Linear warm-up to ``lr`` then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``."""
    warmup = optim.warmup_steps
    floor = optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def clip_coefficient(total_norm: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``, or one when clipping is off."""
    if max_norm is None:
        return torch.ones_like(total_norm)
    return torch.clamp(max_norm / (total_norm + _CLIP_EPS), max=1.0)


def train_iteration(executor: Executor, optimizer: MasterWeightAdamW, scheduler: LambdaLR,
                    inputs: torch.Tensor, targets: torch.Tensor, backward: Backward,
                    step: Callable[[], object], max_grad_norm: float | None,
                    clip_coef: torch.Tensor | None = None) -> IterationResult:
    """One optimizer step over ``inputs``/``targets`` of shape ``[M, b, S]``.

    Args:
        executor: Runs the forward/backward of the micro-batches and syncs gradients.
        optimizer: The master-weight AdamW.
        scheduler: The LR scheduler, stepped after the optimizer.
        inputs: Token ids, ``[M, b, S]`` (``M`` micro-batches of ``b`` sequences).
        targets: Next-token labels, shaped like ``inputs``.
        backward: Runs the backward of a micro-batch loss (Lightning wraps it).
        step: Runs the optimizer step (Lightning wraps it).
        max_grad_norm: Global gradient-norm clipping; ``None``: no clipping.
        clip_coef: Replaces the computed clipping coefficient when given (replay uses the
            logged one); ``None``: computed.

    Returns:
        The iteration's scalars and routing telemetry, still on the device.
    """
    executor.reset_stats()
    microbatches = inputs.shape[0]
    loss_sum = executor.forward_backward(inputs, targets, language_model_loss, backward)
    optimizer.collect_grads(divisor=microbatches)
    grads = optimizer.named_master_grads()
    executor.reduce_gradients(grads)
    grad_norm = executor.grad_norm(grads)
    coef = clip_coefficient(grad_norm, max_grad_norm) if clip_coef is None else clip_coef
    if grads and (max_grad_norm is not None or clip_coef is not None):
        torch._foreach_mul_(list(grads.values()), coef)
    lr = float(optimizer.param_groups[0]["lr"])
    # The statistics' collective runs before the update: a peer that dies during it leaves
    # this rank's state untouched, and the iteration simply runs again after the recovery.
    # Nothing after the update communicates.
    stats = executor.iteration_stats(loss_sum, microbatches)
    step()
    optimizer.zero_grad()
    scheduler.step()
    return IterationResult(loss=stats.loss, aux_loss=stats.aux_loss,
                           grad_norm=grad_norm.detach(), clip_coef=coef.detach(), lr=lr,
                           expert_load=stats.expert_load, dropped=stats.dropped,
                           soft_load=stats.soft_load)
