"""A user's own model split over the mesh: what both ``MoEParallelStrategy`` classes share.

The strategy hands the full model to :meth:`UserModelSplit.split` once the mesh exists; the
plan (built-in for Hugging Face MoE models, or the user's ``parallelize_fn``) prunes it to
this rank's stage and expert shard. :meth:`UserModelSplit.forward_backward` then runs a
batch's micro-batches through the staged executor, built at the first batch because the
pipeline's static boundary shapes come from it. The full model's layer and expert counts
and parameter order are read before pruning: routing telemetry, the planner's layout and
the grad-norm vector span the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.parallel.engine import ProcessGroups
from lightning_moe_ckpt.parallel.model_plans import (
    ModelShape,
    ParallelizeFn,
    StagedModel,
    resolve_plan,
)
from lightning_moe_ckpt.parallel.staged_executor import LossFn, StagedExecutor
from lightning_moe_ckpt.parallel.topology import ParallelPlan
from lightning_moe_ckpt.strategies.core import MoEParallelCore


class UserModelSplit:
    """One rank's part of a user's model and the executor that trains it."""

    def __init__(self, core: MoEParallelCore, microbatches: int,
                 parallelize_fn: ParallelizeFn | None) -> None:
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ConfigError(f"microbatches={microbatches!r} must be an integer >= 1")
        self.core = core
        self.microbatches = microbatches
        self.parallelize_fn = parallelize_fn
        self.staged: StagedModel | None = None
        self.executor: StagedExecutor | None = None
        self.shape = ModelShape(0, 0)
        self.full_names: list[str] = []

    def split(self, model: nn.Module) -> StagedModel:
        """Prune ``model`` in place to this rank's stage and expert shard."""
        if self.core.mesh is None:
            raise RuntimeError("a model is split once the strategy's mesh exists "
                               "(after fabric.launch() / the Trainer's set-up)")
        plan_fn, _ = resolve_plan(model, self.parallelize_fn)
        self.full_names = [name for name, _ in model.named_parameters()]
        self.shape = ModelShape.of(model)
        self.staged = plan_fn(model, self.core.mesh)
        return self.staged

    def layout(self) -> ParallelPlan | None:
        """The layout the model runs in, with the full model's shape (None: not split)."""
        if self.staged is None:
            return None
        assert isinstance(self.core.dp, int), "the layout is resolved at launch"
        return ParallelPlan(self.core.pp, self.core.dp, self.core.ep, self.microbatches,
                            self.shape.n_layers, self.shape.n_experts, self.core.schedule)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn,
                         device: torch.device) -> torch.Tensor:
        """Forward and backward of a batch (``[B, S]`` ids and targets of this data shard)
        in ``microbatches`` micro-batches; returns the mean loss over the global batch
        (gradients are this rank's sums: :meth:`StagedExecutor.reduce_gradients` next)."""
        count = self.microbatches
        if inputs.shape[0] % count:
            raise ConfigError(f"a batch of {inputs.shape[0]} sequences does not split into "
                              f"parallel.microbatches={count} micro-batches")
        executor = self._executor(loss_fn, inputs.shape[0] // count, inputs.shape[-1], device)
        loss_sum = executor.forward_backward(inputs.reshape(count, -1, inputs.shape[-1]),
                                             targets.reshape(count, -1, targets.shape[-1]))
        return executor.global_loss(loss_sum)

    def grad_norm(self) -> torch.Tensor:
        """The norm of the model's gradients over all of its ranks (collective)."""
        if self.executor is None:
            raise RuntimeError("gradients exist after a forward/backward")
        return self.executor.grad_norm()

    def _executor(self, loss_fn: LossFn, micro_batch: int, seq_len: int,
                  device: torch.device) -> StagedExecutor:
        if self.executor is None:
            layout = self.layout()
            if layout is None or self.staged is None or self.core.mesh is None:
                raise RuntimeError("split the model before training it")
            self.executor = StagedExecutor(
                self.staged, layout, ProcessGroups.from_mesh(self.core.mesh),
                self.core.coordinates, device, micro_batch, seq_len, loss_fn,
                self.core.boundary_hooks, self.full_names)
        return self.executor
