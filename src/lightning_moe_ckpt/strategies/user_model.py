"""A user's own model split over the mesh: what both ``MoEParallelStrategy`` classes share.

The strategy hands the full model to :meth:`UserModelSplit.split` once the mesh exists; the
plan (built-in for Hugging Face MoE models, or the user's ``parallelize_fn``) prunes it to
this rank's stage and expert shard. :meth:`UserModelSplit.forward_backward` then runs a
batch's micro-batches through the staged executor, built at the first batch because the
pipeline's static boundary shapes come from it. The full model's layer and expert counts
and parameter order are read before pruning: routing telemetry, the planner's layout and
the grad-norm vector span the whole model.

When a peer fails, :meth:`UserModelSplit.release` first drops the broken process groups;
after a failed rank is replaced, :meth:`UserModelSplit.reform` rebuilds the mesh, points
the expert shards at its expert-parallel group and rebuilds the executor over the live
model; :meth:`UserModelSplit.warm_up` then runs the new schedule's start-up exchange on
every rank together (a joining process builds its executor there too).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_moe_ckpt.core.layout import ParallelPlan
from lightning_moe_ckpt.core.target import PipelineExecution, UserModelParallelism
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.parallel.fsdp import reattach_fsdp_groups, release_fsdp_groups
from lightning_moe_ckpt.parallel.fused_experts import set_expert_group
from lightning_moe_ckpt.parallel.model_plans import ModelShape, ParallelizeFn, StagedModel
from lightning_moe_ckpt.parallel.plan_selection import resolve_plan
from lightning_moe_ckpt.strategies.core import MoEParallelCore
from lightning_moe_ckpt.training.distributed_executor import ProcessGroups
from lightning_moe_ckpt.training.staged_executor import LossFn, StagedExecutor


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
        self._loss_fn: LossFn | None = None
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
        staged = plan_fn(model, self.core.mesh)
        if self.core.dp_shard > 1 and not any(
                isinstance(p, DTensor) for p in staged.model.parameters()):
            raise ConfigError(
                f"parallel.dp_shard={self.core.dp_shard}, but the plan for "
                f"{type(model).__name__} sharded no parameter: a parallelize_fn shards "
                "its model over mesh['dp_shard'] itself (fully_shard), as the built-in "
                "plans do")
        self.staged = staged
        return staged

    def layout(self) -> ParallelPlan | None:
        """The layout the model runs in, with the full model's shape (None: not split)."""
        if self.staged is None:
            return None
        assert isinstance(self.core.dp, int), "the layout is resolved at launch"
        return ParallelPlan(self.core.pp, self.core.dp, self.core.ep, self.microbatches,
                            self.shape.n_layers, self.shape.n_experts, self.core.schedule,
                            self.core.dp_shard)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn,
                         device: torch.device) -> torch.Tensor:
        """Forward and backward of a batch (``[B, S]`` ids and targets of this data shard)
        in ``microbatches`` micro-batches; returns the mean loss over the global batch
        (gradients are this rank's sums: :meth:`StagedExecutor.reduce_gradients` next)."""
        count = self.microbatches
        self._micro_batch(inputs)
        executor = self.ensure_executor(loss_fn, inputs, device)
        loss_sum = executor.forward_backward(inputs.reshape(count, -1, inputs.shape[-1]),
                                             targets.reshape(count, -1, targets.shape[-1]))
        return executor.global_loss(loss_sum)

    def grad_norm(self) -> torch.Tensor:
        """The norm of the model's gradients over all of its ranks (collective)."""
        if self.executor is None:
            raise RuntimeError("gradients exist after a forward/backward")
        return self.executor.grad_norm()

    def ensure_executor(self, loss_fn: LossFn, inputs: torch.Tensor,
                        device: torch.device) -> StagedExecutor:
        """The executor, built at the first batch (``inputs``: its ``[B, S]`` token ids):
        the pipeline's static boundary shapes come from it."""
        if self.executor is None:
            self._build_executor(loss_fn, self._micro_batch(inputs), inputs.shape[-1], device)
        assert self.executor is not None
        return self.executor

    def _micro_batch(self, inputs: torch.Tensor) -> int:
        count = self.microbatches
        if inputs.shape[0] % count:
            raise ConfigError(f"a batch of {inputs.shape[0]} sequences does not split into "
                              f"parallel.microbatches={count} micro-batches")
        return inputs.shape[0] // count

    def release(self) -> None:
        """Before a recovery forms new process groups: drop every reference to the broken
        ones (the executor's pipeline and gradient-sync groups, the expert shards' group,
        the mesh), so that their connections close and a peer blocked on this rank fails
        at once. The executor keeps its shapes and counts for :meth:`reform`."""
        if self.executor is not None:
            self.executor.release()
        if self.staged is not None:
            set_expert_group(self.staged.model, None)
            if self.core.model_mesh is not None:  # sharded over dp_shard
                release_fsdp_groups(self.staged.model, self.core.model_mesh)
        self.core.release_mesh()

    def reform(self, device: torch.device) -> None:
        """The default process group was formed anew (a failed rank was replaced): rebuild
        the mesh (collective, as at launch), point the expert shards at its
        expert-parallel group and rebuild the executor over the live model, keeping its
        iteration and pass counts."""
        mesh = self.core.setup_mesh(device.type)
        if self.staged is not None:
            set_expert_group(self.staged.model, mesh.get_group("ep"))
            if self.core.model_mesh is not None:
                reattach_fsdp_groups(self.staged.model, self.core.model_mesh, mesh)
        old = self.executor
        if old is not None:
            assert self._loss_fn is not None
            self.executor = None
            self._build_executor(self._loss_fn, old.micro_batch, old.seq_len, old.device)
            assert self.executor is not None
            self.executor.iteration = old.iteration
            self.executor.forward_backward_calls = old.forward_backward_calls

    def warm_up(self, loss_fn: LossFn, inputs: torch.Tensor, device: torch.device) -> None:
        """Build the executor if this process has none yet (from ``inputs``, a batch's
        token ids) and run the pipeline's start-up exchange (collective)."""
        self.ensure_executor(loss_fn, inputs, device).warm_up()

    def _build_executor(self, loss_fn: LossFn, micro_batch: int, seq_len: int,
                        device: torch.device) -> None:
        layout = self.layout()
        if layout is None or self.staged is None or self.core.mesh is None:
            raise RuntimeError("split the model before training it")
        self._loss_fn = loss_fn
        self.executor = StagedExecutor(
            self.staged, layout, ProcessGroups.from_mesh(self.core.mesh),
            self.core.coordinates, device, micro_batch, seq_len, loss_fn,
            self.core.boundary_hooks, self.full_names)


class SplitModelParallelism(UserModelParallelism):
    """What the targets of a user's loop read from a strategy that splits the model with
    a :class:`UserModelSplit` over a :class:`MoEParallelCore` (both
    ``MoEParallelStrategy`` classes)."""

    core: MoEParallelCore
    user_model: UserModelSplit

    @override
    def user_layout(self) -> ParallelPlan | None:
        return self.user_model.layout()

    @override
    def user_grad_norm(self) -> torch.Tensor:
        return self.user_model.grad_norm()

    @property
    @override
    def data_shard(self) -> int:
        return self.core.data_shard

    @property
    @override
    def user_pipeline(self) -> PipelineExecution | None:
        return self.user_model.executor
